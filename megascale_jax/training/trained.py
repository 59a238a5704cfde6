"""The parameters a run trained: its newest committed checkpoint (or step N), read onto one
device in canonical layer order, whatever mesh and pipeline layout wrote it.

This is how a run's model leaves the run: `python -m megascale_jax.export_hf` and `python -m
megascale_jax.sample` start here. Only the parameters are read (not the optimizer's moments) and
their checksums are verified. What the model is comes from the checkpoint itself (the config its
`meta` item was written with), so a `config.yaml` a later command rewrote cannot make a healthy
checkpoint unreadable; the run's `config.yaml` is the fallback for checkpoints without it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from megascale_jax import run_dir as run_dirs
from megascale_jax.config import Config, ConfigError, from_dict, load_config
from megascale_jax.training.checkpoint import Checkpointer, CorruptCheckpoint, saved_config
from megascale_jax.training.state import abstract_state


@dataclasses.dataclass(frozen=True)
class Trained:
    cfg: Config  # the run's config
    params: Any  # float32 arrays on one device, layers in canonical (network) order
    step: int  # the checkpoint's step: updates applied


def run_config(run_dir: str) -> Config:
    """The config a run was started with (its `config.yaml`), checked as far as sizing needs:
    the data it read need not exist here."""
    path = run_dirs.config_path(run_dir)
    if not os.path.isdir(run_dir):
        raise ConfigError(f"run directory {run_dir!r} does not exist; pass the --run-dir of a training run")
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir!r} has no config.yaml; pass the run directory of `python -m megascale_jax.train`")
    return load_config(path, planning=True)


def load(run_dir: str, step: int | None = None, warn=lambda line: None) -> Trained:
    """The run's parameters at checkpoint `step`, default the newest committed one that reads: an
    unreadable newest checkpoint is one `warn` line and the one before it is used (as `train`
    resumes, but nothing is moved aside: this only reads). An unreadable `step` asked for by
    number is a ConfigError naming the steps there are."""
    cfg = run_config(run_dir)
    directory = run_dirs.checkpoint_dir(cfg, run_dir)
    steps = run_dirs.committed_steps(directory)
    if not steps:
        raise ConfigError(f"{run_dir!r} has no committed checkpoint in {directory}; train with checkpoint.every > 0")
    if step is not None and step not in steps:
        raise ConfigError(f"--step {step}: no committed checkpoint at that step in {directory} "
                          f"(committed: {', '.join(map(str, steps))})")
    single = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    checkpointer = Checkpointer(cfg, directory, warn)
    for tried in ([step] if step is not None else steps[::-1]):
        written = model_of(cfg, directory, tried)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=single),
                                abstract_state(written))
        try:
            params = checkpointer.restore_params(tried, abstract)
        except CorruptCheckpoint as e:
            older = [s for s in steps if s < tried]
            if step is not None or not older:
                raise ConfigError(f"checkpoint step {tried} in {directory} is unreadable: {e}"
                                  + (f"; pass --step with an older one ({', '.join(map(str, older))})" if older else "")
                                  ) from None
            warn(f"warning: checkpoint step {tried} in {directory} is unreadable: {e}; using step {older[-1]}, "
                 "the newest before it (--step N picks another)")
            continue
        return Trained(cfg=written, params=params, step=tried)
    raise AssertionError("unreachable: the loop returns or raises")


def model_of(cfg: Config, directory: str, step: int) -> Config:
    """`cfg` with the model (and optimizer: the state's shapes) checkpoint `step` was written with,
    from its `meta` item; `cfg` itself where the checkpoint has none this version can read."""
    saved = saved_config(directory, step)
    try:
        written = from_dict(saved) if saved is not None else None
    except (ConfigError, TypeError):  # a key an older or newer version named otherwise
        written = None
    return cfg if written is None else dataclasses.replace(cfg, model=written.model, optim=written.optim)
