"""JAX's persistent compilation cache for a run: a restart loads the executables its earlier
attempts compiled instead of compiling them again.

What is cached where. `RUN_DIR/compile_cache/` (`run_dir.compile_cache_dir`) holds one file per
executable JAX compiled for this run — the train step, evaluation, the checkpoints' checksums and
the small ops around them — named by JAX's key: the program, its compile options, its devices, the
jax/XLA versions and flags. One cache per run directory: its entries are that run's, a restart
finds all of them, and nothing grows outside the run.

A cache shared by runs. Where the user set JAX's own `JAX_COMPILATION_CACHE_DIR` (or
`jax_compilation_cache_dir` before calling `main`), JAX's entries go there instead, so a new run
of a program another run compiled loads it (tiny_cpu's first 6 steps: 7.3-7.8 s, then 5.4-5.8 s with
every entry a hit; gpt_1b's step takes 30-50 s to compile for an H200 on this project's 2-core CPU
machine, tests/aot). A corrupt entry there discards every entry, as in the run's own directory
(below). Not in a CPU job of several
processes, whose entries serve process 0 only (below): it keeps the run's own directory. JAX's
other settings of that directory stay the user's: with `JAX_COMPILATION_CACHE_MAX_SIZE` JAX evicts
the least recently used entries past it and locks the directory around each read and write (every
process sharing it must then set it: JAX's eviction fails on entries written without it). This
process's own executables (`load_or_compile`, below) stay in `RUN_DIR/compile_cache/process-<i>/`:
their key holds the run's config.

Why these settings. `jax_persistent_cache_min_compile_time_secs=0` and
`jax_persistent_cache_min_entry_size_bytes=-1` keep every executable. JAX's default keeps only
compilations over 1 s, and a restart would still compile the ~20 small ones (the learning-rate
schedule's ops, the initialisation's helpers): ~1 s of a tiny_cpu restart, for ~0.1 MB of cache.
`jax_persistent_cache_enable_xla_caches=""`: JAX's default also puts XLA's GPU autotuning cache
in the directory, and that directory's path into every key, so a run directory that is moved or
copied (or mounted elsewhere) would never hit; autotuning results are not worth that.

Who can read it — the first-step stall with gloo (jax 0.10.2). JAX writes entries from process 0
only; every process looks up its own key. On GPUs JAX strips the device assignment from the key so
that all processes share process 0's entries (not tried here: no machine with several GPUs). On
the CPU the key includes the CPU client's topology, which describes the asking process's own
devices (ids 0-3 in process 0, 2048-2051 in process 1), so in a CPU job of several processes no
process but 0 ever hits. On a restart process 0 loaded everything in under a second, then waited
in the first step's collectives while the others compiled afresh: 8-14 s for tiny_cpu on this
2-core machine, idle to loaded; ~30 s in the earlier attempt, past gloo's 30 s timeout, which
aborts the job. The loaded executables are not at fault: process 1, given copies of process 0's
entries under its own keys, loads them and both train; and `jax_share_binary_between_hosts` fails
the same way (process 1 waits for its own key, which process 0 never publishes). So the cache is
used where every process can read process 0's entries — a job of one process, or accelerators.
In a CPU job of several processes every process keeps its own copies of what train.py compiles
up front (the initialisation, the train step, evaluation and the checkpoints' checksums) in
`RUN_DIR/compile_cache/process-<i>/`, through `jax.experimental.serialize_executable`
(`compile`, `load_or_compile`), and process 0 compiles each of them once for all: it hands each
to the others through the job's coordination service (see `_slot`). What they would compile
implicitly is kept out of the restart's path:
build_trainer traces rather than runs the optimizer's init (train.staged), and the restore
verifies with the precompiled checksums.

Only executables seen compiled are kept (jaxlib 0.10.2): XLA:CPU serializes an executable that
was itself deserialized (a hit of JAX's cache) without the program's compiled functions, and the
copy fails when it runs ("Function add_tanh_fusion.1 not found"). A program JAX's cache serves is
therefore neither kept nor handed over; the others compile it themselves.

What a restart still spent with every executable cached: tracing. JAX looks an executable up by
its lowered program, so a hit still traces and lowers the train step first: ~1.1 s of a 3.5 s
single-process tiny_cpu resume, ~3 s of ~12 s for each of 4 processes sharing 2 cores.
`load_or_compile` skips that for the executables train.py compiles up front: each process keeps
them in `RUN_DIR/compile_cache/process-<i>/` under a key of what the program is made from instead
of the program itself — the config, the arguments' shapes, dtypes and shardings, this package's
source (every module's bytes), the versions of jax, jaxlib, flax and optax, JAX's settings and
XLA_FLAGS, the process and its devices — and loads them without tracing. Anything else the
program could depend on (an edited dependency at the same version) is not in that key: delete
`compile_cache/` or set `train.compile_cache=false` after such a change.

Corrupt entries (a kill during JAX's in-place write, a full disk): JAX warns and compiles, but it
never replaces an existing entry, so the same entry would be unreadable on every restart. Here the
first unreadable entry discards the whole cache with one warning line, and the compilations that
follow write it anew. A cache directory that is not a readable, writable directory is one warning
line and a run without the cache.

Counts: JAX's monitoring events count the compilations that consulted the cache
(`/jax/compilation_cache/compile_requests_use_cache`) and the hits among them
(`/jax/compilation_cache/cache_hits`; its `cache_misses` event counts process 0's writes, not
misses). `CacheCounts.summary()` is the line a run ends with: `compilation cache: H hits, M misses`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import hashlib
import json
import os
import pickle
import warnings
from collections.abc import Callable, Iterator

import flax
import jax
import jaxlib
import optax
import orbax.checkpoint as ocp
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

from megascale_jax import cli, run_dir as run_dirs
from megascale_jax import job_key

logger = cli.get_logger("compile_cache")

REQUESTS, HITS = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"
SETTINGS = {"jax_persistent_cache_min_compile_time_secs": 0.0, "jax_persistent_cache_min_entry_size_bytes": -1,
            "jax_persistent_cache_enable_xla_caches": ""}
ENTRIES = "*-cache"  # JAX's file name of an entry: <module>-<key>-cache


# The largest executable process 0 hands the others through the coordination service; a larger
# one each process compiles itself (the service holds every entry in memory). tiny_cpu's train
# step is ~1.4 MB.
SHARE_MAX_BYTES = 64 << 20
SHARE_TIMEOUT_MS = 30 * 60 * 1000  # how long the others wait for process 0 to compile one


@dataclasses.dataclass
class CacheCounts:
    """This process's compilations that consulted the cache, the hits among them, and the misses
    it loaded from process 0 instead of compiling (see `_share`)."""

    requests: int = 0
    hits: int = 0
    from_process_0: int = 0

    @property
    def misses(self) -> int:
        return self.requests - self.hits

    def summary(self) -> str:
        return (f"compilation cache: {self.hits} hits, {self.misses} misses "
                f"({self.from_process_0} loaded from process 0)")


_store: dict = {}  # directory, counts: this process's store for `load_or_compile`, while `use` is on
_share: dict = {}  # client: while `use` serves a CPU job of several processes (see `_slot`)
# name -> how many programs of that name this process has compiled or loaded. Never reset: every
# process of a job asks for the same programs in the same order, so the n-th is the same program.
_asked: collections.Counter = collections.Counter()


def coordination_client():
    """The job's `jax.distributed` client (its key-value store); JAX has no public accessor, and
    orbax's is public."""
    return ocp.multihost.get_jax_distributed_client()


