"""What a reader worker serving an engine's session tells its control plane is untrusted
(service/net/sessions.py, service/workers/readbackend.py): malformed or hostile events change nothing
beyond that engine's own session, raise nothing on the loop, and a worker that floods its control plane
is cut off (killed as out of protocol) instead of growing the loop's queue."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.base.config import DaemonConfig
from kvxferd.service.base.metrics import Metrics
from kvxferd.service.net.sessions import WorkerSessions
from kvxferd.service.workers.readbackend import MAX_SESSION_EVENTS_PENDING, WorkerReadBackend


class Supervisor:
    def __init__(self) -> None:
        self.sent: list[tuple[int, dict]] = []
        self.serving_generation, self.failure = 3, ""

    def send_to(self, generation: int, message: dict, fds=()) -> int:
        self.sent.append((generation, message))
        return generation

    def send(self, message: dict, fds=()) -> int:
        return self.send_to(self.serving_generation, message, fds)


class Reader:
    def __init__(self) -> None:
        self.supervisor, self.taken, self.ready = Supervisor(), 0, []

    def session_event_taken(self) -> None:
        self.taken += 1

    def link_ready(self, engine_id: str, ready: bool) -> None:
        self.ready.append((engine_id, ready))


@pytest.fixture
def parts():
    reader = Reader()
    slot = SimpleNamespace(engine_id="e", reader_worker=reader, links={}, reads={}, closing=False,
                           worker_reads_in_flight=0)
    daemon = SimpleNamespace(config=DaemonConfig(), metrics=Metrics(),
                             registry=SimpleNamespace(slots={"e": slot}), spawn=lambda coro: coro.close())
    return WorkerSessions(daemon), slot, reader, daemon


def metric(daemon, name: str, labels: dict | None = None) -> float:
    return daemon.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_malformed_events_change_nothing_and_raise_nothing(parts):
    sessions, slot, reader, daemon = parts
    hostile = [{"op": "session_calls", "frame": "zz"}, {"op": "session_calls"},
               {"op": "session_calls", "frame": pb.ReadBatch(reads=[pb.ReadSpec(request_id="x")]).SerializeToString().hex()},
               {"op": "session_stats", "reads": "no"}, {"op": "session_stats", "in_flight": -5},
               {"op": "session_stats", "in_flight": 1 << 40, "reads": [[True, "none", -1, 2, 3, 4, 5, False],
                                                                         ["x"] * 8, [1] * 9, None]},
               {"op": "link_stale", "engine_id": ["not", "a", "name"]}, {"op": "capability_refused"},
               {"op": "session_closed", "code": 99}, {"op": "session_closed", "code": "x"}]
    for message in hostile:
        sessions.on_event(slot, message)
    assert reader.supervisor.sent == [] and slot.worker_reads_in_flight == 0
    assert metric(daemon, "kvxferd_read_bytes_total") == 0
    assert reader.taken == len(hostile)  # each event counted as taken (the flood bound)
    # The control: well-formed events do count.
    sessions.on_event(slot, {"op": "session_stats", "in_flight": 2,
                             "reads": [[True, "none", 0.001, 4096, 2, 0, 0.0005, False]]})
    assert slot.worker_reads_in_flight == 2 and metric(daemon, "kvxferd_read_bytes_total") == 4096


def test_holds_of_another_engine_end_the_session_of_the_generation_that_sent_them(parts):
    sessions, slot, reader, _ = parts
    calls = pb.ReadBatch(holds=[pb.HoldRequest(engine_id="someone-else", request_id="h")])
    sessions.on_event(slot, {"op": "session_calls", "frame": calls.SerializeToString().hex(), "generation": 2})
    ((generation, message),) = reader.supervisor.sent
    assert generation == 2 and message["op"] == "session_end" and message["code"] == 3
    assert "belongs to 'e'" in message["message"]


def test_a_handshake_for_a_link_never_made_is_refused_and_asks_are_rate_limited(parts):
    sessions, slot, reader, daemon = parts
    sessions.on_event(slot, {"op": "need_handshake", "engine_id": "nobody"})
    ((_, message),) = reader.supervisor.sent
    assert message == {"op": "handshake_failed", "engine_id": "nobody", "refused_code": 5,
                       "error": "remote_engine_id: no handshake with 'nobody' yet"}
    spawned = []
    daemon.spawn = lambda coro: (spawned.append(coro), coro.close())
    slot.links["p"] = SimpleNamespace(remote=object(), ready=False, remote_engine_id="p")
    for _ in range(50):  # a worker asking in a loop starts one handshake
        sessions.on_event(slot, {"op": "need_handshake", "engine_id": "p"})
    assert len(spawned) == 1
    slot.links["p"].ready = True
    sessions.on_event(slot, {"op": "need_handshake", "engine_id": "p"})
    assert reader.ready == [("p", True)]  # a ready link: told at once, nothing started


def test_a_worker_that_floods_its_control_plane_is_out_of_protocol():
    backend = WorkerReadBackend.__new__(WorkerReadBackend)
    backend._state, backend.session_events_pending, backend.current = threading.Condition(), 0, {}
    backend.supervisor = SimpleNamespace(serving_generation=1)
    queued = []
    backend.on_session = queued.append  # the loop never gets to them
    for _ in range(MAX_SESSION_EVENTS_PENDING):
        backend._session_event(1, {"op": "session_stats"})
    with pytest.raises(InvalidArgumentError):  # the supervisor kills a worker whose message raises
        backend._session_event(1, {"op": "session_stats"})
    backend.session_event_taken()  # the loop took one: there is room again
    backend._session_event(1, {"op": "session_stats"})
    assert len(queued) == MAX_SESSION_EVENTS_PENDING + 1 and queued[0]["generation"] == 1
