"""The scheduler side's choice, torch-free: the forward-time fit from vLLM's steps (`StepTimes`),
the choice among a full load, the held chunks of the faster tiers (a split) and a recompute
(`Chooser`, with kvtier's planner), the deadline it gives a read, a tier's probe (`TierProbe`)
and the first tokens per request (`FirstTokens`)."""

from __future__ import annotations

import time

import pytest

from kvtier.hfconfig import from_hf_dict
from kvtier.integrations.vllm.choice import Chooser
from kvtier.integrations.vllm.first_tokens import FirstTokens
from kvtier.integrations.vllm.step_times import StepTimes
from kvtier.integrations.vllm.tier_probe import TierProbe

CT = 256
LLAMA_8B = {  # Llama-3-8B's config.json fields the planner reads
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
}
A, B, C = 3.0, 0.03, 1e-6  # a step's fixed ms, ms per token, ms per attention pair


def _steps(times: StepTimes) -> None:
    """Decode steps, chunked prefills and mixed steps of an engine whose forward is A + B t + C w."""
    for tokens, computed in [(64, 2000)] * 6 + [(2048, 0), (2048, 2048), (512, 0), (1024, 6000), (8, 100)]:
        work = tokens * (computed + tokens / 2)
        times.observe(tokens, work, A + B * tokens + C * work)


def _chooser(**rates) -> Chooser:
    ch = Chooser(from_hf_dict(LLAMA_8B, "test"), 16, CT, 2048, cap_s=5.0)
    _steps(ch.steps)
    ch.rates = {"host": (50.0, 0.0)} | rates
    ch.kinds = {"disk": "disk", "redis": "remote"}
    return ch


def test_step_times_fit_the_engines_forward_and_chunk_a_prefill():
    times = StepTimes(2048)
    _steps(times)
    a, b, c = times.coefficients()
    assert (a, b, c) == pytest.approx((A, B, C), rel=1e-6)
    # 8192 tokens in steps of 2048: four forwards, each after the ones before
    want = sum(A + B * 2048 + C * 2048 * (i * 2048 + 1024) for i in range(4))
    assert times.prefill_ms(8192) == pytest.approx(want)
    assert times.ready(2048) and not times.ready(4096)


def test_step_times_time_each_step_from_its_build_to_its_report_even_when_they_overlap():
    times = StepTimes(2048)
    times.built(1, 100, 0.0, now=0.0)
    times.built(2, 10, 0.0, now=0.01)  # async scheduling: step 2 built while step 1 runs
    times.reported(1, now=0.1)
    times.reported(2, now=0.15)  # its forward ran after step 1's: 50 ms, not 140
    assert sorted(times._recent) == pytest.approx([50.0, 100.0])
    times.built(3, 10, 0.0, now=0.2)
    times.built(4, 10, 0.0, now=0.21)
    times.reported(4, now=0.3)  # step 3's report never came: dropped, not timed by step 4's
    assert len(times._recent) == 3 and times._recent[-1] == pytest.approx(90.0)


def test_a_hit_the_host_holds_is_loaded():
    c = _chooser().choose(["host"] * 32, 0, 32 * CT + 64, in_step=True)
    assert (c.kind, c.chunks, c.tier, c.budget_s) == ("load", 32, "host", None)
    assert c.predicted_ms < c.recompute_ms


def test_a_tier_slower_than_the_prefill_is_recomputed_and_a_fast_one_loaded_with_a_deadline():
    slow = _chooser(disk=(0.05, 0.0)).choose(["disk"] * 32, 0, 32 * CT + 64, in_step=False)
    assert (slow.kind, slow.chunks, slow.budget_s) == ("recompute", 0, None)
    fast = _chooser(disk=(5.0, 0.002)).choose(["disk"] * 32, 0, 32 * CT + 64, in_step=False)
    assert (fast.kind, fast.chunks, fast.tier) == ("load", 32, "disk")
    read_s = 32 * CT * 131072 / 5e9 + 0.002  # Llama-3-8B's KV: 128 KiB a token
    # The deadline: when the load would finish after a recompute (its read may take that long).
    assert fast.budget_s == pytest.approx((fast.recompute_ms - fast.predicted_ms) / 1e3 + read_s, rel=1e-3)
    assert fast.budget_s > read_s


def test_the_host_chunks_load_and_vllm_prefills_what_only_a_slow_tier_holds():
    c = _chooser(disk=(0.2, 0.0)).choose(["host"] * 16 + ["disk"] * 16, 0, 32 * CT + 64, in_step=True)
    assert (c.kind, c.chunks, c.tier, c.budget_s) == ("split", 16, "host", None)


def test_vllms_own_cache_is_counted_and_a_tier_absent_ends_the_hit():
    ch = _chooser()
    c = ch.choose(["host"] * 8, 4 * CT, 8 * CT + 64, in_step=True)  # vLLM holds the first 4 chunks
    assert (c.kind, c.chunks) == ("load", 8)
    assert c.recompute_ms == pytest.approx(ch.steps.prefill_ms(4 * CT + 64, 4 * CT))
    assert ch.choose(["host"] * 4, 4 * CT, 8 * CT + 64, in_step=True).kind == "recompute"  # nothing past it


