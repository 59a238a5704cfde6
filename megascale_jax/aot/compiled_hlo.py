"""What XLA made of a step, read from the compiled module's text and XLA's own memory dump: its
kernels, the buffers live at its memory peak, and which collectives overlap compute.

* `kernel_inventory`: every kernel the program launches, statically and per step (a while loop's
  body counts its trip count times): fusions by kind, GEMMs by backend (Triton GEMM fusions,
  cuBLAS and cuDNN custom calls, dots XLA left in its own loop/input fusions), custom calls by
  target, collectives by opcode. What is a kernel: a fusion, a custom call, a collective, a copy
  or any other non-free instruction of a computation that runs on its own (the entry, loop bodies,
  branches, async wrappers) — not the instructions a fusion fuses.
* `peak_buffers`: the values XLA's heap simulation holds at the peak (the `-live-range.txt` dump's
  "Live ranges at N (peak)" list), each with its shape and the model part that owns it
  (`observe.hlo_parts`): a state argument by its path, a loop's state as the layer scan's.
* `overlap`: each asynchronous collective (`*-start` ... `*-done`) with the kernels the schedule
  puts between its start and its done and their FLOPs. A compiled GPU module is scheduled
  (`is_scheduled=true`): a computation's instruction order is its launch order, and a collective
  overlaps compute exactly when compute kernels are scheduled inside its start/done window (they
  run on the compute stream while the collective runs on its own). A synchronous collective
  overlaps nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Iterator

from megascale_jax.observe import collectives as hlo_collectives
from megascale_jax.observe.hlo_parts import Instruction, part_of, scope_part, short_op_name

# Instructions that launch nothing: views, tuples, the wait of an async pair, loop plumbing.
FREE = frozenset(("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
                  "replica-id", "opt-barrier", "add-dependency", "while", "conditional", "call", "async-start",
                  "async-update", "async-done", "all-gather-done", "all-reduce-done", "collective-permute-done",
                  "fusion-done", "copy-done", "send-done", "recv-done"))
GEMM_FUSION_KINDS = {"__triton_gemm": "triton", "__triton_nested_gemm_fusion": "triton", "__cudnn$fusion": "cudnn",
                     "__cublas$gemm_fusion": "cublas"}
_FUSION_KIND = re.compile(r"kind=(k\w+)")
_BACKEND_KIND = re.compile(r'"fusion_backend_config":\{.*?"kind":"(__[^"]+)"')  # not always its first key
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of the program (module docstring), where it runs and how often a step runs it."""

    name: str
    shape: str
    op: str
    rest: str  # the rest of its line: operands and attributes
    category: str  # "fusion", "custom-call", "collective" or "other"
    kind: str  # the fusion's kind (kLoop, or a custom fusion's backend kind), the call's target, the opcode
    computation: str
    runs: int  # executions per step: its computation's


def kernels(computations: dict, entry: str) -> Iterator[Kernel]:
    """Every kernel of a parsed module (`collectives.parse_computations`), in schedule order within
    each computation that runs kernels of its own."""
    for computation, times in _kernel_computations(computations, entry).items():
        for name, shape, op, rest in computations[computation]:
            if op in FREE or op.endswith("-done"):
                continue
            yield Kernel(name, shape, op, rest, *_kernel_kind(op, rest), computation, times)


def _kernel_computations(computations: dict, entry: str) -> dict[str, int]:
    """Computation -> how many times one step runs it, for the computations that run kernels of
    their own: the entry, while bodies (× trip count), conditional branches (× 1: which branch runs
    is data), called and async-wrapped computations. Fusion computations are not among them."""
    runs: dict[str, int] = collections.Counter()

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for inst, _, op, rest in computations[name]:
            if op == "while":
                body = re.search(r"\bbody=%([\w.\-]+)", rest).group(1)
                visit(body, times * hlo_collectives.trip_count(inst, rest))
            elif op == "conditional":
                for callee in hlo_collectives.branches(rest):
                    visit(callee, times)
            elif op in ("call", "async-start"):
                for callee in hlo_collectives.CALLEE.findall(rest):
                    visit(callee, times)

    visit(entry, 1)
    return runs


