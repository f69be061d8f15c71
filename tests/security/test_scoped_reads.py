"""Issue 35, attack 1: reads are scoped to holds, checked before a byte moves, on real daemons.

A decode engine used to name any blocks under a request id that was held
(51-54 held, 60-63 read: completion ok, byte-exact), and a never-held id
failed as stale only after its bytes were in the reader's cache. Now every
read carries each holder rank's capability (from its ``HoldReply``), which
seals one exact block list of one request: the decode daemon refuses a read
whose blocks, request id or capability do not match, with PERMISSION_DENIED
and nothing written. Both in the default (loopback) configuration and with
mutual TLS as the chart runs it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from tests.security.conftest import SPIFFE, tls_args

GROUPS = model_groups("gqa", ModelShape())
DENIED = 7  # PERMISSION_DENIED


@pytest.fixture(scope="module", params=["default", "chart"])
def cluster(request, workdir, ca):
    args = ()
    if request.param == "chart":
        args = tls_args(ca, ca.issue("scoped", dns_names=("kvxferd-peer",), spiffe_id=SPIFFE))
    with DaemonCluster(*GROUPS, 2, 1, workdir=workdir, name=f"scoped-{request.param}", daemon_args=args) as c:
        yield c


def _plus_one(lists, num_blocks: int) -> tuple:
    """Each group's ids and one id more that is not among them."""
    return tuple(np.append(ids, min(set(range(num_blocks)) - set(ids.tolist()))) for ids in lists)


def test_a_read_of_other_blocks_than_its_hold_moves_nothing(cluster):
    held = random_request("tenant-a", *GROUPS, 64, np.random.default_rng(1))
    cluster.hold(held)
    other = tuple((ids + 7) % GROUPS[0][0].spec.num_blocks for ids in held.remote_block_ids)  # not held
    attacks = {
        "other blocks, the hold's request id and capabilities": dataclasses.replace(held, request_id="a1",
                                                                                   remote_block_ids=other),
        "one block more": dataclasses.replace(
            held, request_id="a2", remote_block_ids=_plus_one(held.remote_block_ids, GROUPS[0][0].spec.num_blocks),
            local_block_ids=_plus_one(held.local_block_ids, GROUPS[1][0].spec.num_blocks), num_tokens=None),
        "a never-held request id, no capabilities": dataclasses.replace(held, request_id="a3",
                                                                        remote_request_id="never-held"),
        "a never-held request id, the hold's capabilities": dataclasses.replace(
            held, request_id="a4", remote_request_id="never-held",
            remote_capabilities=cluster.capabilities[held.remote_request_id]),
        "the ranks' capabilities swapped": dataclasses.replace(
            held, request_id="a5", remote_capabilities=cluster.capabilities[held.remote_request_id][::-1]),
    }
    for name, attack in attacks.items():
        cluster.reset_decode()
        cluster.submit(attack)
        (completion,) = cluster.completions(attack)
        assert not completion.ok and completion.refused_code == DENIED, (name, completion)
        assert "remote_capabilities" in completion.error, (name, completion.error)
        assert cluster.decode_untouched(), f"{name}: a refused read wrote bytes"
    # The hold is untouched by all of that and its own read is byte-exact (the control: reads do work).
    assert cluster.subscribers[0].wait_for(held.remote_request_id, timeout_s=0.3) is None
    cluster.reset_decode()
    cluster.submit(held)
    assert all(c.ok for c in cluster.completions(held))
    assert cluster.verify(held) == ([], 0) and not cluster.decode_untouched()
    assert [e.kind for e in cluster.hold_events(held)] == [pb.NotifyEvent.CONSUMED] * 2


def test_made_up_key_ids_do_not_make_the_link_re_handshake(cluster):
    """A capability's key id comes from the engine's input: a made-up one is refused and at most probes the
    link (one GetIncarnation a second); it never re-handshakes it, which would fail every read in flight."""
    decode_log = cluster.decode_daemons[0]
    handshakes = decode_log.tail(200_000).count('"handshake done"')
    held = random_request("tenant-b", *GROUPS, 64, np.random.default_rng(2))
    cluster.hold(held)
    made_up = [bytes([n]) * 16 for n in range(1, 21)]
    for n, capability in enumerate(made_up):
        attack = dataclasses.replace(held, request_id=f"k{n}", remote_capabilities=(capability, capability))
        cluster.submit(attack)
        (completion,) = cluster.completions(attack)
        assert not completion.ok and completion.refused_code == DENIED, completion
    cluster.reset_decode()
    cluster.submit(held)
    assert all(c.ok for c in cluster.completions(held)) and cluster.verify(held) == ([], 0)
    assert decode_log.tail(200_000).count('"handshake done"') == handshakes


def test_a_capability_replayed_after_its_hold_ended_copies_nothing(cluster):
    """A decode engine kept the params of a read it already made and sends them again once the hold was
    consumed, and again after the same request id was held anew on other blocks (another tenant's data may
    sit in the old blocks by then). Before, the read was posted and its bytes copied, and only the board check
    after the copy called it stale; now the board is read first and nothing moves."""
    rng = np.random.default_rng(3)
    first = random_request("tenant-c", *GROUPS, 64, rng)
    cluster.hold(first)
    cluster.submit(first)
    assert all(c.ok for c in cluster.completions(first))
    assert [e.kind for e in cluster.hold_events(first)] == [pb.NotifyEvent.CONSUMED] * 2
    kept = cluster.capabilities[first.remote_request_id]
    replay = dataclasses.replace(first, request_id="replay-1", remote_capabilities=kept)
    cluster.reset_decode()
    cluster.submit(replay)
    (completion,) = cluster.completions(replay)
    assert not completion.ok and "stale read, nothing copied" in completion.error, completion
    assert cluster.decode_untouched(), "a replayed capability copied bytes"
    # The request id is held again, on other blocks: the old capability still names the old blocks.
    num_blocks = GROUPS[0][0].spec.num_blocks
    again = dataclasses.replace(first, remote_block_ids=tuple((ids + 9) % num_blocks for ids in first.remote_block_ids))
    cluster.hold(again)
    replay = dataclasses.replace(first, request_id="replay-2", remote_capabilities=kept)
    cluster.submit(replay)
    (completion,) = cluster.completions(replay)
    assert not completion.ok and "stale read, nothing copied" in completion.error, completion
    assert cluster.decode_untouched(), "an old capability read a later hold's request id"
    # Control: the new hold's own read moves its bytes (decode_untouched can fail).
    cluster.submit(dataclasses.replace(again, request_id="again"))
    (completion,) = cluster.completions(dataclasses.replace(again, request_id="again"))
    assert completion.ok and not cluster.decode_untouched()
