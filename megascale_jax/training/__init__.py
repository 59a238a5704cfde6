"""What one training process runs: `optim` (LAMB/AdamW), `data` (grain batches), `checkpoint`
(orbax, two-stage), `interrupt` (SIGINT/SIGTERM), `observers` (the hooks the loop calls)."""
