"""One config's train step compiled ahead of time on the local devices, and its median time
(shared by the benches of bench/parallel/)."""

import dataclasses
import statistics
import time
from typing import Any


@dataclasses.dataclass
class CompiledStep:
    cfg: Any
    step: Any  # the compiled train step: (state, batch) -> (state, metrics)
    state: Any
    batch: Any
    compile_s: float

    def cost(self) -> dict:
        """XLA's `cost_analysis()` of the step (a dict on every jax version)."""
        cost = self.step.cost_analysis()
        return cost[0] if isinstance(cost, list) else cost

    def median_time_s(self, steps: int) -> float:
        """Median wall time of `steps` steps after one warm-up step."""
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            self.state, metrics = self.step(self.state, self.batch)
            metrics["loss"].block_until_ready()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])


def compile_train_step(overrides: list[str]) -> CompiledStep:
    from megascale_jax.training import data
    from megascale_jax.config import load_config
    from megascale_jax.parallel.mesh import make_mesh
    from megascale_jax.training.trainer import build_trainer

    cfg = load_config(None, overrides)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
    state = trainer.init()
    batch = data.make_global_batch(batches, 0, trainer.batch_sharding)
    start = time.perf_counter()
    step = trainer.train_step.lower(state, batch).compile()
    return CompiledStep(cfg, step, state, batch, time.perf_counter() - start)
