"""Parallelism applied from outside the model: `mesh` (the (dp, pp, cp, tp) mesh), `sharding` (the
one logical-axis -> mesh-axis table), `tensor_parallel` (sequence parallelism and collective
matmul), `context_parallel` (attention over a sequence split over cp), `pipeline` (the executor of `megascale_jax.pipeline_schedule`'s tick tables),
`pipeline_stash` (what a stage keeps for a chunk's backward), `layout` (the stored, stage-major
layer order) and `residuals` (which vjp residuals the residual stash keeps)."""
