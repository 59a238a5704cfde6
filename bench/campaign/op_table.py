"""Where a training step's device time goes: the top HLO ops of a profiled step, each named as
a part of the model (issue 36, item 6).

    python -m bench.campaign.op_table --config configs/gpt_1b.yaml --out table.json [key=value ...]

compiles the config's train step (one device), runs it once, traces STEPS more with
`jax.profiler` and writes `table(...)` as JSON. The trace is read with megascale_jax's own reader
(`observe.device_profile.read_ops`: every executed HLO op's `hlo_op` name and interval — a thunk
on XLA:CPU, a kernel on a GPU), so both backends are read the same way. An op's model part comes
from its HLO metadata in the compiled module's text (`instructions`), not from the trace: XLA:CPU's
trace events carry no metadata, and on a GPU the kernel's annotation is built from the same text.

The metadata's op_name path holds the named scopes the model opens around its parts
(megascale_jax/model/transformer.py: norm, embed, qkv_projection, attention, out_projection,
mlp, the parallel block's qkv_mlp_up and out_mlp_down, lm_head, loss; under autodiff wrapped:
`jvp(mlp)`, `transpose(jvp(mlp))`); `part_of` reads them with a short, explicit rule table. An op
no rule names is "other", never a guess.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import re
import sys
import tempfile

from megascale_jax.observe.collectives import COMPUTATION_HEADER, INSTRUCTION, shape_dims
from megascale_jax.training.trainer import OPTIMIZER_UPDATE

STEPS = 2  # traced, after one untraced step
TOP = 15
PER_PART = 5  # each part's own top ops: what "other" and "copies" hold is where a next lever is

PARTS = ("attention", "QKV projection", "output projection", "MLP", "QKV + MLP-up GEMM", "output + MLP-down GEMM",
         "LM head/loss", "norms", "embedding", "optimizer", "copies/transposes", "collectives", "other")
# Named scope in an op_name path -> its part; the innermost scope on this list decides. The parallel
# block multiplies q, k, v and the MLP's first weight in one GEMM and leaves through one: those two
# are parts of their own ("mlp" is then its activation).
SCOPE_PARTS = {"attention": "attention", "qkv_projection": "QKV projection", "out_projection": "output projection",
               "mlp": "MLP", "qkv_mlp_up": "QKV + MLP-up GEMM", "out_mlp_down": "output + MLP-down GEMM",
               "lm_head": "LM head/loss", "loss": "LM head/loss", "norm": "norms", "embed": "embedding",
               OPTIMIZER_UPDATE: "optimizer"}
COPY_OPCODES = ("copy", "copy-start", "copy-done", "transpose")
# Opcodes that move, cast or re-lay-out data without arithmetic: a fusion of nothing else is a copy.
MOVES = frozenset(("parameter", "constant", "convert", "bitcast", "bitcast-convert", "copy", "transpose", "reshape",
                   "broadcast", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "tuple",
                   "get-tuple-element", "iota"))
_WRAPPER = re.compile(r"^(\w+\()+|\)+$")  # "transpose(jvp(mlp))" -> "mlp"


@dataclasses.dataclass(frozen=True)
class Instruction:
    """An HLO instruction as the compiled module's text gives it."""

    opcode: str
    op_name: str = ""  # its metadata's op_name path
    fused: tuple = ()  # (opcode, op_name) of the computation it calls (a fusion's), less parameters,
    # constants and scalars: loop-index arithmetic and CSE'd constants carry another op's op_name
    flops: float = 0.0  # a matrix product's FLOPs per call: its own (dot, cuBLAS) or its fusion's dots


def scope_part(op_name: str) -> str | None:
    """The part of the innermost SCOPE_PARTS scope in an op_name path, e.g.
    'jit(step)/transpose(jvp(Transformer))/while/body/layers/mlp/dot_general' -> 'MLP'."""
    for scope in reversed(op_name.split("/")):
        part = SCOPE_PARTS.get(_WRAPPER.sub("", scope))
        if part:
            return part
    return None


def in_gradient(op_name: str) -> bool:
    """Whether an op belongs to the gradient's computation: forward under jvp, backward under transpose."""
    return "jvp(" in op_name or "transpose(" in op_name


