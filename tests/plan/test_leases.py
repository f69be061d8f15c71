"""Hold table: every hold ends exactly once; a notice counts only while held; the board mirrors the holds."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError, ResourceExhaustedError
from kvxferd.plan.board import HoldBoard, hold_tag
from kvxferd.plan.capability import hold_capability
from kvxferd.plan.leases import CONSUMED, EXPIRED, HoldTable
from kvxferd.plan.notifications import ReadNotice

KEY = bytes(range(32))


def HoldTable(board=None, max_hold_s=float("inf")):  # noqa: N802 - the table under test, with this module's key
    from kvxferd.plan.leases import HoldTable as Table

    return Table(KEY, board, max_hold_s)


def tag(rid: str, blocks=()) -> int:
    """The board tag of holding ``blocks`` for ``rid`` with this module's key."""
    return hold_tag(hold_capability(KEY, rid, blocks))


def test_a_later_hold_of_the_same_request_on_other_blocks_has_another_tag():
    """Issue 35: a capability replayed after its hold ended must find no tag, even when the request id is
    held again (on other blocks): the tag seals the blocks, not just the request id."""
    table = HoldTable(HoldBoard(4))
    table.hold("r", ((1, 2),), 10, now=0)
    table.release("r")
    table.hold("r", ((7, 8),), 10, now=0)
    assert table.board.contains(tag("r", ((7, 8),))) and not table.board.contains(tag("r", ((1, 2),)))


def notice(rid="r", reader=0, expected=2, ok=True, blocks=()):
    """A reader's notice carrying the capability of holding ``blocks`` for ``rid`` (as a reader was given)."""
    return ReadNotice(rid, "dec", reader, expected, ok, capability=hold_capability(KEY, rid, blocks))


def test_consumed_after_every_reader_and_only_then():
    table = HoldTable()
    assert table.hold("r", ((1, 2),), 10, now=0) == hold_capability(KEY, "r", ((1, 2),))
    first = table.record(notice(reader=0, blocks=((1, 2),)), now=1)
    assert first.alive and first.end is None
    assert table.record(notice(reader=0, blocks=((1, 2),)), now=1).end is None  # a repeated reader counts once
    last = table.record(notice(reader=1, blocks=((1, 2),)), now=2)
    assert last.alive and last.end.kind == CONSUMED and last.end.block_ids == ((1, 2),)
    assert len(table) == 0 and not table.record(notice(reader=1, blocks=((1, 2),)), now=2).alive


def test_a_notice_counts_only_with_the_holds_capability():
    """Issue 35: any introduced reader's notice naming a request id ended that hold; now only a reader given
    the hold's capability counts (another tenant's reader, or a capability of other blocks, does not)."""
    table = HoldTable()
    table.hold("r", ((1, 2),), 10, now=0)
    for forged in (notice(expected=1), notice(expected=1, blocks=((1, 3),)),
                   ReadNotice("r", "dec", 0, 1, capability=hold_capability(bytes(32), "r", ((1, 2),)))):
        with pytest.raises(PermissionDeniedError):
            table.record(forged, now=1)
    assert len(table) == 1  # still held
    assert table.record(notice(expected=1, blocks=((1, 2),)), now=1).end.kind == CONSUMED


def test_expiry_is_exact_even_before_the_timer_runs():
    table = HoldTable()
    table.hold("r", (), 1.0, now=0)
    assert not table.record(notice(), now=1.0).alive  # lease over at 1.0, the expiry tick has not run
    (end,) = table.expire(now=1.0)
    assert end.kind == EXPIRED and end.reason == "lease" and table.expire(now=5) == []


def test_renew_release_and_failed_readers():
    table = HoldTable()
    table.hold("r", (), 1.0, now=0)
    assert table.renew(["r", "x"], 5.0, now=0.5) == ["x"]
    assert table.record(notice(ok=False), now=4).failed
    end = table.record(notice(reader=1), now=4).end
    assert end.kind == CONSUMED and end.failed_readers == (("dec", 0),)
    table.hold("q", (), 1.0, now=0)
    assert table.release("q").reason == "released"
    with pytest.raises(NotFoundError):
        table.release("q")
    table.hold("z", (), 1.0, now=0)
    with pytest.raises(InvalidArgumentError):
        table.hold("z", (), 1.0, now=0)
    with pytest.raises(InvalidArgumentError):
        table.record(notice("z", expected=2), now=0.1) and table.record(notice("z", reader=1, expected=3), now=0.1)
    assert [e.request_id for e in table.drop_all("engine gone")] == ["z"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "notice", "renew", "release", "tick"]),
                          st.integers(0, 3), st.integers(0, 2)), max_size=40))
def test_every_hold_ends_exactly_once(ops):
    """Random interleavings: holds end once; a notice counts only between hold and end; a hold's tag is on
    the board exactly while the table holds it, so it is gone before any end is returned."""
    table, now, live, ended, started = HoldTable(HoldBoard(2)), 0.0, set(), [], 0
    for op, rid_n, reader in ops:
        rid = f"r{rid_n}"
        now += 0.4
        if op == "hold" and rid not in live:
            table.hold(rid, (), 1.0, now)
            live.add(rid)
            started += 1
        elif op == "notice":
            out = table.record(notice(rid, reader, expected=3), now)
            assert out.alive == (rid in live and not _expired(table, rid, now))
            if out.end:
                ended.append(out.end)
                live.discard(rid)
        elif op == "renew":
            table.renew([rid], 1.0, now)
        elif op == "release" and rid in live:
            ended.append(table.release(rid))
            live.discard(rid)
        for end in table.expire(now):
            ended.append(end)
            live.discard(end.request_id)
        held = set(table.request_ids())
        assert {f"r{n}" for n in range(4) if table.board.contains(tag(f"r{n}"))} == held
        assert table.board.num_tags == len(held)
    ended += table.drop_all("end")
    assert len(ended) == started and table.board.num_tags == 0 and not table.board.words.any()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "renew", "release", "consume", "expire"]), st.integers(0, 5),
                          st.floats(0.1, 3.0), st.integers(1, 3)), max_size=60))
