"""Runs one piece of the GPU campaign in this process and writes what it returns as JSON:

    python -m bench.campaign.worker SECTION SETTINGS.json RESULT.json

`python -m bench.campaign` starts one of these per section (see `process` for why each gets its
own process). SETTINGS holds what every section needs (dry_run, the device as `device.run`
found it, where PNGs go). A section's failure is this process's
failure: the traceback goes to stderr, the exit code is non-zero, and the campaign records the
line that names it.
"""

import importlib
import json
import sys

PIECES = {  # name -> module with `run(settings) -> dict` (imported only when asked for)
    "probe": "bench.campaign.device",
    "kernels": "bench.campaign.kernels",
    "mfu_ladder": "bench.campaign.ladder",
    "levers": "bench.campaign.levers",
    "torch_peer": "bench.campaign.torch_peer",
    "checkpoints": "bench.campaign.checkpoints",
    "profiled_steps": "bench.campaign.profile",
    "rates": "bench.campaign.rates",
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
