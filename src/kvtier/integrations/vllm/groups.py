"""KV cache groups: what each of vLLM's groups keeps of a chunk, and what a hit needs of it.

vLLM 0.33 gives a hybrid model one KV cache group per kind of layer, each with its own block
table over one shared block pool (`KVCacheConfig.kv_cache_groups`). Torch-free: the scheduler
side plans with it, the workers cut their stores by it.

    groups_of(kv_cache_config) -> (groups, refused)   the groups served, or why none is
    Group.unit(bpc)                   blocks a chunk keeps in this group (per chunk, its last ones)
    Group.unit_positions(c, bpc)      block positions of chunk c's unit
    Group.hit_chunks(n, bpc)          chunks whose units a hit ending at chunk n needs
    Group.first_needed(n, bpc)        the first block position that hit reads in this group
    Group.load_span(lo, n, bpc)       (first chunk, blocks of its unit skipped) loading [lo, n*bpc)
    Group.volatile                    vLLM frees or hands out this group's blocks while a request runs

Kinds served:
- ``full``: full attention, MLA and the DSA indexer (vLLM's `FullAttentionSpec` family): every
  block of every chunk, as a model of one group keeps them;
- ``window``: sliding-window attention (`SlidingWindowSpec`, window W): a hit ending at token T
  reads only the last ``need = ceil((W - 1) / block_size)`` blocks before T (vLLM's
  `SlidingWindowManager` hit rule; the blocks before them it fills with its null block), so each
  chunk keeps its last ``min(need, bpc)`` blocks, and a hit needs the units that cover those;
- ``state``: Mamba, gated delta net, short conv and other linear-attention layers (`MambaSpec`)
  under vLLM's prefix caching (``mamba_cache_mode="align"``): a block holds one state per layer
  (its conv and SSM tensors, the page padded to the attention page), the state after exactly
  the tokens up to that block's end. A chunk keeps the state at its end; a hit of n chunks needs
  exactly the state at chunk n, which vLLM reads from the block at position n * bpc - 1 (the one
  block it allocates there for an external hit; the positions before it hold its null block).
  vLLM's block table of this group is not append-only (it nulls interior states, frees them while
  the request runs), so its saves follow vLLM's own hand-off of each state it keeps
  (`KVConnectorBlockState.boundary_state_offloads`: request, group, block, tokens), never the
  table: `GroupPlan.states`.

Refused (the connector stays idle): a state group without prefix caching (vLLM keeps no state at
any block boundary then), with speculative decoding's state blocks, and any other kind (chunked
local attention, cross attention, EAGLE draft groups, groups vLLM marks as not transferable).
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, WINDOW, STATE = "full", "window", "state"


@dataclass(frozen=True)
class Group:
    """index: vLLM's group index (whose block table it uses). kind: FULL, WINDOW or STATE.
    block_size: this group's tokens per block. layers: its layer names. spec: the spec class's
    name (key identity). window: W (WINDOW only). part: which kind of layer within vLLM's group,
    where one group holds several (`UniformTypeKVCacheSpecs`: DeepSeek-V3.2's MLA latent and its
    DSA indexer share one block table, their pages apart). state_bytes: one layer's state in a
    block, its tensors packed, without the page's padding (STATE only)."""

    index: int
    kind: str
    block_size: int
    layers: tuple[str, ...]
    spec: str
    window: int | None = None
    part: int = 0
    state_bytes: int | None = None

    @property
    def label(self) -> str:
        """What tier keys of this group carry beside the layout: index, part, kind, window, spec."""
        w = f"{self.window}" if self.window is not None else ""
        return f"g{self.index}.{self.part}:{self.kind}{w}:{self.spec}"

    @property
    def need(self) -> int:
        """Blocks a hit reads before its end (WINDOW); 0 for FULL (every block)."""
        if self.window is None:
            return 0
        return max(1, -(-(self.window - 1) // self.block_size))

    @property
    def volatile(self) -> bool:
        """Whether vLLM frees this group's blocks while a request runs and hands them out again
        (a window's blocks behind it, a state group's interior states): a save still reading one
        must land before a step that hands it out writes it."""
        return self.kind != FULL

    def unit(self, bpc: int) -> int:
        if self.kind == STATE:
            return 1  # the chunk's last block: the state at its end
        return bpc if self.kind == FULL else min(bpc, self.need)

    def unit_positions(self, c: int, bpc: int) -> range:
        return range((c + 1) * bpc - self.unit(bpc), (c + 1) * bpc)

    def hit_chunks(self, n: int, bpc: int) -> range:
        if self.kind == FULL:
            return range(n)
        if self.kind == STATE:
            return range(n - 1, n)  # the state at the hit's end, no other
        per = self.unit(bpc)
        return range(max(0, n - -(-self.need // per)), n)

    def first_needed(self, n: int, bpc: int) -> int:
        if self.kind == STATE:
            return n * bpc - 1
        return 0 if self.kind == FULL else max(0, n * bpc - self.need)

    def load_span(self, lo: int, n: int, bpc: int) -> tuple[int, int] | None:
        """Loading block positions [max(lo, first needed), n * bpc): (its first chunk, blocks of
        that chunk's unit skipped); None when there is nothing to load."""
        lo = max(lo, self.first_needed(n, bpc))
        if lo >= n * bpc:
            return None
        c0 = lo // bpc
        return c0, lo - self.unit_positions(c0, bpc).start


def groups_of(kv_cache_config) -> tuple[list[Group], str | None]:
    """vLLM's groups as `Group`s, or ([], why) when one is of a kind not served. A config
    with one group (or none: a test's) is served as a full-attention model's, whatever its spec,
    but a state group's."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    found = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    out = []
    for i, g in enumerate(found):
        spec, name = g.kv_cache_spec, type(g.kv_cache_spec).__name__
        kinds = getattr(spec, "kv_cache_specs", None)
        if isinstance(kinds, dict):  # one block table over layers of several kinds: a part each
            parts: dict = {}
            for layer, sub in kinds.items():
                parts.setdefault(sub, []).append(layer)
            for p, (sub, layers) in enumerate(parts.items()):
                if type(sub) not in (FullAttentionSpec, MLAAttentionSpec) or not _plain(sub):
                    return [], f"group {i} holds {type(sub).__name__} layers, not served"
                out.append(Group(i, FULL, sub.block_size, tuple(layers), _name(sub), part=p))
            continue
        if isinstance(spec, MambaSpec):  # a state model of one group too: its table is no KV's
            why = "a draft or non-transferable group, not served" if _draft(g) else _state_refused(spec)
            if why is not None:
                return [], f"group {i} holds {name} state ({_kind_of(spec)}): {why}"
            layers = tuple(g.layer_names)
            out.append(Group(i, STATE, spec.block_size, layers, _name(spec), state_bytes=_state_bytes(spec)))
            continue
        if len(found) == 1:  # one group: served whatever its spec, as a full-attention model's
            out.append(Group(i, FULL, spec.block_size, tuple(g.layer_names), name))
            break
        if _draft(g):
            return [], f"group {i} ({name}) is a draft or non-transferable group, not served"
        if isinstance(spec, SlidingWindowSpec) and not getattr(spec, "extra_retained_tokens", 0):
            out.append(Group(i, WINDOW, spec.block_size, tuple(g.layer_names), name, spec.sliding_window))
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec) and _plain(spec):
            out.append(Group(i, FULL, spec.block_size, tuple(g.layer_names), _name(spec)))
        else:
            return [], f"group {i} ({name}) is of a kind not served"
    return out, None


def _draft(group) -> bool:
    return getattr(group, "is_eagle_group", False) or not getattr(group, "enable_kv_transfer", True)


def _name(spec) -> str:
    """A spec's class, and its role where it has one (MLA's latent, the indexer) or the kind of
    state layer (a state group's: gdn_attn, mamba2, ...)."""
    role = getattr(getattr(spec, "cache_role", None), "name", "") or (
        _kind_of(spec) if hasattr(spec, "mamba_type") else ""
    )
    return type(spec).__name__ + (f":{role}" if role else "")


def _kind_of(spec) -> str:
    """A state spec's kind of layer: its backend's enum name, lower case (vLLM's value is the
    backend's class path, which may move between releases; the keys must not)."""
    kind = getattr(spec, "mamba_type", "")
    name = getattr(kind, "name", None)
    return name.lower() if isinstance(name, str) else str(kind)


def _state_bytes(spec) -> int:
    """One layer's state in a block: its tensors (conv, SSM, ...) packed, as vLLM's state layers
    cut the page (`MambaBase.bind_kv_cache`), without the page's padding."""
    return int(spec.state_content_size_bytes)


def _state_refused(spec) -> str | None:
    """Why a state group cannot be served, None when it can. vLLM 0.33 keeps a state per block
    boundary only in mamba_cache_mode "align", which it sets from prefix caching (its
    --mamba-cache-mode flag has no effect)."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (
            f"mamba_cache_mode={mode!r}, so vLLM keeps no state at any block boundary to save or load "
            "into; start vLLM with --enable-prefix-caching (enable_prefix_caching=True), which sets "
            "mamba_cache_mode='align'"
        )
    if getattr(spec, "num_speculative_blocks", 0):
        return (
            f"num_speculative_blocks={spec.num_speculative_blocks} (speculative decoding's state "
            "blocks), not served; serve without --speculative-config"
        )
    return None


def _plain(spec) -> bool:
    """A full-attention spec vLLM keeps every block of, one state per token."""
    return not (
        getattr(spec, "sliding_window", None)
        or getattr(spec, "attention_chunk_size", None)
        or getattr(spec, "tokens_per_state", 1) != 1
    )


class GroupPlan:
    """A hybrid model's groups for the scheduler side: ``ct`` tokens per chunk, a multiple of
    every group's block size. Per request it answers from tier keys and block tables:

        tiers(keys, where) -> [tier]        per chunk of the hit every group holds, its slowest tier
        loads(ids, blocks, start, n, ...)   the load's runs, one per group with blocks to fill
        saves(ids, blocks, saved, n, ...)   the save's runs, one per block-table group with a unit
                                            to keep (a state group's are `states`')
        states(ids, offers, make)           the save's runs of the states vLLM handed off
    """

    def __init__(self, groups: list[Group], ct: int) -> None:
        for g in groups:
            if ct % g.block_size:
                raise ValueError(
                    f"chunk_tokens={ct}: a multiple of group {g.index}'s block_size={g.block_size}"
                )
        self.groups, self.ct = groups, ct
        self.bpcs = [ct // g.block_size for g in groups]
        self.volatile = any(g.volatile for g in groups)

    def tiers(self, keys, where) -> list[str]:
        """keys[c][g]: chunk c's tier keys in group g, one per rank; where(key) -> the tier
        holding it or None (also for a tier planned absent). The longest hit n such that every
        full group holds chunks [0, n) and every window group the units a hit at n needs, as
        vLLM's own hybrid lookup takes the longest prefix every group can serve; per chunk of
        it, the slowest tier among what the load reads ("host" first)."""
        host = "host"

        def tier(c: int, g: int) -> str | None:
            got = [where(k) for k in keys[c][g]]
            if None in got:
                return None
            return next((t for t in got if t != host), host)

        full = [i for i, g in enumerate(self.groups) if g.kind == FULL]
        prefix: list[str] = []
        for c in range(len(keys)):
            got = [tier(c, g) for g in full]
            if None in got:
                break
            prefix.append(next((t for t in got if t != host), host))
        for n in range(len(prefix), 0, -1):
            out = prefix[:n]
            for i, g in enumerate(self.groups):
                if g.kind == FULL:
                    continue
                for c in g.hit_chunks(n, self.bpcs[i]):
                    t = tier(c, i)
                    if t is None:
                        break
                    if out[c] == host:
                        out[c] = t
                else:
                    continue
                break
            else:
                return out
        return []

    def loads(self, ids, blocks, start: int, n: int, make) -> list:
        """Runs filling tokens [start, n * ct) of every group (``blocks``: vLLM's block ids per
        group; ``ids``: chunk ids 0..n-1); make(group, first chunk, ids, block ids, skip) builds one."""
        runs = []
        for i, g in enumerate(self.groups):
            bpc = self.bpcs[i]
            span = g.load_span(start // g.block_size, n, bpc)
            if span is None:
                continue
            c0, skip = span
            table = blocks[g.index]
            bids = [table[p] for c in range(c0, n) for p in g.unit_positions(c, bpc)][skip:]
            runs.append(make(i, c0, ids[c0:n], bids, skip))
        return runs

    def load_bytes(self, start: int, n: int, unit_bytes) -> int:
        """One rank's bytes `loads` moves for tokens [start, n * ct): every group's blocks, a
        window group's only those its window reads (``unit_bytes``: each group's bytes of a
        chunk's unit, as its store keeps it)."""
        total = 0
        for i, g in enumerate(self.groups):
            bpc = self.bpcs[i]
            span = g.load_span(start // g.block_size, n, bpc)
            if span is not None:
                c0, skip = span
                unit = g.unit(bpc)
                total += ((n - c0) * unit - skip) * unit_bytes[i] // unit
        return total

    def saves(self, ids, blocks, saved: int, before: int, make) -> tuple[int, list]:
        """Runs keeping chunks [saved, n) of every group, n the full chunks of ``ids`` whose blocks
        every group has; before: the tokens computed before the step (vLLM may have freed a window
        group's blocks below that window: its units there are not kept). make(group, ids, block
        ids) builds one. Returns (n, runs)."""
        tables = [(i, g) for i, g in enumerate(self.groups) if g.kind != STATE]
        n = min([len(ids)] + [len(blocks[g.index]) // self.bpcs[i] for i, g in tables])
        runs = []
        for i, g in tables:
            bpc, table = self.bpcs[i], blocks[g.index]
            alive = 0 if g.kind == FULL else max(0, before - g.window + 1) // g.block_size
            c = saved
            while c < n:  # a null (0) or freed block comes only before the units still held
                unit = g.unit_positions(c, bpc)
                if unit.start >= alive and all(table[p] for p in unit):
                    break
                c += 1
            if c < n:
                bids = [table[p] for k in range(c, n) for p in g.unit_positions(k, bpc)]
                runs.append(make(i, ids[c:n], bids))
        return n, runs

    def states(self, ids, offers, make) -> list:
        """Runs keeping the states vLLM handed off in a step: ``offers``, vLLM's (group index,
        block id, tokens) of each state it keeps (the state after exactly that many tokens, in
        that block); a state is chunk c's unit when its tokens are (c + 1) * ct and ``ids`` (the
        request's chunk ids) names chunk c. make(group, ids, block ids) builds one run per state
        group, its states in vLLM's order."""
        ct, out = self.ct, {}
        for gid, block, tokens in offers:
            c = tokens // ct - 1
            if block == 0 or tokens % ct or not 0 <= c < len(ids):
                continue  # vLLM's null block, a state inside a chunk, or past the chunks named
            for i, g in enumerate(self.groups):
                if g.kind == STATE and g.index == gid:
                    got = out.setdefault(i, ([], []))
                    got[0].append(ids[c])
                    got[1].append(block)
        return [make(i, run_ids, bids) for i, (run_ids, bids) in sorted(out.items())]