def test_expiry_matches_a_brute_force_model(ops):
    """The heap ends exactly the holds a full scan would, in bounded sweeps, whatever was renewed or reused;
    no renewal keeps a hold past ``max_hold_s`` after it began."""
    max_hold_s = 2.0
    table, model, ends_by, now = HoldTable(max_hold_s=max_hold_s), {}, {}, 0.0  # model: request id -> expires_s
    for op, rid_n, seconds, max_ends in ops:
        rid = f"r{rid_n}"
        now += 0.25
        if op == "hold" and rid not in model:
            table.hold(rid, ((rid_n,),), seconds, now)
            ends_by[rid] = now + max_hold_s
            model[rid] = min(now + seconds, ends_by[rid])
        elif op == "renew":
            unknown = table.renew([rid], seconds, now)
            alive = rid in model and model[rid] > now
            assert unknown == ([] if alive else [rid])
            if alive:
                model[rid] = max(model[rid], min(now + seconds, ends_by[rid]))
        elif op == "release" and rid in model:
            assert table.release(rid).block_ids == ((rid_n,),)
            del model[rid]
        elif op == "consume" and rid in model:
            out = table.record(notice(rid, 0, expected=1, blocks=((rid_n,),)), now)
            assert out.alive == (model[rid] > now)
            if out.alive:
                assert out.end.kind == "CONSUMED"
                del model[rid]
        elif op == "expire":
            due = {r for r, expires_s in model.items() if expires_s <= now}
            got = set()
            while True:  # sweeps of at most max_ends until nothing is due
                batch = table.expire(now, max_ends=max_ends)
                assert len(batch) <= max_ends
                if not batch:
                    break
                got |= {end.request_id for end in batch}
            assert got == due
            for r in due:
                del model[r]
        assert len(table) == len(model)


def test_expiry_cost_grows_with_what_ends_not_with_what_is_held():
    """100,000 holds: a sweep that ends nothing touches one heap entry; ending k costs k pops."""
    table = HoldTable()
    for n in range(100_000):
        table.hold(f"r{n}", (), 10.0 + n * 1e-4, 0.0)
    assert table.expire(5.0) == [] and len(table._deadlines) == 100_000
    ended = table.expire(10.0 + 99 * 1e-4 + 1e-9, max_ends=1000)
    assert [e.request_id for e in ended] == [f"r{n}" for n in range(100)]
    assert len(table) == 99_900


def _expired(table, rid, now):
    entry = table._holds.get(rid)
    return entry is not None and entry.expires_s <= now


def test_the_holders_own_reader_count_wins_over_a_notice():
    """A notice announcing one reader cannot end a hold the holder knows two readers need (issue 11, attack 4)."""
    table = HoldTable()
    table.hold("r", (), 10, now=0)
    with pytest.raises(InvalidArgumentError, match="expected_readers"):
        table.record(notice(expected=1), now=1, expected_readers=2)
    assert len(table) == 1  # still held
    assert table.record(notice(reader=0), now=1, expected_readers=2).end is None
    assert table.record(notice(reader=1), now=1, expected_readers=2).end.kind == CONSUMED


def test_a_hold_the_board_cannot_take_is_not_held():
    """Both buckets full: the hold is refused and nothing of it stays (table and board)."""
    table = HoldTable(HoldBoard(2))  # two buckets of eight: the 17th hold cannot fit
    for n in range(16):
        table.hold(f"r{n}", (), 10, now=0)
    with pytest.raises(ResourceExhaustedError):
        table.hold("r16", (), 10, now=0)
    assert len(table) == 16 and "r16" not in table.request_ids() and table.board.num_tags == 16
    table.release("r3")
    table.hold("r16", (), 10, now=0)
    assert table.board.contains(tag("r16")) and not table.board.contains(tag("r3"))


def test_layers_become_final_never_unfinal_and_only_while_held():
    """A push written layer by layer (issue #57): the hold says how many layers per group are final so far."""
    table = HoldTable()
    table.hold("r", ((1, 2), (3,)), 5.0, 0.0, b"d" * 32, layers_final=(0, 0))
    assert table.lookup("r", 1.0).layers_final == (0, 0)
    table.final_layers("r", (1, 0), 1.0)
    assert table.lookup("r", 1.0).layers_final == (1, 0)
    with pytest.raises(InvalidArgumentError, match="never become unfinal"):
        table.final_layers("r", (0, 1), 1.0)
    with pytest.raises(InvalidArgumentError, match="groups"):
        table.final_layers("r", (2,), 1.0)
    table.final_layers("r", None, 1.0)  # every layer
    assert table.lookup("r", 1.0).layers_final is None
    table.final_layers("r", None, 1.0)  # said again: nothing changes
    with pytest.raises(InvalidArgumentError, match="final already"):
        table.final_layers("r", (2, 1), 1.0)
    with pytest.raises(NotFoundError):
        table.final_layers("r", None, 6.0)  # past its lease
    with pytest.raises(NotFoundError):
        table.final_layers("other", (1, 1), 1.0)
    table.hold("whole", ((1,), (2,)), 5.0, 0.0)
    assert table.lookup("whole", 1.0).layers_final is None
