"""Pairing block ids per group: units against a brute force on token positions."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import BlockIdError, InvalidArgumentError, LayoutMismatchError
from kvxferd.layout.specs import AttentionSpec, MambaSpec
from kvxferd.plan.groups import CacheGroup, EngineCache, GroupPairing, RegionMemory, check_groups_compatible
from kvxferd.rig.verify.oracle import TokenSource

NUM_BLOCKS = 64


def brute_pairs(local_ids, remote_ids, bs_l, bs_r, num_tokens):
    """Every (local unit, remote unit) pair, found token by token."""
    unit = min(bs_l, bs_r)
    source = TokenSource(local_ids, remote_ids, bs_l, bs_r, num_tokens, NUM_BLOCKS)
    pairs = set()
    for block in local_ids:
        for token in range(0, bs_l, unit):
            remote, remote_token = source(np.array([block]), np.array([token]))
            if remote[0] >= 0:
                pairs.add((block * (bs_l // unit) + token // unit, int(remote[0]) * (bs_r // unit) + int(remote_token[0]) // unit))
    return pairs


sizes = st.sampled_from([(16, 16), (16, 32), (32, 16), (8, 32), (64, 16), (16, 48)])


@given(sizes=sizes, num_tokens=st.integers(1, 200), cached=st.integers(0, 6), policy=st.sampled_from(["prefix", "window"]),
       window=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_pairs_equal_brute_force(sizes, num_tokens, cached, policy, window, seed):
    bs_l, bs_r = sizes
    if max(sizes) % min(sizes):
        return
    rng = np.random.default_rng(seed)
    n_r, n_l = -(-num_tokens // bs_r), -(-num_tokens // bs_l)
    if policy == "prefix":
        n_l = max(0, n_l - cached)
    else:
        n_l, n_r = min(n_l, window), min(n_r, window + 1)
    local_ids, remote_ids = rng.permutation(NUM_BLOCKS)[:n_l], rng.permutation(NUM_BLOCKS)[:n_r]
    pairing = GroupPairing(policy, bs_l, bs_r, NUM_BLOCKS, NUM_BLOCKS)
    tokens = None if bs_l == bs_r and rng.random() < 0.5 else num_tokens
    local_units, remote_units = pairing.pair_units(local_ids, remote_ids, tokens, "g")
    assert len(local_units) == len(remote_units)
    assert set(zip(local_units.tolist(), remote_units.tolist())) == brute_pairs(local_ids, remote_ids, bs_l, bs_r, tokens)


def test_prefix_hit_reads_the_tail_and_a_full_hit_reads_nothing():
    pairing = GroupPairing("prefix", 16, 16, NUM_BLOCKS, NUM_BLOCKS)
    local, remote = pairing.pair_units([9, 8], [1, 2, 3, 4], None, "g")
    assert local.tolist() == [9, 8] and remote.tolist() == [3, 4]
    local, remote = pairing.pair_units([], [1, 2, 3], None, "g")
    assert len(local) == len(remote) == 0


def test_block_size_difference_in_both_directions():
    # prefill 32-token blocks, decode 16: prefill block 7 = decode units 14, 15.
    pairing = GroupPairing("prefix", 16, 32, NUM_BLOCKS, NUM_BLOCKS)
    local, remote = pairing.pair_units([4, 5, 6], [7, 9], 40, "g")
    assert list(zip(local.tolist(), remote.tolist())) == [(4, 14), (5, 15), (6, 18)]
    # decode 32, prefill 16 with one decode block cached: decode block 3 = units 6, 7.
    pairing = GroupPairing("prefix", 32, 16, NUM_BLOCKS, NUM_BLOCKS)
    local, remote = pairing.pair_units([3], [10, 11, 12, 13], 60, "g")
    assert list(zip(local.tolist(), remote.tolist())) == [(6, 12), (7, 13)]


def test_window_reads_only_blocks_both_list():
    pairing = GroupPairing("window", 16, 16, NUM_BLOCKS, NUM_BLOCKS)
    local, remote = pairing.pair_units([5, 6], [1, 2, 3], None, "g")
    assert list(zip(local.tolist(), remote.tolist())) == [(5, 2), (6, 3)]
    local, remote = pairing.pair_units([5, 6, 7], [3], None, "g")
    assert list(zip(local.tolist(), remote.tolist())) == [(7, 3)]


@pytest.mark.parametrize("call, field", [
    (lambda p: p.pair_units([1, 2, 3], [1, 2], None, "groups[0]"), "groups[0]"),  # more local than remote
    (lambda p: p.pair_units([64], [1], None, "groups[0]"), "groups[0].local_block_ids[0]"),
    (lambda p: p.pair_units([1], [-1], None, "groups[0]"), "groups[0].remote_block_ids[0]"),
    (lambda p: p.pair_units([1, 2], [1, 2], 10, "groups[0]"), "groups[0].local_block_ids"),  # 2 blocks for 10 tokens
])
def test_bad_requests_name_the_field(call, field):
    with pytest.raises(InvalidArgumentError) as err:
        call(GroupPairing("prefix", 16, 16, NUM_BLOCKS, NUM_BLOCKS))
    assert err.value.field == field


def test_differing_block_sizes_need_num_tokens_and_state_pages_pair_exactly():
    with pytest.raises(InvalidArgumentError) as err:
        GroupPairing("prefix", 16, 32, NUM_BLOCKS, NUM_BLOCKS).pair_units([1], [2], None, "g")
    assert err.value.field == "num_tokens"
    exact = GroupPairing("exact", None, None, NUM_BLOCKS, NUM_BLOCKS)
    assert [u.tolist() for u in exact.pair_units([3], [9], None, "g")] == [[3], [9]]
    with pytest.raises(InvalidArgumentError):
        exact.pair_units([3, 4], [9], None, "g")
    with pytest.raises(InvalidArgumentError):
        exact.pair_units([3], [], None, "g")
    # no local page: refused inside a read that restores other groups (the state would stay stale) ...
    with pytest.raises(InvalidArgumentError):
        exact.pair_units([], [9], None, "g")
    # ... and pairs nothing in a read that restores nothing at all (a release-only read, a one-token prompt)
    assert [u.tolist() for u in exact.pair_units([], [9], None, "g", restores_nothing=True)] == [[], []]
    with pytest.raises(BlockIdError):
        exact.pair_units([3], [NUM_BLOCKS], None, "g")


ATTN = AttentionSpec("packed_HND", num_blocks=8, num_kv_heads=4, head_size=8, block_size=16)
MAMBA = MambaSpec(num_blocks=8, num_heads=4, head_dim=4, num_groups=1, state_size=4, conv_window=3)


def test_group_and_engine_validation():
    with pytest.raises(InvalidArgumentError) as err:
        CacheGroup("mamba", ATTN)
    assert err.value.field == "spec"
    with pytest.raises(InvalidArgumentError):
        CacheGroup("mla", ATTN)
    with pytest.raises(InvalidArgumentError):
        CacheGroup("sliding", ATTN)
    # GDN-style linear attention is laid out like Mamba: whole pages, one to one.
    assert CacheGroup("linear", MAMBA).policy == "exact" and CacheGroup("linear", MAMBA).block_size is None
    assert CacheGroup("swa", ATTN).policy == "window" and CacheGroup("mla", ATTN.with_(layout="mla")).policy == "prefix"
    group = CacheGroup("full", ATTN, 2)
    need = ATTN.region().num_bytes
    with pytest.raises(InvalidArgumentError) as err:
        EngineCache("e", 1, 0, (group,), ((RegionMemory(0, need),),))
    assert err.value.field == "memory[0]"
    with pytest.raises(InvalidArgumentError) as err:
        EngineCache("e", 1, 0, (group,), ((RegionMemory(0, need), RegionMemory(need, need - 1)),))
    assert err.value.field == "memory[0][1].num_bytes"
    ok = EngineCache("e", 1, 0, (group,), ((RegionMemory(0, need), RegionMemory(need, need)),))
    other = EngineCache("f", 1, 0, (CacheGroup("full", ATTN.with_(block_size=24)),), ((RegionMemory(0, 1 << 20),),))
    with pytest.raises(LayoutMismatchError) as err:
        check_groups_compatible(ok, other)
    assert err.value.field == "groups[0].num_regions"
    other = EngineCache("f", 1, 0, (CacheGroup("full", ATTN.with_(block_size=24), 2),), ((RegionMemory(0, 1 << 20),) * 2,))
    with pytest.raises(LayoutMismatchError) as err:
        check_groups_compatible(ok, other)
    assert err.value.field == "groups[0].block_size"


@given(ids=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=8, unique=True), data=st.data(),
       policy=st.sampled_from(["prefix", "window", "exact"]))
def test_duplicate_decode_block_ids_are_refused(ids, data, policy):
    """Issue 14, defect 9: a local block listed twice in one read was accepted."""
    at = data.draw(st.integers(0, len(ids)))
    repeated = data.draw(st.sampled_from(ids))
    local = ids[:at] + [repeated] + ids[at:]
    sizes = (None, None) if policy == "exact" else (16, 16)
    pairing = GroupPairing(policy, *sizes, NUM_BLOCKS, NUM_BLOCKS)
    with pytest.raises(InvalidArgumentError) as err:
        pairing.pair_units(local, list(range(len(local))), None, "groups[0]")
    second = [n for n, b in enumerate(local) if b == repeated][1]
    assert err.value.field == f"groups[0].local_block_ids[{second}]"
    assert f"block id {repeated} is listed more than once" in err.value.message
    # Repeating a *remote* block is harmless (two local copies of it) and stays allowed.
    pairing.pair_units(list(range(len(local))), local, None, "groups[0]")
