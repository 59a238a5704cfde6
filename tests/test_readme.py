"""What a user types is a test: every `python -m megascale_jax.<cmd>` in the code blocks of
README.md and then of each docs/*.md page (pages in name order), run exactly as written from a
scratch copy of the checkout (so relative paths such as `runs/...` and `configs/...` behave as they
do for a user), in that order. The commands of all the files are one list, so a command that reads
what a command on another page wrote still runs after it, in the same chain.

The only change allowed is a shorter `train.steps=` appended to commands that train. The first
chain (the README's first command) runs with no XLA_FLAGS, as in a user's shell; the others with
the suite's compile-time flags (conftest.py), which make compiling several times faster and leave
what the programs compute unchanged. Blocks
whose first line starts with `# on NVIDIA GPU hosts` are skipped (they need a GPU or a cluster),
and so are those starting `# with the compile-only environment`: tests/aot runs those as written
where that environment exists.
Every relative link in README.md and docs/ must name a file that exists and, after `#`, one of its
headings (GitHub's anchors).
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU_MARK = "# on NVIDIA GPU hosts"
COMPILE_MARK = "# with the compile-only environment"
SHORT_STEPS = "train.steps=6"
TIMEOUT_S = 600


def documented_files(root: Path = REPO) -> list[Path]:
    """README.md, then the docs/ pages in name order: the order their commands run in."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def readme_commands(text: str, marked: str | None = None) -> list[str]:
    """The `python -m megascale_jax.*` commands of a Markdown text's code blocks, continuation
    lines joined and comments dropped, outside blocks marked as needing a GPU or the compile-only
    environment; with `marked`, those of the blocks whose first line starts with it instead."""
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
        first = lines[0] if lines else ""
        if language not in ("bash", "sh", ""):
            continue
        if (marked is None and first.startswith((GPU_MARK, COMPILE_MARK))) or (marked and not first.startswith(marked)):
            continue
        for line in "\n".join(lines).replace("\\\n", " ").splitlines():
            for part in line.split("&&"):  # the first README line installs, then trains
                command = shlex.join(shlex.split(part, comments=True))  # quoting kept: a value with spaces stays one argument
                if command.startswith("python -m megascale_jax."):
                    commands.append(command)
    return commands


def documented_commands(root: Path = REPO) -> list[str]:
    """The commands of README.md and every docs/ page, in `documented_files` order."""
    return [c for path in documented_files(root) for c in readme_commands(path.read_text())]


def test_readme_commands_are_found():
    """The parser sees the commands a user sees (a parser that finds nothing would pass vacuously)."""
    commands = documented_commands()
    modules = {shlex.split(c)[2] for c in commands}
    assert {"megascale_jax.train", "megascale_jax.launch", "megascale_jax.report", "megascale_jax.diagnose",
            "megascale_jax.flops", "megascale_jax.plan", "megascale_jax.tokenize", "megascale_jax.sample",
            "megascale_jax.export_hf"} <= modules  # most of them live in docs/ pages, not README.md
    assert not any("gpt_1b" in c for c in commands)  # the GPU blocks are skipped


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), the text possibly over several lines


def prose(text: str) -> str:
    """The text outside code blocks (where `[x](y)` is code, not a link)."""
    return "\n".join(line for i, line in enumerate(re.split(r"^```.*$", text, flags=re.M)) if i % 2 == 0)


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings: lower case, punctuation dropped, spaces as hyphens, and
    `-1`, `-2` ... after a repeated one."""
    anchors, seen = set(), {}
    for title in re.findall(r"^#{1,6} +(.+?) *#*$", prose(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_relative_link_resolves():
    """Every relative link in README.md and docs/ names a file that exists and, after `#`, one of
    its headings, so moving a section between pages cannot leave a dead link behind."""
    links, broken = 0, []
    for path in documented_files():
        for target in LINK.findall(prose(path.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            links += 1
            name, _, anchor = target.partition("#")
            dest = (path.parent / name).resolve() if name else path
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text())):
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert links > 10 and not broken, broken


def scratch_checkout(dest: Path) -> Path:
    """The tracked files of the checkout (what a user clones), nothing generated."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def chains(commands: list[str]) -> list[list[str]]:
    """The commands in groups that can run apart, README order kept inside each: a command joins
    the group of every earlier command it shares a path with that the checkout does not hold (what
    an earlier command wrote: `--out tok` then `data.path=tok/tokens.bin`, `--run-dir runs/bpe`
    then `sample runs/bpe`). A path is an argument with a `/` (or its value after `=`) or the value
    of `--out`; under `runs/` it is the run directory, elsewhere its first component."""
    groups: list[tuple[set[str], list[str]]] = []
    for command in commands:
        argv = shlex.split(command)
        # a value may hold several paths (data.mix="{'tok/tokens.bin': 0.7, ...}"): each one counts
        paths = {part for word in argv if "/" in word
                 for part in re.split(r"[{}\[\]'\",: ]+", word.split("=", 1)[-1]) if "/" in part}
        paths |= {value for option, value in zip(argv, argv[1:]) if option == "--out"}
        keys = {"/".join(p.split("/")[:2]) if p.startswith("runs/") else p.split("/")[0]
                for p in paths if not (REPO / p.split("/")[0]).exists()}
        joined = [g for g in groups if g[0] & keys]
        for g in joined:
            groups.remove(g)
        groups.append((keys.union(*(g[0] for g in joined)),
                       sorted([c for g in joined for c in g[1]] + [command], key=commands.index)))
    return sorted((g[1] for g in groups), key=lambda chain: commands.index(chain[0]))


