"""The load / recompute / split planner: hand-computed cases, edge cases, the CLI."""

import json

import pytest
from click.testing import CliRunner

from kvtier.ceilings import Ceilings
from kvtier.cli import cli
from kvtier.cli import plan as _  # noqa: F401  (registers the command)
from kvtier.models import get_model
from kvtier.planner import overlap, plan, tier_path, transfer_parts
from kvtier.roofline import prefill
from kvtier.specs import get_gpu

M, G = get_model("llama-3-8b"), get_gpu("h200")
KV = 131072  # Llama-3-8B bf16 KV bytes per token, all layers


def pre(tokens, prefix=0):
    return prefill(M, G, tokens, prefix).ms


def test_overlap_is_a_two_stage_layer_pipeline():
    assert overlap(0.0, 5.0, 4) == 5.0  # nothing to load
    assert overlap(8.0, 4.0, 4) == 8.0 + 1.0  # load-bound: the last layer's compute after the load
    assert overlap(4.0, 8.0, 4) == 1.0 + 8.0  # compute-bound: waits only for the first layer


def test_host_load_by_hand():
    """8192 tokens from the host of an H200: 1 GiB over PCIe Gen5 at 50 GB/s + 10.1 us of latency."""
    p = plan("llama-3-8b", "h200", "host", 8192, 64)
    x = 8192 * KV / 50e9 * 1e3 + (0 + 10 + 0.1) / 1e3
    c = pre(64, 8192)
    assert p.options["load"].load_ms == pytest.approx(x)
    assert p.predicted_ms["load"] == pytest.approx(max(x + c / 32, x / 32 + c))
    assert p.predicted_ms["recompute"] == pytest.approx(pre(8256))
    assert p.path.bottleneck.name.startswith("PCIe Gen5")
    assert p.predicted_ms["load"] < p.predicted_ms["recompute"] / 5  # P8's regime: loading wins by far


def test_split_is_the_best_chunk_boundary_and_its_formula():
    p = plan("llama-3-8b", "h200", "disk", 8192, 64)
    assert p.choice == "split" and p.split_tokens % 256 == 0 and 0 < p.split_tokens < 8192
    c, path = pre(64, 8192), tier_path(G, "disk")

    def at(s):  # [0, s) beside the disk read of [s, n), then its copies layer by layer under the tail
        nbytes = (8192 - s) * KV
        read = nbytes / (path.hops[0].gbps * 1e9) * 1e3 + path.hops[0].latency_us / 1e3
        copy = (
            nbytes / (min(h.gbps for h in path.hops[1:]) * 1e9) * 1e3
            + sum(h.latency_us for h in path.hops[1:]) / 1e3
        )
        return max(pre(s), read) + overlap(copy, c, 32)

    assert p.predicted_ms["split"] == pytest.approx(at(p.split_tokens))
    assert all(at(s) >= p.predicted_ms["split"] - 1e-9 for s in range(256, 8192, 256))
    assert p.ms == min(v for v in p.predicted_ms.values() if v is not None)
    assert p.ms <= 0.8 * min(p.predicted_ms["load"], p.predicted_ms["recompute"])  # the split's margin
    # both sides are busy: neither a chunk more nor a chunk less of recompute helps
    assert at(p.split_tokens - 256) > p.ms and at(p.split_tokens + 256) > p.ms


def test_a_lower_tier_is_read_before_its_copies_and_the_host_pipelines_whole():
    disk, host = tier_path(G, "disk"), tier_path(G, "host")
    nbytes = 8192 * KV
    read, copy = transfer_parts(disk, 8192, KV)
    assert read == pytest.approx(nbytes / (disk.hops[0].gbps * 1e9) * 1e3 + disk.hops[0].latency_us / 1e3)
    rest = disk.hops[1:]  # host DRAM, PCIe, HBM: the copies
    assert copy == pytest.approx(
        nbytes / (min(h.gbps for h in rest) * 1e9) * 1e3 + sum(h.latency_us for h in rest) / 1e3
    )
    assert transfer_parts(host, 8192, KV) == (0.0, host.transfer_ms(nbytes))
    assert transfer_parts(disk, 0, KV) == (0.0, 0.0)
    o = plan("llama-3-8b", "h200", "disk", 8192, 64).options["load"]
    # the new tokens' layers cannot start before the whole read is done: they pipeline with the copies
    assert o.ms == pytest.approx(read + overlap(copy, o.new_ms, 32)) and o.load_ms == pytest.approx(
        read + copy
    )
    assert o.ms > overlap(disk.transfer_ms(nbytes), o.new_ms, 32)  # slower than one pipelined transfer


