"""Issue 11, attacks 4 and 5: forged read notices, and reading other engines' bus events.

Run with the loopback (development) defaults, where an introduction needs no
certificate: even then a notice counts only from the NIXL agent its reader
introduced, only with the hold's capability (issue 35: a reader speaking for
itself ended any hold it named), and only with the reader count the holder
computed itself.
With TLS on, nobody without an allowed certificate is introduced at all
(``test_peer_mtls``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from kvxferd.plan.notifications import ReadNotice
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.service.net.bus import NotifyBus
from kvxferd.rig.soak.forged import holder_info, send
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.wire.names import topic
from kvxferd.xfer.nixl.agent import NixlAgent

GROUPS = model_groups("gqa", ModelShape())


@pytest.fixture(scope="module")
def cluster(workdir):
    with DaemonCluster(*GROUPS, 1, 2, workdir=workdir, name="ntc") as c:  # two decode ranks: two readers expected
        yield c


def forge(cluster, agent_name: str, reader_engine_id: str, reader_tp_size: int, notice: ReadNotice) -> NixlAgent:
    agent = NixlAgent(agent_name)
    info = holder_info(cluster.prefill_daemons[0].peer_address, cluster.prefill_id, 0, agent, reader_engine_id,
                       reader_tp_size)
    send(agent, info.agent_metadata, [notice.encode()], send_s=0.5)
    return agent


def test_forged_notices_end_no_hold(cluster):
    request = random_request("forged", *GROUPS, 48, np.random.default_rng(3))
    cluster.hold(request)
    prefill = cluster.prefill_daemons[0]
    dropped = prefill.metric("kvxferd_notices_dropped_total", 'reason="foreign"')
    unsealed = prefill.metric("kvxferd_notices_dropped_total", 'reason="unsealed"')
    malformed = prefill.metric("kvxferd_notices_dropped_total", 'reason="malformed"')
    # 1. An agent introduced under its own name claims to be the real reader: not that reader's agent.
    agents = [forge(cluster, "mallory-1", "mallory", 1, ReadNotice(request.remote_request_id, cluster.decode_id, 0, 1))]
    assert prefill.metric("kvxferd_notices_dropped_total", 'reason="foreign"') == dropped + 1
    # 2. Issue 35: a reader introduced under its own id, speaking for itself with the count the holder
    #    expects of it (TP 1: one), ended any hold it named. Without the hold's capability it counts for nothing.
    agents.append(forge(cluster, "mallory-2", "mallory-own", 1, ReadNotice(request.remote_request_id, "mallory-own", 0, 1)))
    assert prefill.metric("kvxferd_notices_dropped_total", 'reason="unsealed"') == unsealed + 1
    # 3. A reader of TP 2 that has the capability announces one reader: the holder itself expects two, so the
    #    notice is refused (the holder's own count, checked apart from the capability).
    capability = cluster.capabilities[request.remote_request_id][0]
    agents.append(forge(cluster, "mallory-3", "mallory-tp2", 2,
                        ReadNotice(request.remote_request_id, "mallory-tp2", 0, 1, capability=capability)))
    assert prefill.metric("kvxferd_notices_dropped_total", 'reason="malformed"') == malformed + 1
    assert cluster.subscribers[0].wait_for(request.remote_request_id, timeout_s=0.5) is None  # still held
    # The real readers still read and end the hold, exactly once.
    cluster.submit(request)
    assert all(c.ok for c in cluster.completions(request)), "the real read failed"
    assert cluster.verify(request) == ([], 0)
    assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED]


def test_the_bus_serves_whole_engine_topics_only(cluster):
    """An empty or partial subscription prefix gets nothing; only the engine's own topic gets its events."""
    address = cluster.prefill_clients[0].notify_address
    context = zmq.Context.instance()
    sockets = {}
    for name, prefix in {"everything": b"", "partial": cluster.prefill_id[:3].encode(),
                         "own": topic(cluster.prefill_id)}.items():
        sockets[name] = context.socket(zmq.SUB)
        sockets[name].setsockopt(zmq.SUBSCRIBE, prefix)
        sockets[name].connect(address)
    try:
        time.sleep(0.5)  # subscriptions reach the daemon
        request = random_request("bus", *GROUPS, 16, np.random.default_rng(4))
        assert all(c.ok for c in cluster.read(request))
        assert cluster.hold_events(request)[0].kind == pb.NotifyEvent.CONSUMED
        time.sleep(0.2)
        got = {name: sock.poll(200) != 0 for name, sock in sockets.items()}
        assert got == {"everything": False, "partial": False, "own": True}
    finally:
        for sock in sockets.values():
            sock.close(linger=0)


def test_curve_admits_only_configured_client_keys():
    server_public, server_secret = zmq.curve_keypair()
    allowed_public, allowed_secret = zmq.curve_keypair()
    stranger_public, stranger_secret = zmq.curve_keypair()
    bus = NotifyBus("127.0.0.1", 0, history=10, curve_secret_key=server_secret.decode(), client_keys=[allowed_public])
    assert bus.curve_public_key == server_public.decode()
    context = zmq.Context.instance()
    sockets = {}
    try:
        for name, keys in {"allowed": (allowed_public, allowed_secret), "stranger": (stranger_public, stranger_secret),
                           "plaintext": None}.items():
            sock = sockets[name] = context.socket(zmq.SUB)
            if keys:
                sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
                sock.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
            sock.setsockopt(zmq.SUBSCRIBE, topic("e"))
            sock.connect(bus.address)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # publish until subscriptions are in
            bus.publish("e", "CONSUMED", "r")
            time.sleep(0.05)
        got = {name: sock.poll(300) != 0 for name, sock in sockets.items()}
        assert got == {"allowed": True, "stranger": False, "plaintext": False}
    finally:
        for sock in sockets.values():
            sock.close(linger=0)
        bus.close()
