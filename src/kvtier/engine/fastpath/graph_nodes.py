"""The DMA nodes of a captured staged graph, pointed at another pool slot of the same size; and
the few runtime calls that replay such a graph without torch (`Launcher`).

A staged graph's DMAs are memcpy nodes between a staging buffer (device) and the job's slot
(pinned host): the slot address is baked into them at capture. After instantiation `SlotNodes.find`
reads every memcpy node of the kept cudaGraph_t (cudaGraphGetNodes, cudaGraphNodeGetType,
cudaGraphMemcpyNodeGetParams), checks they are exactly the expected chunk copies (one side in
the slot, the other inside a staging buffer, the slot sides tiling the slot with no gap or
overlap) and remembers each host pointer's offset from the slot base. `retarget(base)` then
moves the host side of every node in the *exec* graph (cudaGraphExecMemcpyNodeSetParams, the
rest of the parameters as captured) before the caller enqueues the replay.

CUDA Runtime API, cudaGraphExecMemcpyNodeSetParams: "The modifications only affect future
launches of hGraphExec. Already enqueued or running launches of hGraphExec are not affected by
this call." So a retarget may follow a replay of the same exec that is still queued or running.
Anything unexpected raises `NodeError`; the caller then keys that graph by the slot address.

`Launcher` enqueues a replay as two runtime calls on a raw stream handle -- cudaMemcpyAsync of the
ids from a pinned buffer, cudaGraphLaunch of the exec -- instead of torch's stream switch, copy_
and CUDAGraph.replay; it also makes further execs of a kept graph (cudaGraphInstantiateWithFlags)
so that graphs.py can keep one exec per recent slot instead of moving one exec's nodes each job.
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import POINTER, byref, c_int, c_size_t, c_ulonglong, c_void_p
from dataclasses import dataclass
from types import SimpleNamespace

MEMCPY_NODE = 1  # cudaGraphNodeTypeMemcpy
KIND_H2D, KIND_D2H, KIND_DEFAULT = 1, 2, 4  # cudaMemcpyHostToDevice / DeviceToHost / Default


class cudaPos(ctypes.Structure):  # driver_types.h (CUDA 12 and 13)
    _fields_ = [("x", c_size_t), ("y", c_size_t), ("z", c_size_t)]


class cudaExtent(ctypes.Structure):
    _fields_ = [("width", c_size_t), ("height", c_size_t), ("depth", c_size_t)]


class cudaPitchedPtr(ctypes.Structure):
    _fields_ = [("ptr", c_void_p), ("pitch", c_size_t), ("xsize", c_size_t), ("ysize", c_size_t)]


class cudaMemcpy3DParms(ctypes.Structure):
    _fields_ = [
        ("srcArray", c_void_p),  # cudaArray_t
        ("srcPos", cudaPos),
        ("srcPtr", cudaPitchedPtr),
        ("dstArray", c_void_p),
        ("dstPos", cudaPos),
        ("dstPtr", cudaPitchedPtr),
        ("extent", cudaExtent),
        ("kind", c_int),  # enum cudaMemcpyKind
    ]


class NodeError(RuntimeError):
    """The graph's memcpy nodes cannot be retargeted (the graph stays keyed by its slot address)."""


@dataclass(frozen=True, slots=True)
class Copy:
    """One 1-D memcpy node: effective addresses (pointer + x position), bytes, cudaMemcpyKind."""

    src: int
    dst: int
    nbytes: int
    kind: int


