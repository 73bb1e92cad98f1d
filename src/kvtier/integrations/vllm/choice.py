"""Chooser: per request, how many of its leading held chunks to load and from which tiers, the rest
left to vLLM's prefill, with kvtier's planner (`kvtier.planner.plan`) fed by what this engine
measured. Torch-free: it runs in vLLM's scheduler.

    chooser.choose(tiers, computed, prompt_tokens, in_step) -> Choice
    chooser.steps            `StepTimes`: this engine's forward, from the steps vLLM ran
    chooser.rates            tier name -> (GB/s, fixed s) each tier delivered to the workers'
                             loads (`KVStore.read_rate`), "host": their copies into the GPU
    chooser.kinds            tier name -> "disk" (a worker's own lower tier) or "remote" (shared)

In vLLM a split is a shorter hit: the first K chunks are loaded and vLLM prefills the rest, after
them. Its time is a load of K chunks (each lower tier's read at its measured rate, the copies at
the host's) plus vLLM's prefill of the tokens after them: on each run of chunks held by one tier
the read grows linearly in K while the prefill left shrinks ever faster (attention), so the
fastest K is where a run of one tier ends. The candidates are those boundaries: K = every held
chunk (the full load), the end of each tier's run (a split), and none (a recompute). Each is one
`plan` of its K chunks (``prefill_ms``: `StepTimes`; ``pipelined``: False for a load in the
background, whose copies land before its forward; ``hit_fixed_ms``: half a step, the wait of a
background load that landed for the step it landed in to end). A full load gives way only to an
option predicted `MARGIN` faster.

A hit the host holds whole may load in the step, layer by layer under its forward, where
``load_async`` lets it (nothing else running). Each such K is planned both ways and done the faster
(`Choice.in_step`): in the step the copies hide under the forward but the step pays what loads in
a step cost this engine beyond that overlap (`StepTimes.in_step_extra_ms`: how much later than
planned the first tokens of such loads came); in the background they come first, whole, and the
request waits for a step. A short hit may then land sooner in the background, a long one in the
step.

Choice.budget_s is the deadline the plan gives a lower tier's read: the time after which the
load would finish later than recomputing would have (the recompute's predicted time less the
rest of the load: its copies, the wait for a step, its forward). A read not done by then is
abandoned and vLLM recomputes what did not land.

Before the engine ran a prefill of a chunk (nothing to compare with yet), or for a model whose
config the planner cannot read, every held chunk is loaded (`Choice.kind` "held"), its reads
bounded by ``cap_s``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.ceilings import Ceilings
from kvtier.models import ModelSpec
from kvtier.planner import plan, tier_path, transfer_parts
from kvtier.specs import get_gpu

from .step_times import StepTimes

log = logging.getLogger(__name__)
HOST = "host"
KINDS = ("load", "split", "recompute", "held")  # Choice.kind: "held" loads every held chunk, unplanned
MARGIN = 0.05  # a split or a recompute replaces the full load only when predicted this much faster
# The GPU whose host link (PCIe Gen5) the plans assume until the workers' loads measured theirs;
# the forward times are this engine's own (`StepTimes`), never this GPU's datasheet.
LINK_GPU = "h100-sxm"


@dataclass(frozen=True, slots=True)
class Choice:
    """kind: "load" (every held chunk), "split" (the first `chunks`), "recompute", or "held"
    (every held chunk, not planned). chunks: the leading chunks granted (0: none). tier: the
    tier they are read from (`_read_tier`; "host": no read). predicted_ms / recompute_ms: the planned
    first token and a recompute's (None: not planned). budget_s: how long their lower-tier reads
    may take (None: no lower-tier read). why: the plan's line. in_step: loaded in the step rather
    than in the background; step_extra_ms: then the cost of that (`StepTimes.in_step_extra_ms`)
    predicted_ms holds."""

    kind: str
    chunks: int
    tier: str
    predicted_ms: float | None
    recompute_ms: float | None
    budget_s: float | None
    why: str
    in_step: bool = False  # the host's copies run in the step that computes the rest, layer by layer
    step_extra_ms: float = 0.0  # in_step: what predicted_ms holds for such a load beyond the overlap


class Chooser:
    """spec: the model (`hfconfig.from_hf_dict` of vLLM's config; None: no plan, every held
    chunk loaded). block_size / chunk_tokens: vLLM's block and kvtier's chunk, in tokens.
    step_tokens: vLLM's ``max_num_batched_tokens``. kv_dtype: the cache's, as the planner names
    dtypes. cap_s: the longest a lower tier's read may hold a request (the plan's deadline is never
    later). enabled: False loads every held chunk (the ``choice: "load"`` setting)."""

    def __init__(
        self,
        spec: ModelSpec | None,
        block_size: int,
        chunk_tokens: int,
        step_tokens: int,
        *,
        kv_dtype: str = "bf16",
        cap_s: float = 2.0,
        enabled: bool = True,
    ) -> None:
        self.spec, self.block_size, self.chunk_tokens = spec, block_size, chunk_tokens
        self.kv_dtype, self.cap_s, self.enabled = kv_dtype, cap_s, enabled
        self.steps = StepTimes(step_tokens)
        self.rates: dict[str, tuple[float, float]] = {}
        self.kinds: dict[str, str] = {}
        self.chunk_bytes: int | None = None  # one rank's bytes of a chunk, as a worker reported them
        # A hybrid model's: one rank's bytes of a load of tokens [start, n chunks), per group as
        # it reads (a sliding window only its window's blocks, a state only the hit's end)
        self.load_bytes: Callable[[int, int], int] | None = None
        self._gpu = get_gpu(LINK_GPU)

    def choose(self, tiers: list[str], computed: int, prompt_tokens: int, in_step: bool) -> Choice:
        """tiers: the tier of each held chunk from the first (cut where a chunk is held by no tier
        the plan may use). computed: the tokens vLLM holds already (its own prefix cache, block
        aligned). prompt_tokens: the prompt's. in_step: a hit the host holds whole may load in
        the step, layer by layer under its forward (else in the background)."""
        ct, n = self.chunk_tokens, len(tiers)
        first = computed // ct  # chunks [0, first) are vLLM's own; chunk `first` may be in part
        if n * ct <= computed:
            return Choice("recompute", 0, HOST, None, None, None, "nothing held past vLLM's own cache")
        if not self.enabled or self.spec is None or not self.steps.ready(ct):
            why = "planning off" if not self.enabled or self.spec is None else "no prefill measured yet"
            read = tiers[first:]
            return Choice("held", n, _read_tier(read), None, None, self._cap(read), why, in_step)
        options, stepped = {}, {}
        for k in range(first + 1, n + 1):  # the end of each tier's run: where a faster K may lie
            if k == n or tiers[k] != tiers[k - 1]:
                options[k] = self._plan(tiers, k, computed, prompt_tokens, False)
                if in_step and all(t == HOST for t in tiers[first:k]):  # may load in the step
                    p = self._plan(tiers, k, computed, prompt_tokens, True)
                    if p.options["load"].ms < options[k].options["load"].ms:
                        options[k], stepped[k] = p, True
        recompute = next(iter(options.values())).options["recompute"].ms
        full = options[n].options["load"].ms
        best_k = min(options, key=lambda k: (options[k].options["load"].ms, -k))
        best = options[best_k].options["load"].ms
        if best > (1 - MARGIN) * full:  # a split must beat the full load by the margin
            best_k, best = n, full
        if recompute < best and recompute <= (1 - MARGIN) * full:  # and so must a recompute
            why = options[n].why
            return Choice("recompute", 0, HOST, recompute, recompute, None, f"recompute | {why}")
        p = options[best_k]
        kind = "load" if best_k == n else "split"
        read_tiers = tiers[first:best_k]
        budget = None
        if any(t != HOST for t in read_tiers):
            read, _ = transfer_parts(p.path, p.matched_tokens, p.kv_bytes_per_token)
            budget = min(self.cap_s, max(0.0, recompute - best + read) / 1e3)
        how = "in the step" if stepped.get(best_k) else "in the background"
        return Choice(
            kind,
            best_k,
            _read_tier(read_tiers),
            best,
            recompute,
            budget,
            f"{kind} {best_k} {how} | {p.why}",
            stepped.get(best_k, False),
            self.steps.in_step_extra_ms() if stepped.get(best_k) else 0.0,
        )

    def _plan(self, tiers: list[str], k: int, computed: int, prompt_tokens: int, in_step: bool):
        """`plan` of loading chunks [0, k) (past vLLM's `computed` tokens), prefilling the rest."""
        ct, moved = self.chunk_tokens, k * self.chunk_tokens - computed
        lower = [t for t in tiers[computed // ct : k] if t != HOST]
        background = bool(lower) or not in_step
        per_token = self._bytes_per_token(computed, k, moved)
        options = dict(
            ceilings=self._ceilings(),
            chunk_tokens=self.block_size,  # vLLM's own hit ends on a block: so may the load's start
            kv_dtype=self.kv_dtype,
            prefill_ms=lambda tokens, prefix: self.steps.prefill_ms(tokens, prefix + computed),
            pipelined=not background,
            # background: the step it lands in ends first; in the step: loads there cost the step
            hit_fixed_ms=self.steps.step_ms() / 2 if background else self.steps.in_step_extra_ms(),
            kv_bytes_per_token=per_token,
        )
        tier = HOST
        if lower:  # the prefix's read: each lower tier's chunks at its own rate, host chunks free
            seconds, fixed = 0.0, 0.0
            for name in dict.fromkeys(lower):
                gbps, fixed_s = self._read_rate(name)
                seconds += lower.count(name) * ct * per_token / (gbps * 1e9)
                fixed += fixed_s
            tier = "disk"  # a read hop at the rate given, then the host's copies
            options |= dict(read_gbps=moved * per_token / seconds / 1e9, read_fixed_ms=fixed * 1e3)
        return plan(self.spec, self._gpu, tier, moved, prompt_tokens - k * ct, **options)

    def _read_rate(self, name: str) -> tuple[float, float]:
        """(GB/s, fixed s) tier `name` delivered; before its first read, the datasheet's figure
        for its kind (a disk's NVMe, a remote's NIC)."""
        got = self.rates.get(name)
        if got is not None:
            return got
        return tier_path(self._gpu, self.kinds.get(name, "remote")).hops[0].gbps, 0.0

    def _ceilings(self) -> Ceilings | None:
        host = self.rates.get(HOST)
        return None if host is None else Ceilings(figures={"h2d_pinned_gbps": host[0]})

    def _bytes_per_token(self, computed: int, k: int, moved: int) -> float:
        """One rank's bytes per token a load of chunks up to ``k`` past vLLM's ``computed`` tokens
        moves (``moved`` tokens); ranks move theirs at once."""
        if self.load_bytes is not None:
            return self.load_bytes(computed, k) / moved
        if self.chunk_bytes:
            return self.chunk_bytes / self.chunk_tokens
        return self.spec.kv_bytes_per_token(self.kv_dtype)

    def _cap(self, tiers: list[str]) -> float | None:
        return self.cap_s if any(t != HOST for t in tiers) else None


def _read_tier(tiers: list[str]) -> str:
    """The tier a load of chunks in ``tiers`` is named by: "host" when none needs a read, else the
    lower tier read last (the one furthest down the request's prefix)."""
    lower = [t for t in tiers if t != HOST]
    return lower[-1] if lower else HOST
