"""The GPU campaign: every measurement this project wants from a lent GPU, in one command,
`python -m bench.campaign` (__main__.py; `--help`).

One module per section (kernels, ladder, torch_peer, checkpoints, profile), each with
`run(settings) -> dict`, which `worker` runs in a process of its own (`process`); `device` probes
the accelerator, `model` sizes the training sections' model and batch, `plots` and `summary` draw
and print the result, `merge` makes one result of several device calls' files. gpu_wheels.sh
fetches the wheels a GPU machine without network needs.
"""