def readable_by_every_process(platform: str, processes: int) -> bool:
    """Whether every process of the job can load the entries process 0 writes (see above)."""
    return processes == 1 or platform != "cpu"


def jax_entries_directory(run_cache: str, users: str | None, platform: str, processes: int) -> str:
    """Where JAX's own entries go: the directory the user gave JAX (`JAX_COMPILATION_CACHE_DIR`),
    shared by runs, where every process reads process 0's entries; else the run's `run_cache`."""
    return users if users and readable_by_every_process(platform, processes) else run_cache


@contextlib.contextmanager
def use(run_dir: str, enabled: bool = True) -> Iterator[CacheCounts | None]:
    """Compile through `RUN_DIR/compile_cache` inside this block (call it before anything is
    compiled); yields the counts, or None when the cache is off."""
    if not enabled:
        yield None
        return
    directory = run_dirs.compile_cache_dir(run_dir)
    jax_entries = jax_entries_directory(directory, jax.config.jax_compilation_cache_dir, jax.default_backend(),
                                        jax.process_count())
    try:
        for path in {directory, jax_entries}:
            os.makedirs(path, exist_ok=True)
        usable = all(os.access(path, os.R_OK | os.W_OK | os.X_OK) for path in {directory, jax_entries})
    except OSError:
        usable = False
    if not usable:
        logger.warning(f"warning: compilation cache {jax_entries} is not a readable, writable directory; "
                       "compiling without it")
        yield None
        return

    counts, warned = CacheCounts(), False

    def count(event: str, **_) -> None:
        if event == REQUESTS:
            counts.requests += 1
        elif event == HITS:
            counts.hits += 1

    show_warning = warnings.showwarning

    def on_warning(message, category, filename, lineno, file=None, line=None):
        """JAX's warning about an entry it could not read (or write): one line of ours instead."""
        nonlocal warned
        text = str(message)
        if "persistent compilation cache" not in text:
            return show_warning(message, category, filename, lineno, file, line)
        if text.startswith("Error reading"):  # JAX compiles now; its write must not find the bad entry
            for entry in glob.glob(os.path.join(jax_entries, ENTRIES)):
                with contextlib.suppress(OSError):
                    os.remove(entry)
            text = f"discarded, compiling afresh: {text}"
        if not warned:
            logger.warning(f"warning: compilation cache {jax_entries} {text}")
            warned = True

    settings = {"jax_compilation_cache_dir": jax_entries, **SETTINGS}
    previous = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    jax_compilation_cache.reset_cache()  # JAX opens its cache once per process: here, now
    jax.monitoring.register_event_listener(count)
    warnings.showwarning = on_warning
    own = os.path.join(directory, f"process-{jax.process_index()}")
    try:
        os.makedirs(own, exist_ok=True)
        _store.update(directory=own, counts=counts)
    except OSError as e:  # the run goes on; JAX's cache may still serve it
        logger.warning(f"warning: compilation cache {own} cannot be made ({e.strerror or e}); "
                       "this process keeps no executables of its own")
    if _store and not readable_by_every_process(jax.default_backend(), jax.process_count()):
        # Handed over only when signed with the job's key: the coordination service lets anyone who
        # reaches it write a key, and an executable is native code every process would run.
        try:
            key = job_key.job_key()
        except job_key.JobKeyError as e:
            key = None
            logger.warning(f"warning: compilation cache: {e}")
        if key is None:
            logger.warning("warning: compilation cache: each process compiles its own executables (handing "
                           f"process 0's to the others needs the job's key: {job_key.HOW})")
        else:
            _share.update(client=coordination_client(), key=key)
    try:
        yield counts
    finally:
        _store.clear()
        _share.clear()
        warnings.showwarning = show_warning
        jax.monitoring.unregister_event_listener(count)
        for name, value in previous.items():
            jax.config.update(name, value)
        jax_compilation_cache.reset_cache()