def part_of(instruction: Instruction, collective: bool = False) -> str:
    """An HLO instruction's model part, by the first rule that applies:

    1. a collective (`device_profile.Op.is_collective`): "collectives";
    2. a copy or transpose, or a fusion of data movement only (MOVES): "copies/transposes";
    3. the named scopes of its fused instructions: the part most of them are in (a tie: "other");
       without a fusion, or none named there, its own op_name's innermost scope;
    4. every op_name it has outside the gradient: "optimizer" (the update, with the gradient norm
       and the step's non-finite check);
    5. else "other"."""
    if collective:
        return "collectives"
    inner = {opcode for opcode, _ in instruction.fused}
    if instruction.opcode in COPY_OPCODES or (inner and inner <= MOVES):
        return "copies/transposes"
    votes = collections.Counter(p for _, name in instruction.fused if (p := scope_part(name)))
    if votes:
        (best, n), *rest = votes.most_common(2) + [(None, 0)]
        return best if n > rest[0][1] else "other"
    if part := scope_part(instruction.op_name):
        return part
    names = [name for name in (instruction.op_name, *(n for _, n in instruction.fused)) if name]
    if names and not any(in_gradient(name) for name in names):
        return "optimizer"
    return "other"


# ============================================================================ the compiled module's text

_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")  # a fusion's computation (not a loop's body: its time is its ops')
_SCALAR = re.compile(r"\w+\[\]")  # a shape like "s32[]"
# Where a product's contracting dimensions are named: an HLO dot's attribute, or a cuBLAS custom
# call's backend_config (JSON: "lhs_contracting_dimensions":["1"])
_DOT_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
# The first operand: its shape where the text prints one before its name, and its name
_FIRST_OPERAND = re.compile(r"^\s*(?P<shape>[^%]*)%(?P<name>[\w.\-]+)")


def product_flops(op: str, shape: str, rest: str, shapes: dict[str, str]) -> float:
    """FLOPs of one matrix product, 2 × (output elements) × (contracted size): an HLO `dot`, or a
    cuBLAS GEMM custom call (its output the tuple's first array, beside its workspace); 0 for
    anything else. The first operand's shape is printed beside it or, as compiled modules print
    them, looked up by its name in `shapes` (instruction name -> shape, names module-unique)."""
    if op == "dot":
        contracting = _DOT_CONTRACTING.search(rest)
    elif op == "custom-call" and any(f'custom_call_target="{t}"' in rest for t in GEMM_TARGETS):
        contracting = _GEMM_CONTRACTING.search(rest)
    else:
        return 0.0
    if contracting is None:
        return 0.0
    operand = _FIRST_OPERAND.match(rest)
    if operand is None:
        return 0.0
    lhs = shape_dims(operand["shape"]) or shape_dims(shapes.get(operand["name"], ""))
    contracted = [int(d) for d in re.findall(r"\d+", contracting.group(1))]
    if not lhs or not contracted or max(contracted) >= len(lhs):  # a form this reader does not know: no guess
        return 0.0
    return 2.0 * math.prod(shape_dims(shape)) * math.prod(lhs[d] for d in contracted)


def instructions(hlo_text: str) -> dict[str, Instruction]:
    """HLO instruction name -> `Instruction`, for every instruction in a compiled module's text
    (`compiled.as_text()`, read line by line with `observe.collectives`' patterns), a fusion with
    the instructions of the computation it calls."""
    own, inside, calls = {}, collections.defaultdict(list), {}
    flops, computation_flops, shapes = {}, collections.Counter(), {}
    computation = None
    for line in hlo_text.splitlines():
        if (header := COMPUTATION_HEADER.match(line)) and not line.startswith(" "):
            computation = header["name"]
        elif computation is not None and (i := INSTRUCTION.match(line)):
            op_name = _OP_NAME.search(i["rest"])
            own[i["name"]] = (i["op"], op_name.group(1) if op_name else "")
            if i["op"] not in ("parameter", "constant") and not _SCALAR.fullmatch(i["shape"]):
                inside[computation].append(own[i["name"]])
            if called := _CALLS.search(i["rest"]):
                calls[i["name"]] = called.group(1)
            shapes[i["name"]] = i["shape"]
            flops[i["name"]] = product_flops(i["op"], i["shape"], i["rest"], shapes)
            computation_flops[computation] += flops[i["name"]]
    return {name: Instruction(opcode, op_name, tuple(inside.get(calls.get(name), ())),
                              flops[name] + computation_flops.get(calls.get(name), 0.0))
            for name, (opcode, op_name) in own.items()}


# ============================================================================ the table


