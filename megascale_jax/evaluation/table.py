"""Results as lm-eval prints them (utils.make_table): a Markdown table of task, version, filter,
n-shot, metric, direction, value and stderr, metrics in alphabetical order, values to 4 places,
"N/A" where lm-eval has no standard error — so the two outputs can be read side by side. Below
it, one line a task whose requests were cut from the left to the model's length."""

from __future__ import annotations

from typing import Sequence

from megascale_jax.evaluation.evaluator import TaskResult

HEADERS = ("Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr")
HIGHER_IS_BETTER = {"acc": True, "acc_norm": True, "acc_bytes": True, "perplexity": False,
                    "word_perplexity": False, "byte_perplexity": False, "bits_per_byte": False}


def table_rows(results: Sequence[TaskResult]) -> list[list[str]]:
    rows = []
    for result in results:
        task, version = result.name, "N/A" if result.version is None else result.version
        for name in sorted(result.metrics):
            value, stderr = result.metrics[name]
            arrow = "↑" if HIGHER_IS_BETTER[name] else "↓"
            rows.append([task, version, "none", str(result.num_fewshot), name, arrow, f"{value:.4f}", "±",
                         "   N/A" if stderr is None else f"{stderr:.4f}"])
            task = version = ""
    return rows


def markdown(results: Sequence[TaskResult], max_length: int) -> str:
    rows = table_rows(results)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(HEADERS)]
    right = {3, 6, 8}  # numbers right-aligned, as pytablewriter aligns them

    def line(cells):
        return "|" + "|".join((c.rjust(w) if i in right else c.ljust(w)) for i, (c, w) in enumerate(zip(cells, widths))) + "|"

    lines = [line(HEADERS), "|" + "|".join(("-" * (w - 1) + ":") if i in right else "-" * w
                                           for i, w in enumerate(widths)) + "|"]
    lines += [line(r) for r in rows]
    for result in results:
        if result.truncated:
            lines.append(f"{result.name}: {result.truncated} of {result.requests} requests longer than "
                         f"{max_length} + 1 tokens were cut from the left (as lm-eval cuts them)")
    return "\n".join(lines)


def as_json(results: Sequence[TaskResult], max_length: int, step: int) -> dict:
    """lm-eval's results layout ("acc,none", "acc_stderr,none"), plus what it only logs."""
    out = {"step": step, "max_length": max_length, "results": {}, "n-shot": {r.name: r.num_fewshot for r in results},
           "truncated": {}}
    for r in results:
        entry = {"alias": r.name, "samples": r.items}
        for name, (value, stderr) in r.metrics.items():
            entry[f"{name},none"] = value
            entry[f"{name}_stderr,none"] = "N/A" if stderr is None else stderr
        out["results"][r.name] = entry
        out["truncated"][r.name] = {"requests": r.requests, "truncated": r.truncated}
    return out
