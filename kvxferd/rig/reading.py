"""Read with an executor and nothing around it: post by remote engine id, wait without a data-plane thread.

The verification cluster, the benchmarks and the executor's tests read this
way; a daemon never does (its data-plane thread polls many reads at once).
"""

from __future__ import annotations

import time

from kvxferd.plan.engine import ReadRequest
from kvxferd.xfer.admission import admit
from kvxferd.xfer.handles import ReadFailure
from kvxferd.xfer.pushes import PushExecutor
from kvxferd.xfer.reads import ReadExecutor
from kvxferd.xfer.records import InFlightRead, ReadResult

POLL_MIN_S = 20e-6  # first sleep between polls; doubles up to POLL_MAX_S
POLL_MAX_S = 1e-3


def post(executor: ReadExecutor, remote_engine_id: str, request: ReadRequest) -> InFlightRead:
    """Admit (plan and seal-check) one request on the current connection and post it; bad input raises
    before anything is posted."""
    return executor.post(admit(executor.remote(remote_engine_id), request))


def wait(executor: ReadExecutor | PushExecutor, inflight: InFlightRead, timeout_s: float = 30.0) -> ReadResult:
    """Poll a posted read (or push) with a growing sleep (never a spinning core) until done, or abort it past
    ``timeout_s``."""
    return wait_all(executor, [inflight], timeout_s)[0]


def wait_all(executor: ReadExecutor | PushExecutor, inflight: list[InFlightRead],
             timeout_s: float = 30.0) -> list[ReadResult]:
    """Poll every posted read each round, as the daemon's data plane does, until all are done (each one
    past ``timeout_s`` aborted). Waiting for one read at a time can wait forever: a later read whose board
    check ended holds its check slot until it is polled, and the first one may need that slot."""
    deadline_s = time.perf_counter() + timeout_s
    sleep_s = POLL_MIN_S
    results: list[ReadResult | None] = [None] * len(inflight)
    while True:
        past = time.perf_counter() >= deadline_s
        for n, f in enumerate(inflight):
            if results[n] is None:
                results[n] = executor.poll(f)
            if results[n] is None and past and f.drain is None:
                results[n] = executor.abort(f, f"deadline: not done after {timeout_s:g} s", ReadFailure.DEADLINE)
        if all(r is not None for r in results):
            return results
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, POLL_MAX_S)


def read(executor: ReadExecutor, remote_engine_id: str, request: ReadRequest, timeout_s: float = 30.0) -> ReadResult:
    """Post and wait for one request."""
    return wait(executor, post(executor, remote_engine_id, request), timeout_s)
