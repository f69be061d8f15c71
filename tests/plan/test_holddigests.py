"""A hold's digests against the blocks a read wrote (issue #59), with the read simulated from its plan.

Every TP pair, model and shape of the plan tests: a clean read matches its
holders' digests atom by atom. Then the faults only a digest catches (the
board sees a live hold each time), each shown to be real by the byte oracle:
a bit flipped in the holder's memory after the hold, an engine writing into
a held block, and a plan made from a wrong description of the holder's layout.
"""

from dataclasses import replace

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.engine import EngineTransferPlan
from kvxferd.plan.holddigests import HoldDigests, LocalDigests, check_read, digest_hold
from kvxferd.rig.verify.buffers import allocate_engine, check_buffers, expected_buffers
from kvxferd.rig.verify.damage import element_offset
from kvxferd.rig.verify.models import MODELS, model_groups, random_request
from kvxferd.rig.verify.simulate import apply_planned_read

from tests.plan.test_engine import SHAPES, TP_PAIRS
from tests.sampling import covering


def hold_digests(engine, request) -> HoldDigests:
    """What holder rank ``engine`` computes when the request's blocks are held."""
    return digest_hold(engine.cache, engine.buffers, request.remote_block_ids)


def check(plan, planned, decode, digests) -> tuple[list[np.ndarray], int]:
    """Every remote rank's part of a read against its digests: bad local blocks per group, atoms checked."""
    bad = [np.zeros(0, np.int64) for _ in planned.units]
    checked = 0
    local = LocalDigests(decode.cache, decode.buffers)
    for rank_plan in plan.rank_plans:
        result = check_read(local, plan.remotes[rank_plan.remote_rank], planned.units, plan.pairings, rank_plan.groups,
                            HoldDigests.decode(digests[rank_plan.remote_rank].encode()))  # as from the wire
        assert result.num_units_unverifiable == 0 and not result.malformed
        checked += result.num_atoms_checked
        bad = [np.union1d(a, b) for a, b in zip(bad, result.bad_block_ids)]
    return bad, checked


def setup(model, shape, p, d, r, seed=0, cached_tokens=32):
    prefill_groups, decode_groups = model_groups(model, shape)
    prefill = [allocate_engine("P", prefill_groups, p, q, tagged=True) for q in range(p)]
    decode = allocate_engine("D", decode_groups, d, r, tagged=False)
    rng = np.random.default_rng(seed)
    request = random_request("hit", prefill_groups, decode_groups, 77, rng, cached_tokens=cached_tokens,
                             window_tokens=20, contiguous=False)
    return prefill_groups, prefill, decode, request


@pytest.mark.parametrize("pair, model, shape", covering(TP_PAIRS, MODELS, list(SHAPES), product_of=2,
                                                        ids=lambda pair, model, shape: f"P{pair[0]}D{pair[1]}-{model}-{shape}"))
def test_a_clean_read_matches_its_holders_digests(pair, model, shape):
    p, d = pair
    for r in range(d):
        prefill_groups, prefill, decode, request = setup(model, SHAPES[shape], p, d, r, seed=p * 10 + d)
        digests = [hold_digests(engine, request) for engine in prefill]
        plan = EngineTransferPlan(decode.cache, [e.cache for e in prefill])
        planned = plan.plan_request(request)
        apply_planned_read(planned, decode, prefill)
        assert check_buffers(decode, expected_buffers(decode.cache, prefill_groups, request)) == []
        bad, checked = check(plan, planned, decode, digests)
        assert [b.tolist() for b in bad] == [[] for _ in bad] and checked > 0


def read_after(fault, model="gqa", p=2, d=1, shape="plain"):
    """A read whose holder suffers ``fault(prefill, request)`` after its digests were taken: (the oracle's
    complaints, the digests' bad blocks per group)."""
    prefill_groups, prefill, decode, request = setup(model, SHAPES[shape], p, d, 0)
    digests = [hold_digests(engine, request) for engine in prefill]
    fault(prefill, request)
    plan = EngineTransferPlan(decode.cache, [e.cache for e in prefill])
    planned = plan.plan_request(request)
    apply_planned_read(planned, decode, prefill)
    complaints = check_buffers(decode, expected_buffers(decode.cache, prefill_groups, request))
    bad, _ = check(plan, planned, decode, digests)
    return complaints, bad, request


def last_read_block(request, g=0):
    return int(request.remote_block_ids[g][-1])


def test_digest_catches_a_bit_flipped_in_the_holders_memory_after_the_hold():
    def flip(prefill, request):
        engine = prefill[1]
        offset, _ = element_offset(engine, 0, last_read_block(request))
        engine.buffers[0][1][offset + 3] ^= 0x10  # layer 1, the last held block's first head of rank 1

    complaints, bad, request = read_after(flip)
    assert complaints  # the fault is real: decode got a wrong byte
    assert bad[0].tolist() == [int(request.local_block_ids[0][-1])]  # and exactly that block is named


def test_digest_catches_an_engine_writing_into_a_held_block():
    def overwrite(prefill, request):
        engine = prefill[0]
        offset, _ = element_offset(engine, 0, last_read_block(request))
        engine.buffers[0][0][offset:offset + 256] = 0  # a new request's prefill landing in a held block

    complaints, bad, request = read_after(overwrite)
    assert complaints and bad[0].tolist() == [int(request.local_block_ids[0][-1])]


