"""JAX's persistent compilation cache (training/compile_cache.py): a restarted job loads every
executable its first attempt compiled, and a corrupt cache costs one warning line and a
recompilation, never the run. Counted through the line a run ends with (`compilation cache: H
hits, M misses`), never timed.

In a CPU job of several processes JAX's cache serves process 0 only (its keys differ by process);
the others load their own copies of the train step, evaluation and checkpoint checksums (see the
module's note). The train step and evaluation are loaded without tracing (`load_or_compile`).
"""

import collections
import dataclasses
import glob
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from megascale_jax import cli
from megascale_jax.training import compile_cache

SMALL = ["model.layers=2", "model.d_model=64", "model.seq_len=64", "train.global_batch=8", "optim.warmup=1",
         "mesh.dp=2", "mesh.tp=1", "mesh.cpu_devices=2", "train.steps=12", "train.eval_every=4",
         "checkpoint.every=4", "supervisor.heartbeat_s=0.5", "supervisor.hang_timeout_s=6"]
COUNTS = re.compile(r"compilation cache: (\d+) hits, (\d+) misses")
SHARED_BY_THE_SUITE = "JAX_COMPILATION_CACHE_DIR"  # conftest's: these runs count their own directory's entries


def run_module(module, args, timeout=600):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env={**{k: v for k, v in os.environ.items() if k != SHARED_BY_THE_SUITE},
                               "JAX_PLATFORMS": "cpu"})


def entries(run_dir) -> list[str]:
    return sorted(glob.glob(os.path.join(run_dir, "compile_cache", "*-cache")))


@pytest.mark.slow
def test_every_process_of_a_restarted_cpu_job_loads_its_train_step(tmp_path):
    """Two processes, kill -9 of rank 1 at step 6: in the restarted attempt process 0 loads
    everything from JAX's cache and its store, and process 1 its own copies of the train step,
    evaluation and checkpoint checksums (without them process 0 would wait in the first step
    while process 1 compiles)."""
    done = run_module("megascale_jax.launch", ["--nprocs", "2", "--run-dir", str(tmp_path), "--no-diagnose",
                                               "--drill", "kill:1@6", *SMALL])
    assert done.returncode == 0, done.stdout + done.stderr
    counts = []
    for rank in (0, 1):
        with open(tmp_path / "logs" / f"worker{rank}.log") as f:
            restarted = f.read().split("===== attempt ")[-1]
        counts.append(tuple(map(int, COUNTS.search(restarted).groups())))
        assert re.search(r"start-up phases: .*trainer .* restore .* train_step .* eval_loss", restarted)
    assert counts[0][1] == 0 and counts[0][0] > 0, counts  # every executable, the train step among them
    assert len(glob.glob(str(tmp_path / "compile_cache" / "jit_train_step-*-cache"))) == 1  # written once
    # Process 1: its own train step, evaluation and checksums; the small ops it compiles are misses.
    assert counts[1][0] == 3, counts
    for rank in (0, 1):  # one entry each, written by the first attempt and loaded by the second
        for name in ("train_step", "eval_loss"):
            assert len(glob.glob(str(tmp_path / "compile_cache" / f"process-{rank}" / f"{name}-*"))) == 1


@pytest.mark.slow
def test_a_corrupt_cache_is_discarded_with_one_warning(tmp_path):
    """A run fills the cache; a second run of the same config on a copy whose every entry is
    garbage warns once, compiles everything, writes the cache anew and trains."""
    args = [*SMALL, "train.steps=2"]
    first = run_module("megascale_jax.train", ["--run-dir", str(tmp_path / "first"), *args])
    assert first.returncode == 0, first.stderr
    names = [os.path.basename(path) for path in entries(tmp_path / "first")]
    assert names
    garbage = {}
    os.makedirs(tmp_path / "second" / "compile_cache")
    for name in names:
        garbage[name] = os.urandom(os.path.getsize(tmp_path / "first" / "compile_cache" / name))
        (tmp_path / "second" / "compile_cache" / name).write_bytes(garbage[name])

    second = run_module("megascale_jax.train", ["--run-dir", str(tmp_path / "second"), *args])
    assert second.returncode == 0, second.stderr
    warned = [line for line in second.stderr.splitlines() if "compilation cache" in line]
    assert len(warned) == 1 and "discarded, compiling afresh" in warned[0], second.stderr
    assert second.stderr.count("persistent compilation cache") == 1  # JAX's own warnings are not repeated
    hits, misses = map(int, COUNTS.search(second.stdout).groups())
    assert hits == 0 and misses > 0
    rewritten = [os.path.basename(path) for path in entries(tmp_path / "second")]
    assert rewritten == names  # the same keys, written anew
    assert all((tmp_path / "second" / "compile_cache" / name).read_bytes() != garbage[name] for name in names)


