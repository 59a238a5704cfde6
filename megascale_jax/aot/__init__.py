"""Compiling the real train step for a GPU on a machine without one (`plan --compile`).

XLA compiles for a described GPU ("deviceless" ahead-of-time compilation) given the GPU machines'
jax and its CUDA plugin in compile-only mode: `configs/aot/setup_env.sh` makes that environment
(jax 0.11.2 needs Python 3.12; the project's own environment may be 3.11 with jax 0.10.2).

* `targets`: the GPUs the compile knows (their XLA target descriptions) and the topology string
  for N of them; jax-free, read by `plan` before anything starts.
* `environment`: finds the compile-only environment and runs `compile_step` in it.
* `compile_step`: runs there: the trainer's own step for the topology, compiled, and its report.
* `compiled_hlo`: reads the compiled module: its kernels, the buffers live at the memory peak,
  its collectives' overlap with compute.
* `roofline`: each kernel's FLOPs and bytes priced at the GPU's rates into a step time.
* `summary`: the report as `plan --compile` prints it, and its verdict on memory.
"""