def test_no_hit_means_recompute_with_nothing_to_load():
    p = plan("llama-3-8b", "h200", "host", 0, 100)
    assert p.choice == "recompute" and p.split_tokens == 0
    assert p.predicted_ms == {"load": None, "recompute": pytest.approx(pre(100)), "split": None}
    assert "no prefix hit" in " ".join(p.reasons)


def test_a_hit_of_one_chunk_has_no_split():
    p = plan("llama-3-8b", "h200", "host", 256, 16)
    assert p.predicted_ms["split"] is None and "split" not in p.options
    assert p.choice in ("load", "recompute")


def test_a_very_slow_tier_means_recompute():
    slow = Ceilings(figures={"h2d_pinned_gbps": 0.01}, gpu_key="h200")
    p = plan("llama-3-8b", "h200", "host", 4096, 64, slow)
    assert p.choice == "recompute" and p.split_tokens == 4096
    assert "0.0 GB/s" in " ".join(p.reasons) or p.path.bottleneck.gbps == 0.01


def test_a_fast_tier_means_load():
    fast = Ceilings(figures={"h2d_pinned_gbps": 2000.0}, gpu_key="h200")
    p = plan("llama-3-8b", "h200", "host", 2048, 64, fast)  # the load hides under the prefill
    assert p.choice == "load" and p.split_tokens == 0
    assert p.predicted_ms["load"] < p.predicted_ms["split"] < p.predicted_ms["recompute"]


def test_measured_ceilings_replace_the_hops_they_measured():
    c = Ceilings(
        figures={
            "h2d_pinned_gbps": 40.0,
            "disk_read_gbps": 1.5,
            "redis_loopback_get_gbps": 0.6,
            "bf16_tflops": 700.0,
        },
        gpu="NVIDIA H200",
        gpu_key="h200",
    )
    disk = tier_path(get_gpu("h200", c), "disk", c)
    assert disk.bottleneck.gbps == 1.5 and "measured" in disk.bottleneck.source
    assert any(h.gbps == 40.0 for h in disk.hops)
    redis = tier_path(get_gpu("h200", c), "redis", c)
    assert redis.bottleneck.name.startswith("Redis GET") and redis.bottleneck.gbps == 0.6
    slower = plan("llama-3-8b", "h200", "host", 8192, 64, c)
    assert (
        slower.predicted_ms["recompute"]
        > plan("llama-3-8b", "h200", "host", 8192, 64).predicted_ms["recompute"]
    )
    assert plan("llama-3-8b", "h200", "host", 8192, 64, c, link="pcie5").path.bottleneck.gbps == 50.0


def test_a_measured_prefill_replaces_the_roofline_and_an_unpipelined_load_adds_up():
    """What a serving engine feeds the planner: its own forward times, its asynchronous load (the
    copies land before the forward), and one TP rank's bytes."""

    def measured(tokens: int, prefix: int) -> float:
        return 2.0 + 0.03 * tokens + 1e-6 * tokens * (prefix + tokens / 2)

    n, m = 8192, 64
    p = plan("llama-3-8b", "h200", "disk", n, m, read_gbps=2.0, prefill_ms=measured, pipelined=False)
    assert p.predicted_ms["recompute"] == pytest.approx(measured(n + m, 0))
    load = p.options["load"]
    read, copy = transfer_parts(p.path, n, p.kv_bytes_per_token)
    assert load.new_ms == pytest.approx(measured(m, n)) and "measured" in load.bound
    assert load.ms == pytest.approx(read + copy + measured(m, n))  # one after the other
    piped = plan("llama-3-8b", "h200", "disk", n, m, read_gbps=2.0, prefill_ms=measured)
    assert piped.options["load"].ms == pytest.approx(read + overlap(copy, measured(m, n), 32))
    half = plan("llama-3-8b", "h200", "host", n, m, prefill_ms=measured, kv_bytes_per_token=65536)
    full = plan("llama-3-8b", "h200", "host", n, m, prefill_ms=measured)
    assert half.options["load"].load_ms == pytest.approx(full.options["load"].load_ms / 2, rel=0.01)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prefill_ms=3.0), "prefill_ms"),
        (dict(kv_bytes_per_token=0), "kv_bytes_per_token"),
        (dict(matched_tokens=100), "matched_tokens"),
        (dict(matched_tokens=-256), "matched_tokens"),
        (dict(new_tokens=0), "new_tokens"),
        (dict(tier="tape"), "tier"),
        (dict(efficiency=0.0), "efficiency"),
        (dict(gpu="h999"), "gpu"),
    ],
)
def test_bad_input_raises_naming_the_argument(kwargs, match):
    args = dict(model="llama-3-8b", gpu="h200", tier="host", matched_tokens=512, new_tokens=8) | kwargs
    with pytest.raises(ValueError, match=match):
        plan(**args)


