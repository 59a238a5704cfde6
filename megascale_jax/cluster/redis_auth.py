"""Who may use a job's Redis: the password comes from the environment or a file, never from a
command line, and every URL that is printed is safe to print.

Redis carries the rendezvous (the coordinator address every process dials), the heartbeats and
the supervisor's view of the job: whoever can write to it can send the job to a coordinator of
their choosing, hide a hang or get healthy nodes evicted. So a job's Redis always requires a
password, and a client that has none is refused before it connects:

* the embedded server (supervise/redis_server.py) gets a random password per launch, kept in a
  0600 file RUN_DIR/redis/password whose path its clients find in MEGASCALE_REDIS_PASSWORD_FILE;
* an external one is `redis://[USER@]HOST:PORT[/DB]`, or `rediss://...` for TLS with
  `?ssl_ca_certs=/path/ca.pem` (redis-py's own URL option) when its certificate is not signed by
  a CA the system trusts. USER is a Redis ACL user (Redis >= 6); the password comes from
  MEGASCALE_REDIS_PASSWORD_FILE (a Kubernetes Secret volume, a 0600 file on SLURM's shared file
  system) or MEGASCALE_REDIS_PASSWORD (a Secret as an environment variable).

Never in the URL: every URL reaches a worker on its command line, which `ps` shows to every user
of the host; a URL with a password is refused, and `redact` masks it wherever a URL is printed.
A server that accepts clients without any password is refused too: it is open to anyone.

Errors are one line naming what to set (`RedisAuthError`; the commands exit 2). The same
password keys the HMAC of the rendezvous record (rendezvous.py): only a holder of it can tell
the workers where the coordinator is.
"""

from __future__ import annotations

import os
import ssl
import urllib.parse
from typing import TYPE_CHECKING

from megascale_jax.job_key import PASSWORD_ENV, PASSWORD_FILE_ENV, JobKeyError, read_secret

if TYPE_CHECKING:  # redis is imported where it is used: a trainer without --redis never loads it
    import redis

SCHEMES = ("redis", "rediss")


class RedisAuthError(RuntimeError):
    """The job cannot use this Redis safely: a missing or wrong password, a certificate that
    fails verification, a server with no password or no ACLs. One line: what to fix."""


def redact(url: str) -> str:
    """`url` with its password, if any, replaced by `***` (for logs, events and errors)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


def password() -> str:
    """The job's Redis password: the contents of $MEGASCALE_REDIS_PASSWORD_FILE (a trailing newline
    dropped), else $MEGASCALE_REDIS_PASSWORD."""
    try:
        secret = read_secret(PASSWORD_FILE_ENV, PASSWORD_ENV, "the job's Redis password")
    except JobKeyError as e:
        raise RedisAuthError(str(e)) from None
    if not secret:
        raise RedisAuthError(f"the job's Redis needs a password: set {PASSWORD_FILE_ENV} to a file holding it "
                             f"(or {PASSWORD_ENV} to the password itself)")
    return secret


def password_source() -> str:
    """Which variable the password came from, for an error that says where to fix it."""
    return f"{PASSWORD_FILE_ENV}={os.environ[PASSWORD_FILE_ENV]}" if os.environ.get(PASSWORD_FILE_ENV) \
        else PASSWORD_ENV


def credentials_env() -> dict[str, str]:
    """The variables through which this process finds the password, for the workers it starts."""
    return {name: os.environ[name] for name in (PASSWORD_FILE_ENV, PASSWORD_ENV) if os.environ.get(name)}


def check_url(url: str) -> None:
    """A URL this job may use: redis:// or rediss://, no password in it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise RedisAuthError(f"Redis URL {redact(url)!r} must look like redis://[USER@]HOST:PORT or "
                             "rediss://[USER@]HOST:PORT?ssl_ca_certs=CA.pem")
    if parts.password is not None:
        raise RedisAuthError(f"Redis URL {redact(url)} carries a password, which `ps` shows to every user of "
                             f"the host: drop it from the URL and set {PASSWORD_FILE_ENV} (a file holding it) "
                             f"or {PASSWORD_ENV}")


def connect(url: str, timeout_s: float | None = None) -> redis.Redis:
    """A client of the job's Redis at `url`, authenticated with the job's password; `timeout_s`
    bounds each command (None: blocking waits allowed). No round trip yet: see `verify`."""
    import redis

    check_url(url)
    return redis.Redis.from_url(url, password=password(), socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s or 5.0)


def verify(client: redis.Redis, url: str) -> None:
    """One round trip that proves the job may use this Redis, or a RedisAuthError naming the fix.
    An unreachable server is left to the caller (redis.ConnectionError): it may be starting."""
    import redis

    try:
        client.ping()
        if client.connection_pool.connection_kwargs.get("username"):
            # Over RESP2 (?protocol=2) redis-py quietly retries AUTH without the user name on a
            # Redis < 6 (no ACLs), which then runs it as its one shared user; a job that names a
            # user relies on ACLs. (Over RESP3, the default, such a server refuses HELLO already.)
            client.acl_whoami()
        _refuse_if_open(url)
    except redis.AuthenticationError as e:
        raise RedisAuthError(f"Redis at {redact(url)} refused the job's password ({first_line(e)}): set the right "
                             f"one in {password_source()}") from None
    except redis.ResponseError as e:
        # HELLO (how redis-py greets with RESP3) and ACL arrived together in Redis 6.
        if "unknown command" in str(e).lower():
            raise RedisAuthError(f"Redis at {redact(url)} does not support ACLs ({first_line(e)}: Redis < 6): upgrade "
                                 "it to Redis >= 6, whose ACL users and passwords keep other jobs out") from None
        raise
    except redis.ConnectionError as e:
        if _certificate_failure(e):
            raise RedisAuthError(f"the TLS certificate of Redis at {redact(url)} failed verification "
                                 f"({_certificate_failure(e)}): renew it, or name the CA that signed it with "
                                 "?ssl_ca_certs=/path/ca.pem in the URL") from None
        raise


def _refuse_if_open(url: str) -> None:
    """A server that lets a client without a password in (its default user has `nopass`, which
    also takes any password offered) is open to every user who reaches it."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    timeout = 5.0
    try:
        redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                             retry=Retry(NoBackoff(), 0)).ping()  # a refusal is the answer: no retries
    except (redis.AuthenticationError, redis.exceptions.NoPermissionError):
        return  # closed to a client without the password, as it must be
    raise RedisAuthError(f"Redis at {redact(url)} accepts clients without a password, so anyone who reaches it "
                         "can rewrite the job's rendezvous and heartbeats: give it one (requirepass, or an ACL "
                         "user and `ACL SETUSER default off`) and hand it to the job")


def first_line(error: BaseException) -> str:
    """The first line of a server's error, for a one-line message."""
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__


def _certificate_failure(error: BaseException) -> str:
    """Why the server's certificate failed verification ('' when that is not what failed)."""
    seen = error
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen.verify_message or str(seen)
        seen = seen.__cause__ or seen.__context__
    return "certificate verify failed" if "CERTIFICATE_VERIFY_FAILED" in str(error) else ""