def test_a_cache_path_that_is_no_directory_is_one_warning_and_no_cache(tmp_path, capsys):
    cli.setup_logging()
    (tmp_path / "compile_cache").write_text("not a directory")
    before = jax.config.jax_compilation_cache_dir
    with compile_cache.use(str(tmp_path)) as counts:
        assert counts is None
        assert jax.config.jax_compilation_cache_dir == before
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: compilation cache") and "not a readable, writable" in err[0]


def test_the_cache_is_set_for_the_block_only(tmp_path):
    """In-process callers (tests running train.main) get JAX's settings back afterwards."""
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    x = jax.numpy.arange(5.0)
    with compile_cache.use(str(tmp_path)) as counts:
        assert jax.config.jax_compilation_cache_dir == os.path.join(str(tmp_path), "compile_cache")
        jax.jit(lambda x: x * 3 + 1)(x).block_until_ready()
        assert (counts.hits, counts.misses) == (0, 1)
    assert (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs) == before
    assert len(entries(tmp_path)) == 1


def test_a_users_jax_cache_directory_is_shared_by_runs(tmp_path):
    """JAX_COMPILATION_CACHE_DIR (here its config value: JAX reads the variable at import): a second
    run directory loads what the first compiled from it, each run keeps only its own store there,
    and JAX's setting is given back."""
    shared, x = tmp_path / "shared", jax.numpy.arange(7.0)
    jax.config.update("jax_compilation_cache_dir", str(shared))
    try:
        for run, want in (("first", (0, 1)), ("second", (1, 0))):
            with compile_cache.use(str(tmp_path / run)) as counts:
                jax.jit(lambda x: x * 5 - 2)(x).block_until_ready()
                assert (counts.hits, counts.misses) == want
            assert entries(tmp_path / run) == [] and (tmp_path / run / "compile_cache" / "process-0").is_dir()
        assert len(glob.glob(str(shared / "*-cache"))) == 1
        assert jax.config.jax_compilation_cache_dir == str(shared)
    finally:
        jax.config.update("jax_compilation_cache_dir", None)


def test_a_cpu_job_of_several_processes_keeps_its_runs_own_directory():
    """Its entries would serve process 0 alone (JAX keys them by process on the CPU)."""
    where = compile_cache.jax_entries_directory
    assert where("run/compile_cache", "/shared", "cpu", 2) == "run/compile_cache"
    assert where("run/compile_cache", "/shared", "cpu", 1) == where("run/compile_cache", "/shared", "gpu", 8) == "/shared"
    assert where("run/compile_cache", None, "gpu", 1) == where("run/compile_cache", "", "cpu", 1) == "run/compile_cache"


def test_who_can_read_process_0s_entries():
    assert compile_cache.readable_by_every_process("cpu", 1)
    assert compile_cache.readable_by_every_process("gpu", 8)
    assert not compile_cache.readable_by_every_process("cpu", 2)


