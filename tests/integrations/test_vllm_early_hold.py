"""A prefill's hold sent with the step that computes its prompt, collected at request_finished (issue #41):
one Hold per rank, the read byte-exact, and every case that must not go early, or must let go.
Real daemons; vLLM-free."""

from __future__ import annotations

import math
import time

import grpc
import pytest
import torch

from kvxferd.client.readsock import ReadsSocketError
from kvxferd.errors import PermissionDeniedError
from kvxferd.integrations.vllm.scheduler import SentHold, SchedulerSide
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from tests.integrations.connector_pair import connector_pair, eventually, read_held

REMOTE_DECODE = {"do_remote_decode": True}


@pytest.fixture
def pair(tmp_path, request):
    """A registered prefill rank and decode rank, the prefill's scheduler, and a count of Holds sent."""
    with connector_pair(tmp_path, ("ep0", "ed0")) as two:
        lease_s = getattr(request, "param", two.prefill.settings.lease_s)
        scheduler = SchedulerSide("p", two.prefill.settings.model_copy(update={"lease_s": lease_s}))
        scheduler.set_ranks(two.ranks)
        client = scheduler._client(two.ranks[0])
        sent = []
        real = client.hold_started
        client.hold_started = lambda request_id, *args, **kwargs: sent.append(request_id) or real(request_id, *args,
                                                                                                   **kwargs)
        yield {"scheduler": scheduler, "prefill": two.prefill, "decode": two.decode, "sent": sent,
               "daemon": two.daemons[0], "caches": (two.prefill_cache, two.decode_cache)}


def test_the_hold_goes_out_with_the_last_step_and_is_only_collected_at_the_end(pair):
    scheduler, sent = pair["scheduler"], pair["sent"]
    scheduler.prefill_allocated("req", REMOTE_DECODE, 64, max_tokens=1)
    sent_s = time.time()
    assert scheduler.prefill_scheduled("req", ([0, 3, 4],), 0, 64)  # 0: vLLM's null block
    assert sent == ["req"]
    delay, params = scheduler.hold("req", ([0, 3, 4],), 64)
    assert delay and sent == ["req"], params  # answered, not sent again
    assert params["remote_block_ids"] == [[3, 4]]
    # the lease runs from when the hold went out, not from request_finished
    assert sent_s <= params["remote_lease_expiry_unix_s"] - scheduler.settings.lease_s <= time.time()
    read_held(pair["scheduler"], pair["prefill"], pair["decode"], params, [7, 8])
    prefill_cache, decode_cache = pair["caches"]
    for name in prefill_cache:
        assert torch.equal(decode_cache[name][7:9], prefill_cache[name][3:5])
    # The control: a request not sent early is held at request_finished, as before, and reads as well.
    delay, params = scheduler.hold("late", ([5, 6],), 64)
    assert delay and sent == ["req", "late"]
    read_held(pair["scheduler"], pair["prefill"], pair["decode"], params, [9, 10])
    for name in prefill_cache:
        assert torch.equal(decode_cache[name][9:11], prefill_cache[name][5:7])


def test_what_does_not_go_early(pair):
    scheduler, sent = pair["scheduler"], pair["sent"]
    scheduler.prefill_allocated("two-tokens", REMOTE_DECODE, 64, max_tokens=2)  # not ended by its prompt's step
    assert not scheduler.prefill_scheduled("two-tokens", ([3, 4],), 0, 64)
    scheduler.prefill_allocated("chunked", REMOTE_DECODE, 64, max_tokens=1)
    assert not scheduler.prefill_scheduled("chunked", ([3],), 0, 32)  # the first of two chunks
    scheduler.prefill_allocated("plain", None, 64, max_tokens=1)  # not a P/D prefill
    assert not scheduler.prefill_scheduled("plain", ([3, 4],), 0, 64)
    scheduler.prefill_allocated("decode", {"do_remote_prefill": True, "do_remote_decode": True}, 64, max_tokens=1)
    assert not scheduler.prefill_scheduled("decode", ([3, 4],), 0, 64)
    assert not scheduler.prefill_scheduled("never-allocated", ([3, 4],), 0, 64)
    assert sent == []


