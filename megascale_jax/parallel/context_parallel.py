"""Context parallelism: every sequence split into mesh.cp contiguous slices, one per cp rank.

Everything in a layer but attention works token by token, so each rank runs it on its slice as
it is. The training step (the gradient accumulation, parallel/microbatches.py, or the pipeline),
evaluation and the downstream scores run the model in a `shard_map` manual over cp (and dp, and
pp where there is one): the model takes whole rows of tokens and cuts its rank's slice out itself
(`manual`, `own_slice`); rotary positions are global (`first_position`), and packed documents'
layout comes from the whole rows; each rank's loss is the mean of its own tokens and its
gradients those of its own tokens, which cross cp once, after the loop, since the weights are
replicated over cp as over dp. (In GSPMD's global view — the logical axes `seq` and `act_seq`
map to cp, `sharding.LOGICAL_RULES` — the model runs unchanged too; there GSPMD reduced the
gradients over cp inside every microbatch, and gathered the sequence around sequence
parallelism's explicit edges.) Only attention looks across tokens, and only attention runs here,
in a `shard_map` manual over every remaining mesh axis, on each rank's slice of n = seq_len/cp
queries, keys and values:

* Sliding window w (a query sees itself and the previous w-1 keys): rank r, holding positions
  [r·n, (r+1)·n), needs the h = w-1 keys and values just before r·n — the halo. They arrive by
  `ppermute` from the ranks before it: from r-1 its last min(h, n) positions, from r-2 the n
  before those if h > n, and so on, so a window longer than a slice costs one permute more per
  slice it reaches back, not a refusal. h is capped at (cp-1)·n, all that any rank can need.
  Rank 0 (and a rank whose halo reaches before the sequence's start) receives zeros there, which
  the mask drops (key positions < 0). Autodiff's transpose of a permute is the reverse permute,
  so the backward sends each halo's gradient back to the rank that owns those keys: the same
  bytes the other way. Per layer and direction each rank receives 2·h·b·kv_heads·head_dim
  values (k and v; `halo_bytes`), and attention moves nothing else over cp.
* Full attention (window=null): k and v all-gathered over cp (tiled; the backward's transpose is
  the gradients' reduce-scatter). Chosen over ring attention for a first slice because it is the
  reference softmax as it stands, exact with no online-softmax rescaling, and moves the same
  bytes as a ring ((cp-1)/cp of the sequence's k and v each way). What it gives up: memory (each
  rank holds the whole sequence's k and v — small with GQA — and n x seq_len scores) and overlap
  (a ring hides each hop behind a block's compute). A causal mask also leaves rank cp-1 with cp
  times rank 0's visible scores; zigzag slicing would balance that. Neither is done yet.
* Packed documents (`model.document_eos`): the keys' document ids travel with them (the halo's,
  or all-gathered), 4 bytes a key beside the keys' and values' 2·kv_heads·head_dim values.

The mask uses global positions: query i of rank r is at r·n + i, halo key j at r·n - h + j. A
slice much longer than the window (n >= 4 blocks of >= w - 1 queries) is attended in blocks, each
scoring only the keys its window reaches (`attention.banded_attention`): n·(block + w - 1) scores
a rank instead of n·(n + h), which is what makes a 64k-token sequence fit.

The fused kernels (`model.attention=pallas|cudnn`). Pallas's takes the queries' offset into the
keys (`flash_attention(q_offset=)`): with a window a rank hands it its halo + n keys and its n
queries at offset h; under full attention the all-gathered keys and its queries at its slice's
start r·n (traced: the rank's index), the kernel visiting only the key blocks up to each query
block's position, so no rank does more than its own queries' work. Keys before the sequence's
start (what rank 0 receives in its halo) are masked as a document of their own (segment id -1,
which no query has); packed documents' ids ride along as with XLA. cuDNN's takes queries and keys
of one length, aligned, as in self-attention: a rank gives it its n queries behind h zero queries
— query j then sits at key j's position, and the kernel's own causal window is the global one —
and keeps the last n outputs. The h padded queries cost h/n more of that kernel's work (a window
of 4,096 on a 16k slice: 25%); their outputs are dropped, so their cotangent is zero and they add
nothing to the keys' gradients. cuDNN takes the segments as a mask, i.e. its biased kernel, and
runs with a window only (its kernel has no queries' offset for the gathered keys).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from megascale_jax.model.attention import attend as one_device_attend
from megascale_jax.model.attention import band_block, banded_attention, masked_attention, window_mask
from megascale_jax.model.flops import halo_length  # JAX-free: the planner prices the same halo
from megascale_jax.parallel import sharding

AXIS = "cp"


def cp_size() -> int:
    """The cp axis' size in the mesh in scope (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or AXIS not in mesh.axis_names else mesh.shape[AXIS]