def dp_input(seed: int):
    """A mesh of two devices and a seeded (8, 4) input sharded over it."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("dp",))
    return mesh, jax.device_put(jax.random.normal(jax.random.key(seed), (8, 4)), NamedSharding(mesh, P("dp")))


def counted_program():
    """tanh(x) @ x.T, and the list that grows by one each time it is traced."""
    traced = []

    def f(x):
        traced.append(1)
        return jnp.tanh(x) @ x.T
    return traced, f


def test_load_or_compile_loads_without_tracing_and_keys_on_what_the_program_is_made_from(tmp_path, monkeypatch):
    """The second request for the same config and arguments traces nothing and computes what jit
    does; another config, other argument shardings or an edited package source compile afresh."""
    mesh, x = dp_input(1)
    traced, f = counted_program()

    def get(config, arg):
        return compile_cache.load_or_compile(
            "f", lambda: jax.jit(lambda x: f(x)).lower(arg), config, (arg,))  # a new function: traced anew

    with compile_cache.use(str(tmp_path)) as counts:
        get({"a": 1}, x)
        assert len(traced) == 1
        loaded = get({"a": 1}, x)
        assert len(traced) == 1 and (counts.hits, counts.misses) == (1, 1)  # the miss: JAX's, compiling
        x64 = np.asarray(x, np.float64)
        np.testing.assert_allclose(loaded(x), np.tanh(x64) @ x64.T, rtol=1e-5, atol=1e-6)
        get({"a": 2}, x)
        assert len(traced) == 2
        get({"a": 1}, jax.device_put(x, NamedSharding(mesh, P())))
        assert len(traced) == 3
        monkeypatch.setattr(compile_cache, "_source_digest", lambda: "an edited package")
        get({"a": 1}, x)
        assert len(traced) == 4
    # Kept: the two programs compiled here; the other two keys' programs JAX's cache served (the
    # same program text), which are never kept (see the test below).
    assert len(glob.glob(str(tmp_path / "compile_cache" / "process-0" / "f-*"))) == 2


def test_the_key_changes_with_a_module_programs_are_made_from_not_with_the_planner(tmp_path):
    """Editing the planner while a job runs must not make its restarts compile afresh (the ETTR
    drill lost 12-15 s per restart to it), nor the driver's supervision (an edit to the supervisor
    during a drill made three of four workers compile the train step again, 20 s); editing the
    model must."""
    for name, text in {"model/layers.py": "width = 1\n", "planner/costs.py": "rate = 1\n", "plan.py": "x = 1\n",
                       "supervise/supervisor.py": "poll = 1\n"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    before = compile_cache.source_digest(str(tmp_path))
    (tmp_path / "planner/costs.py").write_text("rate = 2\n")
    (tmp_path / "plan.py").write_text("x = 2\n")
    (tmp_path / "supervise/supervisor.py").write_text("poll = 2\n")
    assert compile_cache.source_digest(str(tmp_path)) == before
    (tmp_path / "model/layers.py").write_text("width = 2\n")
    assert compile_cache.source_digest(str(tmp_path)) != before


def test_an_unreadable_stored_executable_is_one_warning_and_a_recompilation(tmp_path, capsys):
    cli.setup_logging()
    x = jax.random.normal(jax.random.key(2), (5,))
    with compile_cache.use(str(tmp_path)):
        compile_cache.load_or_compile("g", lambda: jax.jit(jnp.sin).lower(x), {}, (x,))
        [entry] = glob.glob(str(tmp_path / "compile_cache" / "process-0" / "g-*"))
        garbage = os.urandom(64)
        with open(entry, "wb") as f:
            f.write(garbage)
        again = compile_cache.load_or_compile("g", lambda: jax.jit(jnp.sin).lower(x), {}, (x,))
    np.testing.assert_allclose(again(x), np.sin(np.asarray(x)), rtol=1e-6)
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and "discarded, compiling afresh" in err[0], err
    # Removed, so no restart warns again. Not written anew here: JAX served this compilation from
    # memory, and only executables seen compiled are kept (see the test of JAX's cache below).
    assert not os.path.exists(entry)


def test_without_the_cache_load_or_compile_just_compiles():
    x = jax.random.normal(jax.random.key(3), (3,))
    compiled = compile_cache.load_or_compile("h", lambda: jax.jit(jnp.cos).lower(x), {}, (x,))
    np.testing.assert_allclose(compiled(x), np.cos(np.asarray(x)), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_building_the_trainer_compiles_nothing(optimizer):
    """build_trainer's shapes and shardings come from traces alone: the small programs it used to
    run (the learning-rate schedule at step 0, inside optax.tree_map_params) were compiled on every
    restart by each process the compilation cache cannot serve."""
    from megascale_jax.config import load_config
    from megascale_jax.parallel.mesh import make_mesh
    from megascale_jax.training.trainer import build_trainer

    cfg = load_config(None, [f"optim.name={optimizer}", "parallel.zero1=true", "train.global_batch=8"])
    mesh = make_mesh(cfg.mesh)
    jax.clear_caches()  # what earlier tests compiled in this process would hide a compilation
    compiled = []

    def on_duration(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        trainer = build_trainer(cfg, mesh)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
    assert compiled == []
    assert jax.tree.leaves(trainer.state_shardings)  # and it built the shardings


def test_an_executable_jax_cannot_serialize_is_compiled_with_one_warning(tmp_path, capsys):
    """A program with a host callback (JAX cannot pickle it): the run goes on with one warning
    line per attempt, and nothing half-written is left in the store."""
    cli.setup_logging()
    x = jax.random.normal(jax.random.key(4), (6,))

    def lower():
        return jax.jit(lambda v: jax.pure_callback(
            lambda a: np.asarray(a) * np.arange(6.0, dtype=np.float32), jax.ShapeDtypeStruct(v.shape, v.dtype), v)
        ).lower(x)

    with compile_cache.use(str(tmp_path)):
        first = compile_cache.load_or_compile("k", lower, {}, (x,))
        second = compile_cache.load_or_compile("k", lower, {}, (x,))
    for compiled in (first, second):
        np.testing.assert_allclose(compiled(x), np.asarray(x) * np.arange(6.0), rtol=1e-6)
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 2 and all("cannot keep k" in line for line in err), err
    assert os.listdir(tmp_path / "compile_cache" / "process-0") == []


def test_a_full_disk_while_keeping_an_entry_is_one_warning_and_training_goes_on(tmp_path, capsys, monkeypatch):
    """EFBIG/ENOSPC writing an entry (seen in the checkpoint test that caps file sizes): the
    executable is returned, one warning line names it, and no half-written file is left."""
    import errno

    cli.setup_logging()
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and "process-0" in str(path):
            f = real_open(path, mode, *args, **kwargs)  # created, then the write fails, like EFBIG
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(compile_cache, "open", full_disk, raising=False)
    x = jax.random.normal(jax.random.key(5), (7,))
    with compile_cache.use(str(tmp_path)):
        compiled = compile_cache.load_or_compile("m", lambda: jax.jit(jnp.exp).lower(x), {}, (x,))
    np.testing.assert_allclose(compiled(x), np.exp(np.asarray(x)), rtol=1e-6)
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and "cannot keep m" in err[0] and "No space left" in err[0], err
    assert os.listdir(tmp_path / "compile_cache" / "process-0") == []


def test_an_executable_jaxs_cache_served_is_neither_kept_nor_handed_over(tmp_path):
    """XLA:CPU cannot serialize a deserialized executable whole (it runs into "Function ... not
    found"), so a program JAX's cache serves is not written to the store: the next request compiles
    it (through JAX's cache) rather than loading a broken copy."""
    x = jax.random.normal(jax.random.key(4), (6, 6))
    with compile_cache.use(str(tmp_path)) as counts:
        jax.jit(lambda x: jnp.sin(x) @ x).lower(x).compile()  # in JAX's cache, not in the store
        served = compile_cache.load_or_compile("k", lambda: jax.jit(lambda x: jnp.sin(x) @ x).lower(x), {}, (x,))
        assert counts.hits == 1  # JAX's
    assert glob.glob(str(tmp_path / "compile_cache" / "process-0" / "k-*")) == []
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(served(x), np.sin(x64) @ x64, rtol=1e-5, atol=1e-5)


class KeyValueStore:
    """The coordination service's key-value store as compile_cache uses it, in one process."""

    def __init__(self):
        self.values = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.values
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        return self.values[key]  # process 0 (earlier in this test) has set it: a missing key is the bug


def as_process(monkeypatch, index: int) -> None:
    """What compile_cache sees of a CPU job of two processes, in this one."""
    monkeypatch.setattr(jax, "process_index", lambda: index)
    monkeypatch.setattr(compile_cache, "_asked", collections.Counter())  # a process's own count


def test_process_0_compiles_once_and_hands_every_program_to_the_others(tmp_path, monkeypatch):
    """In a CPU job of several processes process 0 compiles each program and publishes it in the
    n-th slot of its name (hit or miss, so nobody waits for a slot never filled); process 1 loads
    it for its own devices without tracing and keeps its copy; a different program in the slot (or
    none to hand over) makes process 1 compile its own."""
    store = KeyValueStore()
    monkeypatch.setattr(compile_cache, "coordination_client", lambda: store)
    monkeypatch.setattr(compile_cache, "readable_by_every_process", lambda *_: False)
    monkeypatch.setenv("MEGASCALE_JOB_KEY", "the job's secret")
    _, x = dp_input(5)
    traced, f = counted_program()

    def get(config):
        return compile_cache.load_or_compile("f", lambda: jax.jit(lambda x: f(x)).lower(x), config, (x,))

    as_process(monkeypatch, 0)
    with compile_cache.use(str(tmp_path)):
        get({"a": 1})
        get({"a": 2})
        compile_cache.compile(jax.jit(jnp.cos).lower(x), "g")
    assert sorted(store.values) == [f"megascale_jax/compile_cache/{name}" for name in ("f/1", "f/2", "g/1")]

    as_process(monkeypatch, 1)
    with compile_cache.use(str(tmp_path)) as counts:
        loaded = get({"a": 1})
        assert traced == [1, 1] and counts.from_process_0 == 1  # process 0's two traces, none here
        get({"a": 3})  # not the program process 0 put in slot 2: compiled here
        assert len(traced) == 3 and counts.from_process_0 == 1
        cosine = compile_cache.compile(jax.jit(jnp.cos).lower(x), "g")
        assert counts.from_process_0 == 2
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(loaded(x), np.tanh(x64) @ x64.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cosine(x), np.cos(x64), rtol=1e-6)
    kept = glob.glob(str(tmp_path / "compile_cache" / "process-1" / "*"))
    assert len(kept) == 2  # its copies of f and g, for its restarts (JAX's cache served {"a": 3})

    as_process(monkeypatch, 1)  # a restart of process 1: its own copy, no slot read
    store.values.clear()
    with compile_cache.use(str(tmp_path)) as counts:
        np.testing.assert_allclose(get({"a": 1})(x), np.tanh(x64) @ x64.T, rtol=1e-5, atol=1e-6)
        assert len(traced) == 3 and counts.hits == 1


def test_an_empty_slot_makes_the_others_compile_their_own(tmp_path, monkeypatch):
    """Process 0 had nothing to hand over (JAX's cache served it, or JAX cannot serialize it)."""
    store = KeyValueStore()
    monkeypatch.setattr(compile_cache, "coordination_client", lambda: store)
    monkeypatch.setattr(compile_cache, "readable_by_every_process", lambda *_: False)
    monkeypatch.setenv("MEGASCALE_JOB_KEY", "the job's secret")
    x = jax.random.normal(jax.random.key(6), (5,))
    as_process(monkeypatch, 0)
    with compile_cache.use(str(tmp_path)):
        jax.jit(jnp.exp).lower(x).compile()  # JAX's cache serves the next one
        compile_cache.load_or_compile("e", lambda: jax.jit(jnp.exp).lower(x), {}, (x,))
    [(slot, payload)] = store.values.items()
    assert payload.endswith(b"\n")  # its signature, the key, and no executable
    as_process(monkeypatch, 1)
    with compile_cache.use(str(tmp_path / "other")) as counts:  # process 1 without JAX's entry
        compiled = compile_cache.load_or_compile("e", lambda: jax.jit(jnp.exp).lower(x), {}, (x,))
        assert counts.from_process_0 == 0
    np.testing.assert_allclose(compiled(x), np.exp(np.asarray(x)), rtol=1e-6)


@pytest.mark.parametrize("attack", ["forged", "unsigned", "other job"])
def test_a_forged_entry_is_refused_with_one_warning_and_the_process_compiles_its_own(tmp_path, monkeypatch, attack):
    """Anyone who reaches the coordination service can write process 0's slot: an executable there
    signed with no key, with another job's, or not signed at all is never deserialized (it would
    run as native code); process 1 compiles the program itself and says so once."""
    store = KeyValueStore()
    monkeypatch.setattr(compile_cache, "coordination_client", lambda: store)
    monkeypatch.setattr(compile_cache, "readable_by_every_process", lambda *_: False)
    monkeypatch.setenv("MEGASCALE_JOB_KEY", "the job's secret")
    x = jax.random.normal(jax.random.key(7), (5,))
    traced, f = counted_program()

    def get():
        return compile_cache.load_or_compile("f", lambda: jax.jit(lambda x: f(x)).lower(x), {"a": 1}, (x,))

    as_process(monkeypatch, 0)
    with compile_cache.use(str(tmp_path / "p0")):
        get()
    [(slot, payload)] = store.values.items()
    signature, _, message = payload.partition(b"\n")
    if attack == "forged":  # the attacker's own executable under the real slot and key, a made-up MAC
        store.values[slot] = b"0" * len(signature) + b"\n" + message
    elif attack == "unsigned":
        store.values[slot] = message
    else:
        monkeypatch.setenv("MEGASCALE_JOB_KEY", "another job's secret")
    warnings = []
    monkeypatch.setattr(compile_cache.logger, "warning", warnings.append)
    as_process(monkeypatch, 1)
    with compile_cache.use(str(tmp_path / "p1")) as counts:
        compiled = get()
        assert counts.from_process_0 == 0 and len(traced) == 2  # compiled here
    assert [w for w in warnings if "not signed with the job's key" in w] == [warnings[0]] and len(warnings) == 1
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(compiled(x), np.tanh(x64) @ x64.T, rtol=1e-5, atol=1e-6)


def test_without_the_jobs_key_no_executable_is_handed_over(tmp_path, monkeypatch):
    store = KeyValueStore()
    monkeypatch.setattr(compile_cache, "coordination_client", lambda: store)
    monkeypatch.setattr(compile_cache, "readable_by_every_process", lambda *_: False)
    for name in ("MEGASCALE_JOB_KEY", "MEGASCALE_JOB_KEY_FILE", "MEGASCALE_REDIS_PASSWORD", "MEGASCALE_REDIS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)
    warnings = []
    monkeypatch.setattr(compile_cache.logger, "warning", warnings.append)
    x = jax.random.normal(jax.random.key(8), (5,))
    as_process(monkeypatch, 0)
    with compile_cache.use(str(tmp_path)):
        compile_cache.load_or_compile("s", lambda: jax.jit(jnp.sin).lower(x), {}, (x,))
    assert store.values == {} and len(warnings) == 1 and "MEGASCALE_JOB_KEY_FILE" in warnings[0]


def test_the_trainer_reads_the_models_abstract_parameters_from_the_cache_on_a_restart(tmp_path, monkeypatch):
    """build_trainer's abstract parameters (shapes, dtypes, logical axes: the model's init traced)
    are kept in the run's store: a second build with the same config traces no init and gives the
    same tree; another config makes its own; an unreadable entry is one warning and a new trace."""
    from megascale_jax.config import load_config
    from megascale_jax.parallel.mesh import make_mesh
    from megascale_jax.training import trainer as trainers

    cfg = load_config(None, ["model.layers=2", "model.d_model=64", "model.seq_len=32", "mesh.dp=1", "mesh.tp=1"])
    mesh = make_mesh(cfg.mesh)
    traced = collections.Counter()
    init = trainers.Transformer.init

    def counted_init(self, *args, **kwargs):
        traced[self.cfg.d_model] += 1
        return init(self, *args, **kwargs)

    monkeypatch.setattr(trainers.Transformer, "init", counted_init)
    with compile_cache.use(str(tmp_path)):
        first = trainers.build_trainer(cfg, mesh)
        again = trainers.build_trainer(cfg, mesh)
        wider = trainers.build_trainer(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=128)),
                                        mesh)
    assert traced == {64: 1, 128: 1}
    same = jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), first.abstract_params,
                        again.abstract_params)
    assert all(jax.tree.leaves(same)) and jax.tree.structure(first.abstract_params) == \
        jax.tree.structure(again.abstract_params)
    assert first.state_shardings == again.state_shardings  # the logical axes came back too
    assert jax.tree.leaves(wider.abstract_params)[0].shape != jax.tree.leaves(first.abstract_params)[0].shape
    for entry in glob.glob(str(tmp_path / "compile_cache" / "process-0" / "abstract_params-*")):
        with open(entry, "wb") as f:
            f.write(b"not a pickle")
    with compile_cache.use(str(tmp_path)):
        trainers.build_trainer(cfg, mesh)
    assert traced == {64: 2, 128: 1}
