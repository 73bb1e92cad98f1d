"""Launching the copy kernel (kernels/kv_copy.py) for one cache: what is planned once, and the
launch itself.

Everything a launch needs beyond its ids, chunk, valid tokens, first layer and stamp is a
property of the cache and the chunk's alignment, so it is worked out once and kept in the cache's
`PagedKV.plans` (under `PLANS_KEY`, a `CacheLaunches`): the units and tile shape per alignment
(`Plan`), and per (alignment, block count, layer count, grid cap, direction, check, ids dtype) a
`Launch` holding the grid, the constexprs and the fixed arguments; a call only binds its
addresses (`Launch.bind`) and fires (`Launch.fire`), on the current stream or one it names.

On CUDA the first launch of a variant goes through Triton's JIT entry, which binds and
specializes every argument and returns the compiled kernel; later launches of the same variant
call that kernel's launcher directly with plain addresses (what `kernel[grid](...)` ends in),
which skips the binding, the specialization and the cache-key work of the JIT entry. A variant is
everything Triton specializes on: the plan, the constexprs, the ids' dtype and whether the ids,
chunk and table addresses are 16-byte aligned (the cache's own addresses are fixed per plan).
The claim kernel of lazily checked writes (`claim`) is launched the same way, its variant the
ids' dtype and alignment. Under Triton's interpreter every launch goes through the JIT entry,
with tensors.

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
        self.num_blocks, self.num_layers = kv.num_blocks, kv.num_layers
        self.plans: dict[int, Plan] = {}
        self.grids: dict[tuple, int] = {}
        self.fixed: dict[tuple, Launch] = {}  # per block count, layer count, grid cap and variant
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


class Launch:
    """One launch shape of one cache, planned once (`launch_for`): everything but the ids, the
    chunk, `last_valid`, the first layer and the stamp, which each call gives."""

    __slots__ = ("c", "plan", "grid", "n", "n_layers", "consts", "dtypes", "variants", "tensors", "addrs")

    def __init__(
        self, c: CacheLaunches, plan: Plan, n: int, n_layers: int, grid: int, gather, table, check, dt
    ):
        self.c, self.plan, self.n, self.n_layers, self.grid = c, plan, n, n_layers, grid
        if check:
            c.flag()
        kv = c.kv
        self.consts = (kv.num_kv, plan.o, kv.block_size, plan.inner, plan.cols, plan.rows, plan.vec)
        self.consts += (gather, table, check)
        off_dtype = torch.int64 if table else dt
        self.dtypes = (plan.unit, torch.int64, dt, plan.unit, off_dtype, torch.int32, torch.int32)
        # What Triton specializes on beyond the plan: the 16-byte alignment of the ids, chunk and
        # offsets addresses, bits 2, 1, 0 of the index.
        fixed = (plan.g, gather, table, check, dt)
        self.variants = tuple((*fixed, i > 3, i & 2 > 0, i & 1 > 0) for i in range(8))
        err = c.err if check else plan.layer_off  # unused without CHECK: any aligned address
        claims = c.claim if check == 2 else plan.layer_off
        self.tensors = (err, claims)  # the last two pointer arguments, made once per cache
        self.addrs = (err.data_ptr(), claims.data_ptr())

    def __call__(self, ids_dev, chunk, last_valid: int, layer0=0, stamp=0, stream=None, off=None) -> None:
        """Launch on `stream` (a torch.cuda.Stream; None: the current one). off: the table of a
        call over several chunks (`ops/slots.py`), else None."""
        ptrs, variant = self.bind(ids_dev, chunk, off)
        self.fire(ptrs, variant, last_valid, layer0, stamp, stream)

    def bind(self, ids_dev, chunk, off=None) -> tuple[tuple, tuple | None]:
        """(the pointer arguments of calls on these tensors, their variant), for `fire`."""
        plan = self.plan
        if INTERPRETING:
            off = ids_dev if off is None else off  # 5th: unused without TABLE
            return (plan.paged, plan.layer_off, ids_dev, _alias(chunk, plan.unit), off, *self.tensors), None
        ids_p, chunk_p = ids_dev.data_ptr(), chunk.data_ptr()
        off_p = ids_p if off is None else off.data_ptr()
        variant = self.variants[(ids_p % 16 == 0) << 2 | (chunk_p % 16 == 0) << 1 | (off_p % 16 == 0)]
        return (plan.paged_ptr, plan.layer_off_ptr, ids_p, chunk_p, off_p, *self.addrs), variant

    def fire(self, ptrs: tuple, variant, last_valid: int, layer0: int, stamp: int, stream) -> None:
        """One launch with `bind`'s arguments."""
        c, plan = self.c, self.plan
        ints = (self.n, last_valid, c.num_layers, layer0, self.n_layers, plan.kv_stride, plan.block_stride)
        ints += (c.num_blocks, stamp)
        if INTERPRETING:
            kv_copy_kernel[(self.grid,)](
                *ptrs, *ints, **dict(zip(_CONST_NAMES, self.consts, strict=True)), num_warps=NUM_WARPS
            )
            return
        fast = c.compiled.get(variant)
        if fast is not None and not _hooked():
            _run_compiled(c, fast, self.grid, stream, (*ptrs, *ints, *self.consts))
            return
        # First launch of this variant (or a launch hook is installed): Triton's JIT entry, which
        # compiles or finds the kernel specialized for these arguments and returns it.
        args = tuple(_Ptr(a, d) for a, d in zip(ptrs, self.dtypes, strict=True))
        with _on_device(c), _on_stream(stream):
            kernel = kv_copy_kernel[(self.grid,)](
                *args, *ints, **dict(zip(_CONST_NAMES, self.consts, strict=True)), num_warps=NUM_WARPS
            )
        _keep(c, variant, kernel)


