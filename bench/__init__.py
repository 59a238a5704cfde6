"""Benchmarks of megascale_jax, with their committed results in bench/results/.

Run from the checkout's root, each as a module (`python -m bench.<group>.<name> --help`):

    campaign/     the GPU campaign, one entry point: `python -m bench.campaign` (NVIDIA GPU hosts)
    kernels/      attention, LayerNorm and GeLU kernels against XLA and cuDNN (a GPU)
    parallel/     the train step under tensor and pipeline parallelism: time, bytes, bubble, MFU
    resilience/   checkpoints, start-up, diagnostics, stragglers, supervisor drills, ETTR
    planner/      the planner against published runs and this project's own
    training/     training claims: LAMB at 4x the batch against AdamW, same tokens, 3 seeds
    common.py     what every bench shares: its command line's --out/--overwrite, the provenance
                  it records, bench/results/

A result file is never replaced without --overwrite (bench/results/ holds measurements that the
README quotes).
"""
