"""`layerwise` (default true): the worker's loads take the engine's layer-major path, one event
per layer over every chunk, so wait_for_layer_load(l) waits for layer l alone; false: the
whole-job path, every layer's event the job's last, and start_load_kv waits for all of them.
Bit-exact both ways, on a SimDevice whose copies land late."""

from __future__ import annotations

import pytest
from test_vllm_host_time import Rig

from kvtier.integrations.vllm.settings import VllmSettings


@pytest.mark.parametrize("layerwise", [True, False])
def test_layerwise_loads_give_each_layer_its_own_event(layerwise):
    r = Rig(layerwise=layerwise)
    try:
        assert r.ws.load_path() == ("kernel" if layerwise else None)
        r.step(r.meta(save=True), "s")
        r.sync()
        r.ws.finished({"save"})
        r.cache[:, r.dst] = -7.0  # poisoned: only the load writes these blocks
        r.ws.start_load(r.meta(load=True))
        ((h, _, _),) = r.ws._loads
        events = {id(e) for job in h.jobs for e in job.layer_events}
        if layerwise:  # one launch and event per layer, shared by every chunk
            assert len(events) == len(r.names)
        else:  # one job event for all layers
            assert events == {id(job.event) for job in h.jobs}
        for name in r.names:
            r.ws.wait_layer(name)
        r.sync()
        assert (r.cache[:, r.dst] == r.cache[:, r.src]).all()
    finally:
        r.close()


def test_a_path_the_settings_name_wins():
    from kvtier.integrations.vllm.worker import WorkerSide

    assert WorkerSide(VllmSettings(engine_path="staged"), "m").load_path() == "staged"
    assert WorkerSide(VllmSettings(), "m").load_path() == "kernel"
    assert WorkerSide(VllmSettings(layerwise=False), "m").load_path() is None
