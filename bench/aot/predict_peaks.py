"""Each training row of a GPU campaign result, compiled without a GPU: its predicted peak memory
beside the peak the GPU measured.

    python -m bench.aot.predict_peaks bench/results/gpu_nvidia_h200_<date>.json [--gpu h200] [--dry]
        [--config configs/gpt_1b.yaml] [--only ROW,ROW]

For every measured row of the result's `levers` and `mfu_ladder` sections it compiles the row's
own configuration (`configs/gpt_1b.yaml` with the row's changes, batch, microbatches and XLA
flags, exactly what the campaign trained) for one GPU of `--gpu` in the compile-only environment
(`aot.environment.compile_report`, the path of `plan --compile`), and writes the compiled step's
peak (argument + output - alias + temporaries) into the row as `peak_bytes_predicted`, then
recomputes the result's summary (`summary.peak_bytes_predicted`: the same-work row's). A row that
does not compile keeps `peak_bytes_predicted_error`, one line. `--dry` prints without writing.
`--config`: the campaign's config file as it was when the rows ran (e.g. `git show
COMMIT:configs/gpt_1b.yaml > old.yaml`), where configs/gpt_1b.yaml has changed since; `--only`
predicts the named rows and keeps the others' predictions.

Run it before a campaign on the configurations it will train (the prediction stands alone: the
compile never sees the measurement) or after one, on its result; ~15 s a row on 2 cores.
"""

from __future__ import annotations

import json
import sys

from bench.campaign import claims, ladder, model
from bench.common import Bench
from megascale_jax.aot import environment, targets


def training_rows(result: dict) -> list[dict]:
    """The measured rows of the result's levers (base first) and MFU ladder sections."""
    sections = result["sections"]
    levers = sections.get("levers", {})
    rows = [levers["base"], *levers["rows"]] if "base" in levers else []
    rows += sections.get("mfu_ladder", {}).get("rows", [])
    return [r for r in rows if ladder.measured(r)]


def row_overrides(row: dict) -> list[str]:
    """The configuration the campaign trained for `row` (its changes, batch and microbatches)."""
    return [*ladder.row_overrides(False, row["config"], row["microbatches"]),
            f"train.global_batch={row['batch'] * row['microbatches']}"]


def xla_options(row: dict) -> list[str]:
    """The row's XLA flags as compile options: '--xla_gpu_enable_triton_gemm=false' -> 'xla_...=false'."""
    return [flag.removeprefix("--") for flag in row.get("xla_flags", [])]


def predict(row: dict, gpu: str, config: str) -> dict:
    try:
        report = environment.compile_report(gpu, targets.topology(1), config, row_overrides(row),
                                            xla_options(row))
    except RuntimeError as e:
        return {"peak_bytes_predicted_error": str(e)}
    return {"peak_bytes_predicted": report["memory"]["peak"], "predicted_compile_s": report["compile_s"]}


def main(argv=None) -> int:
    bench = Bench(__doc__, "<result>")
    bench.add_argument("result", help="a GPU campaign result (bench/results/gpu_*.json)")
    bench.add_argument("--gpu", default="h200", help="the GPU to compile for (default h200)")
    bench.add_argument("--dry", action="store_true", help="print, do not write the result")
    bench.add_argument("--config", default=model.CONFIG, help="the config file the rows ran with")
    bench.add_argument("--only", default=None, help="comma list of row names (default: every row)")
    args = bench.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    print(f"{'row':<32}{'batch':>6}{'measured GiB':>14}{'predicted GiB':>15}{'ratio':>8}")
    only = set(args.only.split(",")) if args.only else None
    for row in training_rows(result):
        if only is not None and row["name"] not in only:
            continue
        row.pop("peak_bytes_predicted_error", None)
        row.update(predict(row, args.gpu, args.config))
        measured, predicted = row.get("peak_bytes_in_use"), row.get("peak_bytes_predicted")
        if predicted is None:
            print(f"{row['name']:<32}{row['batch']:>6}  {row['peak_bytes_predicted_error']}", flush=True)
            continue
        ratio = f"{predicted / measured:>8.4f}" if measured else f"{'n/a':>8}"
        print(f"{row['name']:<32}{row['batch']:>6}{(measured or 0) / 2**30:>14.2f}{predicted / 2**30:>15.2f}{ratio}",
              flush=True)
    result["summary"] = claims.summary(result["device"], result["sections"])
    if not args.dry:
        with open(args.result, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
