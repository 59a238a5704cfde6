"""data.mix (training/mixture.py): several sources mixed by weight. Each source's sequences carry
its own token range, so which source a row came from, and which of its sequences, is read off the
row itself — counted independently of the mixture's own bookkeeping."""

import numpy as np
import pytest

from megascale_jax.config import ConfigError, load_config
from megascale_jax.training import data
from megascale_jax.training.mixture import MixedBatches

SEQ, BATCH = 4, 8
SIZES = {"a": 40, "b": 25, "c": 13}  # sequences of each source
WEIGHTS = {"a": 5, "b": 3, "c": 2}  # normalised: 0.5, 0.3, 0.2


def source_tokens(i: int, n: int) -> np.ndarray:
    """Source i's n sequences of SEQ tokens (+1): token values 1000·i + position, so a row names
    its source (value // 1000) and its sequence (first value % 1000 // SEQ)."""
    return (1000 * i + np.arange(n * SEQ + 1)).astype(np.uint16)


def mixture(seed=0, split="train", weights=WEIGHTS) -> MixedBatches:
    sources = [data.SequenceBatches(source_tokens(i, n), SEQ, split, 0.1, seed, 1) for i, n in enumerate(SIZES.values())]
    return MixedBatches(list(SIZES), sources, [weights[k] for k in SIZES], BATCH)


def test_after_1000_steps_each_source_has_its_weight_within_1_percent_and_the_records_say_so():
    mixed = mixture()
    rows = np.concatenate([mixed.rows(step, 0, BATCH) for step in range(1000)])
    counted = np.bincount(rows[:, 0] // 1000, minlength=3) / len(rows)
    assert np.abs(counted - [0.5, 0.3, 0.2]).max() < 0.01, counted
    # what the run's records say (record_fields) is what the batches held
    assert mixed.record_fields(1000)["data_mix"] == pytest.approx(dict(zip(SIZES, counted)), abs=1e-6)
    # every step is a mixture, not a run of one source
    assert all(len(np.unique(mixed.rows(step, 0, BATCH)[:, 0] // 1000)) > 1 for step in range(50))


def test_each_source_walks_its_own_epochs_without_repeating_a_sequence():
    mixed = mixture()
    rows = np.concatenate([mixed.rows(step, 0, BATCH) for step in range(200)])
    for i, name in enumerate(SIZES):
        sequences = (rows[rows[:, 0] // 1000 == i, 0] % 1000) // SEQ
        n = mixed.sources[i].n_train
        whole = len(sequences) // n * n
        assert whole >= 2 * n, name  # two epochs at least, each a permutation of the source's training sequences
        for epoch in sequences[:whole].reshape(-1, n):
            assert sorted(epoch) == list(range(n)), name


def test_rows_are_a_pure_function_of_seed_and_step_whatever_the_process_split():
    """A resume, or another process count: any step's rows again from a fresh mixture, and the
    rows a process holds are its slice of the global batch."""
    first, again = mixture(seed=3), mixture(seed=3)
    for step in (0, 7, 123, 999):
        whole = first.rows(step, 0, BATCH)
        np.testing.assert_array_equal(again.rows(step, 0, BATCH), whole)
        np.testing.assert_array_equal(np.concatenate([again.rows(step, 0, 3), again.rows(step, 3, BATCH)]), whole)
    assert not np.array_equal(mixture(seed=4).rows(0, 0, BATCH), first.rows(0, 0, BATCH))


def test_validation_draws_only_held_out_sequences():
    mixed = mixture(split="val")
    rows = np.concatenate([mixed.rows(step, 0, BATCH) for step in range(20)])
    for i in range(3):
        held = mixed.sources[i]
        sequences = (rows[rows[:, 0] // 1000 == i, 0] % 1000) // SEQ
        assert len(sequences) and set(sequences) <= set(range(held.n_train, held.n_train + held.n_val))


def test_a_weight_as_small_as_one_sequence_a_block_still_gets_its_share():
    mixed = mixture(weights={"a": 98, "b": 1, "c": 1})
    shares = mixed.realised(1000)
    assert shares["b"] == pytest.approx(0.01, abs=0.001) and shares["c"] == pytest.approx(0.01, abs=0.001)


@pytest.mark.parametrize("overrides,message", [
    (["data.source=tokens", "data.mix={a.bin: 0}"], "data.mix['a.bin']=0.0 must be > 0"),
    (["data.source=tokens", "data.path=x.bin", "data.mix={a.bin: 1}"], "data.mix replaces data.path"),
    (["data.mix={a.bin: 1}"], "not stdlib"),
    (["data.source=tokens", "data.mix=[a.bin]"], "data.mix must be a mapping"),
    (["data.source=tokens", "data.mix={nowhere.bin: 1}"], "'nowhere.bin' is not a readable file"),
    (["data.source=tokens", "data.mix={a.bin: 0.7, b: [}"], "the value is not valid YAML (line 1, column 18"),
])
def test_bad_mixtures_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)
