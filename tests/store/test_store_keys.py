"""Chunk keys: stable across processes, prefix-chained, isolated by model / dtype / layout / rank."""

import os
import subprocess
import sys

import pytest

from kvtier.store.keys import KeyExtra, chunk_keys

EXTRA = KeyExtra(model="llama-3-8b@abc", kv_dtype="bfloat16", layout="vllm_flash", tp_rank=0, tp_size=2)
TOKENS = [(i * 7919) % 128256 for i in range(1000)]
GOLDEN = "b9ac1272459b6d55298e114244769c5d"


def test_one_key_per_full_chunk_and_no_key_for_the_partial_tail():
    keys = chunk_keys(TOKENS, chunk_tokens=256, block_size=16, extra=EXTRA)
    assert len(keys) == 3  # 1000 tokens: three full chunks, 232 tokens left unkeyed
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == 3
    assert chunk_keys(TOKENS[:255], extra=EXTRA) == []


def test_key_names_the_whole_prefix():
    keys = chunk_keys(TOKENS, chunk_tokens=128, extra=EXTRA)
    assert chunk_keys(TOKENS[:600], chunk_tokens=128, extra=EXTRA) == keys[:4]
    changed = list(TOKENS)
    changed[300] += 1  # in chunk 2: chunks 0, 1 keep their keys, every later key changes
    other = chunk_keys(changed, chunk_tokens=128, extra=EXTRA)
    assert other[:2] == keys[:2]
    assert all(a != b for a, b in zip(other[2:], keys[2:], strict=True))
    # Same tokens at the same chunk position but after a different prefix: different key.
    shifted = TOKENS[128:256] + TOKENS[128:256]
    assert chunk_keys(shifted, chunk_tokens=128, extra=EXTRA)[1] != keys[1]


@pytest.mark.parametrize(
    "change",
    [
        dict(model="llama-3-8b@abd"),
        dict(kv_dtype="fp8_e4m3"),
        dict(layout="flashinfer_hnd"),
        dict(tp_rank=1),
        dict(tp_size=4),
        dict(salt=b"tenant-7"),
    ],
)
def test_every_field_of_extra_isolates(change):
    fields = dict(model=EXTRA.model, kv_dtype=EXTRA.kv_dtype, layout=EXTRA.layout, tp_rank=0, tp_size=2)
    other = KeyExtra(**{**fields, **change})
    a = chunk_keys(TOKENS, extra=EXTRA)
    b = chunk_keys(TOKENS, extra=other)
    assert not set(a) & set(b)


def test_fields_are_length_prefixed():
    a = KeyExtra(model="ab", kv_dtype="c", layout="x")
    b = KeyExtra(model="a", kv_dtype="bc", layout="x")
    assert chunk_keys(TOKENS, extra=a) != chunk_keys(TOKENS, extra=b)


def test_stable_across_processes_and_versions():
    # Golden value: a change here breaks every stored chunk, so it must be deliberate.
    first = chunk_keys(list(range(256)), extra=KeyExtra(model="m", kv_dtype="bfloat16", layout="l"))[0]
    assert first.hex() == GOLDEN
    code = (
        "from kvtier.store.keys import KeyExtra, chunk_keys;"
        "extra = KeyExtra(model='m', kv_dtype='bfloat16', layout='l');"
        "print(chunk_keys(list(range(256)), extra=extra)[0].hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == GOLDEN


def test_tensor_numpy_and_list_give_the_same_keys():
    torch = pytest.importorskip("torch")
    import numpy as np

    ref = chunk_keys(TOKENS, extra=EXTRA)
    assert chunk_keys(torch.tensor(TOKENS), extra=EXTRA) == ref
    assert chunk_keys(np.array(TOKENS, dtype=np.int64), extra=EXTRA) == ref
    assert chunk_keys(np.array(TOKENS, dtype=np.uint32), extra=EXTRA) == ref
    with pytest.raises(ValueError, match="tokens"):
        chunk_keys(torch.tensor([-1] * 256), extra=EXTRA)
    with pytest.raises(ValueError, match="tokens"):
        chunk_keys(torch.zeros(2, 256, dtype=torch.int64), extra=EXTRA)
    with pytest.raises(ValueError, match="tokens"):
        chunk_keys(np.zeros(256, dtype=np.float32), extra=EXTRA)


def test_xxh3_variant_is_deterministic_and_distinct():
    a = chunk_keys(TOKENS, extra=EXTRA, hash_name="xxh3_128")
    assert a == chunk_keys(TOKENS, extra=EXTRA, hash_name="xxh3_128")
    assert a != chunk_keys(TOKENS, extra=EXTRA)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(chunk_tokens=100, block_size=16), "chunk_tokens"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(block_size=0), "block_size"),
        (dict(hash_name="md5"), "hash_name"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        chunk_keys(TOKENS, extra=EXTRA, **kwargs)


def test_bad_tokens_and_extra():
    with pytest.raises(ValueError, match="tokens"):
        chunk_keys([-1] * 256, extra=EXTRA)
    with pytest.raises(ValueError, match="tokens"):
        chunk_keys([2**32] * 256, extra=EXTRA)
    with pytest.raises(ValueError, match="extra"):
        chunk_keys(TOKENS, extra="llama")
    with pytest.raises(ValueError, match="tp_rank"):
        KeyExtra(model="m", kv_dtype="bf16", layout="l", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="model"):
        KeyExtra(model="", kv_dtype="bf16", layout="l")
    with pytest.raises(ValueError, match="salt"):
        KeyExtra(model="m", kv_dtype="bf16", layout="l", salt="text")