def host_offsets(copies, host_side: str, base: int, nbytes: int, staging, expected: int) -> list[int]:
    """Offset from `base` of each copy's host side ("src" on loads, "dst" on saves). Raises
    NodeError unless there are `expected` copies, each between the slot [base, base + nbytes) and
    one staging buffer ((address, size) pairs), whose slot sides tile the slot exactly."""
    if len(copies) != expected:
        raise NodeError(f"{len(copies)} memcpy nodes, expected {expected}")
    kinds = (KIND_D2H if host_side == "dst" else KIND_H2D, KIND_DEFAULT)
    offsets = []
    for c in copies:
        host, dev = (c.dst, c.src) if host_side == "dst" else (c.src, c.dst)
        if c.kind not in kinds:
            raise NodeError(f"memcpy kind {c.kind}, expected one of {kinds}")
        off = host - base
        if c.nbytes <= 0 or off < 0 or off + c.nbytes > nbytes:
            raise NodeError(f"a memcpy's host side [{host:#x}, +{c.nbytes}) is not inside the slot")
        if not any(lo <= dev and dev + c.nbytes <= lo + size for lo, size in staging):
            raise NodeError(f"a memcpy's device side {dev:#x} is not inside a staging buffer")
        offsets.append(off)
    end = 0
    for off, k in sorted(zip(offsets, (c.nbytes for c in copies), strict=True)):
        if off != end:
            raise NodeError(f"the memcpys' host sides leave a gap or overlap at offset {end}")
        end += k
    if end != nbytes:
        raise NodeError(f"the memcpys cover {end} of the slot's {nbytes} bytes")
    return offsets


def moved(offsets, base: int) -> list[int]:
    """Host addresses of the nodes for a slot at `base` (same size): base + each offset."""
    return [base + off for off in offsets]


@functools.cache
def _api() -> SimpleNamespace:
    from kvtier.device.cudart import runtime

    lib, _ver, why = runtime()
    if lib is None:
        raise NodeError(why)
    P = POINTER

    def fn(name, *args):
        # Own prototypes: the shared CDLL's function objects keep their settings for other users.
        return ctypes.CFUNCTYPE(c_int, *args)((name, lib))  # AttributeError if the runtime lacks it

    try:
        return SimpleNamespace(
            get_nodes=fn("cudaGraphGetNodes", c_void_p, P(c_void_p), P(c_size_t)),
            node_type=fn("cudaGraphNodeGetType", c_void_p, P(c_int)),
            get_params=fn("cudaGraphMemcpyNodeGetParams", c_void_p, P(cudaMemcpy3DParms)),
            exec_set=fn("cudaGraphExecMemcpyNodeSetParams", c_void_p, c_void_p, P(cudaMemcpy3DParms)),
        )
    except AttributeError as e:
        raise NodeError(f"CUDA runtime lacks a graph call: {e}") from e


def _check(rc: int, what: str) -> None:
    if rc != 0:
        from kvtier.device.cudart import clear_last_error

        clear_last_error()  # handled here: torch's next check must not report it at an unrelated launch
        raise NodeError(f"{what} failed (cudaError {rc})")