def _kernel_kind(op: str, rest: str) -> tuple[str, str]:
    """(category, name) of one kernel: ("fusion", "kLoop" or the custom fusion's backend kind),
    ("custom-call", target), ("collective", opcode), or ("other", opcode)."""
    base = op.removesuffix("-start")
    if op in ("fusion", "fusion-start"):
        kind = _FUSION_KIND.search(rest)
        backend = _BACKEND_KIND.search(rest)
        return "fusion", backend.group(1) if backend else (kind.group(1) if kind else "fusion")
    if op == "custom-call":
        return "custom-call", _TARGET.search(rest).group(1)
    if base in hlo_collectives.OPS:
        return "collective", base
    return "other", op


def gemm_backend(category: str, name: str, flops: float, called_target: str | None = None) -> str | None:
    """Which library runs a kernel's matrix product, None for a kernel without one.
    `called_target`: the custom call inside the computation a fusion calls (a custom fusion around a
    library call, e.g. XLA's dynamic-slice fusion of a cuBLAS GEMM writing into the layer scan's
    stack, is that library's)."""
    if category == "fusion" and name in GEMM_FUSION_KINDS:
        return GEMM_FUSION_KINDS[name]
    if category == "fusion" and flops and called_target:
        return gemm_backend("custom-call", called_target, flops)
    if category == "custom-call" and name.startswith("__cublas"):
        return "cublas-fp8" if name.endswith("$f8") else "cublas"
    if category == "custom-call" and name.startswith("__cudnn"):
        return "cudnn"
    return "xla" if flops else None  # a dot XLA emitted itself, inside a loop/input fusion


def kernel_inventory(hlo_text: str, hlo: dict[str, Instruction]) -> dict:
    """Kernels of the program (module docstring): {"static": {...}, "per_step": {...}}, each
    {"fusions": {kind: n}, "gemms": {backend: n}, "custom_calls": {target: n}, "collectives":
    {op: n}, "other": {opcode: n}, "kernels": n}, and the matrix products' FLOPs per step by backend."""
    computations, entry = hlo_collectives.parse_computations(hlo_text)
    targets = library_calls(computations)
    counts = {scope: collections.defaultdict(collections.Counter) for scope in ("static", "per_step")}
    gemm_flops = collections.Counter()
    for k in kernels(computations, entry):
        flops = hlo[k.name].flops if k.name in hlo else 0.0
        callee = hlo_collectives.CALLEE.search(k.rest) if k.category == "fusion" else None
        backend = gemm_backend(k.category, k.kind, flops, targets.get(callee.group(1)) if callee else None)
        for scope, n in (("static", 1), ("per_step", k.runs)):
            counts[scope][{"fusion": "fusions", "custom-call": "custom_calls", "collective": "collectives",
                           "other": "other"}[k.category]][k.kind] += n
            counts[scope]["kernels"]["all"] += n
            if backend:
                counts[scope]["gemms"][backend] += n
        if backend:
            gemm_flops[backend] += flops * k.runs
    out = {scope: {key: dict(sorted(c.items(), key=lambda kv: -kv[1])) for key, c in by.items() if key != "kernels"}
           | {"kernels": by["kernels"]["all"]} for scope, by in counts.items()}
    out["gemm_flops_per_step"] = dict(gemm_flops)
    return out


def library_calls(computations: dict) -> dict[str, str]:
    """Computation -> the target of the first custom call in it (for the fusions that wrap one)."""
    found = {}
    for name, sequence in computations.items():
        target = next((m.group(1) for *_, op, rest in sequence if op == "custom-call" and (m := _TARGET.search(rest))),
                      None)
        if target:
            found[name] = target
    return found


# ============================================================================ the memory peak

_PEAK_HEADER = re.compile(r"^\s*Live ranges at (\d+) \(peak\):")
_PEAK_VALUE = re.compile(r"^\s+(?P<name>[\w.\-]+)(?P<index>\{[\d,]*\}): (?P<bytes>\d+) bytes")
# A value of the buffer assignment:
# `value: <3740 input_add_reduce_select_fusion{0} @0> (size=1024,offset=512): f32[2,64]{1,0}`
_ASSIGNED_VALUE = re.compile(r"value: <\d+ (?P<name>[\w.\-]+)(?P<index>\{[\d,]*\})?(?: \(phi\))? @\d+> "
                             r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<shape>\S+)")


