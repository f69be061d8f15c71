"""Digests through real daemons (issue #59): a hold asked for them answers each prefill rank's digests; a read
that carries them is checked by the decode daemon before it completes. A bit flipped in the prefill engine's
memory after the hold fails that read (the blocks named invalid, counted as ``corrupt``); the same fault read
without digests completes ok with wrong bytes, which the byte oracle shows."""

import time

import numpy as np
import pytest

from kvxferd.plan.holddigests import HoldDigests
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.damage import damage_held
from kvxferd.rig.verify.models import random_request
from tests.service.helpers import GQA_GROUPS as GROUPS


@pytest.fixture(scope="module")
def cluster(workdir):
    with DaemonCluster(*GROUPS, 2, 1, workdir=workdir, name="digests") as c:
        yield c


def _request(cluster, name, seed):
    return random_request(name, cluster.prefill_groups, cluster.decode_groups, 70, np.random.default_rng(seed))


def _flip(cluster, request, rank=1):
    """One bit of the last held block, on prefill rank ``rank`` only (the read's other holder stays right)."""
    damage_held(cluster.prefill[rank], request.remote_block_ids, "flip", np.random.default_rng(9))


def _corrupt_failures(cluster, at_least: float = 0.0, timeout_s: float = 5.0) -> float:
    """The decode daemons' corrupt reads, once they counted ``at_least`` (a daemon counts a read just after it
    sent its completion) or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = sum(daemon.metric("kvxferd_read_failures_total", 'kind="corrupt"') for daemon in cluster.decode_daemons)
        if count >= at_least or time.monotonic() >= deadline:
            return count
        time.sleep(0.02)


def test_a_hold_answers_its_digests_only_when_asked(cluster):
    plain, request = _request(cluster, "unasked", 1), _request(cluster, "asked", 1)
    cluster.hold(plain)
    assert cluster.digests[plain.remote_request_id] == (b"", b"")
    cluster.hold(request, want_digests=True)
    digests = [HoldDigests.decode(d) for d in cluster.digests[request.remote_request_id]]
    assert all(d.groups[0].block_ids.tolist() == request.remote_block_ids[0].tolist() for d in digests)


def test_a_read_with_digests_is_checked_and_a_flipped_bit_fails_it(cluster):
    clean = _request(cluster, "clean", 2)
    cluster.reset_decode()
    cluster.hold(clean, want_digests=True)
    cluster.submit(clean, digests=True)
    assert [(c.ok, c.failure) for c in cluster.completions(clean)] == [(True, "")] and cluster.check(clean) == []

    before = _corrupt_failures(cluster)
    flipped = _request(cluster, "flipped", 3)
    cluster.reset_decode()
    cluster.hold(flipped, want_digests=True)
    _flip(cluster, flipped)
    cluster.submit(flipped, digests=True)
    (completion,) = cluster.completions(flipped)
    assert not completion.ok and "digest check" in completion.error and list(completion.failed_ranks) == [1]
    assert completion.failure == "corrupt"  # what an engine logs or counts it as (the metric's kind)
    assert list(completion.invalid_block_ids[0].ids) == [int(flipped.local_block_ids[0][-1])]
    assert cluster.check(flipped) != []  # the fault is real
    assert _corrupt_failures(cluster, at_least=before + 1) == before + 1


def test_without_digests_the_flipped_bit_reaches_decode_silently(cluster):
    silent = _request(cluster, "silent", 4)
    cluster.reset_decode()
    cluster.hold(silent, want_digests=True)
    _flip(cluster, silent)
    cluster.submit(silent)
    assert [c.ok for c in cluster.completions(silent)] == [True] and cluster.check(silent) != []


def test_digests_that_are_not_a_holds_are_refused_with_nothing_written(cluster):
    """Digests are external input: bytes that are not a hold's digests refuse the read (INVALID_ARGUMENT naming
    them) before anything moves; a read with digests of some ranks only is refused too."""
    import grpc

    request = _request(cluster, "bad-digests", 5)
    cluster.reset_decode()
    cluster.hold(request, want_digests=True)
    good = cluster.digests[request.remote_request_id]
    client = cluster.decode_clients[0]
    for n, digests in enumerate([(b"junk", good[1]), good[:1]]):
        client.submit_read(f"{request.request_id}-{n}", cluster.prefill_id, request.remote_request_id,
                           request.local_block_ids, request.remote_block_ids, num_tokens=request.num_tokens or 0,
                           remote_capabilities=cluster.capabilities[request.remote_request_id], remote_digests=digests)
        completion = client.reads.wait_completion(f"{request.request_id}-{n}", 30)
        assert not completion.ok and completion.refused_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "remote_digests" in completion.error and completion.failure == "refused"
    assert cluster.decode_untouched()


def test_a_daemon_that_requires_digests_refuses_a_read_without_them(workdir):
    """``require_digests`` (the daemon's setting): a read with no digests is refused (FAILED_PRECONDITION,
    nothing written), a push too (not checked yet); one with them is checked and completes."""
    import grpc

    with DaemonCluster(*GROUPS, 1, 1, workdir=workdir, name="required",
                       args_of=lambda daemon_id: ("--require-digests",) if "-d" in daemon_id else ()) as required:
        unchecked, checked = _request(required, "unchecked", 6), _request(required, "checked", 7)
        required.hold(unchecked, want_digests=True)
        required.submit(unchecked)
        (completion,) = required.completions(unchecked)
        assert (completion.ok, completion.failure) == (False, "refused")
        assert completion.refused_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "require_digests" in completion.error and required.decode_untouched()
        required.reset_decode()
        required.hold(checked, want_digests=True)
        required.submit(checked, digests=True)
        assert [(c.ok, c.failure) for c in required.completions(checked)] == [(True, "")]
        assert required.check(checked) == []
        assert required.decode_daemons[0].metric("kvxferd_digest_checked_bytes_total") > 0
        pushed = _request(required, "pushed", 8)
        required.expect(pushed, push_key=bytes(16))
        (completion,) = required.completions(pushed)
        assert completion.refused_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "require_digests" in completion.error and "push" in completion.error
