"""`groups.GroupPlan`, torch-free: what each KV cache group keeps of a chunk, which units a hit
needs, the load and save runs per group, against vLLM's sliding-window rule (a hit ending at T
reads the ceil((W - 1) / block_size) blocks before T; vLLM's null block, 0, before them) and its
state rule (a hit ending at T reads the one state after T tokens, from block T / block_size - 1)."""

from __future__ import annotations

from kvtier.integrations.vllm.groups import FULL, STATE, WINDOW, Group, GroupPlan

FULL_G = Group(1, FULL, 16, ("full",), "FullAttentionSpec")
WIN_128 = Group(0, WINDOW, 16, ("swa",), "SlidingWindowSpec", window=128)  # 8 blocks
WIN_1024 = Group(0, WINDOW, 16, ("swa",), "SlidingWindowSpec", window=1024)  # 64 blocks
GDN = Group(0, STATE, 16, ("gdn",), "MambaSpec:gdn_attn", state_bytes=4096)


def _keys(n: int, groups: int = 2) -> list:
    return [[(f"c{c}g{g}".encode(),) for g in range(groups)] for c in range(n)]


def test_a_window_keeps_its_last_blocks_and_a_hit_needs_only_those():
    assert (
        WIN_128.need == 8
        and WIN_128.unit(16) == 8
        and list(WIN_128.unit_positions(2, 16)) == list(range(40, 48))
    )
    assert list(WIN_128.hit_chunks(3, 16)) == [2] and list(FULL_G.hit_chunks(3, 16)) == [0, 1, 2]
    # 64 blocks of window: each chunk kept whole, a hit needs the last 4
    assert WIN_1024.unit(16) == 16 and list(WIN_1024.hit_chunks(6, 16)) == [2, 3, 4, 5]


def test_a_hit_is_the_longest_prefix_every_group_holds():
    plan = GroupPlan([WIN_128, FULL_G], 256)
    held = {k for c in range(5) for g in range(2) for k in _keys(5)[c][g]}
    where = lambda k: "host" if k in held else None  # noqa: E731
    assert plan.tiers(_keys(5), where) == ["host"] * 5
    held.discard(b"c4g0")  # the window's unit at the end of chunk 4
    assert plan.tiers(_keys(5), where) == ["host"] * 4  # chunk 3's window is held
    held -= {b"c3g0", b"c1g0"}
    assert plan.tiers(_keys(5), where) == ["host"] * 3
    held.discard(b"c0g1")  # the full group lacks the first chunk: nothing
    assert plan.tiers(_keys(5), where) == []
    slow = lambda k: None if k == b"c9" else ("disk" if k == b"c1g0" else "host")  # noqa: E731
    assert plan.tiers(_keys(2), slow) == ["host", "disk"]  # the load's slowest read per chunk


def test_loads_fill_each_group_from_where_vllm_holds_nothing():
    plan = GroupPlan([WIN_128, FULL_G], 64)  # 4 blocks a chunk; the window: 2 whole chunks
    blocks = [[0] * 8 + list(range(100, 112)), list(range(200, 220))]  # 20 blocks, nulls first

    def make(g, c0, ids, bids, skip):
        return (g, c0, ids, bids, skip)

    ids = [f"id{c}".encode() for c in range(5)]
    runs = plan.loads(ids, blocks, 0, 5, make)
    assert runs == [(0, 3, ids[3:], list(range(100, 112))[4:], 0), (1, 0, ids, list(range(200, 220)), 0)]
    runs = plan.loads(ids, blocks, 4 * 16 + 16, 5, make)  # vLLM's own cache ends 1 block into chunk 1
    assert runs[1] == (1, 1, ids[1:], list(range(205, 220)), 1)


def test_saves_skip_window_units_vllm_freed_or_nulled():
    plan = GroupPlan([WIN_128, FULL_G], 64)
    ids = [f"id{c}".encode() for c in range(5)]
    blocks = [[0] * 4 + list(range(104, 120)), list(range(200, 220))]

    def make(g, run_ids, bids):
        return (g, run_ids, bids)

    n, runs = plan.saves(ids, blocks, 0, 0, make)
    assert (
        n == 5
        and runs[0] == (0, ids[1:], list(range(104, 120)))
        and runs[1] == (1, ids, list(range(200, 220)))
    )
    n, runs = plan.saves(ids, blocks, 0, 4 * 64, make)  # 256 computed: blocks below 8 may be freed
    assert runs[0] == (0, ids[2:], list(range(108, 120)))


