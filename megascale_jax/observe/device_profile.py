"""Per-device busy time from a JAX profiler trace: which device computed what, and when.

XLA records every executed HLO op (a "thunk" on CPU, a kernel on GPU) in the trace with the op
name (`hlo_op` stat), its module (`hlo_module`) and the device that ran it (`device_ordinal` stat
on CPU, the `/device:GPU:N` plane on GPU). `read_ops` collects those; `busy_ns` is the union of
a device's compute intervals, so nested ops (a fusion inside a `conditional` inside a `while`)
count once and collectives, which mostly wait for peers, count as idle.

`per_tick` cuts a device's ops into the ticks of a pipeline (`megascale_jax.parallel.pipeline`): every
tick ends with the same number of permutes (activations forward, cotangents back),
so the k-th group of them closes tick k. From the busy time of every (stage, tick),
`lockstep_bubble` is the bubble of the table's lockstep execution with the measured costs: each
tick lasts as long as its busiest stage (`bench/parallel/pipeline_bubble.py` compares it with the table).

`StepProfiler` samples the train loop (`observe.profile_every`): one step in N is traced and
every device's compute, collective and span seconds go to the timings as device rows, so the
report can show which *device* is slow, not only which process arrives late.

On XLA:CPU simulated devices share the host's cores, so busy times there are stretched by the
other devices' work; the per-(stage, tick) *pattern* is exact, the absolute times are not.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import shutil
import time

import jax

# Ops whose duration is waiting for other devices, or that only contain other (traced) ops.
# Collectives carry XLA's opcode or, on recent jax, the primitive's name ("ppermute", "psum").
PERMUTES = ("collective-permute", "ppermute")
COLLECTIVES = (*PERMUTES, "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-broadcast",
               "send", "recv", "psum", "all_gather", "all_to_all", "reduce_scatter")
CONTAINERS = ("while", "conditional", "call", "async")
_GPU_PLANE = re.compile(r"/device:GPU:(\d+)")


@dataclasses.dataclass(frozen=True)
class Op:
    device: int
    name: str  # the HLO instruction, e.g. "fusion.3", "collective-permute.1"
    start_ns: float
    end_ns: float

    @property
    def kind(self) -> str:
        """The instruction's opcode-like stem: "collective-permute.1-start" -> "collective-permute"."""
        return re.sub(r"(\.\d+)+(\.clone)?(-start|-done)?$", "", self.name)

    @property
    def is_collective(self) -> bool:
        return self.kind.startswith(COLLECTIVES)

    @property
    def is_compute(self) -> bool:
        return not self.is_collective and not self.kind.startswith(CONTAINERS)


def latest_trace(trace_dir: str) -> str:
    """The newest `.xplane.pb` written under `trace_dir` by `jax.profiler.trace`."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}: was jax.profiler.trace(...) run there?")
    return max(paths, key=os.path.getmtime)


def read_ops(trace_path: str, module: str | None = None) -> dict[int, list[Op]]:
    """device -> its HLO ops in start order (of HLO module `module` only, if given)."""
    ops: dict[int, list[Op]] = {}
    for plane in jax.profiler.ProfileData.from_file(trace_path).planes:
        gpu = _GPU_PLANE.search(plane.name)
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" not in stats or (module and str(stats.get("hlo_module")) != module):
                    continue
                device = int(gpu.group(1)) if gpu else int(stats.get("device_ordinal", -1))
                ops.setdefault(device, []).append(
                    Op(device, str(stats["hlo_op"]), event.start_ns, event.start_ns + event.duration_ns))
    return {d: sorted(v, key=lambda o: o.start_ns) for d, v in sorted(ops.items())}


def busy_ns(ops: list[Op]) -> float:
    """Length of the union of the compute ops' intervals."""
    return _union_ns([o for o in ops if o.is_compute])


