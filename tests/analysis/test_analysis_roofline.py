"""roofline and path: the seed's worked examples and the trade between loading and recomputing."""

import subprocess
import sys

import pytest

from kvtier import path as kpath
from kvtier import roofline as rl
from kvtier.models import MODELS
from kvtier.specs import GPUS, LINKS, get_link

L8 = MODELS["llama-3-8b"]
H100 = GPUS["h100-sxm"]
GIB = 1 << 30


def test_decode_is_memory_bound_and_batch_1_and_32_cost_about_the_same():
    one, many = rl.decode_step(L8, H100, 1, 0), rl.decode_step(L8, H100, 32, 0)
    assert one.bound == many.bound == "memory"
    assert one.ms == pytest.approx(4.8, abs=0.05)
    assert many.ms / one.ms < 1.01  # same weight read; 32x the tokens for (almost) free


def test_kv_reads_add_up_like_the_seed_says():
    step1 = rl.decode_step(L8, H100, 1, 8192)
    step32 = rl.decode_step(L8, H100, 32, 8192)
    kv_one = step1.memory_ms - rl.decode_step(L8, H100, 1, 0).memory_ms
    assert kv_one == pytest.approx(0.32, abs=0.005)
    assert step32.memory_ms - rl.decode_step(L8, H100, 32, 0).memory_ms == pytest.approx(10.26, abs=0.05)


def test_turning_batch_is_about_the_balance_point():
    b = rl.turning_batch(L8, H100, context=0)
    assert abs(b - H100.balance) / H100.balance < 0.1
    assert rl.turning_batch(L8, H100, context=8192) is None  # KV grows with batch: never compute-bound


def test_moe_decode_reads_only_touched_experts():
    mix = MODELS["mixtral-8x7b"]
    assert rl.decode_weight_bytes(mix, 1, "bf16") < 0.35 * mix.weight_bytes("bf16")
    assert rl.decode_weight_bytes(mix, 512, "bf16") == pytest.approx(mix.weight_bytes("bf16"), rel=1e-6)


def test_prefill_is_compute_bound_and_quadratic():
    p8k = rl.prefill(L8, H100, 8192)
    assert p8k.bound == "compute"
    linear = 2 * L8.matmul_params() * 8192
    assert p8k.flops > linear  # the attention term
    assert rl.prefill_flops(L8, 2048, prefix=6144) < rl.prefill_flops(L8, 8192)


def test_amdahl_seed_example():
    # 20% faster kernel, 10% of request time: about 2% overall
    assert rl.amdahl(0.1, 1.2) == pytest.approx(1.017, abs=0.001)
    with pytest.raises(ValueError, match="fraction"):
        rl.amdahl(1.5, 2)


def test_one_gib_over_pcie4_takes_about_42_ms():
    p = kpath.build_path(H100, "host", get_link("pcie4"), "load")
    assert p.transfer_ms(GIB) == pytest.approx(42, abs=0.6)
    assert p.bottleneck.name.startswith("PCIe Gen4")


def test_gpudirect_skips_host_dram_and_sharing_divides_a_hop():
    plain = kpath.build_path(H100, "remote", "pcie5", "load", nic="nic400")
    gdr = kpath.build_path(H100, "remote", "pcie5", "load", nic="nic400", gpudirect=True)
    assert any("DRAM" in h.name for h in plain.hops) and not any("DRAM" in h.name for h in gdr.hops)
    shared = kpath.build_path(H100, "host", "pcie5", "load", shared_by=4)
    assert shared.bottleneck.gbps == pytest.approx(LINKS["pcie5"].typical_gbps / 4)
    with pytest.raises(ValueError, match="tier"):
        kpath.build_path(H100, "tape")


def test_break_even_and_split_point():
    disk = kpath.build_path(H100, "disk", "pcie5", "load")
    n = kpath.break_even_tokens(L8, H100, disk)
    assert n is not None and n > 1
    assert kpath.load_ms(L8, disk, n) <= kpath.recompute_ms(L8, H100, n)
    assert kpath.load_ms(L8, disk, n - 1) > kpath.recompute_ms(L8, H100, n - 1)
    s = kpath.split_point(L8, H100, disk, 8192)
    alone = min(kpath.load_ms(L8, disk, 8192), kpath.recompute_ms(L8, H100, 8192))
    assert s.ms < alone and abs(s.recompute_ms - s.load_ms) / s.ms < 0.01


def test_analysis_modules_import_no_torch():
    code = (
        "import sys; import kvtier.specs, kvtier.models, kvtier.hfconfig, kvtier.roofline, kvtier.path, "
        "kvtier.ceilings, kvtier.cli.report, kvtier.cli.tables; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
