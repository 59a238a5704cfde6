"""The planner behind `python -m megascale_jax.plan`: `calibration` (hardware numbers, read from
configs/calibration.yaml), `costs` (one function per cost model, each stating its formula),
`workload` (a layout as the cost models see it, from a config or a published run),
`predict` (iteration time, its breakdown, MFU and memory), `published` and `validation` (published runs,
each predicted held out) and `search` (every valid layout for
N GPUs, ranked). No jax: it plans for machines this process does not have."""
