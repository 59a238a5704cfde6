"""The reduction of logits to per-row scores (model.transformer.target_scores) against float64 numpy."""

import jax.numpy as jnp
import numpy as np

from megascale_jax.model.transformer import target_scores


def test_target_scores_are_the_masked_log_softmax_sum_and_greedy():
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, (3, 5, 11))
    targets = rng.integers(0, 11, (3, 5))
    targets[1] = logits[1].argmax(-1)  # row 1: every target is the argmax
    mask = np.zeros((3, 5), np.float32)
    mask[:, 2:4] = 1
    summed, greedy = target_scores(jnp.asarray(logits, jnp.float32), jnp.asarray(targets, jnp.int32), jnp.asarray(mask))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = (np.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask).sum(-1)
    np.testing.assert_allclose(np.asarray(summed), want, rtol=1e-5)
    want_greedy = ((logits.argmax(-1) == targets) | (mask == 0)).all(-1)
    assert np.asarray(greedy).tolist() == want_greedy.tolist() and want_greedy[1]
