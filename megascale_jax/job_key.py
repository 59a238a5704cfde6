"""The job's own key: what authenticates the data its processes send each other outside Redis —
peer copies of memory snapshots (training/peer_copy.py) and the executables process 0 hands the
others through jax.distributed's key-value store (training/compile_cache.py). Neither channel
authenticates its clients by itself: a snapshot server is a TCP port, and JAX's coordination
service lets anyone who reaches it read and write keys.

Where the key comes from, first found:
* `$MEGASCALE_JOB_KEY_FILE`: a file holding the job's secret (a 0600 file on the job's shared file
  system, a Kubernetes Secret volume), or `$MEGASCALE_JOB_KEY` the secret itself;
* the job's Redis password (`cluster/redis_auth.py`): every supervised job has one (`launch`
  makes a random one per launch), so a job under the supervisor needs nothing more.
The secret itself never travels: the key is HMAC-SHA256(secret, a fixed label), and every
message carries an HMAC-SHA256 under that key. Without a key a job of several processes shares
neither (`None`: peer copies off, each process compiles for itself), and says so once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

KEY_FILE_ENV = "MEGASCALE_JOB_KEY_FILE"
KEY_ENV = "MEGASCALE_JOB_KEY"
# The job's Redis password (cluster/redis_auth.py, which reads it through `read_secret` too).
PASSWORD_FILE_ENV = "MEGASCALE_REDIS_PASSWORD_FILE"
PASSWORD_ENV = "MEGASCALE_REDIS_PASSWORD"
LABEL = b"megascale_jax job key v1"
HOW = (f"set {KEY_FILE_ENV} to a file holding a secret every process of the job can read (or {KEY_ENV}), "
       "or run under python -m megascale_jax.launch")


class JobKeyError(RuntimeError):
    """A secret is named but cannot be read: one line naming what to fix."""


def read_secret(file_env: str, env: str, what: str) -> str | None:
    """The contents of the file $`file_env` names (a trailing newline dropped), else $`env`; None
    where neither is set. JobKeyError (one line) for a file that cannot be read or is empty."""
    path = os.environ.get(file_env)
    if path:
        try:
            with open(path) as f:
                secret = f.read().rstrip("\r\n")
        except OSError as e:
            raise JobKeyError(f"cannot read {file_env}={path} ({e.strerror}): point it at the file holding "
                              f"{what}") from None
        if not secret:
            raise JobKeyError(f"{file_env}={path} is empty: write {what} into it")
        return secret
    return os.environ.get(env) or None


def job_key() -> bytes | None:
    """The job's key, or None where the environment names no secret."""
    secret = (read_secret(KEY_FILE_ENV, KEY_ENV, "the job's secret")
              or read_secret(PASSWORD_FILE_ENV, PASSWORD_ENV, "the job's Redis password"))
    return None if secret is None else hmac.new(secret.encode(), LABEL, hashlib.sha256).digest()


def sign(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verify(key: bytes, message: bytes, mac) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(sign(key, message), mac)


def canonical(record: dict) -> bytes:
    """A record's bytes as signed: its fields but the MAC, in key order."""
    return json.dumps({k: v for k, v in record.items() if k != "mac"}, sort_keys=True, separators=(",", ":")).encode()


def signed(key: bytes, record: dict) -> dict:
    return {**record, "mac": sign(key, canonical(record))}


def authentic(key: bytes, record: dict) -> bool:
    return verify(key, canonical(record), record.get("mac"))
