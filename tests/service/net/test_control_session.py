"""vLLM's scheduler process holds, renews and releases on a control session of the reads socket (issue #54,
item 3): no gRPC call, beside the engine's own session, and what breaks a rule ends only the control session."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvxferd.client import EngineClient
from kvxferd.client.readsock import ReadsSocketStream
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.wire.frames import reads_socket_path
from tests.service.helpers import GQA_GROUPS as GROUPS, frame, raw_session, two_block_request

C = grpc.StatusCode


class _NoGrpc:
    """A stub on which every call fails the test: the scheduler's client must not make one."""

    def __getattr__(self, name):
        raise AssertionError(f"the scheduler's client called {name} over gRPC")


@pytest.fixture(scope="module")
def cluster(workdir):
    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="ctl") as c:
        c.handshake()
        yield c


@pytest.fixture
def scheduler(cluster):
    """A client as vLLM's scheduler process has one: the workers' engine id and session, never registered."""
    worker = cluster.prefill_clients[0]
    client = EngineClient(worker.target)
    client.engine_id, client.session = cluster.prefill_id, worker.session
    client.stub = _NoGrpc()
    yield client
    client.close()


def _path(cluster) -> str:
    return reads_socket_path(cluster.prefill_daemons[0].engine_target.removeprefix("unix:"))


def test_holds_renewals_and_releases_go_over_the_control_session(cluster, scheduler):
    worker = cluster.prefill_clients[0]
    request = two_block_request("ctl-read", 1)
    answer = scheduler.hold_started(request.remote_request_id, request.remote_block_ids, lease_s=30)
    held = answer()  # sent, then waited for: nothing blocked in between
    assert held.incarnation == worker.incarnation and len(held.capability) == 16
    assert scheduler.control_session() is not None and isinstance(worker.reads._stream, ReadsSocketStream)
    assert scheduler.renew([request.remote_request_id, "ctl-unknown"], lease_s=30) == ["ctl-unknown"]
    # The hold placed on the control session is read and consumed; the engine's own session was not taken over.
    cluster.capabilities[request.remote_request_id] = (held.capability,)
    cluster.submit(request)
    (completion,) = cluster.completions(request)
    assert completion.ok, completion.error
    assert cluster.hold_events(request)[0].kind == pb.NotifyEvent.CONSUMED
    assert worker.reads.stream_error is None and worker.reads.on_socket
    cluster.reset_decode()
    released = two_block_request("ctl-released", 2)
    scheduler.hold(released.remote_request_id, released.remote_block_ids, lease_s=30)
    scheduler.release(released.remote_request_id)  # returns once sent
    event = cluster.hold_events(released)[0]
    assert event.kind == pb.NotifyEvent.EXPIRED and event.reason == "released"
    # Negative control: the same flow on a registered client's own session is not a control session.
    assert worker.control_session() is None


def test_a_refused_hold_or_renewal_is_answered_with_its_code_and_the_session_goes_on(cluster, scheduler):
    with pytest.raises(grpc.RpcError) as refused:
        scheduler.hold("ctl-bad", [np.array([10_000])] * len(GROUPS[0]))
    assert refused.value.code() == C.INVALID_ARGUMENT and "block_ids" in refused.value.details()
    with pytest.raises(grpc.RpcError) as too_long:
        scheduler.renew(["ctl-bad"], lease_s=10 ** 9)
    assert too_long.value.code() == C.INVALID_ARGUMENT and "lease_s" in too_long.value.details()
    request = two_block_request("ctl-after", 3)
    assert len(scheduler.hold(request.remote_request_id, request.remote_block_ids, lease_s=30).capability) == 16
    scheduler.release(request.remote_request_id)
    assert cluster.hold_events(request)[0].kind == pb.NotifyEvent.EXPIRED


def test_a_broken_control_session_fails_what_waits_and_the_next_call_opens_a_new_one(cluster, scheduler):
    request = two_block_request("ctl-broken", 4)
    control = scheduler.control_session()
    scheduler.hold(request.remote_request_id, request.remote_block_ids, lease_s=30)  # opens the session
    stream = control._stream
    stream.cancel()  # as a daemon restart or a broken connection would
    scheduler.release(request.remote_request_id)  # a new session: released there
    assert control._stream is not stream
    assert cluster.hold_events(request)[0].reason == "released"


def test_what_a_control_session_must_not_carry_ends_it_with_a_status(cluster):
    worker = cluster.prefill_clients[0]
    hello = pb.ReadBatch(engine_id=cluster.prefill_id, session=worker.session, control=True)
    spec = pb.ReadSpec(request_id="x", remote_engine_id="y")
    cases = [([hello, pb.ReadBatch(reads=[spec])], C.INVALID_ARGUMENT, "control session carries"),
             ([hello, pb.ReadBatch(ack_seq=1)], C.INVALID_ARGUMENT, "control session carries"),
             ([hello, pb.ReadBatch(control=True)], C.INVALID_ARGUMENT, "first batch"),
             ([hello, pb.ReadBatch(releases=[pb.ReleaseRequest(engine_id="someone-else", request_id="x")])],
              C.INVALID_ARGUMENT, "engine_id"),
             ([pb.ReadBatch(engine_id=cluster.prefill_id, session="forged", control=True)], C.UNAUTHENTICATED, "session")]
    for batches, code, text in cases:
        answers, end_code, message = raw_session(_path(cluster), [frame(b) for b in batches])
        assert end_code == code.value[0] and text in message, (code, message)
        assert not any(batch.completions for batch in answers)  # a control session gets no completions
    # A batch with one call of another engine does nothing of the rest: its good hold was never placed.
    good = pb.HoldRequest(request_id="ctl-partial", block_ids=[pb.BlockIds(ids=[5])] * len(GROUPS[0]), lease_s=30)
    mixed = pb.ReadBatch(holds=[good], releases=[pb.ReleaseRequest(engine_id="someone-else", request_id="x")])
    _, end_code, _ = raw_session(_path(cluster), [frame(hello), frame(mixed)])
    assert end_code == C.INVALID_ARGUMENT.value[0]
    assert worker.renew(["ctl-partial"], lease_s=30) == ["ctl-partial"]
    # Negative control: a control session that only holds is answered and not ended; the engine's session lives.
    hold = pb.HoldRequest(request_id="ctl-raw", block_ids=[pb.BlockIds(ids=[5])] * len(GROUPS[0]), lease_s=1)
    answers, end_code, _ = raw_session(_path(cluster), [frame(hello), frame(pb.ReadBatch(holds=[hold]))], num_batches=1)
    assert end_code == 0 and answers[0].holds[0].code == 0 and len(answers[0].holds[0].capability) == 16
    assert worker.reads.stream_error is None