def test_unplanned_before_a_prefill_was_measured_or_when_choice_is_load():
    fresh = Chooser(from_hf_dict(LLAMA_8B, "test"), 16, CT, 2048, cap_s=2.0)
    c = fresh.choose(["host"] * 2 + ["disk"] * 2, 0, 4 * CT + 1, in_step=False)
    assert (c.kind, c.chunks, c.tier, c.budget_s, c.predicted_ms) == ("held", 4, "disk", 2.0, None)
    off = _chooser(disk=(0.01, 0.0))
    off.enabled = False
    assert off.choose(["disk"] * 4, 0, 4 * CT + 1, in_step=False).kind == "held"


def test_a_hybrid_models_load_is_planned_at_the_bytes_its_groups_read():
    # A host link of 2 GB/s: a load of every layer's KV of 8K tokens (Llama-3-8B's 128 KiB a
    # token) is slower than the prefill; one whose sliding-window groups read only their window,
    # a sixth of that, is faster.
    ch = _chooser(host=(2.0, 0.0))
    ch.chunk_bytes = CT * 131072  # a chunk's units of every group
    assert ch.choose(["host"] * 32, 0, 32 * CT + 64, in_step=False).kind == "recompute"
    ch.load_bytes = lambda start, n: (n * CT - start) * 131072 // 6
    c = ch.choose(["host"] * 32, 0, 32 * CT + 64, in_step=False)
    assert (c.kind, c.chunks) == ("load", 32) and c.predicted_ms < c.recompute_ms


class _Tier:
    """A lower tier that fails every read until healed."""

    name = "disk"

    def __init__(self) -> None:
        self.healed = False

    def get_into(self, key, dest):
        if not self.healed:
            raise TimeoutError("no answer")
        return "header"

    def contains(self, key):
        return True

    def stats(self):
        return {}


def test_a_tier_that_failed_is_down_until_its_probe_reads_again():
    tier = _Tier()
    probe = TierProbe([tier], 16, interval_s=0.01)
    try:
        probe.failed("disk", bytes(16))
        probe.failed("disk", bytes(16))  # once down, once probed
        assert probe.take() == ({"disk"}, set()) and probe.down() == {"disk"}
        time.sleep(0.1)
        assert probe.take() == (set(), set())  # its reads still fail
        tier.healed = True
        deadline = time.monotonic() + 5
        while probe.down():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert probe.take() == (set(), {"disk"})
    finally:
        probe.close()


def test_first_tokens_are_timed_from_the_first_lookup_to_the_report_of_their_step():
    from kvtier.integrations.vllm.choice import Choice

    firsts = FirstTokens()
    choice = Choice("split", 4, "host", 12.0, 30.0, None, "")
    firsts.asked("r", choice, now=1.0)
    firsts.asked("r", choice, now=1.5)  # asked again while it waited for blocks: the clock runs on
    firsts.scheduled("r", 7)
    firsts.reported(6, now=1.6)
    assert firsts.take() == []
    firsts.reported(7, now=1.02 + 1.0)
    assert firsts.take() == [["split", "host", 12.0, pytest.approx(1020.0)]]


def test_a_step_that_carries_a_load_is_not_fitted_and_what_such_loads_missed_is_learned():
    times = StepTimes(2048)
    _steps(times)
    fit = times.coefficients()
    times.built(1, 64, 64 * 2000.0, now=10.0)
    times.loading(1)  # this step's forward waited for its layers' loads
    times.reported(1, now=12.0)
    assert times.coefficients() == pytest.approx(fit)  # the fit is the forward's alone
    times.in_step_seen(2000.0)  # the first: a path's first use, not learned from
    assert times.in_step_extra_ms() == 0.0
    for missed in (20.0, 30.0, -5.0):  # a first token earlier than planned costs nothing extra
        times.in_step_seen(missed)
    assert times.in_step_extra_ms() == pytest.approx(20.0)


@pytest.mark.parametrize("extra_ms, in_step", [(5.0, True), (40.0, False)])
def test_a_host_hit_loads_in_the_step_only_where_that_lands_sooner_than_in_the_background(extra_ms, in_step):
    ch = _chooser()
    first = ch.choose(["host"] * 32, 0, 32 * CT + 64, in_step=True)
    assert first.in_step and first.step_extra_ms == 0.0  # nothing measured: the copies hide, for free
    for _ in range(2):  # the first is a first use, not learned from
        ch.steps.in_step_seen(extra_ms)  # such loads' first tokens came extra_ms after their plan's
    c = ch.choose(["host"] * 32, 0, 32 * CT + 64, in_step=True)
    background = ch.choose(["host"] * 32, 0, 32 * CT + 64, in_step=False)
    # in the background: the load (~21 ms at 50 GB/s), half a step's wait, then the forward; in
    # the step: the load under the forward, plus what such loads missed
    assert (c.kind, c.in_step, background.in_step) == ("load", in_step, False)
    assert c.predicted_ms == pytest.approx(min(first.predicted_ms + extra_ms, background.predicted_ms))
    assert c.step_extra_ms == (extra_ms if in_step else 0.0)


def test_a_step_far_slower_than_the_others_a_first_use_does_not_pull_the_fit():
    times = StepTimes(2048)
    _steps(times)
    times.observe(2048, 2048 * 1024, 2000.0)  # a first prefill: compiles, allocations
    assert times.coefficients() == pytest.approx((A, B, C), rel=1e-6)
    assert times.prefill_ms(2048) == pytest.approx(A + B * 2048 + C * 2048 * 1024)
