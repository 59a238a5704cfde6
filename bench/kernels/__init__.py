"""The fused kernels (`pallas_kernels`) against XLA and cuDNN on one GPU; the GPU campaign's
kernels section builds on it."""
