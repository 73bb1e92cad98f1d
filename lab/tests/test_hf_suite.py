"""The `hf` bench suite on the CPU (tiny random-weight Llama, SimDevice, quick mode): its rows,
their checks and ratios, the offloaded case skipped with a reason;
and the pieces that differ on a GPU (plan, sizes, offloaded-cache detection, token clock)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.bench import Context, result, run_bench  # noqa: E402
from kvtier.bench.llama_rig import build_llama, llama_config  # noqa: E402
from kvtier.store.config import StoreConfig  # noqa: E402
from lab.suites import hf as suite  # noqa: E402

QUICK = suite.plan_for(on_gpu=False, quick=True)


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    r = run_bench(["hf"], quick=True, out_dir=tmp_path_factory.mktemp("hf"), plot=False, progress=False)
    assert r.failed == [], r.doc["suites"]
    return result.load(r.path)  # validates: ceilings of this run, gbps and ratio follow from the row


def _rows(doc):
    return {row["case"]: row for row in doc["rows"] if row["suite"] == "hf"}


def test_quick_run_has_every_case_correct_with_its_ratios(doc):
    rows = _rows(doc)
    assert doc["suites"]["hf"]["status"] == "ran"
    for n in QUICK.prefixes:
        for case in ("ttft recompute", "ttft kvtier", "decode recompute", "decode kvtier"):
            assert f"{case} {n}" in rows
    for row in rows.values():
        assert row["correct"] is True, row["case"]
        assert row["ceiling"] == "host_memcpy" and row["ratio"] > 0
        p = row["params"]
        assert p["transformers"] == transformers.__version__ and p["dtype"] == "float32"
        if row["case"].startswith("ttft"):
            assert row["bytes"] == p["prefix_tokens"] * p["kv_bytes_per_token"]
            assert p["ttft_ms"] == row["median_ms"] and p["speedup_vs_recompute"] > 0
        else:
            assert row["bytes"] == p["prompt_tokens"] * p["kv_bytes_per_token"]
            assert p["tokens_per_s"] == pytest.approx(1e3 / row["median_ms"]) and p["decode_vs_dynamic"] > 0
    assert rows[f"ttft recompute {QUICK.prefixes[0]}"]["params"]["speedup_vs_recompute"] == 1.0


def test_kvtier_rows_hit_the_host_bit_exact_and_match_the_recompute(doc):
    for n in QUICK.prefixes:
        p = _rows(doc)[f"ttft kvtier {n}"]["params"]
        assert p["hit_tokens"] == n and p["hit_tier"] == "host" and p["kv_bit_exact"] is True
        assert p["cold_matches_reference"] is True and p["saved_chunks"] >= n // QUICK.chunk_tokens
        # fp32 on the CPU: the tail prefilled apart from the prefix gives the recompute's tokens too
        assert p["tokens_match_recompute"] is True and p["first_divergence_from_recompute"] is None
        assert p["load_ms"] > 0 and p["load_gbps"] > 0 and "P8" in p["target"]


def test_offloaded_case_runs_or_is_skipped_with_a_reason(doc):
    rows, skipped = _rows(doc), {c["case"]: c["reason"] for c in doc["skipped_cases"]}
    for n in QUICK.prefixes:
        for what in ("ttft", "decode"):
            case = f"{what} offloaded {n}"
            assert (case in rows) != (case in skipped)
            if case in skipped:
                assert "needs a GPU" in skipped[case] or "offload" in skipped[case]


def test_gpu_plan_is_the_8b_shape_in_bf16_at_8k_and_32k():
    p = suite.plan_for(on_gpu=True, quick=False)
    assert (p.shape, p.dtype, p.prefixes, p.new_tokens) == ("llama-3-8b", "bfloat16", (8192, 32768), 32)
    q = suite.plan_for(on_gpu=True, quick=True)
    assert q.shape == "llama-3-8b" and max(q.prefixes) <= 8192
    assert max(p.prefixes) + p.tail + p.new_tokens <= llama_config("llama-3-8b").max_position_embeddings


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(new_tokens=1), "new_tokens"),
        (dict(tail=0), "tail"),
        (dict(chunk_tokens=40), "chunk_tokens"),
        (dict(prefixes=(100,)), "prefixes"),
        (dict(reps=True), "reps"),
    ],
)
def test_a_bad_plan_names_the_argument(bad, match):
    args = dict(shape="tiny", dtype="float32", prefixes=(64,), tail=4, new_tokens=3, reps=1, chunk_tokens=32,
                block_size=16) | bad  # fmt: skip
    with pytest.raises(ValueError, match=match):
        suite.Plan(**args)


@pytest.mark.parametrize("on_gpu", [True, False])
def test_store_sizes_hold_the_longest_request(on_gpu):
    plan = suite.plan_for(on_gpu=on_gpu, quick=False)
    bpt = 131072 if on_gpu else suite.kv_bytes_per_token(llama_config("tiny"), torch.float32)
    blocks, pool = suite.store_sizes(plan, bpt)
    longest = max(plan.prefixes) + plan.tail + plan.new_tokens
    assert blocks * plan.block_size >= longest
    span = plan.chunk_tokens * bpt
    need = longest // plan.chunk_tokens * span  # what the cold request's finish() saves
    assert StoreConfig(chunk_tokens=plan.chunk_tokens).host_capacity(pool, span) >= need
    if on_gpu:  # 32K tokens of 8B KV are 4 GiB: the pinned pool stays close to that
        assert pool < 5 * 2**30


def test_kv_bytes_per_token_of_the_8b_shape_in_bf16_is_128_kib():
    assert suite.kv_bytes_per_token(llama_config("llama-3-8b"), torch.bfloat16) == 128 * 1024


def test_offloaded_cache_is_found_in_this_transformers_and_in_older_ones(monkeypatch):
    from transformers import cache_utils
    from transformers.generation import configuration_utils as gc

    model = build_llama("tiny", "cpu")
    make, api = suite.offloaded_cache(model)
    assert api == "DynamicCache(offloading=True)"
    cache = next(iter(make().values()))
    assert isinstance(cache, cache_utils.DynamicCache) and cache.offloading is True

    class Old:  # a DynamicCache without offloading, and the OffloadedCache of 4.x
        def __init__(self, *args, **kwargs):
            pass

    monkeypatch.setattr(cache_utils, "DynamicCache", Old)
    monkeypatch.setattr(cache_utils, "OffloadedCache", Old, raising=False)
    make, api = suite.offloaded_cache(model)
    assert api == "OffloadedCache" and isinstance(next(iter(make().values())), Old)
    monkeypatch.delattr(cache_utils, "OffloadedCache")
    monkeypatch.setattr(gc, "ALL_CACHE_IMPLEMENTATIONS", ("dynamic", "offloaded"), raising=False)
    make, api = suite.offloaded_cache(model)
    assert make() == {"cache_implementation": "offloaded"}
    monkeypatch.setattr(gc, "ALL_CACHE_IMPLEMENTATIONS", ("dynamic",))
    make, why = suite.offloaded_cache(model)
    assert make is None and transformers.__version__ in why


def test_token_clock_synchronizes_the_gpu_before_each_token_is_timed(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("sync"))
    clock = suite.TokenClock(cuda=True)
    clock.put(torch.zeros(1, 9, dtype=torch.long))  # the prompt: not a token
    assert calls == [] and clock.times == []
    clock.put(torch.zeros(1, dtype=torch.long))
    clock.put(torch.zeros(1, dtype=torch.long))
    assert calls == ["sync", "sync"] and len(clock.times) == 2
    cpu = suite.TokenClock(cuda=False)
    cpu.put(torch.zeros(1, dtype=torch.long))
    assert calls == ["sync", "sync"] and len(cpu.times) == 1


def test_a_corrupted_hit_makes_the_kvtier_rows_incorrect(monkeypatch):
    def corrupt(kvt) -> None:  # one byte of every stored chunk flipped: the hit loads wrong KV
        for entry in kvt.store.host.entries():
            entry.slot.tensor.view(torch.uint8)[100] ^= 0x10

    monkeypatch.setattr(suite, "after_save", corrupt)  # the lab's own hook, not kvtier
    ctx = Context("cpu", quick=True)
    ctx.suite = "hf"
    rows = {r.case: r for r in suite.hf(ctx)}
    n = QUICK.prefixes[0]
    assert rows[f"ttft kvtier {n}"].params["kv_bit_exact"] is False
    assert rows[f"ttft kvtier {n}"].correct is False
    assert rows[f"ttft recompute {n}"].correct is True