def manual() -> bool:
    """Whether an enclosing `shard_map` is manual over cp (the training step's, evaluation's, the
    pipeline's): then the model holds whole rows of tokens, cuts its rank's slice out itself
    (`own_slice`), and every activation is that slice, not the global view."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names or mesh.shape[AXIS] == 1:
        return False
    return mesh.axis_types[mesh.axis_names.index(AXIS)] == AxisType.Manual


def own_slice(x, axis: int = 1):
    """This cp rank's contiguous slice of whole rows `x` along `axis` (inside a region manual over
    cp): positions [r·n, (r+1)·n) of rank r, n = length/cp. A local slice: nothing moves."""
    n = x.shape[axis] // cp_size()
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(AXIS) * n, n, axis)


def first_position(n: int):
    """The global position of this rank's first token when the sequence is its slice of n tokens
    (`manual`), else 0: rotary positions are global."""
    return jax.lax.axis_index(AXIS) * n if manual() else 0


# The axes the training step's forward runs manual over on cp > 1 (parallel/microbatches.py)
SLICED = ("dp", AXIS)


def _on_slices(cfg, fn):
    """`fn` under the logical rules of a region manual over `SLICED`."""
    def local(*args):
        with sharding.axis_rules(cfg, manual=SLICED):
            return fn(*args)
    return local


def mean_over_slices(cfg, mesh: Mesh, loss):
    """`loss(params, batch)`, the mean over the batch's tokens, run as the training step runs the
    model on cp > 1 — in a `shard_map` manual over dp and cp, each rank on its slice of its rows —
    and averaged over dp and cp. For evaluation: in GSPMD's global view instead the sequence was
    gathered over cp around sequence parallelism's explicit edges."""
    replicas = mesh.shape["dp"] * mesh.shape[AXIS]
    run = lambda params, batch: jax.lax.psum(_on_slices(cfg, loss)(params, batch), SLICED) / replicas
    return jax.shard_map(run, mesh=mesh, axis_names=set(SLICED), in_specs=(P(), P("dp")), out_specs=P(),
                         check_vma=False)


def scores_over_slices(cfg, mesh: Mesh, score):
    """`score(params, batch, mask)` -> (per-row summed log-probabilities, per-row all-greedy) run
    as `mean_over_slices` runs the loss: each rank scores its slice of every row; the sums add over
    cp, and a row is greedy where it is on every rank."""
    def run(params, batch, mask):
        summed, greedy = _on_slices(cfg, score)(params, batch, mask)
        misses = jax.lax.psum((~greedy).astype(jnp.int32), AXIS)
        return jax.lax.psum(summed, AXIS), misses == 0
    return jax.shard_map(run, mesh=mesh, axis_names=set(SLICED), in_specs=(P(), P("dp"), P("dp")),
                         out_specs=(P("dp"), P("dp")), check_vma=False)


def halo_bytes(window: int, seq_len: int, cp: int, batch: int, kv_width: int, itemsize: int) -> int:
    """Bytes a rank receives over cp per layer and direction (forward: keys and values; backward:
    their gradients; rank 0 forward and rank cp-1 backward receive zeros in the same permutes):
    the ideal the compiled step's permutes are held to, each permute's buffer counted once as
    `observe.collectives` counts it. `kv_width`: kv_heads x head_dim on the rank (its tp share),
    `batch` the rows on the rank."""
    return 2 * halo_length(window, seq_len, cp) * batch * kv_width * itemsize


def attend(q, k, v, *, window: int | None, documents=None, kv_heads_axis: str = "kv_heads",
           implementation: str = "xla"):
    """Attention over a sequence split over cp: q (b, s, heads, head_dim), k and v (b, s,
    kv_heads, head_dim; their heads' logical axis `kv_heads_axis`), `documents` (b, s) ids or
    None, in the global view -> (b, s, heads, head_dim), laid out as q is; `implementation` as
    `model.attention` (pallas and cudnn with a window only: config_checks).

    Manual over every automatic axis (as `sharding.per_device`): each device attends with its own
    rows and heads, as the model laid them out, and GSPMD has nothing to decide here — nor jax's
    cuDNN partitioner, which fails (an AssertionError, or a crash of the GPU compile) wherever an
    automatic axis is left around its custom call."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Auto)
    axes = [("batch", "seq", "heads", "head_dim"), ("batch", "seq", kv_heads_axis, "head_dim"),
            ("batch", "seq", kv_heads_axis, "head_dim"), ("batch", "seq")]
    args = (q, k, v) if documents is None else (q, k, v, documents)
    specs = [nn.logical_to_mesh_axes(a) for a in axes[:len(args)]]
    if q.shape[0] % _size(mesh, specs[0][0]):  # the init's one dummy row: every device has it whole
        specs = [P(None, *spec[1:]) for spec in specs]
    # the sequence's length: q's in the global view, cp slices of it inside a region manual over cp
    seq_len = q.shape[1] * (cp_size() if manual() else 1)
    body = functools.partial(_local, cp=cp_size(), window=window, seq_len=seq_len, implementation=implementation)
    return jax.shard_map(body, in_specs=tuple(specs), out_specs=specs[0], axis_names=auto, check_vma=False)(*args)


def _names(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _size(mesh, entry) -> int:
    return math.prod(mesh.shape[a] for a in _names(entry))


def _local(q, k, v, ids=None, *, cp: int, window: int | None, seq_len: int, implementation: str = "xla"):
    """One rank's slice: its n queries against the keys it holds and those it receives."""
    n = q.shape[1]
    first = jax.lax.axis_index(AXIS) * n  # this slice's first position in the sequence
    keys, values, key_ids, halo = attended_keys(k, v, ids, cp=cp, window=window, seq_len=seq_len)
    key_start = 0 if window is None else first - halo  # the first key's position in the sequence
    if implementation == "pallas":
        return _pallas(q, keys, values, ids, key_ids, key_start, q_offset=first if window is None else halo,
                       window=window)
    if implementation == "cudnn":
        return _cudnn(q, keys, values, key_ids, key_start, window=window)
    if window is not None and (block := band_block(n, window)) is not None:
        # a slice much longer than the window: only the keys each block reaches
        return banded_attention(q, keys, values, window, block, first=first, halo=halo, ids=ids, key_ids=key_ids)
    key_positions = key_start + jnp.arange(keys.shape[1])
    mask = window_mask(first + jnp.arange(n), key_positions, window) & (key_positions >= 0)[None, :]
    if ids is not None:
        mask = mask[None] & (ids[:, :, None] == key_ids[:, None, :])
    return masked_attention(q, keys, values, mask)