def test_an_aborted_request_lets_its_early_hold_go_and_the_workers_ignore_that(pair):
    scheduler, prefill, daemon = pair["scheduler"], pair["prefill"], pair["daemon"]
    assert daemon.metric("kvxferd_holds_pending") == 0
    scheduler.prefill_allocated("aborted", REMOTE_DECODE, 64, max_tokens=1)
    assert scheduler.prefill_scheduled("aborted", ([3, 4],), 0, 64)
    assert eventually(lambda: daemon.metric("kvxferd_holds_pending") == 1)
    scheduler.drop_early("aborted")  # request_finished of an aborted request
    assert eventually(lambda: daemon.metric("kvxferd_holds_pending") == 0)
    # The release's EXPIRED reaches the prefill worker, which keeps nothing of it (it never held it).
    assert eventually(lambda: prefill.subscriber.last_seq >= 1 or prefill.results().finished_sending)
    for _ in range(3):
        assert prefill.results().finished_sending == set()
    assert prefill._ended == set() and pair["sent"] == ["aborted"]


def test_other_blocks_at_the_end_are_held_anew_and_only_the_new_hold_ends_it(pair):
    scheduler, prefill, sent, daemon = pair["scheduler"], pair["prefill"], pair["sent"], pair["daemon"]
    scheduler.prefill_allocated("moved", REMOTE_DECODE, 64, max_tokens=1)
    assert scheduler.prefill_scheduled("moved", ([3, 4],), 0, 64)  # then, say, preempted and scheduled again
    delay, params = scheduler.hold("moved", ([3, 5],), 64)
    assert delay and params["remote_block_ids"] == [[3, 5]] and sent == ["moved", "moved"], params
    assert eventually(lambda: daemon.metric("kvxferd_holds_pending") == 1)  # the first released, the second held
    held = scheduler.take_held()
    prefill.expect_held(held)
    # The first hold's EXPIRED (released) does not end the second: no reader has read yet.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert prefill.results().finished_sending == set()
        time.sleep(0.05)
    scheduler._held.extend(held)  # read_held hands them to the worker again (the same, no harm)
    read_held(scheduler, prefill, pair["decode"], params, [7, 8])
    prefill_cache, decode_cache = pair["caches"]
    for name in prefill_cache:  # the blocks of the end, not those of the early hold
        assert torch.equal(decode_cache[name][7], prefill_cache[name][3])
        assert torch.equal(decode_cache[name][8], prefill_cache[name][5])


def test_a_stale_early_hold_is_held_anew_and_a_rank_that_cannot_be_asked_fails_the_request(pair):
    scheduler, sent = pair["scheduler"], pair["sent"]
    scheduler.prefill_allocated("slow", REMOTE_DECODE, 64, max_tokens=1)
    assert scheduler.prefill_scheduled("slow", ([3, 4],), 0, 64)
    early = scheduler._early.pop("slow")  # as a rank that no longer knew it marks it (early.py)
    scheduler._early.put("slow", SentHold(early.blocks, -math.inf, early.answers))
    delay, params = scheduler.hold("slow", ([3, 4],), 64)
    assert delay and sent == ["slow", "slow"]  # its lease gone: held anew, with a fresh lease
    assert params["remote_lease_expiry_unix_s"] > time.time() + scheduler.settings.lease_s / 2
    scheduler.take_held()
    # A daemon that cannot even be asked (here: the socket is another user's) fails that request at
    # request_finished, never vLLM's schedule.
    client = scheduler._client(scheduler.ranks[0])

    def refuse(*args, **kwargs):
        raise PermissionDeniedError("daemon_uid", "the socket belongs to another user")
    client.hold_started = refuse
    scheduler.prefill_allocated("refused", REMOTE_DECODE, 64, max_tokens=1)
    assert scheduler.prefill_scheduled("refused", ([5, 6],), 0, 64)
    delay, params = scheduler.hold("refused", ([5, 6],), 64)
    assert not delay and "another user" in params["error"], params
    # Off (a sliding window or state group, or speculative decoding): nothing goes early.
    scheduler.early_holds = False
    scheduler.prefill_allocated("off", REMOTE_DECODE, 64, max_tokens=1)
    assert not scheduler.prefill_scheduled("off", ([7, 8],), 0, 64)


