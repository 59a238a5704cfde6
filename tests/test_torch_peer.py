"""The GPU campaign's PyTorch peer (bench/campaign/torch_peer.py) does our ladder rows' work: it
trains on the token rows `megascale_jax.train` feeds, step by step, with our loss and our AdamW,
and its sliding-window row attends to exactly the window. On the CPU at tiny shapes; the GPU
numbers are the GPU session's to read."""

import json
import math
import os
import sys
import time
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is not installed: it imports from the checkout's root

from bench.campaign import ladder, torch_peer  # noqa: E402
from bench.campaign import model as campaign_model  # noqa: E402
from megascale_jax.model.transformer import cross_entropy  # noqa: E402
from megascale_jax.training import data, optim  # noqa: E402


def dry_run_config(row: str, batch: int = 4, steps: int = 3, extra: tuple = ()):
    """The config of our dry-run ladder row `row` at `batch` sequences and `steps` steps."""
    overrides = ladder.row_overrides(True, torch_peer.row_changes(row, True))
    return campaign_model.load([*overrides, f"train.global_batch={batch}", f"train.steps={steps}", *extra])


def numpy_window_attention(q, k, v, window):
    """Float64 reference: query i attends to keys j with i - window < j <= i."""
    seq = q.shape[-2]
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    scores = np.where((j <= i) & (i - j < window), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True) @ v


def test_peer_trains_on_the_token_rows_our_training_loop_feeds():
    cfg = dry_run_config("parallel_block", batch=4, steps=3)
    peer = torch_peer.token_batches(cfg)
    # What `megascale_jax.train` feeds a fresh run: its Prefetcher from data index 0.
    ours = data.Prefetcher(data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train"),
                           jax.sharding.SingleDeviceSharding(jax.devices()[0]), start=0, depth=0)
    try:
        for step_rows in peer:
            np.testing.assert_array_equal(step_rows, np.asarray(ours.get()))
    finally:
        ours.close()
    assert len(peer) == 3 and peer[0].shape == (4, cfg.model.seq_len + 1)
    assert len({rows.tobytes() for rows in peer}) == 3  # a new batch every step, not one repeated
    assert max(int(rows.max()) for rows in peer) < cfg.model.vocab  # the byte corpus fits the model's vocab


def test_peer_loss_is_our_next_token_loss():
    batch = torch.randint(0, 32, (2, 9))
    logits = torch.randn(2, 8, 32)
    seen = {}

    def lm(input_ids, attention_mask):
        seen["input_ids"] = input_ids
        return SimpleNamespace(logits=logits)

    loss = torch_peer.next_token_loss(lm, None, "cpu")(batch)
    assert torch.equal(seen["input_ids"], batch[:, :-1])  # the inputs our loss_fn takes
    ours = cross_entropy(jax.numpy.asarray(logits.numpy()), jax.numpy.asarray(batch[:, 1:].numpy()))
    assert float(loss) == pytest.approx(float(ours), rel=1e-6)


