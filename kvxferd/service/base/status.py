"""The one place where kvxferd errors become gRPC status codes.

    InvalidArgumentError (BlockIdError, TpConfigError)  -> INVALID_ARGUMENT
    LayoutMismatchError (SpanBudgetError)               -> FAILED_PRECONDITION
    NotFoundError                                       -> NOT_FOUND
    TransferError (NixlError)                           -> UNAVAILABLE
    UnavailableError (no CUDA here, draining)           -> FAILED_PRECONDITION
    UnauthenticatedError (no or a wrong session)        -> UNAUTHENTICATED
    PermissionDeniedError (identity not allowed)        -> PERMISSION_DENIED
    AlreadyExistsError (engine id registered and alive) -> ALREADY_EXISTS
    ResourceExhaustedError (a configured limit)         -> RESOURCE_EXHAUSTED
    any other KvxferError                               -> INTERNAL

The message always starts with the offending field, so an engine can tell
which part of its request was wrong.
"""

from __future__ import annotations

import logging
import uuid

import grpc

from kvxferd.errors import STATUS_NUMBERS, KvxferError

log = logging.getLogger("kvxferd.rpc")

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
_CODES: tuple[tuple[type[KvxferError], grpc.StatusCode], ...] = tuple(
    (kind, _BY_NUMBER[number]) for kind, number in STATUS_NUMBERS)  # the table lives in kvxferd.errors


def code_numbered(number: int) -> grpc.StatusCode:
    """The gRPC status code with this number (UNKNOWN for a number that is none)."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


class StreamReplaced(Exception):
    """A newer stream took over this engine's completions (its feed raises it to the old stream)."""


def status_code(error: KvxferError) -> grpc.StatusCode:
    """The gRPC status for a typed error (first matching class wins)."""
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, error: KvxferError) -> None:
    """Abort an RPC with the status and message of ``error``."""
    await context.abort(status_code(error), str(error))


def error_status(method: str, err: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a caller gets for ``err`` (call it in the ``except`` block that caught it).

    Typed errors map through :func:`status_code`; a replaced completion stream
    is ABORTED; anything else is a bug: logged under a new id, and the caller
    gets only the id, never our exception text or paths.
    """
    if isinstance(err, KvxferError):
        return status_code(err), str(err)
    if isinstance(err, StreamReplaced):
        return grpc.StatusCode.ABORTED, f"engine_id: {err}"
    error_id = uuid.uuid4().hex[:12]
    log.exception("internal error", extra={"method": method, "error_id": error_id})
    return grpc.StatusCode.INTERNAL, f"internal error {error_id} (details in the daemon's log)"