def buffer_part(name: str, inst: Instruction) -> str:
    """The model part that owns a value live at the peak, by the first rule that applies:

    1. a state argument, by its path (the entry parameter's op_name, `state.params['layers']...`):
       "parameters", "optimizer state", "input batch";
    2. a loop's state (a while's tuple, or a loop body's parameter): "layer scan state" — the
       residuals the layer scan stacked for the backward, or gradients it carries;
    3. a slice the forward scan writes into its stack of per-layer residuals (jax's
       `dynamic_update_index_in_dim`): "kept for the backward: <the part most of the fused
       instructions' scopes name>";
    4. otherwise the defining instruction's part (`hlo_parts.part_of`)."""
    path = inst.op_name.replace("\\'", "'")
    if inst.opcode == "parameter" and path.startswith("state.opt_state"):
        return "optimizer state"
    if inst.opcode == "parameter" and path.startswith("state.params"):
        return "parameters"
    if inst.opcode == "parameter" and path.startswith("batch"):
        return "input batch"
    if inst.opcode in ("parameter", "while"):
        return "layer scan state"
    if "dynamic_update_index_in_dim" in inst.op_name:
        votes = collections.Counter(p for _, n in inst.fused if (p := scope_part(n)))
        return f"kept for the backward: {votes.most_common(1)[0][0] if votes else 'layer scan'}"
    return part_of(inst)


def peak_buffers(live_range_text: str, buffer_assignment_text: str, hlo: dict[str, Instruction]) -> list[dict]:
    """The values live at the memory peak, largest first: {"value", "bytes", "shape", "part",
    "op_name"}, the part by `buffer_part`."""
    shapes = {m["name"] + (m["index"] or "{}"): m["shape"] for m in _ASSIGNED_VALUE.finditer(buffer_assignment_text)}
    values, in_peak = [], False
    for line in live_range_text.splitlines():
        if _PEAK_HEADER.match(line):
            in_peak = True
        elif in_peak:
            m = _PEAK_VALUE.match(line)
            if m is None:
                break
            values.append((m["name"], m["index"], int(m["bytes"])))
    out = []
    for name, index, nbytes in values:
        inst = hlo.get(name, Instruction(""))
        out.append({"value": name + (index if index != "{}" else ""), "bytes": nbytes,
                    "shape": shapes.get(name + index, ""), "part": buffer_part(name, inst),
                    "op_name": short_op_name(inst.op_name) if inst.opcode != "parameter" else inst.op_name})
    return sorted(out, key=lambda v: -v["bytes"])


_CHUNK = re.compile(r"^\s+[\d.]+\w+\(\s*\d+%\);\s+(?P<size>[\d.]+)(?P<unit>B|KiB|MiB|GiB);\s+(?P<offset>\d+);\s+\d+; (?P<shapes>.*)$")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_TEMP_ALLOCATION = re.compile(r"^allocation \d+: size \d+, .*preallocated-temp:$")


def heap_chunks(memory_usage_text: str, buffer_assignment_text: str, hlo: dict[str, Instruction],
                top: int = 8) -> list[dict]:
    """The largest ranges of the step's temporary buffer, as XLA packed it (the dump's
    `-memory-usage-report.txt`, first section): {"bytes", "offset", "shapes", "parts"}. Values
    that are never live together share a range; a range's parts are those of the values placed at
    its offset (`buffer_part`). The temporaries' size is the sum of these ranges, which is more
    than what is live at any one time (`peak_buffers`) where packing leaves gaps."""
    at_offset = collections.defaultdict(set)
    in_temp = False
    for line in buffer_assignment_text.splitlines():
        if line.startswith("allocation "):
            in_temp = bool(_TEMP_ALLOCATION.match(line))
        elif in_temp and (m := _ASSIGNED_VALUE.search(line)):
            at_offset[int(m["offset"])].add(buffer_part(m["name"], hlo.get(m["name"], Instruction(""))))
    chunks = []
    for line in memory_usage_text.splitlines()[4:]:  # after the title, total, header and rule
        m = _CHUNK.match(line)
        if m is None:
            break
        offset = int(m["offset"])
        chunks.append({"bytes": round(float(m["size"]) * _UNITS[m["unit"]]), "offset": offset,
                       "shapes": m["shapes"], "parts": sorted(at_offset.get(offset, ()))})
    return chunks[:top]