def launch_for(
    kv: PagedKV,
    n: int,
    align: int,
    ids_dtype: torch.dtype,
    host_chunk: bool,
    *,
    gather: bool,
    max_ctas,
    n_layers: int,
    table: bool = False,
    check: int = 0,
) -> Launch:
    """The `Launch` of n blocks and n_layers layers, arguments already validated. align: divides
    every chunk address the calls give (`chunk_align`); host_chunk: the chunk is pinned host
    memory (not under the interpreter); table: a call over several chunks (`ops/slots.py`);
    check: 0 ids checked by the host, 1 (gather) and 2 (scatter, after `claim`) by the kernel."""
    c = for_cache(kv)
    plan = plan_for(kv, align)
    key = (plan.g, n, n_layers, max_ctas, host_chunk, gather, table, check, ids_dtype)
    got = c.fixed.get(key)
    if got is None:
        grid = grid_for(c, plan, n, n_layers, max_ctas, host_chunk)
        got = Launch(c, plan, n, n_layers, grid, gather, table, check, ids_dtype)
        if len(c.fixed) >= MAX_GRIDS:
            c.fixed.clear()  # callers of ever-new sizes: keep the table small, recomputing is cheap
        c.fixed[key] = got
    return got


def launch(
    kv: PagedKV,
    ids_dev: torch.Tensor,
    chunk: torch.Tensor,
    last_valid: int,
    *,
    gather: bool,
    max_ctas,
    layers: tuple[int, int] | None = None,
    check: int = 0,
    stamp: int = 0,
):
    """Launch on the current stream; arguments already validated. layers: (first, count) or all.
    check: 0 ids checked by the host; 1 (gather) and 2 (scatter, after `claim`, which gave
    `stamp`): checked by the kernel."""
    layer0, n_layers = layers if layers is not None else (0, len(kv.layers))
    n = ids_dev.shape[0]
    if n:
        host_chunk = chunk.is_cpu and not INTERPRETING
        run = launch_for(
            kv,
            n,
            chunk_align(chunk),
            ids_dev.dtype,
            host_chunk,
            gather=gather,
            max_ctas=max_ctas,
            n_layers=n_layers,
            check=check,
        )
        run(ids_dev, chunk, last_valid, layer0, stamp)


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
    from layer0 on the current stream (a per-layer load launches L times with the same arguments).
    table: (chunk_off, align) of a call over several chunks (`ops/slots.py`): block i's pieces
    start chunk_off[i] VEC-units from `chunk`; align divides every chunk address involved."""
    align = chunk_align(chunk) if table is None else table[1]
    host_chunk = chunk.is_cpu and not INTERPRETING
    n = ids_dev.shape[0]
    shape = launch_for(
        kv,
        n,
        align,
        ids_dev.dtype,
        host_chunk,
        gather=gather,
        max_ctas=max_ctas,
        n_layers=n_layers,
        table=table is not None,
        check=check,
    )
    ptrs, variant = shape.bind(ids_dev, chunk, None if table is None else table[0])

    def run(layer0: int, stamp: int = 0) -> None:
        if n:
            shape.fire(ptrs, variant, last_valid, layer0, stamp, None)

    return run


def claim(kv: PagedKV, ids_dev: torch.Tensor) -> int:
    """Before the launches of one lazily checked scatter (check 2), on the current stream: mark
    its ids in the cache's claims and count the bad ones; -> the stamp those launches take."""
    c = for_cache(kv)
    c.flag()
    stamp = c.stamp()
    n = ids_dev.shape[0]
    if not n:
        return stamp
    grid = -(-n // CLAIM_BLOCK)
    if INTERPRETING:
        block_id_claim_kernel[(grid,)](ids_dev, c.claim, c.err, n, c.num_blocks, stamp, BLOCK=CLAIM_BLOCK)
        return stamp
    ids_p = ids_dev.data_ptr()
    # What Triton specializes the claim kernel on per call: the ids' dtype and 16-byte alignment
    # (the claims, the flag and num_blocks are the cache's own).
    variant = ("claim", ids_dev.dtype, ids_p % 16 == 0)
    fast = c.compiled.get(variant)
    if fast is not None and not _hooked():
        args = (ids_p, c.claim.data_ptr(), c.err.data_ptr(), n, c.num_blocks, stamp, CLAIM_BLOCK)
        _run_compiled(c, fast, grid, None, args)
        return stamp
    with _on_device(c):
        kernel = block_id_claim_kernel[(grid,)](
            ids_dev, c.claim, c.err, n, c.num_blocks, stamp, BLOCK=CLAIM_BLOCK
        )
    _keep(c, variant, kernel)
    return stamp


_CONST_NAMES = ("KV", "O", "BS", "I", "COLS", "ROWS", "VEC", "GATHER", "TABLE", "CHECK")


def _run_compiled(c: CacheLaunches, fast: tuple, grid: int, stream, args: tuple) -> None:
    """A compiled kernel's launcher called directly (what `kernel[grid](...)` ends in), on
    `stream` (None: the current stream of the cache's device). args: every kernel argument in
    order, pointers as addresses, constexprs included."""
    launcher, function, meta = fast
    idx = c.index
    if torch._C._cuda_getDevice() == idx:
        raw = torch._C._cuda_getCurrentRawStream(idx) if stream is None else stream.cuda_stream
        launcher(grid, 1, 1, raw, function, meta, None, None, None, *args)
        return
    with torch.cuda.device(idx):  # the kernel's function belongs to the device's context
        raw = torch._C._cuda_getCurrentRawStream(idx) if stream is None else stream.cuda_stream
        launcher(grid, 1, 1, raw, function, meta, None, None, None, *args)


def _keep(c: CacheLaunches, variant: tuple, kernel) -> None:
    """After a JIT launch: keep the compiled kernel's launcher for the next calls of `variant`."""
    if kernel is not None and hasattr(kernel, "function"):
        c.compiled[variant] = (kernel.run, kernel.function, kernel.packed_metadata)


def _hooked() -> bool:
    """A launch hook is installed (a profiler's): launch through the JIT entry, which calls it."""
    h = triton.knobs.runtime.launch_enter_hook
    return h is not None and bool(getattr(h, "calls", True))


def _on_device(c: CacheLaunches):
    return torch.cuda.device(c.index) if c.index is not None else contextlib.nullcontext()


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _alias(t: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """A 1-D `unit` tensor starting at t's first byte (to the end of t's storage)."""
    storage = t.untyped_storage()
    start = t.data_ptr() - storage.data_ptr()
    size = (storage.nbytes() - start) // unit.itemsize
    return torch.empty(0, dtype=unit, device=t.device).set_(storage, start // unit.itemsize, (size,), (1,))
