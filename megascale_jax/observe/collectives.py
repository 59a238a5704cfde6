"""The collectives a compiled XLA program runs, read from its HLO text: what each one moves, over
which mesh axes, and how many times per step.

    traffic = bytes_per_axis(compiled.as_text(), mesh)   # {"tp": ..., "dp": ..., "pp": ...}

Bytes are what one device sends per step over its links with ring algorithms, the bytes the
planner's α–β formulas price: for a buffer of B bytes over a group of n, an all-reduce sends
2(n−1)/n·B, an all-gather (B its full result) or a reduce-scatter (B its full input) (n−1)/n·B,
an all-to-all (n−1)/n·B, a permute B. A collective inside a while loop counts once per iteration
(XLA's `known_trip_count`). A group's mesh axes are the axes along which its devices' coordinates
differ; the HLO's device ids are positions in the mesh's flat device order (the executable's
device assignment).

The HLO spells replica groups three ways, all parsed here: explicit (`{{0,1},{2,3}}`), iota
(`[4,2]<=[2,4]T(1,0)`) and mesh (`mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0))
{'axis_1'}`). Which branch of a `conditional` runs is data, not program text: a collective
inside one is counted only when the caller says how often its named scope runs per step
(`branch_runs`; the pipeline's are `pipeline.branch_runs`), and refused otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               # the 8-bit floats (model.fp8: e4m3fn values and weights, e5m2 gradients) and their kin
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
               "f8e3m4": 1, "f8e8m0fnu": 1}

# One HLO instruction line and one computation's header line of a module's text (also
# bench/campaign/op_table.py reads modules with them).
INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>.*?) (?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")
COMPUTATION_HEADER = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) .*\{$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
CALLEE = re.compile(r"\b(?:body|calls|to_apply)=%([\w.\-]+)")  # the computations an instruction calls
BRANCHES = re.compile(r"\b(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%([\w.\-]+))")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # one of OPS
    nbytes: int  # buffer bytes: the result's, a reduce-scatter's input (result × group size)
    groups: tuple[tuple[int, ...], ...]  # device groups; for a permute, its (source, target) pairs
    executions: int  # the product of the enclosing loops' trip counts (inside its branch, if any)
    in_branch: bool  # inside a conditional: `executions` counts per run of the branch
    op_name: str  # the jax name stack (metadata op_name), which names the scopes it ran in

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends per execution with a ring algorithm (the module docstring)."""
        n = len(self.groups[0])
        if self.op == "collective-permute":
            return float(self.nbytes)
        return (2 if self.op == "all-reduce" else 1) * (n - 1) / n * self.nbytes


def shape_dims(shape: str) -> list[int]:
    """Dims of the first array in an HLO shape or operand list: `(bf16[8,16]{1,0}, s8[64]{0})` → [8, 16]."""
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape, a tuple's summed over its elements: `(f32[2,3]{1,0}, bf16[4])` → 32."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape[:80]!r}")
        total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _iota(spec: str) -> np.ndarray:
    """`[4,2]T(1,0)` (or `[8]`): iota over the dims, transposed, flattened."""
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    dims = [int(d) for d in m.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
        ids = ids.transpose([int(p) for p in m.group(2).split(",")])
    return ids.reshape(-1)


def replica_groups(rest: str, devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of one collective's attribute text, in any of the three spellings."""
    if m := re.search(r"source_target_pairs=\{(.*?)\}\}", rest):
        return tuple(tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{([\d,]+)", m.group(1) + "}"))
    if m := re.search(r"replica_groups=\{(\{[\d,{}]*\})?\}", rest):
        if not m.group(1):
            return (tuple(range(devices)),)  # {}: every device in one group
        return tuple(tuple(int(x) for x in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", m.group(1)))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", rest):
        ids = _iota(m.group(3)).reshape(int(m.group(1)), int(m.group(2)))
        return tuple(tuple(int(x) for x in g) for g in ids)
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))? \{([^}]*)\}", rest):
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        if m.group(2) is None:
            ids = np.arange(math.prod(sizes))
        elif m.group(2).startswith("["):
            ids = _iota(m.group(2))
        else:
            ids = np.array([int(x) for x in m.group(2).split(",")])
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(3))]
        kept = [i for i in range(len(names)) if i not in grouped]
        ids = ids.reshape(sizes).transpose(kept + grouped).reshape(-1, math.prod(sizes[i] for i in grouped))
        return tuple(tuple(int(x) for x in g) for g in ids)
    raise ValueError(f"no replica groups this parser knows in {rest[:160]!r}")