def per_tick(ops: list[Op], ticks: int, steps: int = 1) -> list[list[Op]]:
    """A device's ops over `steps` runs of a pipeline step, cut into `steps * ticks` ticks at the
    tick loop's permutes: the permute instructions that ran exactly once per tick (others, e.g.
    re-laying out weights for v > 1, run once per step). Ops after a step's last tick (gradient
    reductions, the optimizer) and before its first (up to the weight re-layout's last permute)
    are in no tick."""
    runs = collections.Counter(o.name for o in ops if o.kind in PERMUTES and not o.name.endswith("-start"))
    in_loop = {name for name, count in runs.items() if count == steps * ticks}
    if not in_loop:
        raise ValueError(f"no permute on device {ops[0].device if ops else '?'} ran once per tick "
                         f"({steps}x{ticks} times; counts {dict(runs)}): is this a pipeline step?")
    permutes = [o for o in ops if o.name in in_loop]
    per = len(in_loop)
    ends = [permutes[i * per + per - 1].end_ns for i in range(steps * ticks)]
    # XLA:CPU traces no event spanning the whole tick loop, so a step's loop is taken to start
    # after the last other permute before its first tick (the v > 1 weight re-layout).
    others = [o for o in ops if o.kind in PERMUTES and o.name not in in_loop]
    loop_starts = []
    for k in range(steps):
        first, previous = permutes[k * ticks * per], ends[k * ticks - 1] if k else float("-inf")
        loop_starts.append(max([o.end_ns for o in others if previous <= o.start_ns and o.end_ns <= first.start_ns],
                               default=previous))
    cut, i = [[] for _ in ends], 0
    for op in ops:
        while i < len(ends) and op.start_ns >= ends[i]:
            i += 1
        if i == len(ends):
            break
        if i % ticks or op.start_ns >= loop_starts[i // ticks]:
            cut[i].append(op)
    return cut


def outside_ticks_ns(ops: list[Op], cut: list[list[Op]]) -> float:
    """Busy time of a device's compute ops that fall in no tick (see `per_tick`)."""
    inside = {id(o) for tick in cut for o in tick}
    return busy_ns([o for o in ops if id(o) not in inside])


def lockstep_bubble(busy: list[list[float]], working: list[list[bool]]) -> dict[str, float]:
    """busy[stage][tick] (measured) and working[stage][tick] (the table) -> the idle share of a
    lockstep step in which every tick lasts as long as its busiest stage, split in two:

    * `idle`: ticks where the table gives a stage no work (whatever it computes there — masked
      junk, zero-filled gradients — is bubble too); the table's own bubble is this share with
      equal costs per forward and per backward;
    * `imbalance`: waiting, in a tick where the stage had work, for a slower stage.

    `total` = idle + imbalance = 1 - useful busy time / (stages * step)."""
    stages, ticks = len(busy), len(busy[0])
    longest = [max(busy[s][t] for s in range(stages)) for t in range(ticks)]
    whole = stages * sum(longest)
    idle = sum(longest[t] for s in range(stages) for t in range(ticks) if not working[s][t]) / whole
    imbalance = sum(longest[t] - busy[s][t] for s in range(stages) for t in range(ticks) if working[s][t]) / whole
    return {"total": idle + imbalance, "idle": idle, "imbalance": imbalance}


# ============================================================================ sampling the train loop


@dataclasses.dataclass(frozen=True)
class DeviceTimes:
    """One device's share of a traced step, in seconds. `start` is on the host's wall clock, taken
    as `time.time()` when tracing started plus the first op's offset in the trace (approximate:
    the trace's own start is not exactly that moment)."""

    device: int  # global device id
    start: float
    compute_s: float  # union of compute ops
    collective_s: float  # union of collectives (transfer and waiting for peers)
    span_s: float  # first op start to last op end


def device_times(ops: dict[int, list[Op]], device_ids: dict[int, int], wall_at_zero: float) -> list[DeviceTimes]:
    """Per device of `ops` (keyed by local ordinal; `device_ids` maps it to the global id)."""
    zero = min((o.start_ns for v in ops.values() for o in v), default=0.0)
    out = []
    for ordinal, device_ops in ops.items():
        if ordinal not in device_ids or not device_ops:
            continue
        collectives = [o for o in device_ops if o.is_collective]
        first, last = min(o.start_ns for o in device_ops), max(o.end_ns for o in device_ops)
        out.append(DeviceTimes(device_ids[ordinal], wall_at_zero + (first - zero) / 1e9, busy_ns(device_ops) / 1e9,
                               _union_ns(collectives) / 1e9, (last - first) / 1e9))
    return out


def _union_ns(ops: list[Op]) -> float:
    total, end = 0.0, float("-inf")
    for op in sorted(ops, key=lambda o: o.start_ns):
        if op.end_ns > end:
            total += op.end_ns - max(op.start_ns, end)
            end = op.end_ns
    return total


class StepProfiler:
    """Traces the train steps it is given (the loop's profile hook: every `observe.profile_every`-th)
    with `jax.profiler` and reports its devices' times to the loop's observers. The loop runs a
    traced step alone (the previous step finished first, the step itself finished before `stop`),
    so the trace holds that step's ops and nothing else of training; the compiled step's HLO module name filters out anything else,
    e.g. evaluation."""

    def __init__(self, compiled_step, trace_root: str):
        self.compiled_step, self.trace_root = compiled_step, trace_root
        self.module = None  # read from the compiled step's HLO text at the first traced step only
        self.trace_dir = None
        self.wall_at_start = 0.0

    def start(self, step: int) -> None:
        if self.module is None:
            self.module = hlo_module_name(self.compiled_step)
        self.trace_dir = os.path.join(self.trace_root, f"step-{step}")
        self.wall_at_start = time.time()
        jax.profiler.start_trace(self.trace_dir)

    def abandon(self) -> None:
        """Stop tracing and drop the trace: the traced step did not complete (a non-finite step
        that will be replayed, and traced again, or an error on the way out)."""
        if self.trace_dir is not None:
            jax.profiler.stop_trace()
            shutil.rmtree(self.trace_dir, ignore_errors=True)
            self.trace_dir = None

    def stop(self, step: int, watch) -> None:
        """Stop tracing and hand each device's compute, collective and span seconds to
        `watch.device_phase` as `device_<name>` phases of `step`."""
        jax.profiler.stop_trace()
        ops = read_ops(latest_trace(self.trace_dir), self.module)
        shutil.rmtree(self.trace_dir, ignore_errors=True)  # the numbers go to the timings; traces are large
        self.trace_dir = None
        ids = {ordinal: d.id for ordinal, d in enumerate(jax.local_devices())}
        for t in device_times(ops, ids, self.wall_at_start):
            for name, seconds in (("compute", t.compute_s), ("collective", t.collective_s), ("span", t.span_s)):
                watch.device_phase(step, t.device, f"device_{name}", t.start, seconds)


def hlo_module_name(compiled) -> str:
    """The HLO module name of a compiled function, as profiler events name it (e.g. "jit_step")."""
    return compiled.as_text().split(None, 2)[1].rstrip(",")
