"""Runs one piece of the GPU campaign in this process and writes what it returns as JSON:

    python bench/campaign_worker.py SECTION SETTINGS.json RESULT.json

`bench/gpu_campaign.py` starts one of these per section (see `campaign_process` for why each
gets its own process). SETTINGS holds what every section needs (dry_run, the device as
`campaign_device.run` found it, where PNGs go). A section's failure is this process's
failure: the traceback goes to stderr, the exit code is non-zero, and the campaign records the
line that names it.
"""

import importlib
import json
import sys

PIECES = {  # name -> module with `run(settings) -> dict` (imported only when asked for)
    "probe": "campaign_device",
    "kernels": "campaign_kernels",
    "mfu_ladder": "campaign_ladder",
    "torch_peer": "campaign_torch",
    "checkpoints": "campaign_checkpoints",
    "profiled_steps": "campaign_profile",
}


class InjectedFailure(RuntimeError):
    """`--fail-section`: a section made to fail on purpose (tests of the campaign's isolation)."""


def main(argv: list[str]) -> int:
    name, settings_path, result_path = argv
    with open(settings_path) as f:
        settings = json.load(f)
    if name in settings.get("fail_sections", ()):
        raise InjectedFailure(f"{name} failed on purpose (--fail-section {name})")
    result = importlib.import_module(PIECES[name]).run(settings)
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