@pytest.mark.slow
def test_peer_update_is_our_adamw():
    """Clipping, the warm-up schedule (the first rate is 0), betas, eps and weight decay on
    matrices only: four updates of torch's AdamW land where our optax chain does."""
    cfg = dry_run_config("serial_dense_adamw", steps=4, extra=("optim.warmup=2",))
    rng = np.random.default_rng(0)
    start = {"w1": rng.normal(size=(4, 3)).astype(np.float32), "bias": rng.normal(size=3).astype(np.float32)}
    grads = [{k: 3 * rng.normal(size=v.shape).astype(np.float32) for k, v in start.items()} for _ in range(4)]

    ours = optim.make_optimizer(cfg.optim, cfg.train.steps, None)
    params = dict(start)
    state = ours.init(params)
    for g in grads:  # norms around 10: every step is clipped to 1
        updates, state = ours.update(g, state, params)
        params = optax.apply_updates(params, updates)

    peer = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.tensor(v)) for k, v in start.items()})
    optimizer = torch_peer.adamw(peer, cfg.optim, fused=False)
    for g, rate in zip(grads, torch_peer.learning_rates(cfg)):
        for k, p in peer.items():
            p.grad = torch.tensor(g[k])
        torch_peer.update(peer, optimizer, rate, cfg.optim.clip)
    for k in start:
        np.testing.assert_allclose(peer[k].detach().numpy(), np.asarray(params[k]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(params["w1"]), start["w1"])  # it moved


EAGER_FLEX = "ignore:flex_attention called without torch.compile"


@pytest.mark.filterwarnings(EAGER_FLEX)
@pytest.mark.parametrize("attention", ["sdpa+mask", "flex_attention"])
def test_window_masks_against_float64_numpy(attention):
    """Both masks of the window row, each through the attention it is made for, against a
    hand-written masked softmax; the window cuts off keys a causal mask would show."""
    from torch.nn.attention.flex_attention import flex_attention

    seq, window = 40, 5
    q, k, v = (torch.randn(2, 3, seq, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
               for s in range(3))
    mask = torch_peer.attention_mask(attention, seq, window, "cpu")
    if attention == "flex_attention":
        out = flex_attention(q, k, v, block_mask=mask)  # eager: the unfused reference of the kernel
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected = numpy_window_attention(q.numpy(), k.numpy(), v.numpy(), window)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-10, atol=1e-12)
    causal = numpy_window_attention(q.numpy(), k.numpy(), v.numpy(), seq)
    assert np.abs(causal - expected)[..., window:, :].min(axis=-1).max() > 1e-3  # beyond the window: masked


@pytest.mark.filterwarnings(EAGER_FLEX)
@pytest.mark.parametrize("attention", ["sdpa+mask", "flex_attention"])
def test_windowed_peer_model_sees_only_the_window(attention, monkeypatch):
    """Through the whole GPT-NeoX as the window row builds it: with one layer, changing token 5
    changes the logits at positions 5..5+window-1 and nowhere else."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex

    # transformers compiles FlexAttention itself (minutes of C++ on the CPU): here, run it eagerly.
    calls = []

    def eager(q, k, v, training=False, **kwargs):
        calls.append(kwargs["block_mask"])
        return flex_attention(q, k, v, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", eager)
    m = SimpleNamespace(vocab=64, d_model=32, layers=1, heads=2, kv_heads=2, seq_len=32, mlp_dim=128, window=4)
    torch.manual_seed(0)
    lm = torch_peer.build("gpt_neox", m, "cpu", attention).eval()
    mask = torch_peer.attention_mask(attention, m.seq_len, m.window, "cpu")
    tokens = torch.randint(0, m.vocab, (1, m.seq_len))
    changed = tokens.clone()
    changed[0, 5] = (tokens[0, 5] + 1) % m.vocab
    with torch.no_grad():
        before = lm(input_ids=tokens, attention_mask=mask).logits
        after = lm(input_ids=changed, attention_mask=mask).logits
    moved = ((before - after).abs().amax(-1)[0] > 1e-6).nonzero().flatten().tolist()
    assert moved == [5, 6, 7, 8]
    assert calls == ([mask, mask] if attention == "flex_attention" else [])  # our BlockMask, passed through


def test_dry_run_window_row_trains_step_by_step_on_distinct_batches(monkeypatch):
    cfg = dry_run_config("sliding_window", batch=4, steps=ladder.STEPS[True][0])
    fed = []
    token_batches = torch_peer.token_batches
    monkeypatch.setattr(torch_peer, "token_batches", lambda c: fed.extend(token_batches(c)) or fed)
    steps, skip = ladder.STEPS[True]
    row = torch_peer.measure("gpt_neox", cfg, "cpu", skip, peak=None)

    assert row["attention"] == "sdpa+mask" and row["fallback"] == torch_peer.CPU_FALLBACK
    assert row["window"] == ladder.WINDOW[True] and row["batch"] == 4 and row["vocab"] == cfg.model.vocab
    assert row["steps"] == steps and row["timed_steps"] == list(range(skip + 1, steps + 1))
    assert len(row["losses"]) == steps and row["final_loss"] == row["losses"][-1]
    assert all(math.isfinite(x) for x in row["losses"]) and row["tokens_per_s"] > 0
    assert row["parameters"] > 0 and row["our_parameters"] > 0
    assert len({rows.tobytes() for rows in fed}) == steps
    # The first update's rate is 0 (warm-up), so the first two losses are the fresh model's on
    # batches 1 and 2: each step trained on its own batch.
    assert torch_peer.learning_rates(cfg)[0] == 0.0
    torch.manual_seed(0)
    fresh = torch_peer.build("gpt_neox", cfg.model, "cpu", "sdpa+mask")
    loss = torch_peer.next_token_loss(fresh, torch_peer.attention_mask("sdpa+mask", cfg.model.seq_len,
                                                                       cfg.model.window, "cpu"), "cpu")
    with torch.no_grad():
        first_two = [float(loss(torch.from_numpy(rows).long())) for rows in fed[:2]]
    assert row["losses"][:2] == pytest.approx(first_two, rel=1e-6)
    assert first_two[0] != first_two[1]


def test_flex_failure_falls_back_to_the_window_mask_and_says_why(monkeypatch):
    def train(family, cfg, device, skip, peak, attention):
        if attention == "flex_attention":
            raise RuntimeError("flex cannot compile here\nmore detail")
        return {"attention": attention}

    monkeypatch.setattr(torch_peer, "train", train)
    row = torch_peer.measure("gpt_neox", dry_run_config("sliding_window"), "cuda", 1, peak=None)
    assert row == {"attention": "sdpa+mask",
                   "fallback": "flex_attention failed: RuntimeError: flex cannot compile here"}


@pytest.mark.slow
def test_a_failing_row_is_one_line_and_the_section_goes_on(monkeypatch):
    def measure(family, cfg, device, skip, peak):
        if cfg.model.block == "parallel" and cfg.model.window is None:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\ntrace")
        return {"family": family, "device": device, "batch": cfg.train.global_batch, "steps": cfg.train.steps,
                "timed_from": skip + 1, "tokens_per_s": 1.0}

    monkeypatch.setattr(torch_peer, "measure", measure)
    settings = {"dry_run": True, "batch": 2,
                "device": {"backend": "cpu", "device_kind": "cpu", "memory_limit_bytes": None}}
    rows = torch_peer.run(settings)["rows"]
    assert [r["row"] for r in rows] == ["serial_dense_adamw", "parallel_block", "sliding_window"]
    assert rows[1] == {"row": "parallel_block", "family": "gpt_neox", "batch": 2,
                       "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"}
    steps, skip = ladder.STEPS[True]  # our dry-run rows' steps, the same ones timed
    assert rows[2] == {"row": "sliding_window", "family": "gpt_neox", "device": "cpu", "batch": 2, "steps": steps,
                       "timed_from": skip + 1, "tokens_per_s": 1.0}


def test_flex_running_out_of_memory_is_the_rows_error_not_a_fallback(monkeypatch):
    def train(family, cfg, device, skip, peak, attention):
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({attention})")

    monkeypatch.setattr(torch_peer, "train", train)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="flex_attention"):  # the boolean mask needs more
        torch_peer.measure("gpt_neox", dry_run_config("sliding_window"), "cuda", 1, peak=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled FlexAttention path needs a CUDA GPU")
def test_compiled_flex_window_model_matches_the_eager_mask_model_on_gpu():
    """The window row's model as it runs on a GPU (torch.compile, FlexAttention in the graph)
    gives the logits of the same weights through eager SDPA with the boolean mask. (On the CPU,
    torch 2.13's inductor gets this graph wrong: 0.17 max logit error, while dynamo's eager and
    aot_eager backends and a compiled flex_attention on its own are exact.) Passed on an H200,
    torch 2.11, 2026-11-27."""
    m = SimpleNamespace(vocab=64, d_model=64, layers=2, heads=4, kv_heads=4, seq_len=256, mlp_dim=256, window=16)
    torch.manual_seed(0)
    flex = torch_peer.build("gpt_neox", m, "cuda", "flex_attention").eval()
    eager = torch_peer.build("gpt_neox", m, "cuda", "sdpa+mask").eval()
    eager.load_state_dict(flex.state_dict())
    tokens = torch.randint(0, m.vocab, (2, m.seq_len), device="cuda")
    logits = lambda lm, mask: lm(input_ids=tokens, attention_mask=mask).logits
    try:
        with torch.no_grad():
            expected = logits(eager, torch_peer.attention_mask("sdpa+mask", m.seq_len, m.window, "cuda"))
            out = torch.compile(logits)(flex, torch_peer.attention_mask("flex_attention", m.seq_len, m.window, "cuda"))
    finally:  # inductor's pool of compile workers outlives the compile: this module leaves no process behind
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_rows_run_the_claims_first_and_none_starts_past_the_deadline(monkeypatch, tmp_path):
    """A lent GPU's call may end mid-section: the same-work (window) row runs first, each finished
    row is in the progress file, and a row with too little time left is a 'not started' row."""
    ran = []

    def measure(family, cfg, device, skip, peak):
        ran.append((family, cfg.model.window))
        return {"family": family, "batch": cfg.train.global_batch, "tokens_per_s": 1.0}

    monkeypatch.setattr(torch_peer, "measure", measure)
    progress = tmp_path / "rows.jsonl"
    settings = {"dry_run": True, "batch": 2, "progress_file": str(progress),
                "device": {"backend": "cpu", "device_kind": "cpu", "memory_limit_bytes": None}}
    rows = torch_peer.run(settings)["rows"]
    assert ran[0] == ("gpt_neox", ladder.WINDOW[True]) and len(ran) == 3
    assert [r["row"] for r in rows] == ["serial_dense_adamw", "parallel_block", "sliding_window"]
    assert [json.loads(line)["row"] for line in progress.read_text().splitlines()] == [
        "sliding_window", "parallel_block", "serial_dense_adamw"]

    ran.clear()
    rows = torch_peer.run({**settings, "deadline": time.time() + torch_peer.MIN_ROW_S - 5})["rows"]
    assert ran == [] and all(r["skipped"].startswith("skipped: not started") for r in rows)
