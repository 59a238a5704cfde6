"""Data pipeline: corpus loading, packing, seed-only order, mesh-independent global batches, errors."""

import os
import sysconfig

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from megascale_jax.training import data
from megascale_jax.config import from_dict
from megascale_jax.training.data import DataError, SequenceBatches, load_corpus, load_tokens, make_global_batch


def _cfg(**sections):
    return from_dict(sections)


def _batches(tokens, seq_len, split, *, val_fraction=0.25, seed=0, global_batch=4):
    return SequenceBatches(tokens, seq_len, split, val_fraction, seed, global_batch)


# ----------------------------------------------------------------------------- loading


def test_stdlib_corpus_matches_an_independent_read():
    tokens = load_tokens(_cfg())
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(stdlib) if n.endswith(".py") and os.path.isfile(os.path.join(stdlib, n)))
    parts = []
    for n in names:
        with open(os.path.join(stdlib, n), "rb") as f:
            parts.append(f.read())
    expected = np.array(list(b"\n".join(parts)), dtype=np.int64)
    assert tokens.ndim == 1 and len(tokens) > 100_000
    assert tokens.max() < 256
    np.testing.assert_array_equal(tokens.astype(np.int64), expected)


def test_files_source_reads_glob_in_sorted_order(tmp_path):
    rng = np.random.default_rng()
    blobs = {}
    for name in rng.permutation(["b.txt", "a.txt", "sub/c.txt"]):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        blobs[name] = "".join(rng.choice(list("abcxyz \n\téß→"), size=rng.integers(50, 200))).encode()
        (tmp_path / name).write_bytes(blobs[name])
    tokens = load_tokens(_cfg(data={"source": "files", "path": str(tmp_path / "**" / "*.txt")}))
    joined = b"\n".join(blobs[n] for n in ["a.txt", "b.txt", "sub/c.txt"])  # sorted full paths
    np.testing.assert_array_equal(tokens, np.frombuffer(joined, dtype=np.uint8))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokens_source_is_memory_mapped(tmp_path, dtype):
    rng = np.random.default_rng()
    vocab = int(rng.integers(300, 70_000 if dtype == "uint32" else 65_536))
    written = rng.integers(0, vocab, size=5_000).astype(dtype)
    path = tmp_path / "tokens.bin"
    written.tofile(path)
    tokens = load_tokens(_cfg(data={"source": "tokens", "path": str(path), "token_dtype": dtype},
                              model={"vocab": vocab}))
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(tokens, written)


# ----------------------------------------------------------------------------- packing


