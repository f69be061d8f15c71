"""The engine's session in its reader worker (kvxferd/worker/sessionreads.py): the session's rules, as the
control plane applies them (service/reads/path.py), checked on a real socket with the engine's own client
code reading it. Nothing here reaches a transfer: every read is refused, parked or failed before one (the
transfers themselves run against real daemons in tests/service/workers/test_sessions.py)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.frames import FrameReader, encode_frame
from kvxferd.wire.messages import pack_ids
from kvxferd.worker.reads import NoticeCollector
from kvxferd.worker.session import SessionFeed
from kvxferd.worker.sessionreads import SessionReads

LIMITS = {"max_reads": 4, "max_reads_per_batch": 3, "deadline_s": 30.0, "max_deadline_s": 600.0,
          "max_frame_bytes": 1 << 16}


class Untouched:
    """An executor that no read of these tests may reach."""

    def __getattr__(self, name):
        raise AssertionError(f"the executor was used ({name}) by a read that should not reach it")


class Engine:
    """The engine's end of a session: batches out, frames in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.frames = sock, FrameReader(1 << 20)
        sock.settimeout(2.0)

    def send(self, batch: pb.ReadBatch) -> None:
        self.sock.sendall(encode_frame(batch.SerializeToString()))

    def receive(self) -> list[pb.CompletionBatch]:
        """What came so far (waits for at least one frame)."""
        batches = []
        while not batches:
            data = self.sock.recv(1 << 16)
            if not data:
                break
            batches = [pb.CompletionBatch.FromString(p) for p in self.frames.feed(data)]
        return batches


@pytest.fixture
def session():
    told: list[dict] = []
    reads = SessionReads(Untouched(), NoticeCollector(), lambda message, fds: told.append(message))
    engines: list[Engine] = []

    def adopt(first: pb.ReadBatch, *, feed: dict | None = None, ready=()) -> Engine:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        engine = Engine(theirs)
        engines.append(engine)
        message = {"op": "session", "engine_id": "e", "limits": LIMITS, "ready": list(ready),
                   "pending": encode_frame(first.SerializeToString()).hex()}
        if feed is not None or reads.feed is None:
            message["feed"] = feed or {"last_seq": 0, "unacked": []}
        try:
            reads.adopt(message, [ours.fileno()])
        finally:
            ours.close()
        return engine

    reads.adopt_engine, reads.told = adopt, told
    yield reads
    reads.close()
    for engine in engines:
        engine.sock.close()


def spec(request_id: str, remote: str = "p", **fields) -> pb.ReadSpec:
    ids, sizes = pack_ids([[1, 2, 3]])
    return pb.ReadSpec(request_id=request_id, remote_engine_id=remote, remote_request_id=request_id,
                       local_block_ids=ids, local_group_sizes=sizes, remote_block_ids=ids, remote_group_sizes=sizes,
                       **fields)


def test_a_read_whose_link_is_not_ready_waits_and_a_link_never_handshaken_refuses_it(session):
    engine = session.adopt_engine(pb.ReadBatch(engine_id="e", reads=[spec("r1")]))
    assert {"op": "need_handshake", "engine_id": "p"} in session.told
    assert session.told[-1] == {"op": "session_stats", "reads": [], "in_flight": 1}  # (the daemon drains by it)
    assert "r1" in session.reads and session.reads["r1"].inflight is None  # parked, nothing posted
    session.handshake_failed("p", "remote_engine_id: no handshake with 'p' yet", 5)
    (batch,) = engine.receive()
    (completion,) = batch.completions
    assert (completion.request_id, completion.ok, completion.refused_code, completion.seq) == ("r1", False, 5, 1)
    assert not session.reads


def test_a_parked_read_past_its_deadline_fails_with_every_local_block_invalid(session):
    engine = session.adopt_engine(pb.ReadBatch(engine_id="e", reads=[spec("r1", deadline_s=0.05)]))
    time.sleep(0.06)
    session.progress()
    (batch,) = engine.receive()
    (completion,) = batch.completions
    assert not completion.ok and not completion.refused_code and "deadline" in completion.error
    assert [list(b.ids) for b in completion.invalid_block_ids] == [[1, 2, 3]]


def test_the_sessions_rules_end_it_with_the_status_the_control_plane_would_give(session):
    cases = [(pb.ReadBatch(engine_id="other"), 3, "this session belongs to 'e'"),
             (pb.ReadBatch(engine_id="e", ack_seq=1), 3, "acks completions not sent yet"),
             (pb.ReadBatch(engine_id="e", reads=[spec(f"r{n}") for n in range(4)]), 3, "max_reads_per_batch"),
             (pb.ReadBatch(engine_id="e", control=True), 3, "control session")]
    for first, code, why in cases:
        engine = session.adopt_engine(first)
        batches = engine.receive()
        assert batches[-1].end_code == code and why in batches[-1].end_message, (first, batches)
        assert engine.sock.recv(1) == b""  # then closed
        assert session.socket is None and session.told[-1]["op"] == "session_closed"
    session.adopt_engine(pb.ReadBatch(engine_id="e"))  # the control: a well-formed first batch keeps it open
    assert session.socket is not None and not session.socket.ending