class SlotNodes:
    """The host sides of one instantiated graph's memcpy nodes, movable to another slot."""

    def __init__(self, api, exec_handle: int, nodes: list, base: int):
        self._api, self._exec = api, c_void_p(exec_handle)
        self._nodes = nodes  # (node handle, params as captured, the host-side cudaPitchedPtr in them, offset)
        self.base = base  # the slot the exec's nodes point at now
        self.captured = base  # the slot the graph's own nodes point at (a new exec of it starts there)
        self.num_nodes = len(nodes)

    def for_exec(self, exec_handle: int) -> SlotNodes:
        """The same nodes in another exec instantiated from the same graph (at the captured slot)."""
        out = SlotNodes(self._api, exec_handle, self._nodes, self.captured)
        out.num_nodes = self.num_nodes
        return out

    @classmethod
    def find(
        cls, graph, host_side: str, base: int, nbytes: int, staging, expected: int, api=None
    ) -> SlotNodes:
        """`graph`: a torch CUDAGraph made with keep_graph=True, instantiated. Raises NodeError.
        api: the runtime's graph calls (None: the CUDA runtime torch loaded; a test passes a fake)."""
        api = api if api is not None else _api()
        g, ex = int(graph.raw_cuda_graph() or 0), int(graph.raw_cuda_graph_exec() or 0)
        if not g or not ex:
            raise NodeError("no cudaGraph_t / cudaGraphExec_t handle")
        count = c_size_t(0)
        _check(api.get_nodes(g, None, byref(count)), "cudaGraphGetNodes")
        handles = (c_void_p * count.value)()
        _check(api.get_nodes(g, handles, byref(count)), "cudaGraphGetNodes")
        copies, found = [], []
        for h in handles[: count.value]:
            t = c_int(-1)
            _check(api.node_type(h, byref(t)), "cudaGraphNodeGetType")
            if t.value != MEMCPY_NODE:
                continue
            p = cudaMemcpy3DParms()
            _check(api.get_params(h, byref(p)), "cudaGraphMemcpyNodeGetParams")
            if p.srcArray or p.dstArray or p.extent.height != 1 or p.extent.depth != 1:
                raise NodeError("a memcpy node is not a 1-D linear copy")
            if p.srcPos.y or p.srcPos.z or p.dstPos.y or p.dstPos.z:
                raise NodeError("a memcpy node has a 2-D/3-D position")
            src, dst = (p.srcPtr.ptr or 0) + p.srcPos.x, (p.dstPtr.ptr or 0) + p.dstPos.x
            copies.append(Copy(src, dst, p.extent.width, p.kind))
            side = p.dstPtr if host_side == "dst" else p.srcPtr  # a view into `p`: writes land in it
            found.append((c_void_p(h), p, side))
        offsets = host_offsets(copies, host_side, base, nbytes, staging, expected)
        # The pointer field's own offset: the effective address minus the node's x position.
        pos = [(p.dstPos.x if host_side == "dst" else p.srcPos.x) for _h, p, _s in found]
        nodes = [(h, p, s, off - x) for (h, p, s), off, x in zip(found, offsets, pos, strict=True)]
        out = cls(api, ex, nodes, base)
        out.num_nodes = count.value  # every node of the graph (kernels, memcpys, event waits ...)
        return out

    def retarget(self, base: int) -> None:
        """Point every node's host side at the slot at `base` (host-side calls only: the caller
        enqueues the replay after this returns). Raises NodeError: the exec is then unusable."""
        exec_set, ex = self._api.exec_set, self._exec
        self.base = None  # unknown until every node is updated
        for h, p, side, off in self._nodes:
            side.ptr = base + off
            # Updates the exec for launches enqueued after this call; launches already enqueued or
            # running keep the old slot (CUDA runtime API, cudaGraphExecMemcpyNodeSetParams).
            _check(exec_set(ex, h, byref(p)), "cudaGraphExecMemcpyNodeSetParams")
        self.base = base


@functools.cache
def _launch_api() -> SimpleNamespace:
    from kvtier.device.cudart import runtime

    lib, _ver, why = runtime()
    if lib is None:
        raise NodeError(why)

    def fn(name, *args):
        return ctypes.CFUNCTYPE(c_int, *args)((name, lib))  # own prototypes, as in _api()

    try:
        return SimpleNamespace(
            memcpy=fn("cudaMemcpyAsync", c_void_p, c_void_p, c_size_t, c_int, c_void_p),
            launch=fn("cudaGraphLaunch", c_void_p, c_void_p),
            instantiate=fn("cudaGraphInstantiateWithFlags", POINTER(c_void_p), c_void_p, c_ulonglong),
            destroy=fn("cudaGraphExecDestroy", c_void_p),
        )
    except AttributeError as e:
        raise NodeError(f"CUDA runtime lacks a call: {e}") from e


class Launcher:
    """A replay as runtime calls on raw handles (ints). Each raises NodeError on failure, after
    clearing the runtime's error; nothing is enqueued by a call that failed."""

    def __init__(self, api: SimpleNamespace | None = None):
        self._api = api if api is not None else _launch_api()

    def h2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Enqueue a copy of `nbytes` from pinned host `src` to device `dst` on `stream`."""
        _check(self._api.memcpy(dst, src, nbytes, KIND_H2D, stream), "cudaMemcpyAsync")

    def launch(self, exec_handle: int, stream: int) -> None:
        _check(self._api.launch(exec_handle, stream), "cudaGraphLaunch")

    def instantiate(self, graph_handle: int) -> int:
        """A new exec of the cudaGraph_t `graph_handle` (its nodes as captured)."""
        ex = c_void_p(0)
        _check(self._api.instantiate(byref(ex), graph_handle, 0), "cudaGraphInstantiateWithFlags")
        if not ex.value:
            raise NodeError("cudaGraphInstantiateWithFlags returned no exec")
        return ex.value

    def destroy(self, exec_handle: int) -> None:
        """Free an exec made by `instantiate`; no launch of it may still be queued or running."""
        _check(self._api.destroy(exec_handle), "cudaGraphExecDestroy")
