"""What a user types is a test: every `python -m megascale_jax.<cmd>` in README.md's code blocks,
run exactly as written from a scratch copy of the checkout (so relative paths such as
`runs/...` and `configs/...` behave as they do for a user), in README order.

The only change allowed is a shorter `train.steps=` appended to commands that train. Blocks
whose first line starts with `# on NVIDIA GPU hosts` are skipped (they need a GPU or a cluster).
"""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU_MARK = "# on NVIDIA GPU hosts"
SHORT_STEPS = "train.steps=6"
TIMEOUT_S = 600


def readme_commands(text: str) -> list[str]:
    """The `python -m megascale_jax.*` commands of README.md's code blocks, continuation lines
    joined and comments dropped, outside blocks marked as needing a GPU."""
    commands, blocks, block = [], [], None
    for line in text.splitlines():
        if line.startswith("```") and block is None:  # opens a block: ```bash, ```python, ...
            block = [line[3:].strip()]
        elif line.startswith("```"):
            blocks.append(block)
            block = None
        elif block is not None:
            block.append(line)
    for language, *lines in blocks:
        if language not in ("bash", "sh", "") or (lines and lines[0].startswith(GPU_MARK)):
            continue
        for line in "\n".join(lines).replace("\\\n", " ").splitlines():
            for part in line.split("&&"):  # the first README line installs, then trains
                command = " ".join(shlex.split(part, comments=True))
                if command.startswith("python -m megascale_jax."):
                    commands.append(command)
    return commands


def test_readme_commands_are_found():
    """The parser sees the commands a user sees (a parser that finds nothing would pass vacuously)."""
    commands = readme_commands((REPO / "README.md").read_text())
    modules = {shlex.split(c)[2] for c in commands}
    assert {"megascale_jax.train", "megascale_jax.launch", "megascale_jax.report", "megascale_jax.diagnose",
            "megascale_jax.flops"} <= modules
    assert not any("gpt_1b" in c for c in commands)  # the GPU blocks are skipped


def scratch_checkout(dest: Path) -> Path:
    """The tracked files of the checkout (what a user clones), nothing generated."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    checkout = scratch_checkout(tmp_path / "checkout")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    failures = []
    for command in readme_commands((REPO / "README.md").read_text()):
        argv = shlex.split(command)
        argv[0] = sys.executable
        if argv[2] in ("megascale_jax.train", "megascale_jax.launch"):
            argv.append(SHORT_STEPS)
        done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            failures.append(f"`{command}` exited {done.returncode}:\n{tail}")
    assert not failures, "\n\n".join(failures)
    # The commands wrote where a user would look: relative run directories inside the checkout.
    assert (checkout / "runs" / "exp1" / "metrics.jsonl").is_file()
    assert (checkout / "runs" / "supervised" / "report" / "summary.txt").is_file()
    assert (checkout / "runs" / "supervised" / "redis" / "redis.log").is_file()
