"""Real redis-server processes for the store tests, on free loopback ports in a tmp dir.

Import the fixtures into a test module (``from store_redis_fixtures import redis_server``);
tests skip with a clear reason when ``redis-server`` is not installed. To test against Valkey,
set ``KVTIER_REDIS_SERVER=valkey-server KVTIER_REDIS_CLI=valkey-cli``.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which(os.environ.get("KVTIER_REDIS_SERVER", "redis-server"))
REDIS_CLI = shutil.which(os.environ.get("KVTIER_REDIS_CLI", "redis-cli"))
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None or REDIS_CLI is None,
    reason="redis-server / redis-cli not on PATH (apt-get install redis-server)",
)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(with_bus: bool = False) -> int:
    """A free loopback port; ``with_bus``: port + 10000 (the cluster bus) is free too.

    Cluster ports come from 12000-22767, so port and bus (22000-32767) both lie below Linux's
    ephemeral range (32768+): no outgoing connection can take them before the node binds.
    """
    for _ in range(200):
        if with_bus:
            port = random.randrange(12000, 22768)
            if _bindable(port) and _bindable(port + 10000):
                return port
            continue
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    raise RuntimeError("no free loopback port found")


class RedisServer:
    """One redis-server process; ``kill`` and ``restart`` keep the port (and lose the data).
    password: the server's ``requirepass`` (its ``url`` then carries it)."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        password: str | None = None,
    ) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_port(with_bus="--cluster-enabled" in extra_args)
        self.password = password
        self.extra_args = extra_args + (("--requirepass", password) if password else ())
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        args += [
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.dir / "redis.log"),
            "--enable-debug-command",
            "local",
        ]
        self.proc = subprocess.Popen(
            [*args, *self.extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout_s
        # Wait until it answers PING: a test that starts before the listener would see a "dead tier".
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode(errors='replace')}")
            if self.cli("PING", check=False) == "PONG":
                return self
            time.sleep(0.02)  # poll, not a fixed delay: a slow CI host just takes longer
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s}s")

    def cli(self, *args: str, check: bool = True, timeout_s: float = 10.0) -> str:
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        done = subprocess.run(
            [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *auth, *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if check and done.returncode:
            raise RuntimeError(f"redis-cli {args}: {done.stderr}")
        return done.stdout.strip()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()  # the port must be released before a restart binds it again
        self.proc = None

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)  # reap it, so no zombie outlives the test
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli not on PATH (apt-get install redis-server)")
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def packs_in_place(pool) -> bool:
    """Whether a connection of redis-py ``pool`` hands a large value to the socket as the
    caller's memory (no copy of it)."""
    conn = pool.get_connection()
    try:
        value = memoryview(bytearray(100_000))
        return any(part is value for part in conn.pack_command("SET", "k", value))
    finally:
        pool.release(conn)


class RedisClusterProcs:
    """Three masters on loopback, no replicas, all 16384 slots assigned."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.nodes: list[RedisServer] = []

    def _make_nodes(self, attempt: int) -> None:
        self.nodes = []
        for i in range(3):
            extra = (
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            )
            self.nodes.append(RedisServer(self.root / f"try{attempt}" / f"node{i}", extra_args=extra))

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0, attempts: int = 3) -> RedisClusterProcs:
        """Start three fresh nodes and join them; a join that stalls is retried on new ports."""
        errors = []
        for attempt in range(attempts):
            self._make_nodes(attempt)
            try:
                return self._join(timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                errors.append(f"attempt {attempt}: {exc}")
                self.stop()  # a half-joined cluster must not hold its ports into the next try
        raise RuntimeError("redis cluster did not come up: " + "; ".join(errors))

    def _join(self, timeout_s: float) -> RedisClusterProcs:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        # redis-cli waits for the join over the cluster bus; a loaded CI host can take seconds.
        self.nodes[0].cli(
            "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes", timeout_s=timeout_s
        )
        deadline = time.monotonic() + timeout_s
        # Wait for every node to agree the cluster is up: slots are gossiped, not instant.
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False) for n in self.nodes):
                return self
            time.sleep(0.05)  # gossip needs a moment; polled until every node agrees
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli not on PATH (apt-get install redis-server)")
    cluster = RedisClusterProcs(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