def test_cli_prints_units_and_json_and_exits_2_on_bad_input(tmp_path):
    r = CliRunner().invoke(
        cli, ["plan", "--gpu", "h200", "--tier", "disk", "--matched", "8192", "--new", "64"]
    )
    assert r.exit_code == 0, r.output
    assert "TTFT" in r.output and "GB/s" in r.output and "choice: split" in r.output  # 2-line headers
    r = CliRunner().invoke(cli, ["plan", "--gpu", "h200", "--matched", "8192", "--new", "64", "--json"])
    d = json.loads(r.output)
    assert d["choice"] in ("load", "split") and d["predicted_ms"]["recompute"] > d["predicted_ms"]["load"]
    assert d["path"]["hops"][0]["name"].startswith("host DRAM")
    ceil = tmp_path / "c.json"
    Ceilings(figures={"h2d_pinned_gbps": 0.01}, gpu_key="h200").save(ceil)
    r = CliRunner().invoke(
        cli, ["plan", "--matched", "4096", "--new", "8", "--ceilings", str(ceil), "--json"]
    )
    assert (
        r.exit_code == 0
        and json.loads(r.output)["choice"] == "recompute"
        and json.loads(r.output)["gpu"] == "h200"
    )
    for bad in (
        ["--matched", "100", "--new", "1"],
        ["--matched", "256", "--new", "0"],
        ["--matched", "256", "--new", "1", "--model", "nope"],
        ["--matched", "256", "--new", "1", "--ceilings", str(tmp_path / "missing.json")],
    ):
        r = CliRunner().invoke(cli, ["plan", *bad])
        assert r.exit_code == 2, (bad, r.output)


def test_prefill_overhead_counts_once_per_forward():
    """A fixed cost per forward: recompute and load run one, a split runs two."""
    from kvtier.planner import plan

    a = plan("llama-3-8b", "h200", "disk", 8192, 64)
    b = plan("llama-3-8b", "h200", "disk", 8192, 64, prefill_overhead_ms=5.0)
    assert b.options["recompute"].ms == pytest.approx(a.options["recompute"].ms + 5.0)
    assert b.options["recompute"].recompute_ms == pytest.approx(a.options["recompute"].recompute_ms + 5.0)
    assert b.options["load"].new_ms == pytest.approx(a.options["load"].new_ms + 5.0)
    s = b.options["split"]
    assert s.recompute_ms > 5.0 and s.new_ms == pytest.approx(a.options["load"].new_ms + 5.0)
    for bad in (-1.0, float("nan"), True, "5"):
        with pytest.raises(ValueError, match="prefill_overhead_ms"):
            plan("llama-3-8b", "h200", "disk", 8192, 64, prefill_overhead_ms=bad)


def _calibration(tmp_path, gpu_key="h200"):
    import json

    doc = {
        "kvtier_calibration": 1, "device": "cuda", "gpu": "NVIDIA H200", "gpu_key": gpu_key,
        "fits": {"prefill": {"overhead_ms": 5.0, "efficiency": 0.5, "fit_points": 3},
                 "h2d": {"overhead_ms": 0.0, "efficiency": 0.5, "fit_points": 4}},
        "gpu_spec": {"bf16_tflops": 800.0, "mem_bw_gbps": 4800.0},
        "ceilings": {"h2d_pinned_gbps": 50.0, "bf16_tflops": 800.0, "d2d_copy_gbps": 4000.0},
    }  # fmt: skip
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_plan_cli_takes_a_calibration(tmp_path):
    """--calibration: prefill at the fitted 400 TFLOP/s (half the peak) + 5 ms a forward, H2D at 25 GB/s."""
    import json

    base = ["plan", "--gpu", "h200", "--matched", "8192", "--new", "64", "--json"]
    cal = _calibration(tmp_path)
    r = CliRunner().invoke(cli, [*base, "--calibration", cal])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["efficiency"] == pytest.approx(0.5) and d["prefill_overhead_ms"] == 5.0
    assert d["path"]["bottleneck_gbps"] == pytest.approx(25.0)
    want = plan("llama-3-8b", "h200", "host", 8192, 64, efficiency=1.0)
    assert d["options"]["load"]["load_ms"] == pytest.approx(2 * want.options["load"].load_ms, rel=0.05)
    bad = CliRunner().invoke(cli, [*base, "--calibration", _calibration(tmp_path, "b200")])
    assert bad.exit_code == 2 and "calibration" in bad.output
    missing = CliRunner().invoke(cli, [*base, "--calibration", str(tmp_path / "none.json")])
    assert missing.exit_code == 2 and "calibration" in missing.output


