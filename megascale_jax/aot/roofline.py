"""A roofline of the compiled program: every kernel's FLOPs and HBM bytes read from the optimized
HLO's shapes, priced at the GPU's rates into a predicted step time, and the kernels ranked by it
(the lever list for a GPU run). No profile: XLA's own `cost_analysis()` returns None without a
device, so the counts are this module's.

Per kernel (a kernel as `compiled_hlo` counts them, a loop body's once per iteration):

* bytes: what it reads and writes. A fusion reads each operand whole, except an operand its
  computation only slices (`dynamic-slice`, `slice`, `gather`: the slices' bytes: the layer scan
  reading one layer of a stacked array) and the buffer a root `dynamic-update-slice` updates in
  place (0 read; the update's bytes written, not the buffer's); it writes its result. A custom
  call or a copy reads its operands and writes its result.
* FLOPs: a matrix product's (`hlo_parts.product_flops`: dots, cuBLAS calls, fusions of dots);
  cuDNN's fused attention by its shape: 4 · head_dim FLOPs per visible (query, key) pair of the
  window, its backward 2.5× that (`planner.costs`).
* seconds: a GEMM max(its time as the planner prices it, B / W) (`costs.gemm_s`: the peak, the
  size curve of the GPU's calibration measured on 8192³ GEMMs, the last wave's idle SMs); attention `costs.fused_attention_s` (its forward,
  × `FLASH_FWD_BWD` / 1 for the backward call); anything else B / W, W the HBM's measured stream rate
  (a device-to-device copy's bytes read + written a second: 4.3 TB/s on the H200, 3.0 on the H100;
  `calibration.yaml`'s `hbm_copy_tbps`); every kernel at least `LAUNCH_S` (a kernel's launch and its ramp: none runs faster).

Collectives are left out (one GPU's step has none; on several, `compile_step` reports their
overlap). Nothing here is fitted to a measured step.
"""

from __future__ import annotations

import collections
import math
import re

from megascale_jax.aot import compiled_hlo
from megascale_jax.observe import collectives as hlo_collectives
from megascale_jax.observe.collectives import shape_bytes, shape_dims
from megascale_jax.observe.hlo_parts import Instruction, part_of, short_op_name
from megascale_jax.planner import costs

LAUNCH_S = 2e-6  # a kernel's floor: launch and ramp (CUDA graphs hide the launch, not the ramp)
SLICES = ("dynamic-slice", "slice", "gather")
_OPERAND = re.compile(r"%([\w.\-]+(?:#\d+)?)")
_TUPLE_ELEMENT = re.compile(r"(?:/\*index=\d+\*/)?\s*([a-z]+\d*(?:e\d+m\d+\w*)?\[[\d,]*\](?:\{[^}]*\})?)")


def _operands(rest: str) -> list[str]:
    """An instruction's operand names, `tuple#i` for a tuple's element i (XLA's dump elides the
    get-tuple-element)."""
    return _OPERAND.findall(rest.split(")", 1)[0])


def _shape_of(name: str, shapes: dict[str, str]) -> str:
    base, _, index = name.partition("#")
    shape = shapes.get(base, "")
    if not index:
        return shape
    elements = _TUPLE_ELEMENT.findall(shape)
    return elements[int(index)] if int(index) < len(elements) else ""


def fusion_bytes(computation: list, operand_shapes: list[str], out_shape: str) -> float:
    """Bytes a fusion reads and writes (module docstring), given its computation's instructions
    (name, shape, opcode, rest), its operands' shapes in parameter order and its result's shape.
    A bitcast is a view: its users are its operand's."""
    params, views = {}, {}
    users = collections.defaultdict(list)
    for name, shape, op, rest in computation:
        if op == "parameter":
            params[name] = int(re.match(r"(\d+)", rest).group(1))
        elif op == "bitcast":
            views[name] = _operands(rest)[0]

    def origin(name: str) -> str:
        while name in views:
            name = views[name]
        return name

    for name, shape, op, rest in computation:
        if op not in ("parameter", "bitcast"):
            for position, operand in enumerate(_operands(rest)):
                users[origin(operand)].append((op, position, shape))
    # What the fusion returns: its root, or each element of a root tuple. An element that is a
    # dynamic-update-slice of a parameter is updated in place: its update is written, the rest not.
    by_name = {name: (shape, op, rest) for name, shape, op, rest in computation}
    root = computation[-1] if computation else None
    results = _operands(root[3]) if root is not None and root[2] == "tuple" else ([root[0]] if root else [])
    written, in_place = 0.0, set()
    for result in results:
        shape, op, rest = by_name.get(origin(result), ("", "", ""))
        if op == "dynamic-update-slice" and origin(_operands(rest)[0]) in params:
            in_place.add(origin(_operands(rest)[0]))
            written += shape_bytes(_local_shape(_operands(rest)[1], computation))
        else:
            written += shape_bytes(shape)
    if not results:
        written = shape_bytes(out_shape)
    read = 0.0
    for name, index in params.items():
        uses = users.get(name, [])
        if name in in_place:
            continue
        elif uses and all(op in SLICES and position == 0 for op, position, _ in uses):
            read += sum(shape_bytes(shape) for _, _, shape in uses)
        else:
            read += shape_bytes(operand_shapes[index]) if index < len(operand_shapes) else 0
    return read + written


