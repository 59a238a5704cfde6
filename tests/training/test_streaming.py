"""`data.stream=true` (training/streaming.py, training/shard_cache.py): JSONL shards tokenized while
training. The rows must equal an independent reference built here from the spec — every document
encoded with `tokenizers` directly, the end-of-document token after it, held out by the documented
hash, concatenated per reader in the seeded shard order over epochs, cut into windows of seq_len+1,
shuffled within windows by the seeded permutation — for training and validation, over more than one
epoch; processes (row ranges) read disjoint readers and tokenize disjoint shards; the order is the
seed's; bad lines are skipped and said, or stop the run; a CLI run resumed (same mesh: bitwise;
another mesh or process count: the same batches, losses within the parity contract)."""

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[interop]')")

from megascale_jax.config import ConfigError, load_config  # noqa: E402
from megascale_jax.training import data, streaming  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORDS = ["the", "model", "attention", "window", "naïve", "日本語", "x = f(y) + 1;", "\n", "🙂", "über"]
SEQ, BATCH, WINDOW, READERS = 16, 4, 8, 2
EOS = "<|endoftext|>"


def documents(rng, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A byte-level BPE trained here and five JSONL shards of seeded random documents (one gzip),
    with a line that is not JSON, one that is not UTF-8 and one without the text field in a.jsonl,
    and an empty shard: {shard name: its good documents in order}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    work = tmp_path_factory.mktemp("stream")
    rng = np.random.default_rng(7)
    docs = {name: documents(rng, int(rng.integers(25, 45))) for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl", "e.jsonl")}
    docs["d.jsonl"] = []
    (work / "train.txt").write_text("\n".join(d for ds in docs.values() for d in ds), encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(work / "train.txt")], trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(work / "tok.json"))
    shards = work / "shards"
    shards.mkdir()
    lines = [json.dumps({"text": d}).encode() for d in docs["a.jsonl"]]
    lines[2:2] = [b"{not json", b'{"text": "\xff\xfe"}', json.dumps({"body": "no text field"}).encode()]  # lines 3-5
    (shards / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with gzip.open(shards / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs["b.jsonl.gz"])
    for name in ("c.jsonl", "d.jsonl", "e.jsonl"):
        (shards / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[name]), encoding="utf-8")
    return work, docs


def config(work, *extra):
    return load_config(None, ["data.source=jsonl", f"data.path={work}/shards/*", f"data.tokenizer={work}/tok.json",
                              "data.stream=true", f"data.cache_dir={work}/cache", "model.vocab=384",
                              f"model.seq_len={SEQ}", f"train.global_batch={BATCH}", f"data.readers={READERS}",
                              f"data.shuffle_window={WINDOW}", "data.val_fraction=0.2", "data.tokenize_workers=1",
                              "mesh.dp=2", "mesh.tp=1", *extra])


# ----------------------------------------------------------------------------- the reference, from the spec


def held_out(name: str, index: int, fraction: float) -> bool:
    digest = hashlib.blake2b(f"{name}\n{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2 ** 64


def reference(work, docs, seed: int, split: str, epochs: int, fraction: float = 0.2) -> list[np.ndarray]:
    """Each reader's token stream of `split` over `epochs` epochs."""
    tok = tokenizers.Tokenizer.from_file(str(work / "tok.json"))
    eos = tok.token_to_id(EOS)
    names = sorted(docs)
    ids = {name: [[*tok.encode(d).ids, eos] for i, d in enumerate(docs[name])
                  if held_out(name, i, fraction) == (split == "val")] for name in names}
    streams = []
    for j in range(READERS):
        mine = np.array(names[j::READERS])
        stream = []
        for epoch in range(epochs):
            order = mine[np.random.default_rng([seed, 0 if split == "val" else epoch, j]).permutation(len(mine))]
            stream += [t for name in order for doc in ids[name] for t in doc]
        streams.append(np.array(stream))
    return streams


def reference_rows(streams, seed: int, step: int, shuffled: bool) -> np.ndarray:
    per = BATCH // READERS
    rows = []
    for r in range(BATCH):
        j, p = r // per, step * per + r % per
        q = p
        if shuffled:
            w = p // WINDOW
            q = w * WINDOW + np.random.default_rng([seed, 0x77696E, j, w]).permutation(WINDOW)[p % WINDOW]
        rows.append(streams[j][q * SEQ: q * SEQ + SEQ + 1])
    return np.stack(rows)


@pytest.fixture
def loaded(corpus):
    opened = []

    def load(*extra, processes: int = 1, run_dir=None):
        s = streaming.load(config(corpus[0], *extra), run_dir, processes)
        opened.append(s.train)
        return s

    yield load
    for batches in opened:
        batches.close()


# ----------------------------------------------------------------------------- rows


def test_streamed_rows_equal_the_reference_over_two_epochs_and_the_seed_fixes_the_order(corpus, loaded):
    work, docs = corpus
    streamed = loaded()
    train, val = reference(work, docs, 0, "train", 6), reference(work, docs, 0, "val", 30)
    epoch = max(len(s) for s in train) // 6  # the longer reader's epoch, in tokens
    steps = int(1.3 * epoch) // SEQ // (BATCH // READERS)  # every reader into its second epoch
    assert ((steps + 1) * (BATCH // READERS) + WINDOW) * SEQ + 1 < min(len(s) for s in train)
    for step in range(steps):
        np.testing.assert_array_equal(streamed.train.rows(step, 0, BATCH), reference_rows(train, 0, step, True),
                                      err_msg=f"step {step}")
    assert len(streamed.train.cache._workers) == 1  # data.tokenize_workers=1: one worker for both readers
    val_steps = max(len(s) for s in val) // 30 // SEQ  # validation cycles its documents
    for step in range(val_steps + 2):
        np.testing.assert_array_equal(streamed.val.rows(step, 0, BATCH), reference_rows(val, 0, step, False))
    # the seed alone fixes the order: another seed, another order, equal to its own reference
    other = loaded("train.seed=5")
    assert not np.array_equal(other.train.rows(0, 0, BATCH), streamed.train.rows(0, 0, BATCH))
    np.testing.assert_array_equal(other.train.rows(3, 0, BATCH),
                                  reference_rows(reference(work, docs, 5, "train", 1), 5, 3, True))


def test_processes_read_their_own_readers_and_tokenize_disjoint_shards(corpus, loaded, tmp_path):
    """Two processes (each its half of the rows, each its own cache, as on two hosts): their rows
    put together are the batch, and each tokenized only its reader's shards, all of them together."""
    work, docs = corpus
    train = reference(work, docs, 0, "train", 2)
    halves = [loaded(f"data.cache_dir={tmp_path / str(p)}", processes=2) for p in range(2)]
    for step in (0, 5, 40):
        rows = [half.train.rows(step, p * BATCH // 2, (p + 1) * BATCH // 2) for p, half in enumerate(halves)]
        np.testing.assert_array_equal(np.concatenate(rows), reference_rows(train, 0, step, True))
    for half in halves:
        half.train.close()
    tokenized = [{json.loads((d / "meta.json").read_text())["shard"] for d in (tmp_path / str(p) / "stream").iterdir()
                  if (d / "meta.json").is_file()} for p in range(2)]
    names = sorted(docs)
    assert [sorted(os.path.basename(s) for s in shards) for shards in tokenized] == [names[0::2], names[1::2]]


def test_bad_lines_are_skipped_and_said_or_stop_the_run(corpus, loaded, tmp_path):
    work, docs = corpus
    said = []
    streamed = loaded(f"data.cache_dir={tmp_path / 'said'}")
    streamed.train.cache.log = said.append
    train = reference(work, docs, 0, "train", 6)
    np.testing.assert_array_equal(streamed.train.rows(250, 0, BATCH), reference_rows(train, 0, 250, True))  # epoch 2
    assert any("skipped 3 bad lines" in line and "a.jsonl:3: not JSON" in line for line in said), said
    assert any("d.jsonl holds no document" in line for line in said), said
    stopped = loaded(f"data.cache_dir={tmp_path / 'stop'}", "data.stop_at_bad_line=true")
    with pytest.raises(data.DataError) as raised:
        for step in range(300):
            stopped.train.rows(step, 0, BATCH)
    assert "a.jsonl:3: not JSON" in str(raised.value) and "\n" not in str(raised.value)
    assert "data.stop_at_bad_line" in str(raised.value) and "--" not in str(raised.value)


# ----------------------------------------------------------------------------- refused, one line each


@pytest.mark.parametrize("extra, says", [
    (["data.readers=3"], "data.readers=3 must divide train.global_batch=4"),
    (["data.source=tokens", "data.path=x.bin"], "data.source=tokens needs no tokenizing (set data.stream=false)"),
    (["data.path=null", "data.mix={'a/*.jsonl': 1}"], "data.stream=true does not mix sources yet"),
    (["data.shuffle_window=0"], "data.shuffle_window=0 must be >= 1"),
])
def test_a_stream_the_config_cannot_have_is_one_line(corpus, extra, says):
    with pytest.raises(ConfigError, match=None) as raised:
        config(corpus[0], *extra)
    assert says in str(raised.value), str(raised.value)


def test_readers_the_processes_or_shards_cannot_share_and_a_resume_with_other_readers_are_one_line(corpus, tmp_path):
    work, _ = corpus
    for extra, processes, says in [([], 4, "data.readers=2 cannot be divided among 4 processes"),
                                   (["data.readers=null", "train.global_batch=6"], 4,
                                    "5 shards cannot be shared by 4 processes with train.global_batch=6"),
                                   (["data.readers=null", "train.global_batch=16"], 1, None),
                                   (["data.readers=8", "train.global_batch=8"], 1, "more than the 5 shards")]:
        cfg = config(work, *extra)
        if says is None:  # the default: the most readers the shards, the batch and the processes allow
            assert streaming.readers_for(cfg, None, processes, 5) == 4
            continue
        with pytest.raises(data.DataError) as raised:
            streaming.readers_for(cfg, None, processes, 5)
        assert says in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
    # a run being resumed keeps the readers and window it started with (its config.yaml)
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "config.yaml").write_text("data:\n  stream: true\n  readers: 2\n  shuffle_window: 8\n")
    assert streaming.readers_for(config(work, "data.readers=null"), str(run), 2, 5) == 2
    with pytest.raises(data.DataError, match="started with data.readers=2 .*set it back or pass a new --run-dir"):
        streaming.readers_for(config(work, "data.readers=1"), str(run), 1, 5)
    with pytest.raises(data.DataError, match="data.readers \\(recorded in .*\\)=2 cannot be divided among 4"):
        streaming.readers_for(config(work, "data.readers=null"), str(run), 4, 5)


# ----------------------------------------------------------------------------- the CLI: resume


def cli_args(steps: int) -> list[str]:
    return ["data.source=jsonl", "data.path=shards/[abce]*", "data.tokenizer=tok.json", "data.stream=true",
            "data.cache_dir=cli_cache", "model.vocab=384", "model.layers=2", "model.d_model=64", "model.heads=4",
            "model.kv_heads=4", f"model.seq_len={SEQ}", "train.global_batch=8", "train.eval_every=3",
            "train.eval_batches=1", "train.sample_at_end=0", "data.val_fraction=0.2", "checkpoint.every=3",
            "optim.warmup=1", "optim.min_lr_ratio=1", f"train.steps={steps}"]  # lr the same whatever train.steps


def run_cli(work, run_dir: str, *extra, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascale_jax.train", "--run-dir", run_dir, *cli_args(steps), *extra],
                          cwd=work, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


DP2, DP4 = ["mesh.dp=2", "mesh.tp=1", "mesh.cpu_devices=2"], ["mesh.dp=4", "mesh.tp=1", "mesh.cpu_devices=4"]


@pytest.fixture(scope="module")
def whole(corpus):
    """6 steps at dp 2 in one process: the run the resumed ones must equal."""
    import yaml

    work, _ = corpus
    done = run_cli(work, "runs/whole", *DP2, steps=6)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 jsonl shards streamed" in done.stdout + done.stderr and "a.jsonl:3: not JSON" in done.stderr
    assert yaml.safe_load((work / "runs/whole/config.yaml").read_text())["data"]["readers"] == 4  # the default
    return losses(work / "runs/whole")


@pytest.mark.slow
def test_a_streamed_run_resumed_mid_epoch_is_bitwise_and_on_another_mesh_the_same_batches(corpus, whole):
    """3 steps then resumed to 6 at dp 2 (losses bitwise), and from the same step-3 checkpoint at
    dp 4 (the same batches: losses within the layouts' fp32 contract, rel 1e-5); a resume that asks
    for other readers is refused before anything compiles."""
    import shutil

    work, _ = corpus
    half = run_cli(work, "runs/half", *DP2, steps=3)
    assert half.returncode == 0, half.stderr[-3000:]
    shutil.copytree(work / "runs/half", work / "runs/other_mesh")
    resumed = run_cli(work, "runs/half", *DP2, steps=6)
    assert resumed.returncode == 0 and "resumed from checkpoint step 3" in resumed.stdout + resumed.stderr, \
        resumed.stderr[-3000:]
    assert losses(work / "runs/half") == whole  # bitwise
    refused = run_cli(work, "runs/other_mesh", *DP4, "data.readers=2", steps=6)
    assert refused.returncode == 2 and "started with data.readers=4" in refused.stderr.strip().splitlines()[-1]
    moved = run_cli(work, "runs/other_mesh", *DP4, steps=6)
    assert moved.returncode == 0, moved.stderr[-3000:]
    np.testing.assert_allclose(losses(work / "runs/other_mesh"), whole, rtol=1e-5)


@pytest.mark.slow
def test_a_streamed_run_of_two_processes_resumes_on_one(corpus, whole, tmp_path):
    """3 steps on two processes (each its two readers, its own cache: as on two hosts), resumed on
    one process to 6: the losses of the one-process run (rel 1e-5: gloo's reductions)."""
    from megascale_jax.cluster.rendezvous import free_port

    work, _ = corpus
    address = f"127.0.0.1:{free_port()}"
    mesh = ["mesh.dp=2", "mesh.tp=1", "mesh.cpu_devices=1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MEGASCALE_JOB_KEY": "the job's secret"}
    procs = [subprocess.Popen([sys.executable, "-m", "megascale_jax.train", "--run-dir", "runs/two", "--coordinator",
                               address, "--num-processes", "2", "--process-id", str(i), *cli_args(steps=3),
                               f"data.cache_dir=cache_of_{i}", *mesh], cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    caches = [{json.loads(m.read_text())["shard"] for m in (work / f"cache_of_{i}" / "stream").glob("*/meta.json")}
              for i in range(2)]
    assert caches[0] and caches[1] and not caches[0] & caches[1]  # each process tokenized its own readers' shards
    resumed = run_cli(work, "runs/two", *DP2, steps=6)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    np.testing.assert_allclose(losses(work / "runs/two"), whole, rtol=1e-5)
