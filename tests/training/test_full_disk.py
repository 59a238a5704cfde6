"""A full disk, said once and nothing lost (issue 59): the run's checkpoints on a small tmpfs the
test mounts in a mount namespace of its own (`unshare -rm`: no root needed, nothing outside it
sees the mount; skipped where the kernel refuses one). What a user types, from a scratch
directory: one line before the first step when the kept checkpoints cannot fit; one warning
line per failed save (orbax's threads' tracebacks not printed), training going on; a final save
that fails ends with exit 5 and one line naming the newest good checkpoint."""

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["train.steps=6", "checkpoint.every=2", "checkpoint.dir=small/ckpt", "model.layers=1", "model.d_model=32",
        "train.eval_batches=0", "data.val_fraction=0", "train.compile_cache=false", "train.sample_at_end=0"]


def on_small_disk(tmp_path, size: str, *overrides: str, filled_kib: int = 0) -> subprocess.CompletedProcess:
    """`train` with `small/` a tmpfs of `size` (`filled_kib` of it taken by a file first)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a small filesystem")
    (tmp_path / "small").mkdir()
    run_dir = [] if "--run-dir" in overrides else ["--run-dir", "run"]
    train = " ".join([sys.executable, "-m", "megascale_jax.train", *run_dir, *TINY, *overrides])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs small || exit 97; "
                           f"head -c {filled_kib * 1024} /dev/zero > small/filler; "
                           f"exec {train}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 97 or "unshare: " in done.stderr:
        pytest.skip(f"this kernel refuses a mount namespace: {done.stderr.strip()[:200]}")
    return done


def lines(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if not line.startswith("step ")]


@pytest.mark.slow
def test_a_final_save_on_a_full_disk_exits_5_naming_the_newest_good_checkpoint(tmp_path):
    # 1,050 KiB with checkpoint.keep=2 (orbax deletes nothing while fewer are kept): the check passes
    # (3 x ~0.33 MiB of state), step 2's checkpoint (~0.55 MiB with orbax's files) fits, step 4's
    # fits or not by a few KiB (orbax's metadata varies), step 6's cannot.
    done = on_small_disk(tmp_path, "1050k", "checkpoint.keep=2")
    assert done.returncode == 5, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "never awaited" not in done.stderr, done.stderr[-3000:]
    *warned, error = lines(done)
    # failed in orbax's background write, or in its save() itself ("not saved"): either way one line
    said = re.compile(r"warning: checkpoint at step (\d+) (failed in the background|not saved): no space left on the "
                      r"disk of ")
    assert all(said.match(line) for line in warned), warned
    failed = [int(said.match(line).group(1)) for line in warned]
    assert failed in ([6], [4, 6]), warned
    good = 2 if 4 in failed else 4
    assert all(line.endswith(f"training continues, last good checkpoint: step {min(good, step - 2)}")
               for line, step in zip(warned, failed)), warned
    assert error.startswith("error: the final checkpoint (step 6) was not saved: no space left on the disk of")
    assert f"the newest saved state is the checkpoint of step {good} in" in error and "run the same command again" in error


def test_kept_checkpoints_that_cannot_fit_are_refused_before_the_first_step(tmp_path):
    done = on_small_disk(tmp_path, "300k")
    assert done.returncode == 2
    assert lines(done) == [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    (line,) = lines(done)
    assert "checkpoint.keep=3 checkpoints of" in line and "lower checkpoint.keep, or set checkpoint.dir" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step


@pytest.mark.slow
def test_a_run_directory_on_a_full_disk_is_one_warning_a_file_and_training_ends_well(tmp_path):
    # The run directory on a 48 KiB tmpfs, 28 of it taken, the checkpoints elsewhere: the timings,
    # TensorBoard's events and metrics.jsonl each stop fitting at some step (snapshots:
    # test_snapshot.py). tensorboardX's own SummaryWriter hung the loop here (its writer thread
    # died, its queue filled).
    done = on_small_disk(tmp_path, "48k", "--run-dir", "small/run", "train.steps=60", "checkpoint.every=60",
                         "checkpoint.dir=ckpt", "train.log_every=20", filled_kib=28)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr[-3000:]
    warned = [line for line in lines(done) if line.startswith("warning: ")]
    assert len(warned) == len(set(warned)) == len(lines(done)), lines(done)  # each said once, nothing else
    said = " ".join(warned)
    for what in ("small/run/timings/process-0.csv", "small/run/tensorboard", "small/run/metrics.jsonl"):
        assert f"cannot write {what}: no space left on its disk" in said or \
            f"cannot append to {what}: no space left on its disk" in said, (what, warned)
    assert (tmp_path / "ckpt" / "60").is_dir()  # the final checkpoint, on a disk with room
