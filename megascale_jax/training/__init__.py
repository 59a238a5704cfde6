"""What one training process runs: `optim` (LAMB/AdamW), `data` (grain batches), `checkpoint`
(orbax, two-stage), `interrupt` (SIGINT/SIGTERM), `hooks` (what runs on a cadence around the
step), `metrics` (the one-step-late record) and `observers` (timings, heartbeats, drills)."""
