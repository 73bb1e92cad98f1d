"""Every setting checked where it is given, the error naming it as the operator typed it: vLLM's
``kv_connector_extra_config`` (`VllmSettings`), SGLang's ``extra_config`` (`KVTierHiCache`) and
`KVTier.for_model`; sizes in one format for all three; a refused start allocates nothing and
leaves no thread behind."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvtier.integrations.sglang import KVTierHiCache
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.integrations.vllm.worker import WorkerSide

VLLM = "kv_connector_extra_config"


class Cfg:
    """The fields of SGLang's HiCacheStorageConfig the backend reads."""

    def __init__(self, extra: dict) -> None:
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = 0, 1, 0, 1
        self.is_mla_model, self.model_name, self.extra_config = False, "org/model", extra


def vllm(**extra) -> VllmSettings:
    return VllmSettings.from_extra(extra)


def sglang(**extra) -> KVTierHiCache:
    return KVTierHiCache(Cfg(extra), {})


def refused(make, *names: str) -> str:
    """``make()``'s ValueError, checked to hold each of ``names``."""
    with pytest.raises(ValueError) as err:
        make()
    for name in names:
        assert name in str(err.value), f"{name!r} not in {str(err.value)!r}"
    return str(err.value)


# -- sizes: one format for every integration ----------------------------------------------------


@pytest.mark.parametrize(
    "value, nbytes",
    [
        (4096, 4096),
        (4e9, 4_000_000_000),
        ("4096", 4096),
        ("4GiB", 4 << 30),
        ("4 gib", 4 << 30),
        ("512MiB", 512 << 20),
        ("64GB", 64_000_000_000),
        ("1.5GiB", 3 << 29),
        ("2TB", 2 * 10**12),
        ("10kB", 10_000),
        ("3KiB", 3072),
    ],
)
def test_sizes_take_bytes_or_a_unit_exactly(value, nbytes):
    from kvtier.integrations.setting_checks import byte_size

    assert byte_size(value, "x") == nbytes
    assert vllm(host_bytes=value).host_bytes == nbytes


@pytest.mark.parametrize("value", ["4G", "4M", "4GiBs", "1.5B", "-1GiB", "GiB", "", True, 1.5, [4], None])
def test_sizes_refused_name_the_setting_and_the_format(value, tmp_path):
    msg = refused(lambda: vllm(host_bytes=value), f"{VLLM}['host_bytes']", "'512MiB'")
    assert repr(value) in msg
    refused(
        lambda: sglang(disk_path=str(tmp_path), redis_part_bytes=value), "extra_config['redis_part_bytes']"
    )


def test_sizes_below_their_minimum_and_zero_are_refused(tmp_path):
    refused(lambda: vllm(host_bytes=0), f"{VLLM}['host_bytes']=0")
    refused(lambda: vllm(disk_bytes="0GiB"), f"{VLLM}['disk_bytes']='0GiB'")
    refused(lambda: sglang(disk_path=str(tmp_path), redis_part_bytes="1KiB"), "redis_part_bytes", "4096")
    be = sglang(disk_path=str(tmp_path / "kv"), redis_part_bytes="8MiB", gather_below_bytes="0KiB")
    assert be.settings.redis_part_bytes == 8 << 20 and be.settings.gather_below_bytes == 0
    be.close()


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_seconds_and_capacities_are_finite(value, tmp_path):
    refused(lambda: vllm(prefetch_timeout_s=value), f"{VLLM}['prefetch_timeout_s']")
    refused(lambda: sglang(disk_path=str(tmp_path), redis_timeout_s=value), "extra_config['redis_timeout_s']")
    refused(
        lambda: sglang(disk_path=str(tmp_path), disk_capacity_gb=value), "extra_config['disk_capacity_gb']"
    )


# -- disk_path ----------------------------------------------------------------------------------