def attended_keys(k, v, ids, *, cp: int, window: int | None, seq_len: int):
    """The keys and values a rank attends to, their documents' ids (None without) and the halo's
    length: under full attention all of them, all-gathered (halo 0); with a window the halo
    received from the ranks before (`with_halo`), then the rank's own."""
    if window is None:
        gather = functools.partial(jax.lax.all_gather, axis_name=AXIS, axis=1, tiled=True)
        return gather(k), gather(v), None if ids is None else gather(ids), 0
    halo = halo_length(window, seq_len, cp)
    key_ids = None if ids is None else with_halo(ids, halo, cp)
    return with_halo(k, halo, cp), with_halo(v, halo, cp), key_ids, halo


def kernel_segments(key_ids, key_start, batch: int, length: int):
    """The keys' segment ids a fused kernel masks with: the documents' (0 for one document), and
    -1 — a segment no query has — for positions before the sequence's start (a rank's received
    zeros). Nothing is sent for them: one document's ids are made here."""
    positions = key_start + jnp.arange(length)
    ids = jnp.zeros((batch, length), jnp.int32) if key_ids is None else key_ids.astype(jnp.int32)
    return jnp.where((positions >= 0)[None, :], ids, -1)


def _pallas(q, keys, values, ids, key_ids, key_start, *, q_offset, window: int | None):
    """Pallas's kernel on the rank's n queries at their positions among the keys it holds
    (`q_offset`: the halo's length with a window, the slice's start — traced, the rank's index —
    under full attention), visiting only the key blocks each query block reaches."""
    from pallas_kernels import flash_attention  # deferred: only this path needs Pallas

    batch, n = q.shape[:2]
    if window is None and ids is None:  # every key exists: no segments at all
        return flash_attention(q, keys, values, q_offset=q_offset)
    q_ids = jnp.zeros((batch, n), jnp.int32) if ids is None else ids.astype(jnp.int32)
    return flash_attention(q, keys, values, window=window, q_offset=q_offset, segment_ids=q_ids,
                           kv_segment_ids=kernel_segments(key_ids, key_start, batch, keys.shape[1]))


def _cudnn(q, keys, values, key_ids, key_start, *, window: int):
    """cuDNN's kernel on one rank's slice: h zero queries before its n, so that queries and keys
    line up (see the module's docstring), keys before the sequence's start a segment of their own."""
    halo = keys.shape[1] - q.shape[1]
    # cuDNN's biased kernels take even lengths only: one masked key more in front where needed.
    extra = keys.shape[1] % 2
    front = [(0, 0), (extra, 0), (0, 0), (0, 0)]
    segments = jnp.pad(kernel_segments(key_ids, key_start, q.shape[0], keys.shape[1]), [(0, 0), (extra, 0)],
                       constant_values=-1)
    keys, values = jnp.pad(keys, front), jnp.pad(values, front)
    queries = jnp.pad(q, [(0, 0), (extra + halo, 0), (0, 0), (0, 0)])
    out = one_device_attend(queries, keys, values, window=window, implementation="cudnn", documents=segments)
    return out[:, extra + halo:]


def with_halo(x, halo: int, cp: int):
    """x (b, n, ...), this rank's slice -> (b, halo + n, ...): the `halo` positions before the
    slice, received from the ranks before it (zeros where there are none), then the slice."""
    n = x.shape[1]
    pieces = [x]
    for hop in range(1, cp):
        take = min(n, halo - (hop - 1) * n)  # from rank r - hop: its last `take` positions
        if take <= 0:
            break
        pieces.insert(0, jax.lax.ppermute(x[:, n - take:], AXIS, [(i, i + hop) for i in range(cp - hop)]))
    return jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else x
