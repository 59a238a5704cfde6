"""The blocking stage of a background save (`checkpoint.background_host_copy`): a copy of the
state that the next step's donation cannot touch, made before the step is dispatched.

On the device the copy is a memory-bandwidth copy (milliseconds; the writer thread then moves it
to the host while training goes on), but it holds the state's size in device memory until then:
15.8 GiB per GPU for gpt_1b with AdamW. Where that does not fit beside the compiled step, or
beyond `checkpoint.device_copy_gib`, the copy is capped: the leaves that fit are copied on the
device, the rest straight to pinned host memory while the step waits (the host link's rate,
~4 GB/s measured on an H200 through orbax, more for a bare copy). The cap comes from
`trainer.device_copy_cap` (`flops.device_copy_bytes`); the checkpoint and a memory
snapshot of the same step share one copy.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from megascale_jax.training import compile_cache


@jax.jit
def device_copy(tree):
    """The state in fresh device buffers (no donation: the inputs stay valid)."""
    return jax.tree.map(jnp.copy, tree)


def to_pinned_host(tree):
    """Each array of `tree` copied into pinned host memory, where its devices have it (GPUs and
    the CPU; not every platform), else as it is; blocks until the copies landed. Page-locked
    memory is what a GPU's copy engines write at PCIe rate. Orbax would make this same copy on a
    GPU inside its save(), then copy again into NumPy arrays; done here first, the device-to-host
    rate is measured apart from orbax's host-side work (the H200 measured ~4 GB/s for the whole).
    The copy runs on the device's transfer stream, beside the training step's compute."""
    def move(x):
        if x.sharding.memory_kind == "pinned_host":  # there already (a capped copy's host part)
            return x
        device = next(iter(x.sharding.device_set))
        if not any(m.kind == "pinned_host" for m in device.addressable_memories()):
            return x
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))

    return jax.block_until_ready(jax.tree.map(move, tree))


def bytes_per_device(leaf) -> int:
    """The bytes one device holds of `leaf` (an array or a ShapeDtypeStruct with a sharding)."""
    return math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize


class SaveCopy:
    """`copy(state)`: the state's leaves copied, the first ones (in tree order) that fit in the cap
    on the device (dispatched, not waited for), the others into pinned host memory (waited for)."""

    def __init__(self, config: dict):
        self._config = config
        self._program = None
        self._on_device: list[int] | None = None  # leaf indices copied on the device
        self.on_device_bytes = self.to_host_bytes = 0  # per device

    def compile(self, abstract_state, cap_bytes: int | None = None) -> None:
        """Choose the leaves copied on the device (all of them with `cap_bytes` None; else first
        fit in tree order) and compile their copy; the whole state's copy goes through the run's
        compilation cache (a restart loads it), a capped one is compiled here."""
        leaves = jax.tree.leaves(abstract_state)
        sizes = [bytes_per_device(x) for x in leaves]
        picked, used = [], 0
        for i, size in enumerate(sizes):
            if cap_bytes is None or used + size <= cap_bytes:
                picked.append(i)
                used += size
        self._on_device, self.on_device_bytes, self.to_host_bytes = picked, used, sum(sizes) - used
        on_device = [leaves[i] for i in picked]
        if not on_device:
            self._program = None
        elif len(picked) == len(leaves):
            self._program = compile_cache.load_or_compile(
                "checkpoint_device_copy", lambda: device_copy.lower(on_device), self._config, (on_device,))
        else:
            self._program = device_copy.lower(on_device).compile()

    def __call__(self, state):
        leaves, tree = jax.tree.flatten(state)
        if self._on_device is None:  # not compiled up front (snapshots without checkpoints)
            self.compile(state)
        out = list(leaves)
        if self._program is not None:
            for i, copy in zip(self._on_device, self._program([leaves[i] for i in self._on_device])):
                out[i] = copy
        chosen = set(self._on_device)
        rest = [i for i in range(len(leaves)) if i not in chosen]
        for i, on_host in zip(rest, to_pinned_host([leaves[i] for i in rest])):
            out[i] = on_host
        return jax.tree.unflatten(tree, out)
