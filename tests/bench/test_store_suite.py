"""The `store` bench suite on the CPU (SimDevice): run through the runner in quick mode, its rows,
their same-run ceilings and path model, the load check, and the new disk / Redis ceilings."""

import importlib.util
import shutil
from contextlib import ExitStack

import pytest
import torch

from kvtier.bench import result
from kvtier.bench.runner import run_bench
from kvtier.bench.suite import Context

HAVE_REDIS = shutil.which("redis-server") is not None and importlib.util.find_spec("redis") is not None
TIERS = ("host", "disk", "redis") if HAVE_REDIS else ("host", "disk")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("store-suite")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTIER_BENCH_DIR", str(base / "scratch"))
        (base / "scratch").mkdir()
        r = run_bench(["store"], quick=True, out_dir=base / "results", plot=False, progress=False)
    return r, base


def test_quick_run_writes_a_valid_result_with_every_tier(run):
    r, base = run
    assert r.failed == [] and r.incorrect == []
    doc = result.load(r.path)  # validates: every row's ceiling was measured in this run
    assert doc["suites"]["store"]["status"] == "ran"
    cases = {row["case"] for row in doc["rows"]}
    for tier in TIERS:
        assert {f"save {tier}", f"load {tier}"} <= cases
    for tier in TIERS[1:]:  # the lower tiers again with a key ring: sealed, then encrypted too
        assert {f"{d} {tier} {a}" for d in ("save", "load") for a in ("mac", "encrypted")} <= cases
    auth = {row["case"]: row["params"].get("auth") for row in doc["rows"]}
    assert auth["save disk"] == "none" and auth["load disk mac"] == "mac"
    vs = {row["case"]: row["params"].get("time_vs_none") for row in doc["rows"]}
    assert vs["save disk"] is None and vs["load disk mac"] > 0 and vs["save disk encrypted"] > 0
    assert {"lookup 32K host hit", "chunk_keys 32K list"} <= cases
    assert all(row["correct"] is True for row in doc["rows"])
    ceilings = doc["environment"]["ceilings"]
    assert {"host_memcpy", "disk_write", "disk_read"} <= set(ceilings)
    if HAVE_REDIS:
        assert {"redis_loopback_set", "redis_loopback_get"} <= set(ceilings)
    else:
        skipped = {c["case"]: c["reason"] for c in doc["skipped_cases"]}
        assert "redis-server" in skipped["save redis"] or "redis-py" in skipped["save redis"]
    assert list((base / "scratch").iterdir()) == []  # the temp dir (disk tier, probes, redis) is gone


def test_tier_rows_use_the_slowest_measured_hop_and_carry_the_path_model(run):
    r, _ = run
    ceilings = r.doc["environment"]["ceilings"]
    tier_ceiling = {
        "disk": ("disk_write", "disk_read"),
        "redis": ("redis_loopback_set", "redis_loopback_get"),
    }
    for row in r.doc["rows"]:
        p = row["params"]
        if "tier" not in p:
            continue
        hops = ["host_memcpy"]  # SimDevice: the "GPU" <-> pool copy is a host memcpy
        if p["tier"] in tier_ceiling:
            hops.append(tier_ceiling[p["tier"]][p["direction"] == "load"])
        assert row["ceiling"] == min(hops, key=ceilings.get), row["case"]
        assert all(f"measured {h}" in p["path_hops"] for h in hops)
        assert p["path_predicted_gbps"] == pytest.approx(min(ceilings[h] for h in hops))
        assert p["vs_path"] == pytest.approx(row["gbps"] / p["path_predicted_gbps"])
        assert p["block_size"] == 16 and p["chunk_tokens"] == 256 and p["kv_heads"] == 8
        if p["direction"] == "load":  # every timed load read every chunk from its tier
            assert p["chunks_by_source"].split()[0] == p["tier"] and "," not in p["chunks_by_source"]
        if p["tier"] == "disk":
            assert p["disk_io"] == "O_DIRECT" or "posix_fadvise" in p["disk_io"]
            assert p["disk_fs"]


def test_lookup_rows_report_microseconds_per_chunk_and_prompt(run):
    r, _ = run
    rows = {row["case"]: row for row in r.doc["rows"]}
    for case in ("lookup 32K host hit", "chunk_keys 32K list"):
        p = rows[case]["params"]
        assert p["chunks"] == 128 and p["prompt_tokens"] == 32768 and rows[case]["bytes"] == 4 * 32768
        assert p["us_per_prompt"] == pytest.approx(rows[case]["median_ms"] * 1e3)
        assert p["us_per_chunk"] == pytest.approx(p["us_per_prompt"] / 128)
        assert rows[case]["ceiling"] == "host_memcpy"


def test_load_check_catches_wrong_bytes_and_the_wrong_tier():
    from kvtier.bench.suites.store_rig import Rig

    ctx = Context("cpu", quick=True)
    with ExitStack() as stack:
        rig = Rig(ctx, stack, layers=1, tokens=512, heads=1, head_dim=128, seed=3)
        with rig.store([]) as st:
            assert st.save(rig.tokens, rig.src).wait(10)
            assert rig.check_load(st, "host")[0]
            assert not rig.check_load(st, "disk")[0]  # the chunks came from the host, not the disk
            rig.kv.block_view(0).view(torch.uint8)[:, rig.src[5]] ^= 1  # the source moved on: stale KV
            ok, how = rig.check_load(st, "host")
            assert not ok and "equals" in how


def test_disk_ceilings_measure_a_file_in_the_given_dir_and_remove_it(tmp_path):
    ctx = Context("cpu", quick=True)
    with pytest.raises(ValueError, match="root"):
        ctx.ceiling("disk_write")  # where to write is not optional
    with pytest.raises(ValueError, match="unexpected"):
        ctx.ceiling("host_memcpy", root=tmp_path)
    assert ctx.ceiling("disk_write", nbytes=1 << 20, root=tmp_path) > 0
    assert ctx.ceiling("disk_read", nbytes=1 << 20, root=tmp_path) > 0
    assert ctx.ceiling("disk_read") == ctx.ceilings["disk_read"]  # measured once, then cached
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not HAVE_REDIS, reason="redis-server / redis-py not available")
def test_redis_ceilings_and_server(tmp_path):
    from kvtier.bench.suites.store_rig import redis_server

    with ExitStack() as stack:
        url, why = redis_server(stack, tmp_path / "redis")
        assert url is not None, why
        ctx = Context("cpu", quick=True)
        assert ctx.ceiling("redis_loopback_set", nbytes=3 << 20, url=url, part_bytes=1 << 20) > 0
        assert ctx.ceiling("redis_loopback_get", nbytes=3 << 20, url=url, part_bytes=1 << 20) > 0
        from redis import Redis

        assert Redis.from_url(url).dbsize() == 0  # the probes' keys are deleted


def test_no_redis_server_is_a_reason_not_an_error(tmp_path, monkeypatch):
    from kvtier.bench.suites import store_rig

    monkeypatch.setattr(store_rig.shutil, "which", lambda name: None)
    with ExitStack() as stack:
        url, why = store_rig.redis_server(stack, tmp_path)
    assert url is None and "redis-server is not on PATH" in why
