"""Where a run starts: the one choice between a memory snapshot, a checkpoint, a Hugging Face
model's weights and a fresh initialisation, made once and returned as a `Start`.

Order: a snapshot newer than the newest checkpoint, else the newest readable checkpoint (an
unreadable newest one is set aside by the checkpointer), else — only for a run with nothing
saved — `model.init_from`'s weights, else the seed's initialisation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from megascale_jax.training import compile_cache


@dataclasses.dataclass
class Start:
    state: Any  # the train state, in stored (pipeline) layer order, on the mesh
    step: int  # steps done so far
    data_position: int  # the index of the next training sequence
    source: str  # "memory snapshot", "checkpoint", "Hugging Face model" or "initialisation"

    @property
    def resumed(self) -> bool:
        return self.source in ("memory snapshot", "checkpoint")


def choose_start(trainer, saves, abstract_state, clock, hf_weights: Callable[[], Any] | None = None,
                 up_to: int | None = None) -> Start:
    """The state training starts from (see the module docstring). `hf_weights()` returns the
    Hugging Face model's parameters as host arrays in canonical order, when the config names one;
    `up_to` (--resume-step) leaves any saved state newer than that step alone."""
    restored = saves.restore(abstract_state, clock, up_to)
    if restored:
        state, step, data_position, source = restored
        # a snapshot holds the stored (pipeline-ordered) state, a checkpoint the canonical
        start = Start(state if source == "memory snapshot" else trainer.to_stored(state), step, data_position, source)
    elif hf_weights is not None:  # placed on this mesh shard by shard
        weights = hf_weights()
        start = Start(trainer.start_from(jax.tree.map(
            lambda w, a: jax.make_array_from_callback(a.shape, a.sharding, lambda index: w[index]),
            weights, trainer.abstract_params)), 0, 0, "Hugging Face model")
    else:  # through the cache: in a CPU job of several processes, process 0 compiles it for all
        start = Start(compile_cache.compile(trainer.init.lower(), "init")(), 0, 0, "initialisation")
    clock.lap("state")
    return start
