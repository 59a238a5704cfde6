"""Parallelism applied from outside the model: `mesh` (the (dp, pp, tp) mesh), `sharding` (the
one logical-axis -> mesh-axis table), `tensor_parallel` (sequence parallelism and collective
matmul), `pipeline_schedule` (tick tables), `pipeline` (the executor), `layout` (the stored,
stage-major layer order) and `residuals` (what the residual stash keeps)."""