def test_rows_are_packed_windows_and_splits_partition_the_sequences():
    rng = np.random.default_rng()
    seq_len, batch = int(rng.integers(3, 9)), 4
    tokens = rng.integers(0, 1000, size=int(rng.integers(300, 400))).astype(np.uint16)
    n = (len(tokens) - 1) // seq_len
    inputs = tokens[: n * seq_len].reshape(n, seq_len)  # independent packing: reshape, then shift
    targets = tokens[1: n * seq_len + 1].reshape(n, seq_len)
    seen = {}
    for split in ("train", "val"):
        b = _batches(tokens, seq_len, split, global_batch=batch)
        seen[split] = set()
        for step in range(n // batch + 2):
            idx, rows = b.global_indices(step), b.rows(step, 0, batch)
            assert rows.dtype == np.int32 and rows.shape == (batch, seq_len + 1)
            np.testing.assert_array_equal(rows[:, :-1], inputs[idx])
            np.testing.assert_array_equal(rows[:, 1:], targets[idx])
            np.testing.assert_array_equal(b.rows(step, 1, 3), rows[1:3])
            seen[split].update(idx.tolist())
    n_val = int(np.ceil(0.25 * n))
    assert seen["val"] == set(range(n - n_val, n))  # the last sequences, contiguous
    assert seen["train"] == set(range(n - n_val))


# ----------------------------------------------------------------------------- order


def test_order_depends_only_on_seed_and_epochs_visit_each_sequence_once():
    rng = np.random.default_rng()
    tokens = rng.integers(0, 256, size=4_000).astype(np.uint16)
    seed, batch = int(rng.integers(0, 2**31)), 6
    a, b = (_batches(tokens, 8, "train", seed=seed, global_batch=batch) for _ in range(2))
    other = _batches(tokens, 8, "train", seed=seed + 1, global_batch=batch)
    for step in (0, 1, 57):
        np.testing.assert_array_equal(a.global_indices(step), b.global_indices(step))
    assert not np.array_equal(a.global_indices(0), other.global_indices(0))

    n_train = a.n_train
    assert n_train % batch  # so batches straddle epoch boundaries
    steps = 2 * n_train // batch + 1
    stream = np.concatenate([a.global_indices(s) for s in range(steps)])
    np.testing.assert_array_equal(np.sort(stream[:n_train]), np.arange(n_train))
    np.testing.assert_array_equal(np.sort(stream[n_train: 2 * n_train]), np.arange(n_train))
    assert not np.array_equal(stream[:n_train], stream[n_train: 2 * n_train])  # reshuffled each epoch


def test_validation_walks_its_sequences_in_order_cycling():
    tokens = np.random.default_rng().integers(0, 256, size=1_000).astype(np.uint16)
    b = _batches(tokens, 10, "val", val_fraction=0.1, global_batch=4)
    stream = np.concatenate([b.global_indices(s) for s in range(5)])
    expected = [b.n_train + (i % b.n_val) for i in range(20)]
    assert b.n_val == 10 and stream.tolist() == expected


# ----------------------------------------------------------------------------- global arrays


@pytest.mark.parametrize("dp,tp", [(8, 1), (4, 2), (1, 1)])
def test_global_batch_is_the_same_on_every_mesh(dp, tp):
    n = dp * tp
    assert len(jax.devices()) >= n, "conftest must provide 8 CPU devices"
    mesh = jax.make_mesh((dp, 1, tp), ("dp", "pp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=jax.devices()[:n])
    sharding = NamedSharding(mesh, P("dp", None))
    tokens = np.random.default_rng(1234).integers(0, 256, size=3_000).astype(np.uint16)
    b = _batches(tokens, 16, "train", seed=7, global_batch=16)
    for step in (0, 3):
        arr = make_global_batch(b, step, sharding)
        assert arr.shape == (16, 17) and arr.dtype == np.int32
        assert arr.sharding.is_equivalent_to(sharding, 2) and arr.sharding.spec == P("dp", None)
        expected = b.rows(step, 0, 16)
        np.testing.assert_array_equal(np.asarray(arr), expected)
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
            assert shard.data.shape == (16 // dp, 17)


class _FakeSharding:
    def __init__(self, row_slices):
        self.row_slices = row_slices

    def addressable_devices_indices_map(self, shape):
        return {i: (s, slice(None)) for i, s in enumerate(self.row_slices)}


def test_process_row_range_requires_one_contiguous_block():
    assert data.process_row_range(_FakeSharding([slice(4, 6), slice(6, 8), slice(4, 6)]), (16, 5)) == (4, 8)
    with pytest.raises(ValueError, match="not contiguous"):
        data.process_row_range(_FakeSharding([slice(0, 2), slice(4, 6)]), (16, 5))


# ----------------------------------------------------------------------------- errors


def test_files_glob_matching_nothing(tmp_path):
    pattern = str(tmp_path / "*.txt")
    with pytest.raises(DataError, match=r"data\.path=.*matches no files"):
        load_tokens(_cfg(data={"source": "files", "path": pattern}))


def test_files_that_are_all_empty(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    (tmp_path / "b.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"data\.path=.*empty"):
        load_tokens(_cfg(data={"source": "files", "path": str(tmp_path / "*.txt")}))


def test_missing_and_empty_token_files(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(DataError, match=r"data\.path=.*nope\.bin.*not a file"):
        load_tokens(_cfg(data={"source": "tokens", "path": str(missing)}))
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.bin.*is empty"):
        load_tokens(_cfg(data={"source": "tokens", "path": str(empty)}))


def test_token_file_size_not_a_multiple_of_the_dtype(tmp_path):
    rng = np.random.default_rng()
    path = tmp_path / "odd.bin"
    path.write_bytes(rng.integers(0, 256, size=2 * int(rng.integers(10, 100)) + 1, dtype=np.uint8).tobytes())
    with pytest.raises(DataError, match=r"odd\.bin.*data\.token_dtype=uint16"):
        load_tokens(_cfg(data={"source": "tokens", "path": str(path)}))


@pytest.mark.parametrize("excess", ["equal", "above"])
def test_token_at_or_above_vocab(tmp_path, monkeypatch, excess):
    monkeypatch.setattr(data, "_SCAN_CHUNK", 64)  # the bad token sits in some later chunk
    rng = np.random.default_rng()
    vocab = int(rng.integers(300, 60_000))
    tokens = rng.integers(0, vocab, size=1_000).astype(np.uint16)
    bad = vocab if excess == "equal" else int(rng.integers(vocab + 1, 65_536))
    tokens[rng.integers(200, 1_000)] = bad
    path = tmp_path / "big.bin"
    tokens.tofile(path)
    with pytest.raises(DataError, match=rf"big\.bin.*token {bad} .*model\.vocab={vocab}"):
        load_tokens(_cfg(data={"source": "tokens", "path": str(path)}, model={"vocab": vocab}))
    with pytest.raises(DataError, match=r"stdlib.*model\.vocab=100"):  # bytes reach 255
        load_tokens(_cfg(model={"vocab": 100}))


def test_too_few_sequences_says_how_many_tokens_are_needed():
    rng = np.random.default_rng()
    seq_len, batch = int(rng.integers(4, 20)), int(rng.integers(2, 9))
    # batch train + 1 val sequence (val_fraction 0.1 rounds up to 1) -> (batch+1)*seq_len + 1 tokens
    needed = (batch + 1) * seq_len + 1
    short = rng.integers(0, 256, size=needed - 1).astype(np.uint16)
    with pytest.raises(DataError, match=rf"model\.seq_len={seq_len}.*train\.global_batch={batch}.*"
                                        rf"needs at least {needed} tokens"):
        _batches(short, seq_len, "train", val_fraction=0.1, global_batch=batch)
    b = _batches(np.append(short, 7), seq_len, "val", val_fraction=0.1, global_batch=batch)
    assert (b.n_train, b.n_val) == (batch, 1)
    assert issubclass(DataError, ValueError)


def test_files_that_are_not_text_are_skipped_once_counted_and_symlinks_read_once(tmp_path, monkeypatch):
    """A glob over a mixed folder (as data.path='/usr/share/doc/**/*' once was): gzip and NUL-laden
    files are skipped with one warning that counts them; a symlink to a file already matched is not
    read twice; a character cut at the 1 KiB mark is still text."""
    import gzip

    rng = np.random.default_rng()
    text = {"a.txt": "def f():\n    return 1\n" * int(rng.integers(5, 20)),
            "long.md": "é" * 1000 + "tail\n"}  # 2,005 bytes: the 1 KiB mark falls inside a 2-byte character
    for name, body in text.items():
        (tmp_path / name).write_text(body, encoding="utf-8")
    (tmp_path / "c.gz").write_bytes(gzip.compress(b"compressed text " * 50))
    (tmp_path / "d.bin").write_bytes(b"header\0" + rng.bytes(100))
    (tmp_path / "link_to_a.txt").symlink_to(tmp_path / "a.txt")
    warnings = []  # the logger's handlers depend on what ran before in this process: catch the calls
    monkeypatch.setattr(data.logger, "warning", warnings.append)
    corpus = load_corpus(_cfg(data={"source": "files", "path": str(tmp_path / "*")}))
    joined = b"\n".join(text[n].encode() for n in ["a.txt", "long.md"])
    np.testing.assert_array_equal(corpus.tokens, np.frombuffer(joined, dtype=np.uint8))
    assert corpus.description == f"2 files, {len(joined):,} bytes"
    assert len(warnings) == 1 and "skipped 2 of 4 files that are not text" in warnings[0], warnings


def test_a_glob_of_only_binary_files_is_one_line(tmp_path):
    (tmp_path / "x.gz").write_bytes(b"\x1f\x8b\x08" + bytes(range(256)))
    with pytest.raises(DataError, match=r"none of the 1 matched files is text .*; pass a glob of text files$"):
        load_tokens(_cfg(data={"source": "files", "path": str(tmp_path / "*")}))


def test_val_fraction_zero_trains_on_every_sequence():
    """data.val_fraction=0 (a run without validation): every packed sequence is a training one,
    each epoch a permutation of all of them; nothing is held out."""
    tokens = np.arange(10 * 8 + 1, dtype=np.uint16) % 251
    b = _batches(tokens, 8, "train", val_fraction=0.0, global_batch=5)
    assert (b.n_train, b.n_val) == (10, 0)
    assert sorted(np.concatenate([b.global_indices(0), b.global_indices(1)])) == list(range(10))
