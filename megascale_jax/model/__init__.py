"""The model, knowing nothing of meshes: `transformer` (the parallel/serial block, Flax),
`attention` (xla / cudnn / pallas dispatch), `flops` (FLOPs, MFU and the memory estimate)."""