def table(ops: list, hlo: dict[str, Instruction], steps: int, top: int = TOP) -> dict:
    """One device's ops (`device_profile.Op`s over `steps` traced steps) -> per step: the `top` ops by
    device time (name, part, seconds, share of the step's op time, calls, the op_name path that
    named its part, and a matrix product's achieved TFLOP/s), every matrix product's FLOPs and
    seconds together (`products`), each part's PER_PART top ops (`top_by_part`),
    seconds `by_part` (with their "total") and the device's busy time.

    The total is the sum of every compute and collective op's duration; containers (while,
    conditional: their time is their ops') count no time of their own. XLA:CPU runs independent
    thunks on several threads at once, so there the total exceeds the busy time (their union); on
    a GPU's one stream they agree."""
    from megascale_jax.observe import device_profile

    timed = [o for o in ops if o.is_compute or o.is_collective]
    seconds, calls, collective = collections.Counter(), collections.Counter(), {}
    for o in timed:
        seconds[o.name] += (o.end_ns - o.start_ns) / 1e9 / steps
        calls[o.name] += 1
        collective[o.name] = o.is_collective
    total = sum(seconds.values())
    parts = {name: part_of(hlo.get(name, Instruction("")), collective[name]) for name in seconds}
    by_part = collections.Counter()
    for name, s in seconds.items():
        by_part[parts[name]] += s

    def flops(name: str) -> float:  # per step
        return hlo.get(name, Instruction("")).flops * calls[name] / steps

    def row(name: str, s: float) -> dict:
        out = {"op": name, "part": parts[name], "seconds": s, "share": s / total if total else 0.0,
               "calls": calls[name] / steps, "op_name": _short(evidence(hlo.get(name, Instruction("")), parts[name]))}
        if flops(name):
            out["tflop_per_s"] = flops(name) / s / 1e12
        return out

    products = [name for name in seconds if flops(name)]
    product_s = sum(seconds[name] for name in products)
    ranked = seconds.most_common()
    return {"top_ops": [row(name, s) for name, s in ranked[:top]],
            # every matrix product's FLOPs (from the module's shapes) over its kernels' time: what the
            # step's GEMMs ran at, beside what the same shapes run at alone (the rates section)
            "products": {"flops": sum(flops(n) for n in products), "seconds": product_s, "ops": len(products),
                         "tflop_per_s": sum(flops(n) for n in products) / product_s / 1e12 if product_s else None},
            "top_by_part": {p: [row(name, s) for name, s in ranked if parts[name] == p][:PER_PART]
                            for p in PARTS if by_part[p] > 0},
            "by_part": {**{p: by_part[p] for p in PARTS if by_part[p] > 0}, "total": total},
            "busy_s": device_profile.busy_ns(ops) / 1e9 / steps, "steps_traced": steps}


def evidence(instruction: Instruction, part: str) -> str:
    """The op_name that named an instruction's part: a fused instruction's in that part, else its own."""
    return next((name for _, name in instruction.fused if scope_part(name) == part), instruction.op_name)


def _short(op_name: str) -> str:
    """The op_name path without the jitted function's own name and the layer scan's plumbing."""
    parts = [p for p in op_name.split("/")[1:] if p not in ("while", "body", "closed_call")]
    return "/".join(parts)


# ============================================================================ tracing a train step


def trace_train_step(config: str | None, overrides: list[str], trace_dir: str, steps: int = STEPS):
    """Compile the config's train step, run it once, trace `steps` more into `trace_dir`: (the
    compiled module's text, its name, the trace file)."""
    import jax
    import numpy as np

    from megascale_jax.config import load_config
    from megascale_jax.observe import device_profile
    from megascale_jax.parallel.mesh import make_mesh
    from megascale_jax.training.trainer import build_trainer

    cfg = load_config(config, overrides)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    state = trainer.init()
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab, (cfg.train.global_batch, cfg.model.seq_len + 1))
    batch = jax.device_put(tokens.astype(np.int32), trainer.batch_sharding)
    compiled = trainer.train_step.lower(state, batch).compile()
    state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            state, _ = compiled(state, batch)
            jax.block_until_ready(state)
    return compiled.as_text(), device_profile.hlo_module_name(compiled), device_profile.latest_trace(trace_dir)


def profile_table(config: str | None, overrides: list[str], steps: int = STEPS, top: int = TOP) -> dict:
    """`table` of the config's train step, traced here (device 0)."""
    from megascale_jax.observe import device_profile

    with tempfile.TemporaryDirectory(prefix="op-table-") as trace_dir:
        hlo_text, module, path = trace_train_step(config, overrides, trace_dir, steps)
        ops = device_profile.read_ops(path, module)
    if not ops:
        raise RuntimeError(f"the trace holds no op of HLO module {module}")
    device = min(ops)
    return {"device": device, **table(ops[device], instructions(hlo_text), steps, top)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.campaign.op_table", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--out", required=True, help="where the table goes (JSON)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)
    result = profile_table(args.config, args.overrides)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for row in result["top_ops"]:
        print(f"{row['op']:<40}{row['part']:<20}{row['seconds'] * 1e3:>9.3f} ms{row['share']:>7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