def test_disk_path_a_file_or_under_a_file_is_refused(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    for path, what in ((f, "is a file"), (f / "kv", f"cannot be created: {f} is a file")):
        refused(lambda p=path: vllm(disk_path=str(p)), f"{VLLM}['disk_path']={str(path)!r}", what)
        refused(lambda p=path: sglang(disk_path=str(p)), f"extra_config['disk_path']={str(path)!r}", what)
    assert f.read_text() == "mine"


def test_disk_path_that_can_be_created_is_not_created_by_the_check(tmp_path):
    path = tmp_path / "a" / "b"
    assert vllm(disk_path=str(path)).disk_path == str(path)
    assert not (tmp_path / "a").exists()  # checked, not made: the worker's disk tier makes it


def test_disk_path_a_broken_symlink_is_refused(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    refused(lambda: vllm(disk_path=str(tmp_path / "link")), "disk_path", "broken symlink")
    refused(lambda: sglang(disk_path=str(tmp_path / "link" / "kv")), "disk_path", "broken symlink")


_UNWRITABLE = """
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.integrations.sglang import KVTierHiCache
class Cfg:
    tp_rank, tp_size, pp_rank, pp_size, is_mla_model, model_name = 0, 1, 0, 1, False, "m"
for path in ("/usr", "/usr/kvtier-cache/kv"):
    for make in (lambda: VllmSettings.from_extra({"disk_path": path}),
                 lambda: KVTierHiCache(type("C", (Cfg,), {"extra_config": {"disk_path": path}})(), {})):
        try:
            make()
            print("accepted", path)
        except ValueError as exc:
            print(exc)
"""


def test_disk_path_unwritable_is_refused():
    """As the operator's user: root writes anywhere, so as root the check runs as nobody."""
    cmd = [sys.executable, "-c", _UNWRITABLE]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    import kvtier

    src = str(Path(kvtier.__file__).parents[1])  # the kvtier this test imports
    env = dict(os.environ, PYTHONPATH=src, PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd="/")
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 4, done.stderr
    assert lines[0] == f"{VLLM}['disk_path']='/usr': the directory is not writable by this process"
    assert lines[1] == "extra_config['disk_path']='/usr': the directory is not writable by this process"
    for line in lines[2:]:
        assert "'/usr/kvtier-cache/kv' cannot be created: /usr is not writable" in line


# -- redis_url ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, what",
    [
        ("http://cache:6379/0", "scheme"),
        ("redis://cache:port/0", "port"),
        ("redis://my cache:6379/0", "host"),
        ("redis://cache:6379/-1", "db index"),
        ("redis://cache:6379/one", "db index"),
    ],
)
def test_redis_url_is_checked_naming_the_setting(url, what):
    refused(lambda: vllm(redis_url=url), f"{VLLM}['redis_url']={url!r}", what)
    refused(lambda: sglang(tiers=["redis"], redis_url=url), f"extra_config['redis_url']={url!r}", what)


def test_redis_url_errors_mask_the_password():
    msg = refused(lambda: vllm(redis_url="redis://:hunter2@cache:port/0"), "redis://:***@cache:port/0")
    assert "hunter2" not in msg
    msg = refused(lambda: sglang(tiers=["redis"], redis_url="htp://u:hunter2@cache/0"), "u:***@cache")
    assert "hunter2" not in msg


# -- names --------------------------------------------------------------------------------------


def test_a_typo_beside_the_kvtier_block_is_refused():
    refused(lambda: vllm(kvtier={"host_bytes": "1GiB"}, hostbytes=1), VLLM, "'hostbytes'", "'kvtier' block")
    refused(lambda: vllm(kvtier={"hostbytes": 1}), f"{VLLM}['kvtier']", "'hostbytes'")
    s = vllm(kvtier={"host_bytes": "1GiB", "chunk_tokens": 7})
    assert s.host_bytes == 1 << 30
    refused(lambda: s.chunk_tokens_for(16), f"{VLLM}['kvtier']['chunk_tokens']")  # named as typed
    refused(lambda: vllm(kvtier={"engine_path": "fast"}), f"{VLLM}['kvtier']['engine_path']", "'fast'")
    refused(lambda: vllm(where="x"), "'where'")  # no setting of that name


def test_engine_path_and_model_are_named():
    refused(lambda: vllm(engine_path="fast"), f"{VLLM}['engine_path']", "'fast'")
    for model in (3, "", ["m"]):
        refused(lambda m=model: vllm(model=m), f"{VLLM}['model']", repr(model))


def test_engine_paths_are_the_engines():
    from kvtier.engine import Path
    from kvtier.integrations.vllm.settings import ENGINE_PATHS

    assert tuple(p.value for p in Path) == ENGINE_PATHS


# -- host_bytes against a chunk: the vLLM worker, before it allocates anything -------------------


def test_host_bytes_too_small_for_a_chunk_names_host_bytes_and_starts_nothing():
    layers, heads, block, head = 4, 2, 16, 8
    cache = torch.zeros(layers, 8, heads, block, 2 * head, dtype=torch.bfloat16)  # LBHNC
    caches = {f"model.layers.{i}.self_attn.attn": cache[i] for i in range(layers)}
    chunk = layers * 2 * heads * block * head * 2 * 2  # two blocks a chunk, K and V, bf16
    before = set(threading.enumerate())
    ws = WorkerSide(vllm(chunk_tokens=2 * block, host_bytes=chunk), "m", order="LBHNC", block_size=block)
    msg = refused(lambda: ws.register(caches), f"{VLLM}['host_bytes']={chunk}", f"chunks of {chunk} bytes")
    assert str(3 * chunk) in msg  # the least that holds: one chunk and room for two more
    assert ws.store is None and set(threading.enumerate()) == before  # no device, pool or thread
    ws = WorkerSide(vllm(chunk_tokens=2 * block, host_bytes=3 * chunk), "m", order="LBHNC", block_size=block)
    ws.register(caches)  # the least that holds is enough for the store
    ws.shutdown()


def test_a_refused_sglang_backend_starts_no_thread(tmp_path):
    before = set(threading.enumerate())
    for extra in (
        {"disk_path": str(tmp_path), "redis_timeout_s": float("inf")},
        {"tiers": ["disk", "redis"], "disk_path": str(tmp_path / "d"), "redis_url": "redis://h:x/0"},
    ):
        with pytest.raises(ValueError):
            sglang(**extra)
    assert set(threading.enumerate()) == before
    assert not (tmp_path / "d").exists()  # the disk tier before a bad redis_url was never made


# -- KVTier.for_model ---------------------------------------------------------------------------


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


CHUNK = 3 * 2 * 64 * 2 * 16 * 4  # 3 layers, K and V, 64 tokens, 2 heads x 16, fp32: 49152 bytes


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(num_blocks=0), ["num_blocks", "0"]),
        (dict(block_size=-16), ["block_size", "-16"]),
        (dict(pool_bytes=0), ["pool_bytes=0"]),
        (dict(pool_bytes=1000), ["pool_bytes=1000", f"chunks of {CHUNK} bytes", str(3 * CHUNK)]),
        (dict(pool_bytes="4G"), ["pool_bytes='4G'", "GiB"]),
        (dict(model_id=3), ["model_id", "3"]),
        (dict(chunk_tokens=24), ["chunk_tokens=24", "block_size=16"]),
        (dict(chunk_token=64), ["'chunk_token'"]),
        (dict(engine_options={"path": "fast"}), ["engine_options", "'fast'"]),
        (dict(engine_options={"paths": "kernel"}), ["engine_options", "'paths'"]),
        (dict(tiers=["disk"]), ["tiers"]),
    ],
)
def test_for_model_names_the_argument_and_leaves_nothing_behind(kwargs, names):
    from kvtier.integrations.hf import KVTier

    model = _llama()
    before = set(threading.enumerate())
    refused(lambda: KVTier.for_model(model, chunk_tokens=kwargs.pop("chunk_tokens", 64), **kwargs), *names)
    assert set(threading.enumerate()) == before  # no device worker, engine stream or store thread


