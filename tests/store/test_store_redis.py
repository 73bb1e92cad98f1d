"""RedisTier against a real redis-server: split chunks, sharing, corruption, kill/restart, slow,
full; its URL checked when made, a server that does not answer at start a warning (password
masked), passwords and TLS as redis-py takes them."""

import logging
import os
import shutil
import subprocess
import threading
import time

import pytest

from kvtier.store.header import ChunkHeader
from kvtier.store.redis_tier import RedisTier
from kvtier.store.tier import DestTooSmall, Tier

from store_redis_fixtures import (  # noqa: F401  (redis_server: a fixture)
    REDIS_SERVER,
    RedisClusterProcs,
    RedisServer,
    free_port,
    needs_redis,
    packs_in_place,
    redis_server,
)

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install redis)")
pytestmark = pytest.mark.redis


def chunk(i: int, n: int = 5000, salt: int = 0):
    key = i.to_bytes(16, "little")
    payload = bytes((i * 31 + j + salt) % 251 for j in range(n))
    return key, ChunkHeader.for_payload(key, payload, (n,), "uint8", "flat"), payload


def raw(server):
    return redis.Redis.from_url(server.url)


def test_small_and_split_chunks_round_trip(redis_server):  # noqa: F811
    tier = RedisTier(url=redis_server.url, part_bytes=4096, ttl_s=600)
    assert isinstance(tier, Tier)
    r = raw(redis_server)
    for i, n in enumerate((1, 3000, 4096 * 5 + 17)):
        key, header, payload = chunk(i, n)
        assert tier.get(key) is None and not tier.contains(key)
        before = r.dbsize()
        assert tier.put(key, header, payload) and tier.put(key, header, payload)
        assert r.dbsize() - before == 1 + -(-n // 4096)  # the manifest + parts; the present put left none
        got = tier.get(key)
        assert got.header == header and bytes(got.payload) == payload and tier.contains(key)
        dest = bytearray(n + 3)
        assert tier.get_into(key, dest) == header and dest[:n] == payload
    assert all(0 < r.ttl(k) <= 600 for k in r.keys("kvtier:*"))
    with pytest.raises(DestTooSmall):
        tier.get_into(chunk(2)[0], bytearray(10))
    s = tier.stats()
    assert s["puts"] == 3 and s["puts_present"] == 3 and s["misses"] == 3 and s["hits"] == 6
    assert tier.delete(chunk(2)[0]) and r.dbsize() == 4 and tier.get(chunk(2)[0]) is None


def test_a_one_value_chunk_of_an_earlier_writer_is_read(redis_server):  # noqa: F811
    tier = RedisTier(url=redis_server.url, part_bytes=4096)
    key, header, payload = chunk(7, 3000)
    raw(redis_server).set(f"kvtier:{key.hex()}", b"S" + header.pack() + payload)
    dest = bytearray(3000)
    assert tier.get_into(key, dest) == header and dest == payload
    assert tier.put(key, header, payload) and tier.stats()["puts_present"] == 1
    assert raw(redis_server).dbsize() == 1  # the present put's part was removed


def test_a_chunk_saved_by_one_host_is_loaded_by_another(redis_server):  # noqa: F811
    host_a = RedisTier(url=redis_server.url, part_bytes=4096)
    host_b = RedisTier(url=redis_server.url, part_bytes=8192)  # part size is read from the manifest
    key, header, payload = chunk(7, 30_000)
    assert host_a.put(key, header, payload)
    assert bytes(host_b.get(key).payload) == payload
    assert host_b.put(key, header, payload) and host_b.stats()["puts_present"] == 1


@pytest.mark.parametrize("damage", ["garbage", "payload_bit", "missing_part", "short_part", "foreign"])
def test_corrupt_values_are_misses_and_dropped(redis_server, damage):  # noqa: F811
    tier = RedisTier(url=redis_server.url, part_bytes=4096)
    r = raw(redis_server)
    key, header, payload = chunk(1, 3000 if damage in ("garbage", "payload_bit", "foreign") else 20_000)
    tier.put(key, header, payload)
    name = "kvtier:" + key.hex()
    parts = sorted(k for k in r.keys("kvtier:*") if k != name.encode())
    if damage == "garbage":
        r.set(name, b"S" + os.urandom(100))
    elif damage == "payload_bit":
        value = bytearray(r.get(name))
        value[-5] ^= 1
        r.set(name, bytes(value))
    elif damage == "missing_part":  # what a server-side LRU eviction of one part looks like
        r.delete(parts[2])
    elif damage == "short_part":
        r.set(parts[0], b"x" * 10)
    else:
        k2, h2, p2 = chunk(2, 3000)
        r.set(name, b"S" + h2.pack() + p2)
    assert tier.get(key) is None
    assert tier.stats()["errors_corrupt"] == 1
    assert r.get(name) is None  # dropped, so the next put can store it again
    assert tier.put(key, header, payload) and bytes(tier.get(key).payload) == payload


def test_concurrent_writers_of_one_key_never_mix_bytes(redis_server):  # noqa: F811
    tiers = [RedisTier(url=redis_server.url, part_bytes=4096, name=f"t{i}") for i in range(4)]
    versions = [chunk(5, 40_000, salt=s) for s in range(4)]  # same key, different bytes
    for _ in range(5):
        threads = [threading.Thread(target=t.put, args=v) for t, v in zip(tiers, versions, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # all writers done before the read that judges them
        got = bytes(tiers[0].get(versions[0][0]).payload)
        assert any(got == v[2] for v in versions)
        tiers[0].delete(versions[0][0])
    r = raw(redis_server)
    assert r.dbsize() == 0  # losers removed their own parts


def test_server_killed_mid_run_then_restarted(redis_server):  # noqa: F811
    tier = RedisTier(
        url=redis_server.url, part_bytes=4096, timeout_s=0.2, failure_threshold=3, cooldown_s=0.2
    )
    stop = threading.Event()
    errors, wrong, counts = [], [], {"ok_get": 0, "none": 0}

    def worker(seed):
        i = seed
        while not stop.is_set():
            i += 4
            key, header, payload = chunk(i % 50, 6000)
            try:
                tier.put(key, header, payload)
                got = tier.get(key)
            except Exception as exc:  # the point of the test: nothing may escape a tier
                errors.append(exc)
                return
            if got is None:
                counts["none"] += 1
            elif bytes(got.payload) != payload:
                wrong.append(key)
            else:
                counts["ok_get"] += 1

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # workers run against a live server first
    redis_server.kill()
    time.sleep(0.6)  # against a dead one: errors, then the breaker skips it
    down = tier.stats()
    redis_server.restart()  # same port, empty: what was stored before is simply gone
    time.sleep(1.0)  # past the cooldown: probes succeed and hits come back
    stop.set()
    for t in threads:
        t.join()  # workers finished before their results are read
    assert not errors and not wrong
    assert down["errors_error"] > 0 and down["errors_skipped"] > 0  # failed, then skipped
    after = tier.stats()
    assert after["hits"] > down["hits"]  # recovered after the restart
    key, header, payload = chunk(999)
    assert tier.put(key, header, payload) and bytes(tier.get(key).payload) == payload


def test_slow_server_times_out_into_a_miss_and_is_skipped(redis_server):  # noqa: F811
    tier = RedisTier(url=redis_server.url, timeout_s=0.1, failure_threshold=2, cooldown_s=0.3)
    key, header, payload = chunk(1)
    assert tier.put(key, header, payload)
    sleeper = threading.Thread(target=lambda: raw(redis_server).execute_command("DEBUG", "SLEEP", "1.5"))
    sleeper.start()
    time.sleep(0.4)  # DEBUG SLEEP must hold the server before our gets (a loaded CI host starts it late)
    t0 = time.perf_counter()
    assert tier.get(key) is None and tier.get(key) is None  # two timeouts open the breaker
    assert tier.get(key) is None  # skipped: no network, no timeout
    assert time.perf_counter() - t0 < 1.0  # two 0.1 s timeouts and a skip, not three server waits
    s = tier.stats()
    assert s["errors_timeout"] == 2 and s["errors_skipped"] == 1 and s["read_skipping"] == 1
    sleeper.join()  # server responsive again before the recovery check
    time.sleep(0.35)  # past the cooldown: the next get is the probe
    assert bytes(tier.get(key).payload) == payload and tier.stats()["read_skipping"] == 0


def test_full_server_fails_puts_cleanly(redis_server):  # noqa: F811
    r = raw(redis_server)
    r.config_set("maxmemory", 3 * 1024 * 1024)
    r.config_set("maxmemory-policy", "noeviction")
    tier = RedisTier(url=redis_server.url, part_bytes=64 * 1024)
    stored = []
    for i in range(40):
        key, header, payload = chunk(i, 200_000)
        if tier.put(key, header, payload):
            stored.append(i)
    s = tier.stats()
    assert stored and len(stored) < 40 and s["errors_full"] > 0
    assert s["write_skipping"] == 0  # a full server is not a broken one
    parts_per_chunk = 1 + -(-200_000 // (64 * 1024))
    assert r.dbsize() == len(stored) * parts_per_chunk  # failed puts left no orphan parts
    for i in stored:
        assert bytes(tier.get(chunk(i)[0]).payload) == chunk(i, 200_000)[2]


def test_arguments(redis_server):  # noqa: F811
    with pytest.raises(ValueError, match="client or url"):
        RedisTier()
    with pytest.raises(ValueError, match="part_bytes"):
        RedisTier(url=redis_server.url, part_bytes=10)
    with pytest.raises(ValueError, match="ttl_s"):
        RedisTier(url=redis_server.url, ttl_s=0)
    tier = RedisTier(url=redis_server.url)
    with pytest.raises(ValueError, match="key"):
        tier.get(b"k")


@pytest.mark.parametrize(
    "url, what",
    [
        ("http://127.0.0.1:6379/0", "scheme"),
        ("redis://127.0.0.1:sixty/0", "port"),
        ("redis://127.0.0.1:70000/0", "port"),
        ("redis://my cache:6379/0", "host"),
        ("redis://:6379/0", "host"),
        ("redis://127.0.0.1:6379/-1", "db index"),
        ("redis://127.0.0.1:6379/zero", "db index"),
        ("redis://127.0.0.1:6379/0?db=x", "db"),
        ("unix://", "socket"),
    ],
)
def test_a_bad_url_is_refused_when_made_naming_it(url, what):
    with pytest.raises(ValueError, match=f"url=.*{what}"):
        RedisTier(url=url)


def test_errors_and_url_mask_the_password():
    with pytest.raises(ValueError) as err:
        RedisTier(url="redis://admin:hunter2@127.0.0.1:port/0")
    assert "hunter2" not in str(err.value) and "redis://admin:***@127.0.0.1:port/0" in str(err.value)
    with pytest.raises(ValueError) as err:
        RedisTier(url="http://127.0.0.1/0?password=hunter2")
    assert "hunter2" not in str(err.value) and "password=***" in str(err.value)


def _start_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "at start" in r.getMessage()
    ]


@needs_redis
def test_no_server_at_start_is_a_warning_then_it_reconnects(tmp_path, caplog):
    port = free_port()
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        tier = RedisTier(url=url, timeout_s=1.0, cooldown_s=0.3)  # nothing listens there yet
    (warning,) = _start_warnings(caplog)
    assert f"redis://:***@127.0.0.1:{port}/0" in warning and "ConnectionError" in warning
    assert "hunter2" not in caplog.text and tier.url == f"redis://:***@127.0.0.1:{port}/0"
    key, header, payload = chunk(3)
    assert not tier.put(key, header, payload) and tier.get(key) is None
    s = tier.stats()  # both skipped by the open breakers: a miss at once, no connection tried
    assert s["read_skipping"] == 1 and s["write_skipping"] == 1 and s["errors_skipped"] == 2
    server = RedisServer(tmp_path / "late", port=port, password="hunter2").start()
    try:
        deadline = time.monotonic() + 10
        while not tier.put(key, header, payload):  # each try past the cooldown is the breaker's probe
            assert time.monotonic() < deadline, "the tier did not reconnect to a server that came up"
            time.sleep(0.1)  # the breaker's cooldown, not a guess at the server's start
        assert bytes(tier.get(key).payload) == payload
    finally:
        server.stop()


@needs_redis
def test_wrong_password_or_db_at_start_is_a_warning_and_a_miss(tmp_path, caplog):
    server = RedisServer(tmp_path / "auth", password="s3cret").start()
    base = f"127.0.0.1:{server.port}"
    try:
        for url, what in (
            (f"redis://:wrong@{base}/0", "AuthenticationError"),
            (f"redis://{base}/0", "AuthenticationError"),  # no password for a server that wants one
            (f"redis://:s3cret@{base}/99", "DB index is out of range"),
        ):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvtier"):
                tier = RedisTier(url=url)
            (warning,) = _start_warnings(caplog)
            assert what in warning and "s3cret" not in caplog.text and "wrong" not in caplog.text
            key, header, payload = chunk(4)
            assert not tier.put(key, header, payload) and tier.get(key) is None
            tier.close()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            tier = RedisTier(url=server.url)  # the right password, as redis-py takes it in the URL
        assert not _start_warnings(caplog)
        key, header, payload = chunk(5, 20_000)
        assert tier.put(key, header, payload) and bytes(tier.get(key).payload) == payload
        assert tier.url == f"redis://:***@{base}/0"
        tier.close()
    finally:
        server.stop()


def _tls_files(d) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1, made with openssl."""

    def run(*args: str) -> None:
        subprocess.run(
            ["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60, stdin=subprocess.DEVNULL
        )

    key = ("-newkey", "rsa:2048", "-nodes", "-days", "1")
    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=kvtier-test-ca")
    run("req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "san.cnf",
    )  # fmt: skip
    return {name: str(d / name) for name in ("ca.crt", "server.crt", "server.key")}


@needs_redis
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not on PATH")
def test_rediss_with_a_password_works_as_redis_py_takes_it(tmp_path, caplog):
    files = _tls_files(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--tls-cert-file", files["server.crt"], "--tls-key-file", files["server.key"],
         "--tls-ca-cert-file", files["ca.crt"], "--tls-auth-clients", "no", "--requirepass", "t1s",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"rediss://:t1s@127.0.0.1:{port}/0?ssl_ca_certs={files['ca.crt']}"
    try:
        deadline = time.monotonic() + 10
        while True:  # polled until the TLS listener answers: a test must not race the server's start
            if proc.poll() is not None:
                pytest.skip(f"redis-server without TLS here: {proc.stderr.read().decode(errors='replace')}")
            try:
                if redis.Redis.from_url(url, socket_timeout=1).ping():
                    break
            except redis.RedisError:
                assert time.monotonic() < deadline, "the TLS redis-server did not answer"
                time.sleep(0.05)
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            tier = RedisTier(url=url, part_bytes=4096)
        assert not _start_warnings(caplog) and tier.url.startswith("rediss://:***@127.0.0.1")
        key, header, payload = chunk(6, 30_000)
        assert tier.put(key, header, payload) and bytes(tier.get(key).payload) == payload
        tier.close()
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            plain = RedisTier(url=f"redis://:t1s@127.0.0.1:{port}/0")  # TLS port, no TLS: no answer
        assert _start_warnings(caplog) and plain.get(key) is None
        plain.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)  # reaped before tmp_path goes


@needs_redis
def test_a_cluster_down_at_start_is_a_warning_then_reached(tmp_path, caplog):
    cluster = RedisClusterProcs(tmp_path)
    cluster._make_nodes(0)  # the nodes' ports, before any of them runs
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            tier = RedisTier(url=cluster.url, cluster=True, timeout_s=2.0, cooldown_s=0.2)
        assert len(_start_warnings(caplog)) == 1
        key, header, payload = chunk(7, 9000)
        assert not tier.put(key, header, payload) and tier.get(key) is None
        cluster._join(timeout_s=30.0)
        deadline = time.monotonic() + 20
        while not tier.put(key, header, payload):  # the breaker's probe reaches the cluster once it is up
            assert time.monotonic() < deadline, "the tier did not reach the cluster once it was up"
            time.sleep(0.2)  # the breaker's cooldown
        assert bytes(tier.get(key).payload) == payload
        tier.close()
    finally:
        cluster.stop()


def test_a_put_sends_its_value_from_the_callers_memory(redis_server):  # noqa: F811
    from kvtier.store.redis_client import make_client

    client = make_client(redis_server.url)
    try:
        assert packs_in_place(client.connection_pool)
    finally:
        client.close()
