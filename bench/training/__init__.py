"""What the optimizer and the batch size do to the loss: LAMB at 4x the batch against AdamW at the
batch, on the same tokens (`lamb_batch`)."""