def test_groups_of_other_block_sizes_cut_the_same_chunks():
    """vLLM may give a window group larger blocks than the full one (its kernel's): a chunk is
    then fewer of its blocks, the window counted in them."""
    win = Group(0, WINDOW, 32, ("swa",), "SlidingWindowSpec", window=128)  # 4 blocks of 32
    plan = GroupPlan([win, FULL_G], 128)  # 4 blocks of 32, 8 of 16 a chunk
    assert plan.bpcs == [4, 8] and win.need == 4 and win.unit(4) == 4

    def make(g, c0, ids, bids, skip):
        return (g, c0, len(ids), bids, skip)

    ids = [f"id{c}".encode() for c in range(3)]
    blocks = [[0] * 8 + [108, 109, 110, 111], list(range(200, 224))]
    runs = plan.loads(ids, blocks, 0, 3, make)
    assert runs == [(0, 2, 1, [108, 109, 110, 111], 0), (1, 0, 3, list(range(200, 224)), 0)]
    runs = plan.loads(ids, blocks, 96, 3, make)  # vLLM's own cache: 3 blocks of 32, 6 of 16
    assert runs == [(0, 2, 1, [108, 109, 110, 111], 0), (1, 0, 3, list(range(206, 224)), 6)]


def test_a_state_group_keeps_each_chunks_last_state_and_a_hit_needs_the_one_at_its_end():
    plan = GroupPlan([GDN, FULL_G], 64)  # 4 blocks a chunk
    assert GDN.unit(4) == 1 and list(GDN.unit_positions(2, 4)) == [11] and list(GDN.hit_chunks(3, 4)) == [2]
    held = {k for c in range(5) for k in _keys(5)[c][1]} | {b"c2g0", b"c4g0"}  # states after 3 and 5
    where = lambda k: "host" if k in held else None  # noqa: E731
    assert plan.tiers(_keys(5), where) == ["host"] * 5
    held.discard(b"c4g0")
    assert plan.tiers(_keys(5), where) == ["host"] * 3  # every chunk's KV, a state only after 3
    held.discard(b"c2g0")
    assert plan.tiers(_keys(5), where) == []
    held.add(b"c0g0")
    held.discard(b"c1g1")  # the full group lacks chunk 1: the state after 1 chunk is the hit
    assert plan.tiers(_keys(5), where) == ["host"]


def test_a_state_loads_into_the_one_block_vllm_reads_and_saves_follow_its_hand_offs():
    plan = GroupPlan([GDN, FULL_G], 64)
    ids = [f"id{c}".encode() for c in range(4)]
    blocks = [[0] * 11 + [57], list(range(200, 212))]  # vLLM's table for an external hit of 3 chunks

    def make_load(g, c0, run_ids, bids, skip):
        return (g, c0, run_ids, bids, skip)

    assert plan.loads(ids, blocks, 0, 3, make_load) == [
        (0, 2, ids[2:3], [57], 0),
        (1, 0, ids[:3], blocks[1], 0),
    ]
    runs = plan.loads(ids, blocks, 16, 3, make_load)  # vLLM's own cache holds a block of the KV
    assert runs[0] == (0, 2, ids[2:3], [57], 0) and runs[1] == (1, 0, ids[:3], blocks[1][1:], 1)

    def make(g, run_ids, bids):
        return (g, run_ids, bids)

    # the state group's table (nulled interior states) is never read for saves: n from the KV's
    n, runs = plan.saves(ids, [[0] * 3 + [9], list(range(200, 216))], 0, 0, make)
    assert n == 4 and runs == [(1, ids, list(range(200, 216)))]
    # vLLM's hand-offs: (group, block, tokens); inside a chunk, the null block, another group's
    # or past the chunks named are not kept
    offers = [(0, 57, 192), (0, 33, 100), (0, 0, 128), (1, 5, 64), (0, 44, 64), (0, 46, 320)]
    assert plan.states(ids, offers, make) == [(0, [ids[2], ids[0]], [57, 44])]
