"""Pipeline schedules as data: (schedule, p, v, m) -> an explicit, validated tick table.

    python -m megascale_jax.pipeline_schedule --pp 4 --microbatches 8 --schedule interleaved_1f1b --virtual 2

Pure arithmetic, no jax, on the bottom floor beside config: config validation checks a schedule
with it (`check`), and the memory estimate (`model.flops`) and the planner count its stash slots
and ticks without importing the executor's floor.

The executor (`megascale_jax.parallel.pipeline`) runs all p stages in SPMD lockstep: every tick each
stage does at most one forward and at most one backward of one model chunk, then activations
move one stage forward and cotangents one stage back (`ppermute`, ring-wrapped for the
interleaved schedule). The model is cut into p·v chunks; chunk g = j·p + s is virtual chunk j of
stage s, so a microbatch visits stages 0..p-1 v times.

Every schedule here is *aligned*: a forward always consumes exactly what arrived at the end of the
previous tick, and so does a backward — no input queues, only the residual stash. With k the
index of a stage's own forward (or backward) in its order:

* forward  k of stage s runs at tick  k + s
* 1f1b / interleaved_1f1b: backward k of stage s runs at tick  k + (v·p − 1) + (p − 1 − s).
  The last chunk's backward runs in the same tick as its forward (fused F+B: the loss gradient
  needs no communication), every stage does one F and one B per tick in the steady state, and a
  stage holds at most (v+1)·p − 1 − 2s chunk inputs — flat in m.
* gpipe: all forwards, then backward k of stage s at tick  (m·v + p − 1) + k + (p − 1 − s);
  stage 0 holds all m·v chunk inputs (memory grows with m — the baseline).

Forward order of a stage (Megatron's interleaving): microbatches in groups of p; within a group,
virtual chunk 0 for the p microbatches, then chunk 1, ... Backward order: the same with the
chunks reversed. With v = 1 this is plain microbatch order.

Lockstep cost: a tick in which some stage runs a forward costs F/v, one with a backward B/v, so
both schedules take (m·v + p − 1)·(F + B)/v and the bubble is (p − 1)/(m·v + p − 1) of the step.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Optional

from megascale_jax import cli

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclasses.dataclass(frozen=True)
class Work:
    """One forward or backward of microbatch `mb` through virtual chunk `chunk` on a stage."""

    mb: int
    chunk: int  # virtual chunk index j on this stage (global chunk = j·p + stage)
    slot: int  # residual-stash slot written by the forward, read (and freed) by the backward


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # p
    virtual: int  # v
    microbatches: int  # m
    forward: tuple[tuple[Optional[Work], ...], ...]  # [tick][stage]
    backward: tuple[tuple[Optional[Work], ...], ...]  # [tick][stage]
    slots: int  # residual-stash slots per stage (max over stages)

    @property
    def ticks(self) -> int:
        return len(self.forward)

    def bubble_fraction(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
        """Idle share of the lockstep step time, from the table (tick cost = max over stages)."""
        total = busy = 0.0
        for fwd, bwd in zip(self.forward, self.backward):
            total += forward_cost * any(fwd) + backward_cost * any(bwd)
        busy = (forward_cost + backward_cost) * self.microbatches * self.virtual
        return 1.0 - busy / total

    def global_chunk(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage


def bubble_closed_form(p: int, v: int, m: int) -> float:
    return (p - 1) / (m * v + p - 1)


def _forward_order(p: int, v: int, m: int) -> list[tuple[int, int]]:
    """(microbatch, virtual chunk) in the order every stage runs its forwards."""
    order = []
    for group in range(0, m, p):
        size = min(p, m - group)
        for j in range(v):
            order += [(group + i, j) for i in range(size)]
    return order


@functools.lru_cache(maxsize=256)  # tables are immutable; the executor, memory estimate and planner share them
def build(name: str, p: int, v: int, m: int) -> Schedule:
    check(name, p, v, m)
    fwd_order = _forward_order(p, v, m)
    bwd_order = [(mb, v - 1 - j) for mb, j in _forward_order(p, v, m)]
    n = m * v
    if name == "gpipe":
        bwd_offset = n + p - 1
    else:
        bwd_offset = v * p - 1
    ticks = max(n - 1 + p - 1, bwd_offset + n - 1 + p - 1) + 1
    forward = [[None] * p for _ in range(ticks)]
    backward = [[None] * p for _ in range(ticks)]
    slots_needed = 0
    for s in range(p):
        events = []  # (tick, order: backward first frees before a forward reuses... see below)
        for k, (mb, j) in enumerate(fwd_order):
            events.append((k + s, 1, "F", mb, j))
        for k, (mb, j) in enumerate(bwd_order):
            events.append((k + bwd_offset + (p - 1 - s), 2, "B", mb, j))
        # Within a tick the forward runs before the backward (the fused last chunk needs that),
        # so a slot freed by a tick's backward is reusable from the next tick on.
        free, in_use, slot_of, top = [], set(), {}, 0
        for tick, _, kind, mb, j in sorted(events):
            if kind == "F":
                slot = free.pop() if free else top
                top = max(top, slot + 1)
                slot_of[(mb, j)] = slot
                in_use.add(slot)
                forward[tick][s] = Work(mb, j, slot)
            else:
                slot = slot_of.pop((mb, j))
                backward[tick][s] = Work(mb, j, slot)
                in_use.discard(slot)
                free.append(slot)
        slots_needed = max(slots_needed, top)
    schedule = Schedule(name, p, v, m, tuple(map(tuple, forward)), tuple(map(tuple, backward)), slots_needed)
    validate(schedule)
    return schedule


def forward_only(s: Schedule) -> Schedule:
    """The forward half of `s`, for evaluation: forward k of stage s still runs at tick k + s (every
    schedule here places forwards so), the backward table is empty and nothing is stashed. Its
    m·v + p − 1 ticks are the first ticks of `s` in which forwards run."""
    ticks = s.microbatches * s.virtual + s.stages - 1
    empty = tuple((None,) * s.stages for _ in range(ticks))
    return dataclasses.replace(s, name=f"{s.name}-forward", forward=s.forward[:ticks], backward=empty, slots=0)


def check(name: str, p: int, v: int, m: int) -> None:
    """Raise ValueError (one line, names the config keys) for an impossible (schedule, p, v, m)."""
    if name not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={name!r} is not one of {', '.join(SCHEDULES)}")
    if min(p, v, m) < 1:
        raise ValueError("mesh.pp, parallel.pp_virtual and parallel.microbatches must be >= 1")
    if v > 1 and name != "interleaved_1f1b":
        raise ValueError(f"parallel.pp_virtual={v} needs parallel.pp_schedule=interleaved_1f1b")
    if name == "1f1b" and m < p:
        raise ValueError(f"parallel.microbatches={m} must be >= mesh.pp={p} for 1f1b")
    if name == "interleaved_1f1b" and m % p:
        raise ValueError(f"parallel.microbatches={m} must be a multiple of mesh.pp={p} for interleaved_1f1b")


def validate(s: Schedule) -> None:
    """Every (mb, chunk) gets one forward and one backward on its stage, after its dependencies,
    inputs always arrive exactly one tick before use, and stash slots never overlap."""
    p, v, m = s.stages, s.virtual, s.microbatches
    f_tick, b_tick, f_slot = {}, {}, {}
    for t in range(s.ticks):
        for st in range(p):
            for table, where in ((s.forward, f_tick), (s.backward, b_tick)):
                w = table[t][st]
                if w is None:
                    continue
                key = (w.mb, s.global_chunk(st, w.chunk))
                assert key not in where, f"{key} scheduled twice"
                where[key] = t
                if table is s.forward:
                    f_slot[key] = (st, w.slot)
    every = {(mb, g) for mb in range(m) for g in range(p * v)}
    assert set(f_tick) == every and set(b_tick) == every, "missing forward or backward"
    last = p * v - 1
    for mb, g in every:
        if g > 0:
            assert f_tick[(mb, g)] == f_tick[(mb, g - 1)] + 1, f"forward input of {(mb, g)} not from last tick"
        if g < last:
            assert b_tick[(mb, g)] == b_tick[(mb, g + 1)] + 1, f"cotangent of {(mb, g)} not from last tick"
        assert b_tick[(mb, g)] >= f_tick[(mb, g)], f"backward of {(mb, g)} before its forward"
    # A slot is live from its forward's tick to its backward's tick, inclusive: per (stage, slot),
    # each use must start after the previous one ended.
    uses: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for k, (stage, slot) in f_slot.items():
        uses.setdefault((stage, slot), []).append((f_tick[k], b_tick[k]))
    for (st, slot), spans in uses.items():
        spans.sort()
        for (_, end), (start2, _) in zip(spans, spans[1:]):
            assert start2 > end, f"stage {st} slot {slot} reused while live"


def timeline(s: Schedule) -> str:
    """ASCII timeline: one row per stage, one column per tick; 'F3' forward of microbatch 3,
    'B3' backward, lowercase letters mark the virtual chunk when v > 1."""
    width = 4 if s.virtual == 1 else 5
    cell = lambda kind, w: "" if w is None else f"{kind}{w.mb}" + (chr(97 + w.chunk) if s.virtual > 1 else "")
    lines = [f"{s.name}: p={s.stages} v={s.virtual} m={s.microbatches}  ticks={s.ticks}  "
             f"stash slots={s.slots}  bubble={s.bubble_fraction():.1%} "
             f"(closed form {bubble_closed_form(s.stages, s.virtual, s.microbatches):.1%})"]
    for row in ("F", "B"):
        lines.append(f"{row:>9} |" + "".join(f"{t:<{width}}" for t in range(s.ticks)))
        for st in range(s.stages):
            table = s.forward if row == "F" else s.backward
            lines.append(f"stage {st:<3}|" + "".join(f"{cell(row, table[t][st]):<{width}}" for t in range(s.ticks)))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m megascale_jax.pipeline_schedule", description=timeline.__doc__)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--virtual", type=int, default=1)
    args = cli.parse(parser, argv)
    try:
        print(timeline(build(args.schedule, args.pp, args.virtual, args.microbatches)))
    except ValueError as e:
        return cli.user_error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