@pytest.mark.parametrize("pair", [2.0], indirect=True)  # a 2 s lease
def test_a_step_slower_than_the_lease_keeps_its_early_hold(pair):
    """The prompt's step takes 2.5 leases: the early holds' thread renews the hold meanwhile, so the
    daemon never ends it by its lease (no EXPIRED on the bus for a hold no reader was given), and
    request_finished hands over the same hold, which decode reads and ends CONSUMED (issue #54)."""
    scheduler, sent, daemon = pair["scheduler"], pair["sent"], pair["daemon"]
    expired_before = daemon.metric("kvxferd_leases_expired_total")
    scheduler.prefill_allocated("long-step", REMOTE_DECODE, 64, max_tokens=1)
    assert scheduler.prefill_scheduled("long-step", ([3, 4],), 0, 64)
    # The forward pass. The thread renews every 0.5-0.75 s; a 5 s step outlives a 2 s lease only if it
    # renewed at least twice, and a starved thread still has 1.25 s of lease left at each renewal.
    time.sleep(5.0)
    delay, params = scheduler.hold("long-step", ([3, 4],), 64)
    assert delay and sent == ["long-step"], params  # the early hold itself, not a new one
    assert scheduler._early.num_renewals >= 2
    assert params["remote_lease_expiry_unix_s"] > time.time()
    assert daemon.metric("kvxferd_leases_expired_total") == expired_before
    read_held(scheduler, pair["prefill"], pair["decode"], params, [7, 8])
    prefill_cache, decode_cache = pair["caches"]
    for name in prefill_cache:
        assert torch.equal(decode_cache[name][7:9], prefill_cache[name][3:5])
    # The control: without renewals the same step lets the daemon end the early hold by its lease, and
    # request_finished must hold anew.
    scheduler._early.close()
    scheduler.prefill_allocated("unrenewed", REMOTE_DECODE, 64, max_tokens=1)
    assert scheduler.prefill_scheduled("unrenewed", ([5, 6],), 0, 64)
    time.sleep(5.0)
    assert eventually(lambda: daemon.metric("kvxferd_leases_expired_total") == expired_before + 1)
    delay, params = scheduler.hold("unrenewed", ([5, 6],), 64)
    assert delay and sent == ["long-step", "unrenewed", "unrenewed"], params