def parse_computations(hlo_text: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str]:
    """A module's computations, each its instructions in program order as (name, shape, opcode,
    the rest of the line), and the ENTRY computation's name. A compiled module is scheduled: the
    order is the order its kernels run in."""
    computations: dict[str, list[tuple[str, str, str, str]]] = defaultdict(list)
    entry, current = None, None
    for line in hlo_text.splitlines():
        if (h := COMPUTATION_HEADER.match(line)) and not line.startswith(" "):
            current = h.group("name")
            entry = current if line.startswith("ENTRY") else entry
        elif current and (i := INSTRUCTION.match(line)):
            computations[current].append((i.group("name"), i.group("shape"), i.group("op"), i.group("rest")))
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return computations, entry


def partitions(hlo_text: str) -> int:
    """The devices an SPMD module runs on (its `num_partitions`; 1 where it says none)."""
    return int(m.group(1)) if (m := re.search(r"num_partitions=(\d+)", hlo_text)) else 1


def branches(rest: str) -> list[str]:
    """The branch computations of a `conditional` (its attribute text)."""
    return [callee for listed, single in BRANCHES.findall(rest)
            for callee in (re.findall(r"%([\w.\-]+)", listed) or [single])]


def trip_count(instruction: str, rest: str) -> int:
    """A while loop's iterations, from XLA's `known_trip_count`; a ValueError where it has none."""
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    if trips is None:
        raise ValueError(f"while loop {instruction} has no known trip count: its collectives cannot be counted")
    return int(trips.group(1))


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of the program, with how often one step executes it."""
    devices = partitions(hlo_text)
    computations, entry = parse_computations(hlo_text)

    found: list[Collective] = []
    started: dict[str, tuple[str, str]] = {}  # async start's name → (op, attribute text)

    def visit(name: str, executions: int, in_branch: bool) -> None:
        for inst, shape, op, rest in computations[name]:
            base = op.removesuffix("-start").removesuffix("-done")
            if base in OPS:
                if op.endswith("-start"):
                    started[inst] = (base, rest)
                    continue
                if op.endswith("-done"):  # the done's shape is the result; the start holds the groups
                    base, rest = started[re.match(r"%([\w.\-]+)", rest).group(1)]
                groups = replica_groups(rest, devices)
                nbytes = shape_bytes(shape) * (len(groups[0]) if base == "reduce-scatter" else 1)
                op_name = m.group(1) if (m := re.search(r'op_name="([^"]*)"', rest)) else ""
                found.append(Collective(base, nbytes, groups, executions, in_branch, op_name))
            times = executions
            if op == "while":
                times = executions * trip_count(inst, rest)
            for callee in CALLEE.findall(rest):
                if callee != name and not op.startswith(OPS):  # a collective's to_apply is its reduction
                    visit(callee, times, in_branch)
            for callee in branches(rest):
                visit(callee, 1, True)  # counted per run of the branch

    visit(entry, 1, False)
    return found


def group_axes(group: tuple[int, ...], mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]) -> str:
    """The mesh axes along which a group's devices differ, joined by '+' in mesh order ('' for
    none): positions in the flat device order, unravelled into mesh coordinates."""
    coords = np.array(np.unravel_index(np.array(group), mesh_shape))  # [axes, members]
    return "+".join(a for a, c in zip(axis_names, coords) if len(set(c)) > 1)


def branch_scope(c: Collective, branch_runs: dict[str, int]) -> str:
    """The scope of `branch_runs` a collective inside a conditional ran in (a component of its
    op_name); a ValueError when none is given, since then its count per step is unknown."""
    for scope in c.op_name.split("/"):
        if scope in branch_runs:
            return scope
    raise ValueError(f"{c.op} inside a conditional, in no scope of {sorted(branch_runs)}: "
                     f"how often it runs per step is unknown ({c.op_name})")


def bytes_per_axis(hlo_text: str, mesh, branch_runs: dict[str, int] | None = None) -> dict[str, float]:
    """Bytes one device sends per step, summed per mesh-axis combination ('tp', 'dp', 'dp+tp',
    ...), over every collective of the program; `branch_runs` says how many times per step the
    device runs each named scope that sits in a conditional. A group within one device moves
    nothing."""
    total: dict[str, float] = defaultdict(float)
    shape, names = tuple(mesh.devices.shape), tuple(mesh.axis_names)
    for c in collectives(hlo_text):
        axes = group_axes(c.groups[0], shape, names)
        if axes:
            runs = branch_runs[branch_scope(c, branch_runs or {})] if c.in_branch else 1
            total[axes] += c.sent_bytes * c.executions * runs
    return dict(total)
