"""The `vllm` suite's failover row on the CPU against a real redis-server: killed mid-load, the
blocks after the loaded ones are reported, the loaded ones are exact, and the first token after
vLLM's recompute of the rest equals recomputing the whole prompt."""

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("redis")
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def _ctx():
    from kvtier.bench.suite import Context

    ctx = Context("cpu", quick=True)
    ctx.suite = "vllm"
    return ctx


@pytest.mark.parametrize("order", ["LBHNC", "BLHNC"])
def test_a_redis_killed_mid_load_turns_into_recompute_with_the_same_token(order):
    from kvtier.bench.suites.vllm import TINY, Replay
    from kvtier.bench.suites.vllm_failover import killed_row
    from kvtier.bench.suites.vllm_rows import Forward

    shape = TINY | {"dtype": torch.float32}  # fp32: the logits are compared too
    ctx = _ctx()
    fwd = Forward(ctx, shape)
    rows = list(killed_row(ctx, fwd, Replay, order, shape, 128))  # 8 blocks: two chunks of 4
    assert len(rows) == 1, ctx.skipped
    row = rows[0]
    p = row.params
    assert p["chunks"] >= 2 and 0 < p["chunks_loaded"] < p["chunks"]
    assert p["error_blocks"] == p["expected_error_blocks"] > 0
    assert p["loaded_blocks_exact"] and p["first_token"] == p["healthy_token"] == p["recompute_token"]
    assert p["logits_max_abs_diff"] < 1e-3 and p["load_errors"] == 0  # a miss, not an exception
    assert row.correct is True


def test_kill_after_kills_at_the_read_it_was_told():
    from kvtier.bench.suites.vllm_failover import KillAfter

    class Proc:
        killed = 0

        def kill(self):
            self.killed += 1

        def wait(self):
            return 0

    class Tier:
        name = "t"
        reads = 0

        def get_into(self, key, dest):
            self.reads += 1
            return None

    proc, tier = Proc(), Tier()
    k = KillAfter(tier, proc, 2)
    k.get_into(b"a", None)
    k.get_into(b"b", None)
    assert proc.killed == 0
    k.get_into(b"c", None)
    k.get_into(b"d", None)
    assert proc.killed == 1 and tier.reads == 4 and k.name == "t"


def test_kill_after_is_a_tier_by_its_class():
    """isinstance() of the Tier protocol looks at the class on Python 3.12 (not __getattr__)."""
    import inspect

    from kvtier.bench.suites.vllm_failover import KillAfter
    from kvtier.store.tier import Tier

    wanted = [n for n, v in vars(Tier).items() if inspect.isfunction(v) and not n.startswith("_")]
    missing = [n for n in wanted if n not in vars(KillAfter)]
    assert not missing, missing


def test_the_orders_asked_by_the_environment():
    from kvtier.bench.suites.vllm import orders_asked
    from kvtier.layout import VLLM_ORDERS

    assert orders_asked(None) == orders_asked("") == VLLM_ORDERS
    assert orders_asked("lbhnc, BLHNC") == ("LBHNC", "BLHNC")
    with pytest.raises(ValueError, match="KVTIER_VLLM_ORDERS"):
        orders_asked("LBHNC,XYZ")


def _failed_load_row(order):
    from kvtier.bench.suites.vllm import TINY, Replay
    from kvtier.bench.suites.vllm_failover import failed_load_row
    from kvtier.bench.suites.vllm_rows import Forward

    shape = TINY | {"dtype": torch.float32}  # fp32: B's own first token is compared too
    ctx = _ctx()
    rows = list(failed_load_row(ctx, Forward(ctx, shape), Replay, order, shape, 1280))  # 5 chunks
    assert len(rows) == 1, ctx.skipped
    return rows[0]


@pytest.mark.parametrize("order", ["LBHNC", "BLHNC"])
def test_a_load_failing_mid_request_stores_only_what_vllm_recomputed(order):
    row = _failed_load_row(order)
    p = row.params
    assert p["chunks"] == 4 and p["chunks_granted"] == 3 and p["failed_chunk"] == 2
    assert p["saves_in_failing_step"] == 0 and p["error_blocks"] == p["expected_error_blocks"] == 16
    assert p["chunks_loaded"] == 4 and p["loaded_equals_recomputed"] is True
    assert p["first_token"] == p["recompute_token"] and p["recompute_logits_max_abs_diff"] < 1e-3
    assert row.correct is True


def test_the_row_sees_chunks_saved_from_a_failed_load(monkeypatch):
    """A scheduler side that saves in the load step (as kvtier's did) stores KV computed over the
    blocks that never loaded: the row says so."""
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    def eager(self, meta, st, before, computed_after):
        if st.load:
            self._send_load(meta, st)
        st.computed, st.before = computed_after, before
        self._add_save(meta, st.request.request_id, st)  # not held back

    monkeypatch.setattr(SchedulerSide, "_scheduled", eager)
    row = _failed_load_row("LBHNC")
    assert row.params["saves_in_failing_step"] > 0 and row.params["loaded_equals_recomputed"] is False
    assert row.correct is False