def compile(lowered: jax.stages.Lowered, name: str) -> jax.stages.Compiled:
    """`lowered.compile()`; in a CPU job of several processes (whose JAX caches serve process 0
    only), through this process's store, keyed by the program's text: process 0 compiles it once
    and hands it to the others (`_slot`), and each keeps its copy for its restarts."""
    if not (_store and _share):
        return lowered.compile()
    # What JAX's key covers that the program text does not: versions, flags, the job's devices.
    key = hashlib.sha256("\n".join([
        lowered.as_text(), jax.__version__, jaxlib.__version__, os.environ.get("XLA_FLAGS", ""),
        str([d.id for d in jax.devices()])]).encode()).hexdigest()
    return _through_store(name, key, _slot(name), lowered.compile, _devices(lowered))


def load_or_compile(name: str, lower: Callable[[], jax.stages.Lowered], config: dict, args: tuple
                    ) -> jax.stages.Compiled:
    """The executable `lower()` compiles for `config` and `args`: loaded from this process's store
    without tracing anything when `use` is on and it is there (in a CPU job of several processes,
    else from process 0); else lowered, compiled and stored. See the module's note for the key."""
    if not _store:
        return lower().compile()
    # The devices the program runs on, in its order (by default it would be every device of the
    # backend, and a program for fewer aborts the process in XLA).
    devices = jax.tree.leaves(args)[0].sharding._device_assignment
    return _through_store(name, _program_key(name, config, args), _slot(name) if _share else None,
                          lambda: lower().compile(), devices)


def remember(name: str, config: dict, make: Callable[[], object]) -> object:
    """`make()`'s value for `config`, kept pickled in this process's store beside its executables,
    so that a restart reads it instead of making it again; `make()` itself when `use` is off. For
    what depends on the config and this package's source alone: the model's abstract parameters,
    whose tracing (the model's init, abstractly) was half of a restart's `trainer` phase (0.21 ->
    0.11 s on one process; that phase took 0.36 s on the 4-process ETTR drill, two cores shared).
    An unreadable entry is made again, one warning."""
    if not _store:
        return make()
    path = os.path.join(_store["directory"], f"{name}-{_program_key(name, config, ())}.pickle")
    if (entry := _read(path)) is not None:
        try:
            return pickle.loads(entry)
        except Exception as e:  # noqa: BLE001 — made again, never fatal
            logger.warning(f"warning: compilation cache {path} discarded, making {name} afresh: {cli.one_line(e)}")
    value = make()
    _keep(path, pickle.dumps(value), name)
    return value


