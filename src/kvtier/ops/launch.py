"""Launching the copy kernel (kernels/kv_copy.py) for one cache: what is planned once, and the
launch itself.

Everything a launch needs beyond its ids, chunk and layer range is a property of the cache and
the chunk's alignment, so it is worked out once and kept in the cache's `PagedKV.plans` (under
`PLANS_KEY`, a `CacheLaunches`): the units and tile shape per alignment (`Plan`), the grid per
(direction, block count, layer count, grid cap), the device's SM count, and the compiled kernel.

On CUDA the first launch of a variant goes through Triton's JIT entry, which binds and
specializes every argument and returns the compiled kernel; later launches of the same variant
call that kernel's launcher directly with plain addresses (what `kernel[grid](...)` ends in),
which skips the binding, the specialization and the cache-key work of the JIT entry. A variant is
everything Triton specializes on: the plan, the constexprs, the ids' dtype and whether the ids,
chunk and table addresses are 16-byte aligned (the cache's own addresses are fixed per plan).
Under Triton's interpreter every launch goes through the JIT entry, with tensors.

Lazily checked ids (`check` 1 and 2: ids on the GPU, never read back by the host) use the cache's
error flag and claim buffer (`CacheLaunches.err`, `.claim`); `ops/device_ids.py` reads the flag.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from dataclasses import dataclass

import torch
import triton

from kvtier.kernels.kv_copy import block_id_claim_kernel, kv_copy_kernel
from kvtier.layout import PagedKV, gcd_bytes
from kvtier.ops.checks import INTERPRETING
from kvtier.ops.device_ids import PLANS_KEY

TILE_BYTES = 16 << 10  # bytes per program step: 8 x 16-byte vectors per thread at 4 warps
# Default grids. GPU<->GPU: one program per tile, which beats a persistent grid of a few resident
# CTAs per SM. A UVA copy is bound by PCIe, not by SMs: a quarter of them move it as fast as all
# of them would, and the rest stay free for the model's compute.
UVA_SM_DIVISOR = 4
NUM_WARPS = 4
CLAIM_BLOCK = 1024  # ids per program of the claim kernel
MAX_GRIDS = 4096  # grids kept per cache (one per block count, direction, layer count, cap)
_UNITS = {4: torch.int32, 2: torch.int16, 1: torch.int8}
_STAMP_LIMIT = 1 << 30  # claim marks are int32: past this, the claims restart from zero


@dataclass(frozen=True, slots=True)
class Plan:
    unit: torch.dtype
    vec: int  # units per aligned vector
    o: int  # segments per piece
    inner: int  # units per token in a segment
    cols: int
    rows: int
    layer_off: torch.Tensor  # int64 [num_layers] on the cache's device, in vec-units
    kv_stride: int  # vec-units
    block_stride: int  # vec-units
    nct: int  # row slices per segment
    paged: torch.Tensor  # the cache's base as a 1-D `unit` tensor (the interpreter's argument)
    g: int  # bytes per aligned vector: the alignment this plan is for
    paged_ptr: int
    layer_off_ptr: int


class _Ptr:
    """An address as Triton's JIT entry reads a pointer argument: data_ptr() and a dtype (pinned
    host memory too: the GPU reaches it at the same address through UVA)."""

    __slots__ = ("addr", "dtype")

    def __init__(self, addr: int, dtype: torch.dtype):
        self.addr, self.dtype = addr, dtype

    def data_ptr(self) -> int:
        return self.addr


class CacheLaunches:
    """What the launches of one cache share, made on its first launch (`for_cache`)."""

    def __init__(self, kv: PagedKV):
        self.kv = kv
        self.g = gcd_bytes(kv)
        self.device = kv.device
        self.index = kv.device.index if kv.device.type == "cuda" else None
        self.num_blocks = kv.num_blocks
        self.plans: dict[int, Plan] = {}
        self.grids: dict[tuple, int] = {}
        self.fixed: dict[tuple, tuple] = {}  # what `prepare` keeps per block count and variant
        self.compiled: dict[tuple, tuple] = {}  # variant -> (launcher, function, packed metadata)
        self.sms = (
            None if self.index is None else torch.cuda.get_device_properties(self.index).multi_processor_count
        )
        self.lock = threading.Lock()  # the error flag and claims are made once, by one thread
        self.err: torch.Tensor | None = None  # int32 [2]: bad ids of lazily checked calls
        self.claim: torch.Tensor | None = None  # int32 [num_blocks]: marks of lazily checked scatters
        self._stamps = itertools.count(1)  # next() is atomic under the GIL

    def flag(self) -> torch.Tensor:
        """The error flag, made (zero) on first use; the claims with it."""
        if self.err is None:
            with self.lock:
                if self.err is None:
                    self.claim = torch.zeros(self.num_blocks, dtype=torch.int32, device=self.device)
                    self.err = torch.zeros(2, dtype=torch.int32, device=self.device)
        return self.err

    def stamp(self) -> int:
        """An even mark larger than every earlier one (claims restart from zero past int32)."""
        k = next(self._stamps)
        if 2 * k + 1 >= _STAMP_LIMIT:
            with self.lock:
                if self.index is not None:
                    torch.cuda.synchronize(self.device)  # no claim kernel may still read older marks
                self.claim.zero_()
                self._stamps = itertools.count(2)
                k = 1
        return 2 * k


def for_cache(kv: PagedKV) -> CacheLaunches:
    c = kv.plans.get(PLANS_KEY)
    if c is None:
        c = kv.plans[PLANS_KEY] = CacheLaunches(kv)
    return c


def plan_for(kv: PagedKV, chunk_align: int) -> Plan:
    """The launch plan; chunk_align: a number every chunk address the kernel sees is a multiple of."""
    c = for_cache(kv)
    g = c.g
    while chunk_align % g:
        g //= 2
    plan = c.plans.get(g)
    if plan is None:
        plan = c.plans[g] = _make_plan(kv, g)
    return plan


def _make_plan(kv: PagedKV, g: int) -> Plan:
    ubytes = min(g, 4)
    unit = _UNITS[ubytes]
    esize = kv.dtype.itemsize
    hnd = kv.interior == "HND" and kv.block_size > 1
    o = kv.num_heads if hnd else 1
    inner = (kv.head_dim if hnd else kv.num_heads * kv.head_dim) * esize // ubytes
    cols, rows = tile_shape(kv.block_size * inner, TILE_BYTES // ubytes)
    to_v = lambda elems: elems * esize // g  # noqa: E731 - exact: g divides all of them
    offs = torch.tensor([to_v(x) for x in kv.layer_offsets], dtype=torch.int64).to(kv.device)
    nct = triton.cdiv(kv.block_size * inner, cols)
    paged = _alias(kv.layers[kv.base], unit)
    kv_stride, block_stride = to_v(kv.kv_stride), to_v(kv.block_stride)
    addrs = paged.data_ptr(), offs.data_ptr()
    return Plan(unit, g // ubytes, o, inner, cols, rows, offs, kv_stride, block_stride, nct, paged, g, *addrs)


def tile_shape(seg: int, tile: int) -> tuple[int, int]:
    """(COLS, ROWS) for segments of `seg` units and `tile` units per step: the widest power-of-2
    row slice that wastes at most 1/8 of each segment (else the least wasteful)."""
    c = min(tile, triton.next_power_of_2(seg))
    floor, best = min(16, c), None
    while c >= floor:
        waste = -seg % c
        if waste * 8 <= seg:
            return c, tile // c
        if best is None or waste < best[0]:
            best = (waste, c)
        c //= 2
    return best[1], tile // best[1]


def chunk_align(chunk: torch.Tensor) -> int:
    """A number every address of `chunk` the kernel sees is a multiple of. The interpreter reads
    the chunk through its storage (`_alias`), so the storage's base counts there too."""
    if INTERPRETING:
        return math.gcd(chunk.data_ptr(), chunk.untyped_storage().data_ptr())
    return chunk.data_ptr()