def test_for_model_sizes_and_the_least_pool_that_holds():
    from kvtier.integrations.hf import KVTier

    model = _llama()
    with KVTier.for_model(model, chunk_tokens=64, pool_bytes="4MiB") as kvt:
        assert kvt.pool.capacity == 4 << 20
    with KVTier.for_model(model, chunk_tokens=64, pool_bytes=3 * CHUNK) as kvt:  # the store agrees
        assert kvt.pool.capacity == 3 * CHUNK
    refused(lambda: KVTier.for_model(model, chunk_tokens=64, pool_bytes=3 * CHUNK - 256), "pool_bytes")
    with KVTier.for_model(model, chunk_tokens=64, num_blocks=4) as kvt:  # the default pool holds a chunk
        assert kvt.pool.capacity >= 3 * CHUNK


# -- auth_keys: the key that seals the shared tiers' chunks, in every integration -----------------

KEY_A, KEY_B = "0123456789abcdef0123456789abcdef", "a second key of twenty four"


def test_auth_keys_become_a_key_ring_in_every_integration(tmp_path, monkeypatch):
    from kvtier.integrations.hf import KVTier
    from kvtier.store.auth import ENV, KeyRing
    from kvtier.store.disk import DiskTier

    monkeypatch.delenv(ENV, raising=False)
    want = KeyRing([KEY_A, KEY_B]).key_ids
    s = vllm(auth_keys=[KEY_A, KEY_B], encrypt_chunks=1)
    assert s.auth_keys.key_ids == want and s.auth_keys.encrypt
    be = sglang(tiers=["disk"], disk_path=str(tmp_path / "sg"), auth_keys=f"{KEY_A},{KEY_B}")
    assert [t.auth.key_ids for t in be.tiers] == [want]
    be.close()
    tier = DiskTier(tmp_path / "hf", 1 << 30)
    with KVTier.for_model(_llama(), chunk_tokens=64, tiers=[tier], auth_keys=[KEY_A, KEY_B]) as kvt:
        assert tier.auth is kvt.store.config.auth_keys and tier.auth.key_ids == want
    tier.close()
    monkeypatch.setenv(ENV, KEY_B)  # no setting: the environment's keys
    assert vllm().auth_keys.key_ids == KeyRing(KEY_B).key_ids
    assert vllm(auth_keys=KEY_A).auth_keys.key_ids == KeyRing(KEY_A).key_ids  # a setting wins