def _devices(lowered: jax.stages.Lowered):
    """The devices `lowered` runs on, in its order (None: every device), from its shardings: a
    program loaded for more devices than it runs on aborts the process in XLA. (JAX keeps them in
    the lowering's private compile arguments; there is no public accessor in jax 0.10.)"""
    compile_args = lowered._lowering.compile_args
    for sharding in (*compile_args["in_shardings"], *compile_args["out_shardings"]):
        if hasattr(sharding, "_device_assignment"):
            return sharding._device_assignment
    return None


def _through_store(name: str, key: str, slot: str | None, compile_here: Callable[[], jax.stages.Compiled],
                   devices) -> jax.stages.Compiled:
    """This process's entry of the program `key` (a pickled `serialize_executable.serialize`);
    else process 0's, handed over under `slot` (None: not shared); else compiled here and kept.
    Process 0 hands over what it loads or compiles under `slot`, an empty entry when it has none."""
    counts, first = _store["counts"], jax.process_index() == 0
    path = os.path.join(_store["directory"], f"{name}-{_own_key(key)}")
    entry = _read(path)
    if (compiled := _deserialize(entry, devices, path)) is not None:
        counts.requests += 1
        counts.hits += 1
        if slot and first:
            _publish(slot, key, entry)
        return compiled
    if entry is not None:  # unreadable (warned): gone, so that no later restart warns again
        with contextlib.suppress(OSError):
            os.remove(path)
    if slot and not first and (compiled := _from_process_0(slot, key, devices, path, name)) is not None:
        counts.requests += 1  # a miss of this process's store, loaded rather than compiled
        counts.from_process_0 += 1
        return compiled
    requests, hits = counts.requests, counts.hits
    compiled = compile_here()  # through JAX's cache, which counts it
    # XLA:CPU cannot serialize an executable that was itself deserialized: the copy lacks the
    # program's compiled functions ("Function ... not found" when it runs). So only an executable
    # seen compiled here (JAX's cache asked, and missed) is kept and handed over; not one JAX's
    # cache served, nor one JAX served from memory (whose origin is unknown).
    fresh = counts.requests > requests and counts.hits == hits
    entry = _serialized(compiled, name) if fresh else None
    if slot and first:
        _publish(slot, key, entry)
    if entry is not None:
        _keep(path, entry, name)
    return compiled


def _serialized(compiled: jax.stages.Compiled, name: str) -> bytes | None:
    """The entry of `compiled`, or None (one warning) when JAX cannot serialize the executable (a
    host callback): never fatal, the executable is compiled again where needed."""
    try:
        return pickle.dumps(serialize_executable.serialize(compiled))
    except Exception as e:  # noqa: BLE001
        logger.warning(f"warning: compilation cache cannot keep {name}, a restart compiles it: {cli.one_line(e)}")
        return None


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _deserialize(entry: bytes | None, devices, where: str) -> jax.stages.Compiled | None:
    """The executable in `entry`, or None when there is none; an unreadable one is one warning and
    None."""
    if entry is None:
        return None
    try:
        serialized, in_tree, out_tree = pickle.loads(entry)
        return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree, execution_devices=devices)
    except Exception as e:  # noqa: BLE001 — an unreadable entry is compiled afresh, never fatal
        logger.warning(f"warning: compilation cache {where} discarded, compiling afresh: {cli.one_line(e)}")
        return None


# ------------------------------------------------------- one compilation for every process

# In a CPU job of several processes every process compiles the same program, and on one machine
# they share its cores: the ETTR drill's 4 processes on this 2-core machine compiled for 47-51 s,
# all at once; with process 0 compiling alone, 16-17 s (bench/results/startup_cpu*.json). So
# process 0 compiles (or loads) each program and hands it to the
# others through the job's coordination service (`jax.distributed`'s key-value store), under the
# n-th slot of its name; the others, on a miss of their own store, wait for that slot and load it
# for their own devices, if it is the same program (same key; otherwise they compile it
# themselves). Process 0 publishes every program it is asked for, hit or miss, so no process ever
# waits for a slot that is never filled. JAX's `jax_share_binary_between_hosts` does the same on
# GPUs, where its keys agree between processes; on the CPU they never do (see above).