def bytes_by_part(buffers: list[dict]) -> dict[str, int]:
    """The peak's live bytes summed by model part, largest first."""
    total = collections.Counter()
    for b in buffers:
        total[b["part"]] += b["bytes"]
    return dict(total.most_common())


# ============================================================================ overlap


def overlap(hlo_text: str, hlo: dict[str, Instruction], mesh_shape: tuple[int, ...],
            axis_names: tuple[str, ...]) -> list[dict]:
    """Every collective of the program: {"op", "axes", "async", "kernels_between", "flops_between",
    "computation", "runs"}; `kernels_between` counts the compute kernels scheduled between an
    asynchronous collective's start and its done (0 for a synchronous one: it overlaps nothing).

    XLA writes an asynchronous collective two ways: `all-gather-start` ... `all-gather-done`
    (`compiled.as_text()`), or, in its dump, a generic `async-start` whose called computation holds
    the collective, ended by `async-done(%that start)`. Both are read."""
    computations, entry = hlo_collectives.parse_computations(hlo_text)
    devices = hlo_collectives.partitions(hlo_text)
    runs = _kernel_computations(computations, entry)
    wrapped = {callee for sequence in computations.values() for _, _, op, rest in sequence if op == "async-start"
               for callee in hlo_collectives.CALLEE.findall(rest)}
    out = []
    for computation, times in runs.items():
        if computation in wrapped:
            continue  # its collective is read at the async-start that wraps it
        sequence = computations[computation]
        for i, (inst, _, op, rest) in enumerate(sequence):
            collective = _collective(op, rest, computations)
            if collective is None:
                continue
            base, attributes = collective
            axes = hlo_collectives.group_axes(hlo_collectives.replica_groups(attributes, devices)[0], mesh_shape,
                                              axis_names)
            if not axes:
                continue
            started = op.endswith("-start")
            done = i
            if started:
                done = next(j for j, (_, _, o, r) in enumerate(sequence)
                            if o.endswith("-done") and re.match(rf"\s*%{re.escape(inst)}\b", r))
            between = [name for name, _, o, r in sequence[i + 1:done] if o not in FREE and not o.endswith("-done")
                       and _collective(o, r, computations) is None]
            out.append({"op": base, "axes": axes, "async": started, "kernels_between": len(between),
                        "flops_between": sum(hlo[n].flops for n in between if n in hlo),
                        "computation": computation, "runs": times})
    return out


def _collective(op: str, rest: str, computations: dict) -> tuple[str, str] | None:
    """(collective opcode, the attributes that hold its groups) of a collective or of the async-start
    that wraps one; None for anything else."""
    base = op.removesuffix("-start")
    if base in hlo_collectives.OPS:
        return base, rest
    if op == "async-start":
        for callee in hlo_collectives.CALLEE.findall(rest):
            for _, _, inner, inner_rest in computations[callee]:
                if inner in hlo_collectives.OPS:
                    return inner, inner_rest
    return None


def overlap_by_axis(rows: list[dict]) -> dict[str, dict]:
    """`overlap`'s rows per mesh axis and collective: executions per step, how many of them are
    asynchronous, and how many have compute scheduled inside their window; `all` sums the axis."""
    by = collections.defaultdict(lambda: collections.defaultdict(lambda: {"collectives": 0, "async": 0, "overlapped": 0}))
    for r in rows:
        for key in ("all", r["op"]):
            a = by[r["axes"]][key]
            a["collectives"] += r["runs"]
            a["async"] += r["runs"] if r["async"] else 0
            a["overlapped"] += r["runs"] if r["kernels_between"] else 0
    return {axes: dict(ops) for axes, ops in by.items()}