def grid_for(c: CacheLaunches, plan: Plan, n: int, n_layers: int, max_ctas, host_chunk: bool) -> int:
    """Programs of a launch over n blocks and n_layers layers (checked: rows fit int32)."""
    key = (plan.g, n, n_layers, max_ctas, host_chunk)
    grid = c.grids.get(key)
    if grid is None:
        kv = c.kv
        n_rows = n * n_layers * kv.num_kv * plan.o * plan.nct
        if n_rows + plan.rows >= 2**31:
            raise ValueError(f"block_ids: {n} blocks make {n_rows} rows, past the kernel's int32 row index")
        n_tiles = triton.cdiv(n_rows, plan.rows)
        if INTERPRETING:
            cap = 4
        elif host_chunk:
            cap = max(1, c.sms // UVA_SM_DIVISOR)
        else:
            cap = n_tiles
        grid = min(n_tiles, max_ctas or cap)
        if len(c.grids) >= MAX_GRIDS:
            c.grids.clear()  # callers of ever-new sizes: keep the table small, recomputing is cheap
        c.grids[key] = grid
    return grid


def launch(
    kv: PagedKV,
    ids_dev: torch.Tensor,
    chunk: torch.Tensor,
    last_valid: int,
    *,
    gather: bool,
    max_ctas,
    layers: tuple[int, int] | None = None,
    table: tuple[torch.Tensor, int] | None = None,
    check: int = 0,
    stamp: int = 0,
):
    """Launch on the current stream; arguments already validated. layers: (first, count) or all.
    table: (chunk_off, align) of a call over several chunks (`ops/slots.py`): block i's pieces
    start chunk_off[i] VEC-units from `chunk`; align divides every chunk address involved.
    check: 0 ids checked by the host; 1 (gather) and 2 (scatter, after `claim`, which gave
    `stamp`): checked by the kernel."""
    layer0, n_layers = layers if layers is not None else (0, kv.num_layers)
    if ids_dev.numel():
        run = prepare(
            kv,
            ids_dev,
            chunk,
            last_valid,
            gather=gather,
            max_ctas=max_ctas,
            n_layers=n_layers,
            table=table,
            check=check,
        )
        run(layer0, stamp)


def prepare(
    kv: PagedKV,
    ids_dev: torch.Tensor,
    chunk: torch.Tensor,
    last_valid: int,
    *,
    gather: bool,
    max_ctas,
    n_layers: int,
    table: tuple[torch.Tensor, int] | None = None,
    check: int = 0,
):
    """`launch`'s planning done once: returns run(layer0, stamp=0), which launches n_layers layers
    from layer0 on the current stream (a per-layer load launches L times with the same arguments)."""
    c = for_cache(kv)
    n = ids_dev.numel()
    plan = plan_for(kv, chunk_align(chunk) if table is None else table[1])
    host_chunk = chunk.device.type == "cpu" and not INTERPRETING
    key = (plan.g, n, n_layers, max_ctas, host_chunk, gather, table is None, check, ids_dev.dtype)
    fixed = c.fixed.get(key)
    if fixed is None:
        fixed = _fixed(
            c, kv, plan, n, n_layers, max_ctas, host_chunk, gather, table is not None, check, ids_dev.dtype
        )
        if len(c.fixed) >= MAX_GRIDS:
            c.fixed.clear()  # callers of ever-new sizes: keep the table small, recomputing is cheap
        c.fixed[key] = fixed
    grid, head, tail, consts, variant0, dtypes = fixed
    err = c.err if check else plan.layer_off  # unused without CHECK: any aligned address
    claims = c.claim if check == 2 else plan.layer_off
    off = ids_dev if table is None else table[0]  # 5th: unused without TABLE
    if INTERPRETING:
        ptrs = (plan.paged, plan.layer_off, ids_dev, _alias(chunk, plan.unit), off, err, claims)
        variant = variant0
    else:
        ptrs = (
            plan.paged_ptr,
            plan.layer_off_ptr,
            ids_dev.data_ptr(),
            chunk.data_ptr(),
            off.data_ptr(),
            err.data_ptr(),
            claims.data_ptr(),
        )
        variant = (*variant0, ptrs[2] % 16 == 0, ptrs[3] % 16 == 0, ptrs[4] % 16 == 0)

    n0, _, num_layers = head

    def run(layer0: int, stamp: int = 0) -> None:
        _launch(c, variant, grid, ptrs, dtypes, (n0, last_valid, num_layers, layer0, *tail, stamp), consts)

    return run


def _fixed(c, kv, plan, n, n_layers, max_ctas, host_chunk, gather, table, check, ids_dtype):
    """What a launch keeps for its block count, layer count, grid cap and variant: (grid, the
    integer arguments before and after layer0, constexprs, the variant's fixed part, dtypes)."""
    grid = grid_for(c, plan, n, n_layers, max_ctas, host_chunk)
    if check:
        c.flag()
    consts = (
        kv.num_kv,
        plan.o,
        kv.block_size,
        plan.inner,
        plan.cols,
        plan.rows,
        plan.vec,
        gather,
        table,
        check,
    )
    head = (n, 0, kv.num_layers)  # [1]: last_valid, per call
    tail = (n_layers, plan.kv_stride, plan.block_stride, c.num_blocks)
    off_dtype = torch.int64 if table else ids_dtype
    dtypes = (plan.unit, torch.int64, ids_dtype, plan.unit, off_dtype, torch.int32, torch.int32)
    return grid, head, tail, consts, (plan.g, gather, table, check, ids_dtype), dtypes


def claim(kv: PagedKV, ids_dev: torch.Tensor) -> int:
    """Before the launches of one lazily checked scatter (check 2), on the current stream: mark
    its ids in the cache's claims and count the bad ones; -> the stamp those launches take."""
    c = for_cache(kv)
    c.flag()
    stamp = c.stamp()
    n = ids_dev.numel()
    if n:
        grid = (triton.cdiv(n, CLAIM_BLOCK),)
        with _on_device(c):
            block_id_claim_kernel[grid](ids_dev, c.claim, c.err, n, c.num_blocks, stamp, BLOCK=CLAIM_BLOCK)
    return stamp


_CONST_NAMES = ("KV", "O", "BS", "I", "COLS", "ROWS", "VEC", "GATHER", "TABLE", "CHECK")


def _launch(c: CacheLaunches, variant, grid: int, ptrs, dtypes, ints, consts) -> None:
    """One launch of the copy kernel on the current stream of the cache's device."""
    if INTERPRETING:
        kv_copy_kernel[(grid,)](
            *ptrs, *ints, **dict(zip(_CONST_NAMES, consts, strict=True)), num_warps=NUM_WARPS
        )
        return
    fast = c.compiled.get(variant)
    if fast is not None and not _hooked():
        launcher, function, meta = fast
        idx = c.index
        if torch._C._cuda_getDevice() == idx:
            stream = torch._C._cuda_getCurrentRawStream(idx)
            launcher(grid, 1, 1, stream, function, meta, None, None, None, *ptrs, *ints, *consts)
            return
        with torch.cuda.device(idx):  # the kernel's function belongs to the device's context
            stream = torch._C._cuda_getCurrentRawStream(idx)
            launcher(grid, 1, 1, stream, function, meta, None, None, None, *ptrs, *ints, *consts)
        return
    # First launch of this variant (or a launch hook is installed): Triton's JIT entry, which
    # compiles or finds the kernel specialized for these arguments and returns it.
    args = tuple(_Ptr(a, d) for a, d in zip(ptrs, dtypes, strict=True))
    with _on_device(c):
        kernel = kv_copy_kernel[(grid,)](
            *args, *ints, **dict(zip(_CONST_NAMES, consts, strict=True)), num_warps=NUM_WARPS
        )
    if kernel is not None and hasattr(kernel, "function"):
        c.compiled[variant] = (kernel.run, kernel.function, kernel.packed_metadata)


def _hooked() -> bool:
    """A launch hook is installed (a profiler's): launch through the JIT entry, which calls it."""
    h = triton.knobs.runtime.launch_enter_hook
    return h is not None and bool(getattr(h, "calls", True))


def _on_device(c: CacheLaunches):
    return torch.cuda.device(c.index) if c.index is not None else contextlib.nullcontext()


def _alias(t: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """A 1-D `unit` tensor starting at t's first byte (to the end of t's storage)."""
    storage = t.untyped_storage()
    start = t.data_ptr() - storage.data_ptr()
    size = (storage.nbytes() - start) // unit.itemsize
    return torch.empty(0, dtype=unit, device=t.device).set_(storage, start // unit.itemsize, (size,), (1,))