class _RecordingStub:
    """Stands in for a client's gRPC stub: records every call it is asked for, and refuses it."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __getattr__(self, name):
        self.calls.append(name)
        raise ReadsSocketError(grpc.StatusCode.UNAVAILABLE, f"a gRPC call: {name}")  # as a failed call raises


def test_the_scheduler_makes_no_grpc_call_on_a_requests_path(pair):
    """Issue #54: holds (early and at the end), their answers, renewals and releases go over a control
    session of the daemon's reads socket; no gRPC call waits on a request's path."""
    scheduler, daemon = pair["scheduler"], pair["daemon"]
    client = scheduler._client(scheduler.ranks[0])
    calls: list[str] = []
    client.stub = _RecordingStub(calls)
    scheduler.prefill_allocated("quiet", REMOTE_DECODE, 64, max_tokens=1)
    assert scheduler.prefill_scheduled("quiet", ([3, 4],), 0, 64)  # sent early
    assert scheduler._renew(["quiet"]) == set()  # the early holds' thread renews it
    delay, params = scheduler.hold("quiet", ([3, 5],), 64)  # other blocks: released and held anew
    assert delay and "error" not in params, params
    read_held(scheduler, pair["prefill"], pair["decode"], params, [7, 8])
    scheduler.prefill_allocated("dropped", REMOTE_DECODE, 64, max_tokens=1)
    assert scheduler.prefill_scheduled("dropped", ([5, 6],), 0, 64)
    scheduler.drop_early("dropped")  # aborted: let go
    assert eventually(lambda: daemon.metric("kvxferd_holds_pending") == 0)
    assert calls == [] and client.control_session() is not None
    # Negative control: without the reads socket the same client holds over gRPC, and the stub sees it.
    client.reads_socket_path, client._control = None, None
    delay, params = scheduler.hold("grpc", ([9, 10],), 64)
    assert calls == ["Hold"] and not delay, params


def test_a_push_prefill_is_never_held_early_and_is_held_under_its_transfer_id(pair):
    """Push (issue #57): the prefill daemon writes as soon as the hold is placed, so a push's hold waits for
    request_finished (the KV computed) and is named by the transfer id the decode side expects; the workers
    map its end back to vLLM's request. The control: the same request in pull mode goes early."""
    pull, sent = pair["scheduler"], pair["sent"]
    push = SchedulerSide("p", pull.settings.model_copy(update={"mode": "push"}))
    push.set_ranks(pull.ranks)
    push._clients = pull._clients  # the same counted client
    leg = {"do_remote_decode": True, "kvxferd_transfer_id": "t-1", "kvxferd_push_digest": "cd" * 32}
    push.prefill_allocated("req", leg, 64, max_tokens=1)
    assert not push.prefill_scheduled("req", ([3, 4],), 0, 64) and sent == []
    delay, params = push.hold("req", ([3, 4],), 64, leg)
    assert delay and sent == ["t-1"] and params["remote_request_id"] == "t-1"
    (held,) = push.take_held()
    assert (held.request_id, held.held_as) == ("req", "t-1")
    pull.prefill_allocated("req2", {**leg, "kvxferd_transfer_id": "t-2"}, 64, max_tokens=1)  # pull mode: ignored
    assert pull.prefill_scheduled("req2", ([5, 6],), 0, 64) and sent == ["t-1", "req2"]
    delay, params = push.hold("bad", ([7],), 64, {**leg, "kvxferd_transfer_id": "a b"})
    assert not delay and "kvxferd_transfer_id" in params["error"]
    delay, params = push.hold("keyless", ([7],), 64, {"do_remote_decode": True, "kvxferd_transfer_id": "t-3"})
    assert not delay and "kvxferd_push_digest" in params["error"] and sent == ["t-1", "req2"]


def test_a_long_push_prefill_is_held_with_its_step_layer_by_layer_and_a_short_one_after_it(pair):
    """push_layer_min_tokens (issue #57): a push prefill leg that long is held with the step that computes it, no
    layer final (the workers say when they are), its transfer id in that step's metadata; a shorter one, or any
    with the option at 0, is held once its forward pass ended (request_finished), as before."""
    from kvxferd.plan.capability import push_key_digest

    def leg(transfer_id):
        return {"do_remote_decode": True, "kvxferd_transfer_id": transfer_id,
                "kvxferd_push_digest": push_key_digest(b"k" * 16).hex()}

    settings = pair["scheduler"].settings.model_copy(update={"mode": "push", "push_layer_min_tokens": 64})
    scheduler = SchedulerSide("p", settings)
    scheduler.set_ranks(pair["scheduler"].ranks)
    scheduler.prefill_allocated("long", leg("T-long"), 64, max_tokens=1)
    scheduler.prefill_allocated("short", leg("T-short"), 63, max_tokens=1)
    assert scheduler.prefill_scheduled("long", ([3, 4],), 0, 64)
    assert not scheduler.prefill_scheduled("short", ([5, 6],), 0, 63)
    assert scheduler.take_layered() == ["T-long"] and scheduler.take_layered() == []
    delay, params = scheduler.hold("long", ([3, 4],), 64, leg("T-long"))  # the early hold, collected
    assert delay and params["remote_request_id"] == "T-long"
    delay, _ = scheduler.hold("short", ([5, 6],), 63, leg("T-short"))  # held at request_finished: every layer final
    assert delay
    prefill = pair["prefill"]
    none_final = [0] * prefill.num_groups
    prefill.client.stub.FinalLayers(pb.FinalLayersRequest(engine_id=prefill.engine_id, request_id="T-long",
                                                          layers_final=none_final))  # accepted: none final yet
    with pytest.raises(grpc.RpcError, match="every layer is final already"):
        prefill.client.stub.FinalLayers(pb.FinalLayersRequest(engine_id=prefill.engine_id, request_id="T-short",
                                                              layers_final=none_final))
    off = SchedulerSide("p", settings.model_copy(update={"push_layer_min_tokens": 0}))
    off.set_ranks(pair["scheduler"].ranks)
    off.prefill_allocated("never", leg("T-never"), 2000, max_tokens=1)
    assert not off.prefill_scheduled("never", ([7, 8],), 0, 2000) and off.take_layered() == []
    # the leg itself may say (the proxy's --push-layers): it wins over the length
    off.prefill_allocated("asked", {**leg("T-asked"), "kvxferd_push_layers": True}, 8, max_tokens=1)
    scheduler.prefill_allocated("declined", {**leg("T-declined"), "kvxferd_push_layers": False}, 2000, max_tokens=1)
    assert off.prefill_scheduled("asked", ([9],), 0, 8) and off.take_layered() == ["T-asked"]
    assert not scheduler.prefill_scheduled("declined", ([10],), 0, 2000) and scheduler.take_layered() == []
    delay, params = off.hold("bad", ([11],), 8, {**leg("T-bad"), "kvxferd_push_layers": "yes"})
    assert not delay and "kvxferd_push_layers" in params["error"]
    # a long prompt computed in chunks is held at the end, in one batch: nothing of it is kept
    scheduler.prefill_allocated("chunked", leg("T-chunked"), 128, max_tokens=1)
    assert not scheduler.prefill_scheduled("chunked", ([12],), 0, 64)
    assert scheduler.hold("chunked", ([12, 13],), 128, leg("T-chunked"))[0]
    assert scheduler._layer_digests == {} and scheduler.take_layered() == []
    # where the workers cannot tell when a layer is final (a device without fences, micro-batches): never
    unfenced = SchedulerSide("p", settings, push_layers_allowed=False)
    unfenced.set_ranks(pair["scheduler"].ranks)
    unfenced.prefill_allocated("asked", {**leg("T-unfenced"), "kvxferd_push_layers": True}, 64, max_tokens=1)
    assert not unfenced.prefill_scheduled("asked", ([14],), 0, 64) and unfenced.take_layered() == []
