"""`python -m megascale_jax.evaluate RUN_DIR --tasks PATH[,PATH...] [--step N] [--limit N]
[--num-fewshot N] [--batch-size B] [--bootstrap-iters N] [--json]`

Scores a run's newest committed checkpoint (or step N) on downstream tasks exactly as
EleutherAI's lm-evaluation-harness scores the same model exported with `export_hf`
(`megascale_jax.evaluation`: the same requests, truncation, metrics and standard errors), and
prints lm-eval's table (task, version, filter, n-shot, metric, value, stderr), or with --json
lm-eval's results layout. A task is a local file: our JSONL schema (`evaluation.tasks`) or an
lm-eval task YAML whose data is a local JSON/JSONL file (`evaluation.lm_eval_yaml`).

It runs on one device — the CPU is enough — whatever mesh trained the run (`training.trained.load`
reads the parameters onto one device, as `sample` and `export_hf` do), in batches of B rows of
`model.seq_len` tokens, one compiled function for all of them. Contexts longer than the model
are cut from the left as lm-eval cuts them; how many were is printed under the table.

Mistakes — a missing run directory or checkpoint, a task file that does not exist or is malformed
(file:line), an unsupported output_type or metric, an empty choice list, a gold index out of
range, a choice the tokenizer cannot encode — are one `error:` line on stderr and exit 2, before
any parameter is read.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Optional, Sequence

from megascale_jax import cli
from megascale_jax.config import ConfigError


def parse_args(argv):
    parser = cli.ArgumentParser(prog="python -m megascale_jax.evaluate",
                                description="Score a trained run on downstream tasks as lm-evaluation-harness does.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a training run")
    parser.add_argument("--tasks", required=True, help="comma-separated task files: .jsonl (this project's schema) "
                        "or lm-eval task .yaml with local data")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    parser.add_argument("--limit", type=int, default=None, help="score only each task's first N items")
    parser.add_argument("--num-fewshot", type=int, default=None,
                        help="few-shot examples before each item, drawn as lm-eval draws them (default: each "
                             "task's own num_fewshot, 0 for a .jsonl task, whose examples come from its own items)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows of model.seq_len tokens a forward (default 8)")
    parser.add_argument("--bootstrap-iters", type=int, default=100_000,
                        help="resamples for perplexity's stderr, as lm-eval's (default 100000; 0: none)")
    parser.add_argument("--json", action="store_true", help="print lm-eval's results JSON instead of the table")
    return cli.parse(parser, argv)


def option_error(args) -> str | None:
    if args.limit is not None and args.limit < 1:
        return f"--limit {args.limit}: score at least 1 item"
    if args.num_fewshot is not None and args.num_fewshot < 0:
        return f"--num-fewshot {args.num_fewshot}: must be >= 0"
    if args.batch_size < 1:
        return f"--batch-size {args.batch_size}: must be >= 1"
    if args.bootstrap_iters < 0:
        return f"--bootstrap-iters {args.bootstrap_iters}: must be >= 0"
    if not [p for p in args.tasks.split(",") if p]:
        return "--tasks is empty; pass task files"
    return None


def prepare_all(paths: list[str], limit, tokenizer, prefix, max_length, num_fewshot=None):
    from megascale_jax.evaluation import evaluator, requests

    encoder = requests.for_tokenizer(tokenizer, prefix)
    return [evaluator.prepare(evaluator.load_task(p, limit, num_fewshot), encoder, max_length) for p in paths]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    problem = option_error(args)
    if problem:
        return cli.user_error(problem)
    if importlib.util.find_spec("tokenizers") is None:
        return cli.user_error("python -m megascale_jax.evaluate needs the `tokenizers` package; "
                              "pip install -e '.[interop]'")
    from megascale_jax.evaluation import evaluator, scoring, table
    from megascale_jax.evaluation.tasks import TaskError
    from megascale_jax.training import trained
    from megascale_jax.training.tokenizer import TokenizerError, prefix_token, run_end_of_text, run_tokenizer

    paths = [p for p in args.tasks.split(",") if p]
    try:
        cfg = trained.run_config(args.run_dir)
        tokenizer = run_tokenizer(args.run_dir, cfg)
        prefix = prefix_token(tokenizer, run_end_of_text(args.run_dir, cfg))
        prepared = prepare_all(paths, args.limit, tokenizer, prefix, cfg.model.seq_len, args.num_fewshot)
        run = trained.load(args.run_dir, args.step, warn=lambda line: print(line, file=sys.stderr))
        max_length = run.cfg.model.seq_len
        if max_length != cfg.model.seq_len:  # the checkpoint's model is not config.yaml's
            prepared = prepare_all(paths, args.limit, tokenizer, prefix, max_length, args.num_fewshot)
    except (ConfigError, TokenizerError, TaskError) as e:
        return cli.user_error(e)
    score_batch = scoring.one_device_scorer(run.cfg.model, run.params)
    results = [evaluator.score(p, score_batch, args.batch_size, max_length, args.bootstrap_iters) for p in prepared]
    if args.json:
        print(json.dumps(table.as_json(results, max_length, run.step), indent=1))
    else:
        shots = sorted({r.num_fewshot for r in results})
        print(f"{args.run_dir} step {run.step}, max length {max_length}, "
              + ("zero-shot" if shots == [0] else f"{shots[0]}-shot" if len(shots) == 1 else "n-shot as listed"))
        print(table.markdown(results, max_length), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