def _slot(name: str) -> str:
    _asked[name] += 1
    return f"megascale_jax/compile_cache/{name}/{_asked[name]}"


def _own_key(key: str) -> str:
    """A process's own entry of the program `key`: process 0's executables are the others' too,
    but each loads (and keeps) its copy for its own devices."""
    return hashlib.sha256(f"{key} {jax.process_index()}".encode()).hexdigest()


def _publish(slot: str, key: str, entry: bytes | None) -> None:
    """Process 0: the entry for `slot` (empty when there is none to give: the others compile)."""
    if entry is not None and len(entry) > SHARE_MAX_BYTES:
        entry = None
    message = key.encode() + b"\n" + (entry or b"")
    signature = job_key.sign(_share["key"], slot.encode() + b"\n" + message).encode()
    try:
        _share["client"].key_value_set_bytes(slot, signature + b"\n" + message, allow_overwrite=True)
    except Exception as e:  # noqa: BLE001 — the others then compile on their own, after the wait
        logger.warning(f"warning: compilation cache cannot hand {slot} to the other processes: {cli.one_line(e)}")


def _from_process_0(slot: str, key: str, devices, path: str, name: str) -> jax.stages.Compiled | None:
    """Processes other than 0: process 0's executable for `slot` when it is this program, loaded
    and kept as this process's own entry at `path`; else None (compile it here)."""
    try:
        payload = _share["client"].blocking_key_value_get_bytes(slot, SHARE_TIMEOUT_MS)
    except Exception as e:  # noqa: BLE001 — process 0 gone or too slow: compile here
        logger.warning(f"warning: compilation cache got no {name} from process 0, compiling it here: "
                       f"{cli.one_line(e)}")
        return None
    signature, _, message = payload.partition(b"\n")
    if not job_key.verify(_share["key"], slot.encode() + b"\n" + message, signature.decode(errors="replace")):
        logger.warning(f"warning: compilation cache: {name} under {slot} is not signed with the job's key (forged?); "
                       "compiling it here")
        return None
    theirs, _, entry = message.partition(b"\n")
    if theirs.decode() != key or not entry:
        return None
    if (compiled := _deserialize(entry, devices, f"{slot} from process 0")) is not None:
        _keep(path, entry, name)
    return compiled


def _keep(path: str, data: bytes, name: str) -> None:
    """Write an entry whole: renamed into place once complete, so a kill never leaves half of one.
    A write that fails (a full disk, a file size limit) is one warning; the run goes on."""
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        logger.warning(f"warning: compilation cache cannot keep {name}, a restart compiles it: "
                       f"{e.strerror or e}")


def _program_key(name: str, config: dict, args: tuple) -> str:
    """What the program `name` is made from, hashed: everything but its traced text (the same in
    every process of a job; `_own_key` makes each process's entry its own)."""
    def describe(x) -> str:
        return f"{x.shape} {x.dtype} {getattr(x, 'weak_type', False)} {x.sharding}"
    settings = {k: repr(v) for k, v in jax.config.values.items() if "cache" not in k}
    return hashlib.sha256(json.dumps([
        name, config, str(jax.tree.structure(args)), [describe(x) for x in jax.tree.leaves(args)],
        _source_digest(), jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__,
        settings, os.environ.get("XLA_FLAGS", ""),
        [(d.id, d.device_kind) for d in jax.devices()]], sort_keys=True, default=str).encode()).hexdigest()


# Modules no compiled program is made from: the planner (it prices layouts, it never traces one).
# Left out of the key so that editing them does not make every restart of a running job compile
# afresh: in the ETTR drill, an edit of planner/ while the job ran made three processes of four
# miss their entries after each restart, 12-15 s of compiling where loading takes 0.4 s.
# Modules no program is made from: the planner, and the driver's supervision (it runs no jax
# program of the train step; an edit there must not make every worker of a run compile afresh).
NOT_IN_PROGRAMS = ("planner/", "plan.py", "supervise/")


@functools.cache
def _source_digest() -> str:
    return source_digest(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def source_digest(package: str) -> str:
    """sha256 of every module of `package` that a program can be made from (not
    NOT_IN_PROGRAMS): an edit to any of them changes every key."""
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(package, "**", "*.py"), recursive=True)):
        if os.path.relpath(path, package).startswith(NOT_IN_PROGRAMS):
            continue
        digest.update(os.path.relpath(path, package).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()

