"""An HLO instruction's part of the model (attention, MLP, LM head, optimizer, ...), read from the
compiled module's text: the named scopes in its metadata's op_name path, for the instruction and,
for a fusion, for the instructions it fuses. The GPU campaign's op table (bench/campaign/op_table.py)
names a profiled step's ops with it; the compile-only report (megascale_jax/aot) names the
buffers live at the step's memory peak and its fusions.

The op_name path holds the named scopes the model opens around its parts
(megascale_jax/model/transformer.py: norm, embed, qkv_projection, attention, out_projection,
mlp, the parallel block's qkv_mlp_up and out_mlp_down, lm_head, loss; under autodiff wrapped:
`jvp(mlp)`, `transpose(jvp(mlp))`); `part_of` reads them with a short, explicit rule table. An op
no rule names is "other", never a guess.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from megascale_jax.observe.collectives import COMPUTATION_HEADER, INSTRUCTION, shape_dims
from megascale_jax.training.trainer import OPTIMIZER_UPDATE

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
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
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


def evidence(instruction: Instruction, part: str) -> str:
    """The op_name that named an instruction's part: a fused instruction's in that part, else its own."""
    return next((name for _, name in instruction.fused if scope_part(name) == part), instruction.op_name)


def short_op_name(op_name: str) -> str:
    """The op_name path without the jitted function's own name and the layer scan's plumbing."""
    parts = [p for p in op_name.split("/")[1:] if p not in ("while", "body", "closed_call")]
    return "/".join(parts)