def test_refusals_limits_and_resends(session):
    engine = session.adopt_engine(pb.ReadBatch(engine_id="e", reads=[spec("r1"), spec("r1")]))
    (batch,) = engine.receive()  # the second r1 while the first is in flight: refused, INVALID_ARGUMENT
    assert [(c.request_id, c.refused_code) for c in batch.completions] == [("r1", 3)]
    engine.send(pb.ReadBatch(reads=[spec("r1", resend=True)]))  # a resend of what is in flight: skipped
    engine.send(pb.ReadBatch(reads=[spec("r2"), spec("r3"), spec("r4")]))  # 1 + 1 unacked + 2 -> r4 over 4
    time.sleep(0.05)
    session.on_readable()
    (batch,) = engine.receive()
    assert [(c.request_id, c.refused_code) for c in batch.completions] == [("r4", 8)]
    assert sorted(session.reads) == ["r1", "r2", "r3"]
    session.accepting = False  # the daemon drains: FAILED_PRECONDITION, as its own refusal
    engine.send(pb.ReadBatch(ack_seq=2, reads=[spec("r5")]))
    time.sleep(0.05)
    session.on_readable()
    (batch,) = engine.receive()
    assert [(c.request_id, c.refused_code, c.seq) for c in batch.completions] == [("r5", 9, 3)]
    assert "draining" in batch.completions[0].error


def test_holds_go_to_the_control_plane_and_its_answers_are_written_in_order(session):
    hold = pb.HoldRequest(engine_id="e", request_id="h1", block_ids=[pb.BlockIds(ids=[1, 2])])
    engine = session.adopt_engine(pb.ReadBatch(engine_id="e", holds=[hold], releases=[pb.ReleaseRequest(request_id="h0")]))
    (calls,) = [m for m in session.told if m["op"] == "session_calls"]
    relayed = pb.ReadBatch.FromString(bytes.fromhex(calls["frame"]))
    assert [h.request_id for h in relayed.holds] == ["h1"] and [r.request_id for r in relayed.releases] == ["h0"]
    assert not relayed.reads and not relayed.engine_id
    answers = [pb.CompletionBatch(holds=[pb.HoldAnswer(request_id="h1", incarnation="i", capability=b"c")]),
               pb.CompletionBatch(renewals=[pb.LeaseAnswer(unknown_request_ids=["h9"])])]
    for answer in answers:
        session.write_frame(answer.SerializeToString())
    received = []
    while len(received) < 2:
        received += engine.receive()
    assert received == answers  # in the order the control plane sent them


def test_a_dropped_session_closes_without_a_word_and_a_feedless_worker_numbers_on_from_the_ack(session):
    """``session_drop`` (the session goes to another generation): closed with no end frame, so the client
    opens it again, and its reads are gone from here. A worker that gets a session without the feed (it
    went to a generation that was replaced meanwhile) numbers on after the engine's ack."""
    engine = session.adopt_engine(pb.ReadBatch(engine_id="e", reads=[spec("r1")]))
    session.drop()
    assert engine.sock.recv(1 << 16) == b"" and not session.reads  # closed, and no frame before the close
    fresh = SessionReads(Untouched(), NoticeCollector(), lambda message, fds: None)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    first = pb.ReadBatch(engine_id="e", ack_seq=41, reads=[spec("r2"), spec("r2")])
    fresh.adopt({"op": "session", "engine_id": "e", "limits": LIMITS, "ready": [], "ack_seq": 41,
                 "pending": encode_frame(first.SerializeToString()).hex()}, [ours.fileno()])
    ours.close()
    (batch,) = Engine(theirs).receive()
    assert [(c.request_id, c.seq) for c in batch.completions] == [("r2", 42)]  # (the second r2, refused)
    fresh.close()
    theirs.close()


def test_a_new_session_gets_every_unacked_completion_and_the_old_one_ends_aborted(session):
    first = session.adopt_engine(pb.ReadBatch(engine_id="e", reads=[spec("r1"), spec("r1")]))
    (batch,) = first.receive()
    assert [c.seq for c in batch.completions] == [1]
    second = session.adopt_engine(pb.ReadBatch(engine_id="e", ack_seq=0))
    (end,) = first.receive()
    assert end.end_code == 10  # ABORTED: a newer session took over
    (again,) = second.receive()
    assert [(c.request_id, c.seq) for c in again.completions] == [("r1", 1)]
    second.send(pb.ReadBatch(ack_seq=1))
    time.sleep(0.05)
    session.on_readable()
    assert len(session.feed) == 0


def test_the_feed_a_worker_is_handed_is_checked():
    from kvxferd.errors import InvalidArgumentError

    done = [pb.Completion(request_id="a", seq=3), pb.Completion(request_id="b", seq=4)]
    feed = SessionFeed(4, done)
    assert (feed.last_seq, len(feed), feed.has("a")) == (4, 2, True)
    assert feed.put(pb.Completion(request_id="c")).seq == 5
    feed.ack(4)
    assert (len(feed), feed.has("a")) == (1, False)
    with pytest.raises(InvalidArgumentError):
        feed.ack(6)
    for bad in ([pb.Completion(seq=5)], [pb.Completion(seq=3), pb.Completion(seq=3)]):
        with pytest.raises(InvalidArgumentError):
            SessionFeed(4, bad)
    assert np.array_equal([c.seq for c in SessionFeed(4, done).queued], [3, 4])
