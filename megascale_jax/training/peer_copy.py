"""Peer copies of memory snapshots: each process's snapshot file is also held in the RAM of another
host, so that when a machine is lost, its processes' state comes back from a peer, not from disk.

Why: a snapshot (training/snapshot.py) lives in its host's /dev/shm and dies with the machine —
the commonest fault at scale — and the job then fell back to the last disk checkpoint, redoing
every step since. Gemini (SOSP '23) and ByteRobust keep checkpoints in peers' CPU memory for this.

Who holds whose: process i's copy goes to the next process in rank order that runs on another
host (ring order: a data-parallel peer at pp = tp = 1). A host is named by `MEGASCALE_HOST` (the
local launcher sets each worker's slot, `<hostname>/slot<k>`, so that slots stand for machines),
else by the machine's hostname. With every process on one host there is no peer, and no copy.

Transport: every process serves its host's snapshot directory over TCP (a thread; the addresses
are exchanged once, through jax.distributed's key-value store: `join`), and the snapshot writer thread sends each new
file to its holder after writing it — in the background, off the training step. The holder
keeps it as `peer_process_<i>-of-<n>.npz` beside its own files, with its SHA-256 in a sidecar,
and keeps the newest `snapshot.KEEP` steps of each owner.

A copy is refused (the caller warns once and uses the next source: a local snapshot, then disk)
when it is partial (fewer bytes than announced), fails its checksum, or is stale (another step,
another config, another owner than asked for: `check_meta`).

Only the job's processes are served (job_key.py): every request carries an HMAC under the
job's key over its fields, a time and a random nonce; the server refuses, with one log line and
nothing written, a request without a valid MAC, one more than `REPLAY_WINDOW_S` off its clock, a
nonce it has seen (a replay), a header that is not JSON or longer than `MAX_HEADER`. A put's
signed header (owner, step, size, SHA-256) is what the holder keeps beside the copy, and what it
hands a restore: the checksum a restore checks is the one the owner signed, never one a server
makes up. The server listens on the address the others reach it at, not on every interface.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import socketserver
import threading
import time

from megascale_jax import cli
from megascale_jax import job_key
from megascale_jax.run_dir import HOST_ENV, SNAPSHOT_FILE, committed_steps

logger = cli.get_logger("peer_copy")

TIMEOUT_S = 60.0  # one transfer; a holder that does not answer in this long is no source
REPLAY_WINDOW_S = 120.0  # a request this far off the server's clock is refused (hosts' clocks differ a little)
MAX_HEADER = 64 << 10  # a request's JSON header, bytes
MAX_LOGGED = 100  # refusals a server logs, one line each; after that one line says it stops
DRAIN_S, DRAIN_BYTES = 2.0, 16 << 20  # what a refused client may still send before its connection closes


class Refused(Exception):
    """A peer copy that must not be restored from: partial, failing its checksum, or stale."""


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def inventory(directory: str, processes: int) -> dict[int, list[int]]:
    """{owner process: [steps]} of every snapshot file (its own or a peer copy) in `directory`
    written by a job of `processes` processes."""
    return inventory_by_count(directory).get(processes, {})


def inventory_by_count(directory: str) -> dict[int, dict[int, list[int]]]:
    """{process count: {owner process: [steps]}} of every snapshot file in `directory`: after a
    shrink (or a grow) the files of the job's previous process count are a source too."""
    held: dict[int, dict[int, list[int]]] = {}
    for step in committed_steps(directory):
        for name in sorted(os.listdir(os.path.join(directory, str(step)))):
            match = SNAPSHOT_FILE.match(name)
            if match:
                steps = held.setdefault(int(match.group(2)), {}).setdefault(int(match.group(1)), [])
                if step not in steps:
                    steps.append(step)
    return held


def newest_recoverable(reports: list[dict[int, list[int]]], processes: int, skip: set[int] = frozenset()) -> int | None:
    """The newest step of which every process's file exists somewhere (each process's
    `inventory`, in process order), not in `skip`; None when there is none — the checkpoint."""
    found = [set().union(*[r.get(p, []) for r in reports]) - set(skip) for p in range(processes)]
    common = set.intersection(*found) if found else set()
    return max(common) if common else None