def test_forward_floor_bounds_every_forward_and_a_split_pays_it_twice():
    """Each forward takes at least the floor: the short tail of a load is host-bound, a split pays
    it twice — so on the host, where the copy is short, the split loses to the load."""
    a = plan("llama-3-8b", "h200", "host", 8192, 64)
    b = plan("llama-3-8b", "h200", "host", 8192, 64, forward_floor_ms=40.0)
    assert a.options["load"].new_ms < 40.0 and b.options["load"].new_ms == 40.0
    assert b.options["recompute"].ms == pytest.approx(a.options["recompute"].ms)  # long: above the floor
    s = b.options["split"]
    assert s.recompute_ms >= 40.0 and s.ms >= 80.0 and b.options["load"].ms < s.ms
    assert "forward floor 40.0" in b.options["load"].bound and "forward floor 40.0" in s.bound
    assert a.choice == "load" and b.choice == "load"
    for bad in (-1.0, float("inf"), False):
        with pytest.raises(ValueError, match="forward_floor_ms"):
            plan("llama-3-8b", "h200", "host", 8192, 64, forward_floor_ms=bad)


def test_plan_cli_takes_the_calibration_floor(tmp_path):
    import json
    from pathlib import Path

    path = _calibration(tmp_path)
    doc = json.loads(Path(path).read_text()) | {"forward_floor_ms": 40.0}
    Path(path).write_text(json.dumps(doc))
    r = CliRunner().invoke(cli, ["plan", "--gpu", "h200", "--matched", "8192", "--new", "64", "--json",
                                 "--calibration", path])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["forward_floor_ms"] == 40.0 and d["options"]["load"]["new_ms"] >= 40.0


def test_a_store_measured_read_rate_replaces_the_probed_one():
    from kvtier.planner import READ_SOURCE

    c = Ceilings(
        figures={"disk_read_gbps": 2.0, "redis_loopback_get_gbps": 2.0}, gpu="NVIDIA H200", gpu_key="h200"
    )
    g = get_gpu("h200", c)
    disk = tier_path(g, "disk", c, read_gbps=1.25)
    assert disk.bottleneck.gbps == 1.25 and disk.bottleneck.source == READ_SOURCE
    remote = tier_path(g, "remote", c, read_gbps=0.8)
    assert remote.hops[0].gbps == 0.8 and remote.hops[0].source == READ_SOURCE
    assert len(remote.hops) == len(tier_path(g, "remote", c).hops)  # replaces the GET hop, adds none
    assert tier_path(g, "disk", None, read_gbps=1.25).bottleneck.gbps == 1.25  # no probe at all
    assert tier_path(g, "host", c, read_gbps=1.25) == tier_path(g, "host", c)  # the host reads nothing
    probed = plan("llama-3-8b", "h200", "disk", 8192, 64, c)
    measured = plan("llama-3-8b", "h200", "disk", 8192, 64, c, read_gbps=1.0)
    nbytes = 8192 * probed.kv_bytes_per_token  # read at 1 GB/s, not 2: bytes / 2 GB/s longer
    extra = measured.predicted_ms["load"] - probed.predicted_ms["load"]
    assert extra == pytest.approx(nbytes / 2e9 * 1e3, rel=0.01)
    for bad in (0, -1.0, float("inf"), True, "fast"):
        with pytest.raises(ValueError, match="read_gbps"):
            plan("llama-3-8b", "h200", "disk", 8192, 64, c, read_gbps=bad)
    # a load's fixed part (ReadRate.fit) is the read hop's latency, paid once per load
    fixed = plan("llama-3-8b", "h200", "disk", 8192, 64, c, read_gbps=1.0, read_fixed_ms=40.0)
    assert fixed.path.hops[0].latency_us == 40e3
    assert fixed.predicted_ms["load"] - measured.predicted_ms["load"] == pytest.approx(40.0, abs=0.5)
    assert tier_path(g, "remote", c, read_gbps=0.8, read_fixed_ms=5.0).hops[0].latency_us == 5e3
    for bad in (-1.0, float("nan"), True):
        with pytest.raises(ValueError, match="read_fixed_ms"):
            plan("llama-3-8b", "h200", "disk", 8192, 64, c, read_gbps=1.0, read_fixed_ms=bad)