def test_auth_keys_refused_name_the_setting_never_the_key(tmp_path, monkeypatch):
    from kvtier.integrations.hf import KVTier
    from kvtier.store.auth import ENV

    monkeypatch.delenv(ENV, raising=False)
    bad = "weak-key-123"
    for msg in (
        refused(lambda: vllm(auth_keys=[KEY_A, bad]), f"{VLLM}['auth_keys']", "key 2 of 2", "16 bytes"),
        refused(lambda: sglang(disk_path=str(tmp_path), auth_keys=bad), "extra_config['auth_keys']"),
        refused(lambda: KVTier.for_model(_llama(), chunk_tokens=64, auth_keys=bad), "auth_keys"),
        refused(lambda: vllm(auth_keys=[KEY_A, KEY_A]), "the same key is given twice"),
        refused(lambda: vllm(encrypt_chunks=True), "encryption needs keys", ENV),
        refused(lambda: vllm(auth_keys=3), f"{VLLM}['auth_keys']", "int"),
    ):
        assert bad not in msg and KEY_A not in msg
    monkeypatch.setenv(ENV, f"{KEY_A},{bad}")
    assert bad not in refused(lambda: vllm(), ENV, "key 2 of 2")


def test_no_key_in_the_settings_reprs(tmp_path, monkeypatch):
    from kvtier.integrations.sglang_settings import HiCacheSettings
    from kvtier.store.auth import ENV
    from kvtier.store.config import StoreConfig

    monkeypatch.delenv(ENV, raising=False)
    shown = [
        repr(vllm(auth_keys=[KEY_A, KEY_B])),
        repr(HiCacheSettings(disk_path=str(tmp_path), auth_keys=[KEY_A, KEY_B])),
        repr(StoreConfig(auth_keys=[KEY_A, KEY_B], encrypt_chunks=True)),
        str(StoreConfig(auth_keys=[KEY_A, KEY_B])),
    ]
    assert not [s for s in shown if KEY_A in s or KEY_B in s]
    assert "KeyRing(2 keys" in shown[2]  # what an operator may see: how many, and which seals