def copy_name(owner: int, processes: int) -> str:
    return f"peer_process_{owner}-of-{processes}.npz"


RECORD = ".record"  # beside a copy: the owner's signed put header (its SHA-256 among its fields)


# What a shrink (or a grow) changes in a run's config: the data-parallel replicas, the microbatches
# that keep the global batch, and the simulated devices a process has. None of them changes the
# state's shapes or its stored order (ZeRO-1 shards a dimension, it pads none), so a snapshot
# written before the change is resharded onto the new mesh rather than read from disk.
RESHARDABLE = (("mesh", "dp"), ("parallel", "microbatches"), ("mesh", "cpu_devices"))


def check_meta(meta: dict, step: int, config: dict, reshard: bool = False) -> None:
    """A copy's own record against what was asked for: the step and the exact config (with
    `reshard`, the config up to the keys a shrink changes, RESHARDABLE)."""
    if meta.get("step") != step:
        raise Refused(f"stale: it holds step {meta.get('step')}, not step {step}")
    written = meta.get("config")
    if reshard and isinstance(written, dict):
        written, config = _without_reshardable(written), _without_reshardable(config)
    if written != config:
        raise Refused("stale: written with another config" + (" (beyond mesh.dp and parallel.microbatches)"
                                                              if reshard else ""))


def _without_reshardable(config: dict) -> dict:
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    for section, key in RESHARDABLE:
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out


