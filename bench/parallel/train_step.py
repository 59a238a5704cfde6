"""Step time, tokens/s and MFU of a real training run; prints a table and writes JSON.

    python -m bench.parallel.train_step --config configs/tiny_cpu.yaml [--name tiny_cpu] [key=value ...]
    python -m bench.parallel.train_step --config configs/gpt_1b.yaml --name gpt_1b_cudnn model.attention=cudnn

Runs `megascale_jax.train` in-process for the configured steps and summarises the steady state
(the first `--skip` steps are dropped): median step time, and the tokens/s and MFU of that
step time (not the median of the records' own tokens/s: each is a running average over the
last steps, warm-up steps included, which put a 4-microbatch row 15% low on an H200), the
device's peak memory in use (null where the device keeps no statistics, e.g. the CPU), with the device kind,
jax/jaxlib versions and the exact command, and the median wait for the next batch (`data_wait_s`),
into bench/results/<name>.json.
"""

import json
import os
import statistics
import sys
import tempfile

from bench.common import Bench


def main(argv=None) -> int:
    bench = Bench(__doc__, "<name>")
    bench.add_argument("--config", required=True)
    bench.add_argument("--name", default=None, help="result file name (default: config name)")
    bench.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the summary")
    bench.add_argument("--run-dir", default=None, help="the run's directory (default: a new temporary one)")
    bench.add_argument("overrides", nargs="*")
    args = bench.parse_args(argv, intermixed=True)  # key=value overrides may follow options, as in train
    bench.refuse_existing(args.name or os.path.splitext(os.path.basename(args.config))[0])

    from megascale_jax import train

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="bench-")
    code = train.main(["--config", args.config, "--run-dir", run_dir, "train.eval_every=0", *args.overrides])
    if code:
        return code

    import jax

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f][args.skip:]
    if not records:
        print("error: no steps left after --skip; raise train.steps", file=sys.stderr)
        return 2
    from megascale_jax.config import load_config
    from megascale_jax.model import flops

    cfg = load_config(os.path.join(run_dir, "config.yaml"))  # the run's own, as resolved
    step_time = statistics.median(r["step_time_s"] for r in records)
    tokens_per_s = cfg.train.global_batch * cfg.model.seq_len / step_time
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "device": jax.devices()[0].device_kind,
        "steps_measured": len(records),
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "mfu": flops.mfu(tokens_per_s, cfg.model, jax.devices()),  # as the run's own records compute it
        "peak_bytes_in_use": (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
        "final_loss": records[-1]["loss"],
        # the host's wait for its next batch (the loader's time on the critical path, which the
        # planner charges 0 for a prefetching loader), median over the same steps
        "data_wait_s": statistics.median(r["data_wait_s"] for r in records),
    }
    print(f"{'config':<28}{'device':<28}{'step s':>9}{'tokens/s':>12}{'MFU':>8}")
    mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a"
    print(f"{os.path.basename(args.config):<28}{result['device'][:27]:<28}"
          f"{result['step_time_s']:>9.3f}{result['tokens_per_s']:>12.0f}{mfu:>8}")
    bench.write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
