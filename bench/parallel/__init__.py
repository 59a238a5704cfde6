"""The train step on the local devices: tensor-parallel modes, pipeline schedules and their
bubble, the bytes per mesh axis against the planner's, and the step time, tokens/s and MFU of a
real training run (`train_step`, which the GPU campaign's MFU ladder runs once per row)."""