class PeerLink:
    """This process's end of the peer copies: the server for its host's directory, the sender."""

    def __init__(self, directory: str, process: int, processes: int, keep: int, key: bytes, host: str | None = None):
        """`key`: the job's (job_key.py), which every request and copy is signed with."""
        self.directory, self.process, self.processes, self.keep, self.key = directory, process, processes, keep, key
        address = _reachable_address()
        self.server = _Server((address, 0), _Handler)  # not 0.0.0.0: only where the others reach it
        self.server.link = self
        self._nonces: dict[str, float] = {}  # seen in the replay window: nonce -> when
        self._lock = threading.Lock()
        self.refusals = 0
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name="peer-copy-server").start()
        # what the others need to know of this process: its host, and where its server listens
        self.record = json.dumps([host or host_name(), f"{address}:{self.server.server_address[1]}"])
        logger.info(f"process {process}: peer-copy server at {address}:{self.server.server_address[1]} "
                    "(requests signed with the job's key)")
        self._peers: list[tuple[str, str]] = []  # (host, address) by process

    # ------------------------------------------------------------------ who is where

    def join(self, records: list[str]) -> None:
        """Every process's `record`, in process order (exchanged by the caller)."""
        self._peers = [tuple(json.loads(r)) for r in records]

    def peers(self) -> list[tuple[str, str]]:
        return self._peers

    def holder(self) -> int | None:
        """The process that holds this one's copy: the next in ring order on another host."""
        hosts = [host for host, _ in self.peers()]
        for offset in range(1, self.processes):
            candidate = (self.process + offset) % self.processes
            if hosts[candidate] != hosts[self.process]:
                return candidate
        return None

    # ------------------------------------------------------------------ send, fetch

    def send(self, step: int, path: str) -> str | None:
        """Send this process's snapshot file of `step` to its holder; the holder's name, or None
        without one. Raises OSError when the transfer fails."""
        holder = self.holder()
        if holder is None:
            return None
        header = self.request({"op": "put", "owner": self.process, "step": step, "processes": self.processes,
                               "size": os.path.getsize(path), "sha256": sha256_file(path)})
        with _connect(self.peers()[holder][1]) as conn, open(path, "rb") as f:
            conn.sendall(json.dumps(header).encode() + b"\n")
            while block := f.read(1 << 20):
                conn.sendall(block)
            reply = conn.makefile("rb").readline()
        if json.loads(reply or b"{}").get("ok") is not True:
            raise OSError(f"process {holder} did not store it: {reply[:200]!r}")
        return f"process {holder} ({self.peers()[holder][0]})"

    def fetch(self, source: int, owner: int, step: int, target: str, processes: int | None = None) -> None:
        """Copy `owner`'s snapshot of `step`, as held by process `source`, to `target` (written to
        `.tmp`, renamed only once whole and its checksum matches); Refused or OSError if not.
        `processes`: the process count of the job that wrote it (this job's unless a shrink or a
        grow came between)."""
        processes = self.processes if processes is None else processes
        with _connect(self.peers()[source][1]) as conn:
            conn.sendall(json.dumps(self.request({"op": "get", "owner": owner, "step": step,
                                                  "processes": processes})).encode() + b"\n")
            stream = conn.makefile("rb")
            header = json.loads(stream.readline(MAX_HEADER + 1) or b"{}")
            record = header.get("record")
            if not isinstance(record, dict):
                raise Refused(f"process {source} has no copy of step {step}: {header.get('error', 'no answer')}")
            if not job_key.authentic(self.key, record):
                raise Refused(f"process {source}'s record of it is not signed with the job's key")
            if (record.get("owner"), record.get("step"), record.get("processes")) != (owner, step, processes):
                raise Refused(f"process {source} sent the record of another file: {record.get('owner')}, "
                              f"step {record.get('step')}")
            arrived, digest = _receive(stream, record["size"], target + ".tmp")
        if arrived != record["size"]:
            os.remove(target + ".tmp")
            raise Refused(f"partial: {arrived} of {record['size']} bytes arrived")
        if digest != record["sha256"]:
            os.remove(target + ".tmp")
            raise Refused("its SHA-256 does not match the one its owner signed when it was sent")
        os.replace(target + ".tmp", target)

    def request(self, fields: dict) -> dict:
        """A request's header: `fields`, a time and a nonce, signed with the job's key."""
        return job_key.signed(self.key, {**fields, "time": time.time(), "nonce": secrets.token_hex(16)})

    # ------------------------------------------------------------------ who may ask

    def admit(self, header) -> str | None:
        """Why a request must be refused, or None: its MAC, its time, its nonce (a replay)."""
        if not isinstance(header, dict) or header.get("op") not in ("put", "get"):
            return "not a request of this protocol"
        if not job_key.authentic(self.key, header):
            return "not signed with the job's key"
        now = time.time()
        sent = header.get("time")
        if not isinstance(sent, (int, float)) or abs(now - sent) > REPLAY_WINDOW_S:
            return f"sent {now - sent if isinstance(sent, (int, float)) else '?'} s off this host's clock (a replay?)"
        with self._lock:
            self._nonces = {n: t for n, t in self._nonces.items() if now - t <= 2 * REPLAY_WINDOW_S}
            if header.get("nonce") in self._nonces:
                return "a replay of a request already served"
            self._nonces[header.get("nonce")] = now
        return None

    def refuse(self, reason: str, client: str) -> None:
        """One log line a refused request (the first `MAX_LOGGED`, then one that says it stops)."""
        with self._lock:
            self.refusals += 1
            count = self.refusals
        if count <= MAX_LOGGED:
            logger.warning(f"warning: peer-copy server of process {self.process} refused a request from {client}: "
                           f"{reason}; nothing written")
        elif count == MAX_LOGGED + 1:
            logger.warning(f"warning: peer-copy server of process {self.process}: more refused requests, no longer logged")

    # ------------------------------------------------------------------ the holder's side

    def store(self, header: dict, stream) -> None:
        """A peer's file arriving (its signed header admitted): written whole to `.tmp`, then
        renamed, with the owner's signed header beside it."""
        owner, step, size = int(header["owner"]), int(header["step"]), int(header["size"])
        if not (0 <= owner < self.processes and header.get("processes") == self.processes and step >= 0 and size >= 0):
            raise ValueError(f"no process {owner} of {header.get('processes')} in this job of {self.processes}")
        path = os.path.join(self.directory, str(step), copy_name(owner, self.processes))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        arrived, digest = _receive(stream, size, path + ".tmp")
        if arrived != size or digest != header["sha256"]:
            os.remove(path + ".tmp")
            raise OSError(f"partial or damaged in transit ({arrived} of {size} bytes)")
        with open(path + RECORD, "w") as f:
            json.dump(header, f)
        os.replace(path + ".tmp", path)
        self._prune(owner)

    def _prune(self, owner: int) -> None:
        """Keep the newest `keep` steps of `owner`'s copies."""
        steps = sorted(inventory(self.directory, self.processes).get(owner, []))
        for step in steps[:-self.keep]:
            for suffix in ("", RECORD):
                try:
                    os.remove(os.path.join(self.directory, str(step), copy_name(owner, self.processes)) + suffix)
                except FileNotFoundError:
                    pass

    def serve(self, header: dict, conn) -> None:
        """Send the file of `owner` at `step` this host holds (its own or a peer copy)."""
        step, owner, processes = int(header["step"]), int(header["owner"]), int(header["processes"])
        folder = os.path.join(self.directory, str(step))
        for name in (copy_name(owner, processes), f"process_{owner}-of-{processes}.npz"):
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                continue
            # a copy: the owner's signed header, kept when it arrived; an own file: signed here
            kept = path + RECORD
            if os.path.exists(kept):
                with open(kept) as f:
                    record = json.load(f)
            else:
                record = job_key.signed(self.key, {"owner": owner, "step": step, "processes": processes,
                                                   "size": os.path.getsize(path), "sha256": sha256_file(path)})
            conn.sendall(json.dumps({"record": record}).encode() + b"\n")
            with open(path, "rb") as f:  # streamed: a snapshot can be GBs
                while block := f.read(1 << 20):
                    conn.sendall(block)
            return
        self.refuse(f"asked for process {owner}'s file of step {step}, which this host does not hold", "a job process")
        conn.sendall(json.dumps({"error": f"no file of process {owner} at step {step}"}).encode() + b"\n")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    link: PeerLink


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.connection.settimeout(TIMEOUT_S)
        link, client = self.server.link, f"{self.client_address[0]}:{self.client_address[1]}"
        try:
            line = self.rfile.readline(MAX_HEADER + 1)
            if len(line) > MAX_HEADER:
                reason = f"a header over {MAX_HEADER} bytes"
            else:
                try:
                    header = json.loads(line or b"{}")
                    reason = link.admit(header)
                except ValueError:
                    reason = "a header that is not JSON"
            if reason is not None:
                link.refuse(reason, client)
                self.wfile.write(json.dumps({"error": f"refused: {reason}"}).encode() + b"\n")
                self._drain()
                return
            if header["op"] == "put":
                link.store(header, self.rfile)
                self.wfile.write(b'{"ok": true}\n')
            else:
                link.serve(header, self.connection)
        except (OSError, ValueError, KeyError, TypeError) as e:
            link.refuse(f"{type(e).__name__}: {str(e)[:200]}", client)
            try:
                self.wfile.write(json.dumps({"error": str(e)[:300]}).encode() + b"\n")
                self._drain()
            except OSError:
                pass

    def _drain(self) -> None:
        """After a refusal: the reply sent, read (and drop) what the client is still sending, a
        little of it, so that it reads the reply rather than a reset of a connection whose unread
        bytes the kernel would answer with RST."""
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_WR)
        self.connection.settimeout(DRAIN_S)
        try:
            left = DRAIN_BYTES
            while left > 0 and (block := self.rfile.read1(min(left, 1 << 16))):
                left -= len(block)
        except OSError:
            pass


def _receive(stream, size: int, path: str) -> tuple[int, str]:
    """Up to `size` bytes of `stream` into `path`: (bytes that arrived, their SHA-256)."""
    digest, left = hashlib.sha256(), size
    with open(path, "wb") as f:
        while left > 0 and (block := stream.read(min(left, 1 << 20))):
            digest.update(block)
            f.write(block)
            left -= len(block)
    return size - left, digest.hexdigest()


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=TIMEOUT_S)


def _reachable_address() -> str:
    """The address peers reach this host at: its hostname's, or loopback on a host without one."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
