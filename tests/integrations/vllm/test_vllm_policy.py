"""vLLM 0.33's kv_load_failure_policy: a cache cannot promise that every hit it grants is
delivered (a chunk may be evicted between the grant and the load), and under "fail" (vLLM's
default) every such hit would end its request with FINISHED_ERROR. The connector refuses to start
under "fail", in both roles, and says which setting to use; under "recompute" a lost hit is
recomputed and the request completes with the true tokens."""

from __future__ import annotations

import pytest
from vllm_harness import Engine
from vllm_utils import create_kv_cache_config, create_vllm_config

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
A = list(range(1, 101))
EXTRA = {"chunk_tokens": 32, "host_bytes": 1 << 22}


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_the_connector_refuses_the_fail_policy_in_both_roles(tmp_path, role):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm import KVTierConnector

    cfg = create_vllm_config(tmp_path, EXTRA, policy="fail")
    with pytest.raises(ValueError, match=r"kv_load_failure_policy.*\"recompute\""):
        KVTierConnector(cfg, KVConnectorRole[role], create_kv_cache_config(64))


def test_vllms_default_policy_is_refused(tmp_path):
    """Not naming the policy gets vLLM's default, "fail": refused too."""
    from vllm.config import KVTransferConfig

    assert KVTransferConfig().kv_load_failure_policy == "fail"  # what this connector must not run under
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        Engine(tmp_path, EXTRA, policy="fail")


def test_under_recompute_a_lost_hit_completes_with_the_true_tokens(tmp_path):
    e = Engine(tmp_path, EXTRA, policy="recompute")
    try:
        e.add("a", A, max_tokens=3)
        e.settle()
        e.sched.reset_prefix_cache()

        def lose(so):
            if so.kv_connector_metadata.loads:
                e.ranks[0].store.evict()  # after the grant: the load finds nothing
                e.before_execute = None

        e.before_execute = lose
        e.add("b", A, max_tokens=3)
        e.settle()
        assert e.loads("b") == [3] and e.invalid_blocks()
        assert e.finished["b"] == "length" and e.outputs["b"] == e.outputs["a"]
        assert e.outputs["b"][0] == e.first_token(A)
    finally:
        e.close()