def _local_shape(name: str, computation: list) -> str:
    return next((shape for n, shape, _, _ in computation if n == name), "")


def gemm_s(flops: float, out_shape: str, gpu) -> float:
    """A GEMM kernel as the planner prices one (`costs.gemm_s`: the size curve and the last wave's
    idle SMs): its output's last dimension the columns, the rest the rows, k from its FLOPs."""
    dims = shape_dims(out_shape)
    cols = dims[-1] if dims else 1
    rows = max(1, math.prod(dims[:-1]))
    return costs.gemm_s(rows, max(1, round(flops / (2 * rows * cols))), cols, gpu)


def attention_s(flops_forward: float, query_rows: float, backward: bool, gpu) -> float:
    forward = costs.fused_attention_s(flops_forward, query_rows, gpu)
    return forward * (costs.FLASH_FWD_BWD - 1) if backward else forward


def kernel_costs(hlo_text: str, hlo: dict[str, Instruction], gpu, window: int | None) -> list[dict]:
    """Every kernel of one step with its bytes, FLOPs, predicted seconds per step, part and name."""
    computations, entry = hlo_collectives.parse_computations(hlo_text)
    shapes = {name: shape for sequence in computations.values() for name, shape, _, _ in sequence}
    rows = []
    for k in compiled_hlo.kernels(computations, entry):
        if k.category == "collective":
            continue
        operands = [_shape_of(o, shapes) for o in _operands(k.rest)]
        called = hlo_collectives.CALLEE.search(k.rest)
        if k.category == "fusion" and called:
            nbytes = fusion_bytes(computations[called.group(1)], operands, k.shape)
        else:
            nbytes = sum(shape_bytes(s) for s in operands if s) + shape_bytes(k.shape)
        instruction = hlo.get(k.name, Instruction(""))
        flops, memory_s = instruction.flops, nbytes / gpu.hbm_stream_bandwidth
        if k.category == "custom-call" and k.kind.startswith("__cudnn$fmha"):
            b, h, s, d = shape_dims(k.shape)[:4]  # its output (the forward's O, the backward's dQ): b, h, s, d
            backward = k.kind.endswith("Backward")
            flops_forward = 4 * d * b * h * costs.visible_pairs(s, window)
            flops = flops_forward * ((costs.FLASH_FWD_BWD - 1) if backward else 1)
            compute_s = seconds = attention_s(flops_forward, b * h * s, backward, gpu)
        else:
            compute_s = gemm_s(flops, k.shape, gpu) if flops else 0.0
            seconds = max(compute_s, memory_s)
        seconds = max(seconds, LAUNCH_S)
        rows.append({"kernel": k.name, "kind": k.kind, "part": part_of(instruction), "runs": k.runs,
                     "bytes": nbytes * k.runs, "flops": flops * k.runs, "seconds": seconds * k.runs,
                     "bound": "compute" if compute_s > memory_s else "memory",
                     "op_name": short_op_name(instruction.op_name)})
    return sorted(rows, key=lambda r: -r["seconds"])


def summary(rows: list[dict], top: int = 15) -> dict:
    """The predicted step (the kernels' seconds summed: one stream), seconds and bytes by part,
    the `top` kernels."""
    by_part = collections.Counter()
    for r in rows:
        by_part[r["part"]] += r["seconds"]
    return {"step_s": sum(r["seconds"] for r in rows), "flops": sum(r["flops"] for r in rows),
            "bytes": sum(r["bytes"] for r in rows), "kernels": sum(r["runs"] for r in rows),
            "by_part_s": dict(by_part.most_common()), "top": rows[:top]}