def test_digest_catches_a_plan_made_from_a_wrong_layout_of_the_holder():
    """The reader believes the holder stores each head's K for every token then V (kv_per_head) where it
    packs K|V per token (packed HND): the plan moves every byte the holder holds, to the wrong places."""
    prefill_groups, prefill, decode, request = setup("gqa", SHAPES["plain"], 1, 1, 0)
    digests = [hold_digests(engine, request) for engine in prefill]
    believed = prefill[0].cache
    wrong_groups = tuple(replace(g, spec=replace(g.spec, layout="kv_per_head")) for g in believed.groups)
    wrong = replace(believed, groups=wrong_groups)
    plan = EngineTransferPlan(decode.cache, [wrong])
    planned = plan.plan_request(request)
    apply_planned_read(planned, decode, prefill)
    assert check_buffers(decode, expected_buffers(decode.cache, prefill_groups, request))  # wrong bytes
    bad, _ = check(plan, planned, decode, digests)
    assert bad[0].tolist() == sorted(np.asarray(request.local_block_ids[0]).tolist())


def test_digests_from_the_wire_are_checked_before_use():
    _, prefill, _, request = setup("hybrid", SHAPES["plain"], 1, 1, 0)
    data = hold_digests(prefill[0], request).encode()
    again = HoldDigests.decode(data)
    assert again.encode() == data
    # (b"KD\x01...": the first format, atoms of 16 tokens: refused, never compared as corrupt)
    for bad in (b"", b"XX" + data[2:], b"KD\x01" + data[3:], data[:-1], data + b"\0", data[:40]):
        with pytest.raises(InvalidArgumentError):
            HoldDigests.decode(bad)


def _checked_against(digests_of_rank0):
    """A clean P1->D1 read checked against the given digests of its one holder rank."""
    prefill_groups, prefill, decode, request = setup("gqa", SHAPES["plain"], 1, 1, 0)
    plan = EngineTransferPlan(decode.cache, [e.cache for e in prefill])
    planned = plan.plan_request(request)
    apply_planned_read(planned, decode, prefill)
    true = hold_digests(prefill[0], request)
    result = check_read(LocalDigests(decode.cache, decode.buffers), plan.remotes[0], planned.units, plan.pairings,
                        plan.rank_plans[0].groups, digests_of_rank0(true))
    return result, request


def _replace_field(true, **changes):
    group = true.groups[0]
    field = replace(group.fields[0], **changes)
    return HoldDigests((replace(group, fields=(field,)),))


@pytest.mark.parametrize("name, forge", [
    ("no groups", lambda true: HoldDigests(())),
    ("other chunks", lambda true: _replace_field(true, chunk_ids=true.groups[0].fields[0].chunk_ids + 1)),
    ("no chunks", lambda true: _replace_field(true, chunk_ids=np.zeros(0, np.int64),
                                              digests=true.groups[0].fields[0].digests[:, :, :0])),
    ("no atoms", lambda true: _replace_field(true, digests=true.groups[0].fields[0].digests[:, :0])),
    ("atoms of 0 tokens", lambda true: HoldDigests((replace(true.groups[0], tokens_per_atom=0),))),
    ("no blocks", lambda true: HoldDigests((replace(true.groups[0], block_ids=np.zeros(0, np.int64), fields=(
        replace(true.groups[0].fields[0], digests=true.groups[0].fields[0].digests[:0]),)),))),
    ("another field", lambda true: HoldDigests((replace(true.groups[0], fields=(
        replace(true.groups[0].fields[0], name="latent"),)),))),
])
def test_digests_that_do_not_describe_the_holders_cache_fail_every_block_they_cover(name, forge):
    """Digests from the wire that lack what the holder's own description says they must hold (found by the
    review of issue #59: such digests used to pass, compare nothing, or crash) name every block read."""
    result, request = _checked_against(lambda true: HoldDigests.decode(forge(true).encode()))
    assert result.malformed or name == "no blocks", name  # (well formed: it holds none of the blocks read)
    assert result.bad_block_ids[0].tolist() == sorted(np.asarray(request.local_block_ids[0]).tolist())
    control, _ = _checked_against(lambda true: true)
    assert not control.malformed and control.bad_block_ids[0].tolist() == []


def test_decoding_is_bounded_by_what_a_cache_can_hold():
    from kvxferd.plan.holddigests import MAGIC, MAX_GROUPS

    data = MAGIC + (MAX_GROUPS + 1).to_bytes(2, "little") + b"\0" * 64
    with pytest.raises(InvalidArgumentError, match="groups"):
        HoldDigests.decode(data)


def test_a_pairing_whose_units_are_not_whole_atoms_is_refused_digests_never_passed_unchecked():
    """Decode blocks of 4 tokens against 16-token prefill blocks read half atoms (8 tokens): such a read with
    digests is refused, not served as checked. Blocks of 8 read whole atoms, and are checked."""
    from kvxferd.errors import UnavailableError
    from kvxferd.plan.holddigests import check_verifiable
    from kvxferd.rig.verify.models import ModelShape

    def pairings(decode_block):
        shape = ModelShape(num_layers=1, num_kv_heads=2, head_size=32, block_size=decode_block,
                           prefill_block_size=16, decode_block_size=decode_block, num_blocks=16)
        prefill_groups, decode_groups = model_groups("gqa", shape)
        prefill = allocate_engine("P", prefill_groups, 1, 0, tagged=True)
        decode = allocate_engine("D", decode_groups, 1, 0, tagged=False)
        return EngineTransferPlan(decode.cache, [prefill.cache]).pairings

    check_verifiable(pairings(8))
    with pytest.raises(UnavailableError, match="not whole digest atoms of 8"):
        check_verifiable(pairings(4))