def test_readme_chains_keep_each_command_after_the_ones_it_reads():
    """The grouping the README test runs apart: what reads an earlier command's output is in that
    command's group, after it; independent commands are apart."""
    groups = chains(documented_commands())

    def where(fragment: str) -> tuple[int, int]:  # (group, position in it) of the command holding `fragment`
        return next((g, i) for g, chain in enumerate(groups) for i, c in enumerate(chain) if fragment in c)

    for first, *then in [("megascale_jax.tokenize", "data.path=tok/tokens.bin", "sample runs/bpe"),
                         ("megascale_jax.tokenize", "--run-dir runs/mix"),  # paths inside a mapping value
                         ("--run-dir runs/llama", "export_hf runs/llama hf/llama", "model.init_from=hf/llama"),
                         ("--run-dir runs/supervised", "report runs/supervised")]:
        places = [where(first), *map(where, then)]
        assert len({g for g, _ in places}) == 1 and [i for _, i in places] == sorted(i for _, i in places), places
    assert where("--run-dir runs/exp1")[0] != where("--run-dir runs/bpe")[0] and len(groups) > 4


# Modules of the interop extra that a command needs beyond the base install.
NEEDS = {"megascale_jax.tokenize": "tokenizers", "megascale_jax.export_hf": "safetensors"}


# What a chain's run directories must hold afterwards, where a user would look (relative to the checkout).
EXPECTED_FILES = {"runs/exp1": ["metrics.jsonl"], "runs/long": ["metrics.jsonl"],
                  "runs/supervised": ["report/summary.txt", "redis/redis.log"]}
CHAINS = chains(documented_commands())


@pytest.mark.slow
@pytest.mark.parametrize("chain", CHAINS, ids=[f"{i}-{c[0].split()[2].split('.')[1]}" for i, c in enumerate(CHAINS)])
def test_readme_commands_run_as_written(tmp_path, chain):
    for module in {NEEDS[c.split()[2]] for c in chain if c.split()[2] in NEEDS}:
        pytest.importorskip(module, reason="the interop extra is not installed (pip install -e '.[interop]')")
    checkout = scratch_checkout(tmp_path / "checkout")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    if chain == CHAINS[0]:  # the README's first command in a user's environment: no XLA flags at all
        env.pop("XLA_FLAGS", None)
    # The others keep the suite's compile-time flags (conftest: they change how fast the compiled
    # code runs, not what it computes); the command lines are the documented ones, as typed.
    for command in chain:
        argv = shlex.split(command)
        argv[0] = sys.executable
        if argv[2] in ("megascale_jax.train", "megascale_jax.launch"):
            argv.append(SHORT_STEPS)
        done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{tail}"
    for run_dir, files in EXPECTED_FILES.items():
        if any(f"--run-dir {run_dir}" in c for c in chain):
            for name in files:
                assert (checkout / run_dir / name).is_file(), f"{run_dir}/{name} missing after {chain}"


def _metrics_steps(runs: Path) -> list[int]:
    return [json.loads(line)["step"] for f in runs.glob("*/metrics.jsonl") for line in f.read_text().splitlines()]


@pytest.mark.slow
def test_ctrl_c_on_the_first_command_prints_the_command_that_resumes_it(tmp_path):
    """README's first command, Ctrl-C'd once it trains: its last line is the command that resumes
    that run (the same command would start a new runs/tiny_cpu-<time>/); that command, as printed,
    continues from the saved step, and Ctrl-C'd in turn says the same command resumes it."""
    checkout = scratch_checkout(tmp_path / "checkout")
    runs = checkout / "runs"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}

    def interrupt(argv: list[str], past_step: int) -> tuple[str, str]:
        """Runs the command until a step after `past_step` is in metrics.jsonl, then sends SIGINT:
        (its last line of output, all of it)."""
        with open(tmp_path / "out.txt", "w+") as out:
            p = subprocess.Popen([sys.executable, *argv[1:]], cwd=checkout, env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
            try:
                deadline = time.time() + TIMEOUT_S
                while not any(s > past_step for s in _metrics_steps(runs)):
                    assert p.poll() is None and time.time() < deadline, (tmp_path / "out.txt").read_text()[-3000:]
                    time.sleep(0.1)
                p.send_signal(signal.SIGINT)
                assert p.wait(timeout=TIMEOUT_S) == 130, (tmp_path / "out.txt").read_text()[-3000:]
            finally:
                p.kill()
        text = (tmp_path / "out.txt").read_text()
        return text.strip().splitlines()[-1], text

    last, out = interrupt(["python", "-m", "megascale_jax.train"], past_step=0)
    step = int(re.search(r"interrupted at step (\d+); checkpoint saved — resume with: ", last)[1])
    command = last.split("resume with: ", 1)[1]
    run_dir = re.fullmatch(r"python -m megascale_jax\.train --run-dir (runs/tiny_cpu-\S+)", command)[1]
    assert (checkout / run_dir / "checkpoints" / str(step)).is_dir(), out[-3000:]

    last, out = interrupt(shlex.split(command), past_step=step)
    assert f"resumed from checkpoint step {step}" in out, out[-3000:]
    assert re.search(r"interrupted at step \d+; checkpoint saved — re-run the same command to resume$", last), out
    assert [p.name for p in runs.iterdir()] == [run_dir.split("/")[1]]  # one run directory, continued
