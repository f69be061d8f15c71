"""The one place a read is planned and seal-checked, whoever posts it.

::

    admit(connection, request)                 the loop, for a read it accepts
      plan: ids per remote rank                 bad ids: a typed error naming them
      seal: each rank's capability made by      else PermissionDenied: nothing posted
        that holder's key for these blocks
    admit(connection, request, plan=False)     a large read: sealed on the loop, planned
                                                on the data-plane thread (admit again)
    admit(new connection, request, earlier)    re-handshaken meanwhile: planned and sealed
                                                again on the connection it is posted on

An :class:`~kvxferd.xfer.records.AdmittedRead` is made here only, so one in
hand was sealed against its connection's hold keys (when it has any: a
connection without boards checks nothing, the data path's benchmarks).
"""

from __future__ import annotations

from kvxferd.errors import InvalidArgumentError
from kvxferd.plan.capability import check_read_capabilities
from kvxferd.plan.engine import ReadRequest
from kvxferd.plan.holddigests import check_verifiable
from kvxferd.xfer.records import AdmittedRead, RemoteEngine


def admit(remote: RemoteEngine, request: ReadRequest, earlier: AdmittedRead | None = None, *,
          plan: bool = True) -> AdmittedRead:
    """``request`` planned (unless ``plan`` is False) and sealed on ``remote``; what ``earlier`` did on
    this same connection is not done again. Raises typed errors (bad ids first), nothing posted."""
    same = earlier is not None and earlier.remote is remote and earlier.request is request
    planned = earlier.planned if same else None
    if planned is None and plan:
        planned = remote.plan.plan_request(request)  # ids first: their errors name them
    digests = request.remote_digests
    if digests and len(digests) != len(remote.agent_names):
        raise InvalidArgumentError("remote_digests", f"{len(digests)} ranks' digests for a remote engine of "
                                   f"{len(remote.agent_names)} ranks (all or none)")
    if remote.hold_keys and not same:  # a read names only blocks its holders sealed for it
        check_read_capabilities(remote.hold_keys, request.remote_request_id, request.remote_block_ids,
                                request.remote_capabilities)
    if digests:  # (after the seal: an unsealed read is refused as such, and audited)
        check_verifiable(remote.plan.pairings)
    return AdmittedRead(remote, request, planned)


def check_ids(remote: RemoteEngine, request: ReadRequest) -> None:
    """Refuse ``request``'s bad block ids (typed errors naming them), sealing nothing: for a read refused
    for another reason right after, which must name its ids first (docs: the order of a read's checks)."""
    remote.plan.plan_request(request)
