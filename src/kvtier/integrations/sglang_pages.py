"""SGLang's host pages as kvtier chunks: byte views over the pool's memory, and the chunk keys.

``pool.get_page_buffer_meta(host_indices)`` gives each page's pieces as ``(pointer, bytes)``:
one or two per page in a page-first pool (MHA: K and V; MLA: the latent), one or two per layer
in a layer-first one. A page becomes chunks in one of two ways:

    in place   each piece is one chunk, read and written straight through a view of the pool's
               memory (no copy); pieces of at least ``gather_below`` bytes
    gathered   the page's pieces are copied into one buffer (one memcpy) and stored as one
               chunk: per-layer pieces are too small to pay a file or a Redis key each

``PageShape`` is measured once, when the pool is registered (every page has the same), so
``batch_exists`` can name a page's chunks without its host indices. The chunk key hashes the
SGLang page key with everything that decides the bytes (model, rank suffix, pool layout, the
KV dtype the model runs, the piece's place and size, a salt) into kvtier's 16-byte keys.

A page stored in place is several chunks, and two servers may write the same page (the same
prefix) with different bytes, each chunk first-writer-wins: ``page_group`` ties every piece of
one write together (its header's ``group``), so a reader can refuse K of one write beside V of
another.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from dataclasses import dataclass
from functools import lru_cache

import xxhash

KEY_BYTES = 16


@lru_cache(maxsize=64)
def _array_type(nbytes: int):
    return ctypes.c_ubyte * nbytes


def byte_view(ptr: int, nbytes: int) -> memoryview:
    """A writable 1-D byte view of ``nbytes`` at address ``ptr`` (the pool's own memory; no copy).
    The pool must outlive the view: SGLang holds the pages of a call until it returns."""
    if not isinstance(ptr, int) or ptr <= 0:
        raise ValueError(f"ptr must be a positive int address, got {ptr!r}")
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be an int > 0, got {nbytes!r}")
    return memoryview(_array_type(nbytes).from_address(ptr)).cast("B")


@dataclass(frozen=True, slots=True)
class PageShape:
    """The byte sizes of one page's pieces (every page of a pool has the same), and whether
    they are stored as one gathered chunk."""

    sizes: tuple[int, ...]
    gathered: bool

    @classmethod
    def of(cls, sizes, gather_below: int) -> PageShape:
        sizes = tuple(int(n) for n in sizes)
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"sizes must be positive byte counts, got {sizes!r}")
        return cls(sizes, gathered=len(sizes) > 1 and min(sizes) < gather_below)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def parts(self) -> list[str]:
        """The names of a page's chunks: the geometry is in them, so a page of another shape
        never matches."""
        if self.gathered:
            return ["page[" + ",".join(map(str, self.sizes)) + "]"]
        return [f"piece{j}/{len(self.sizes)}:{n}" for j, n in enumerate(self.sizes)]


def page_views(pool, host_indices, n_pages: int, shape: PageShape) -> list[tuple[memoryview, ...]]:
    """Each page's pieces at ``host_indices`` (``n_pages * pool.page_size`` token slots) as
    views of the pool. Raises ValueError when the pool's answer is not ``n_pages`` pages of
    ``shape``."""
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    per = len(shape.sizes)
    if n_pages < 1 or len(ptrs) != len(sizes) or len(ptrs) != n_pages * per:
        raise ValueError(f"get_page_buffer_meta gave {len(ptrs)} pieces for {n_pages} pages of {per}")
    if any(int(n) != shape.sizes[i % per] for i, n in enumerate(sizes)):
        raise ValueError(f"get_page_buffer_meta gave piece sizes other than the pool's {shape.sizes}")
    return [
        tuple(byte_view(int(p), int(n)) for p, n in zip(ptrs[i : i + per], sizes[i : i + per], strict=True))
        for i in range(0, len(ptrs), per)
    ]


def chunk_key(page_key: str, namespace: str, part: str) -> bytes:
    """kvtier's key of one chunk of a page: ``namespace`` says what decides the bytes (model,
    ranks, layout, dtype, salt), ``part`` which piece (and its size)."""
    if not isinstance(page_key, str) or not page_key:
        raise ValueError(f"page_key must be a non-empty str, got {page_key!r}")
    return hashlib.sha256(f"kvtier.sglang.v2\0{namespace}\0{page_key}\0{part}".encode()).digest()[:KEY_BYTES]


def page_group(checksums: list[int]) -> int:
    """The ``group`` of one write of a page: a hash of its pieces' checksums, so every piece of
    that write carries it and pieces of two writes with different bytes never agree. 0 (no
    group) for a page of one chunk, which is atomic on its own."""
    if len(checksums) < 2:
        return 0
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(checksums)}Q", *checksums)) or 1
