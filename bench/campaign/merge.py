"""One campaign result from the files of several device calls.

    python -m bench.campaign.merge CALL1.json CALL2.json ... --out bench/results/gpu_<device>_<date>.json

A lent GPU keeps nothing between calls, so each call writes its own result under the device
tool's $OUT (`python -m bench.campaign ... --out $OUT/callN.json`) and the files come back here.
This puts their sections in one result (a later file's section replaces an earlier one's), each
section keeping the command that produced it; records every call's command under `calls`;
redraws the PNGs beside the result and copies the profiled section's device heat map; and
recomputes the summary from all the sections, as one campaign run would. Files of different
devices, or a dry run's, are refused with one line (exit 2), before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from bench.campaign import claims, plots
from bench.campaign.__main__ import SECTIONS
from bench.common import invocation, result_path


def merge(paths: list[str], out: str) -> dict:
    """The merged result of `paths` (in call order), written to `out` with its PNGs; ValueError
    (one line) for files that cannot be merged."""
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    devices = sorted({r["device"] for r in results})
    if len(devices) > 1:
        raise ValueError(f"the files hold results of different devices ({', '.join(devices)}); merge one device's")
    if any(r.get("dry_run") or r.get("tiny") for r in results):
        raise ValueError("a --dry-run or --tiny result measures nothing worth keeping; merge full runs only")
    stem = os.path.splitext(out)[0]
    sections = {}
    for path, result in zip(paths, results):
        for name, section in result["sections"].items():
            sections[name] = section
            if name == "profiled_steps" and section.get("device_heatmap"):
                heatmap = os.path.splitext(path)[0] + "_device_heatmap.png"  # beside the file it came with
                if os.path.isfile(heatmap):
                    shutil.copyfile(heatmap, stem + "_device_heatmap.png")
                    sections[name] = {**section, "device_heatmap": stem + "_device_heatmap.png"}
    sections = {name: sections[name] for name in SECTIONS if name in sections}
    header = {k: v for k, v in results[0].items() if k not in ("sections", "summary", "pngs", "png_problems")}
    header["command"] = f"{len(paths)} device calls merged by python -m bench.campaign.merge (see calls)"
    header["calls"] = [{"command": r["command"], "date": r.get("date"), "sections": list(r["sections"])}
                       for r in results]
    pngs, problems = plots.draw(sections, stem)
    merged = {**header, "summary": claims.summary(devices[0], sections), "sections": sections, "pngs": pngs,
              "png_problems": problems}
    with open(out, "w") as f:
        json.dump(merged, f, indent=2)
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=invocation(), description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="the calls' result files, in the order they ran")
    parser.add_argument("--out", required=True, help="the merged result (its PNGs go beside it)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    missing = [p for p in args.files if not os.path.isfile(p)]
    if missing:
        print(f"error: no such result file: {missing[0]}", file=sys.stderr)
        return 2
    out = result_path("", args.out, args.overwrite)
    try:
        merged = merge(args.files, out)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"error: {e if isinstance(e, ValueError) else f'not a campaign result: {e}'}", file=sys.stderr)
        return 2
    print(f"wrote {out}: sections {', '.join(merged['sections'])}; PNGs {', '.join(merged['pngs']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
