"""Typed errors of kvxferd.

Every error names the offending input field (``field``) so that the service
layer can map it to a precise gRPC status in one place. This module is pure:
the pure layers (layout, tp, plan) raise these, services translate them.
"""

from __future__ import annotations


class KvxferError(Exception):
    """Base class: ``field`` names the input that was wrong (dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InvalidArgumentError(KvxferError, ValueError):
    """Malformed input: bad sizes, unknown dim names, bad dtype."""


class BlockIdError(InvalidArgumentError):
    """A block id is negative or not below the number of blocks."""


class TpConfigError(InvalidArgumentError):
    """A tensor-parallel rank/size pair that cannot exist or be served."""


class LayoutMismatchError(KvxferError):
    """Two layouts of what should be the same logical data cannot be paired."""


class SpanBudgetError(LayoutMismatchError):
    """Pairing two layouts is possible only at a granularity above the budget."""


class NotFoundError(KvxferError):
    """An engine, peer or request id that this process does not know."""


class TransferError(KvxferError):
    """A data-plane call failed (remote gone, backend error); fails one request."""


class UnavailableError(KvxferError):
    """This daemon cannot serve the request here (no CUDA runtime, shutting down)."""


class UnauthenticatedError(KvxferError):
    """The caller did not prove who it is (no or a wrong engine session)."""


class PermissionDeniedError(KvxferError):
    """The caller is known but not allowed to do this (identity off the allow-list)."""


class AlreadyExistsError(KvxferError):
    """The thing to create exists and is alive (a live engine registration)."""


class ResourceExhaustedError(KvxferError):
    """A configured limit would be exceeded; ``field`` names the limit."""


# The gRPC status code (its number) each kind of error maps to, first matching class wins; anything else is
# INTERNAL (13). The one table: service/base/status.py turns it into grpc.StatusCode, and a reader worker,
# which loads no gRPC, numbers the refusals it writes to an engine with it.
STATUS_NUMBERS: tuple[tuple[type[KvxferError], int], ...] = (
    (InvalidArgumentError, 3),  # INVALID_ARGUMENT
    (LayoutMismatchError, 9),  # FAILED_PRECONDITION
    (NotFoundError, 5),  # NOT_FOUND
    (TransferError, 14),  # UNAVAILABLE
    (UnavailableError, 9),  # FAILED_PRECONDITION
    (UnauthenticatedError, 16),  # UNAUTHENTICATED
    (PermissionDeniedError, 7),  # PERMISSION_DENIED
    (AlreadyExistsError, 6),  # ALREADY_EXISTS
    (ResourceExhaustedError, 8),  # RESOURCE_EXHAUSTED
)
INTERNAL_NUMBER = 13


def status_number(error: KvxferError) -> int:
    """The number of the gRPC status code ``error`` maps to (see :data:`STATUS_NUMBERS`)."""
    for kind, number in STATUS_NUMBERS:
        if isinstance(error, kind):
            return number
    return INTERNAL_NUMBER


def first_error(err) -> tuple[str, str]:
    """``(dotted location, message)`` of a pydantic ``ValidationError``'s first problem, for one-line errors."""
    first = err.errors()[0]
    return ".".join(str(part) for part in first["loc"]), first["msg"]
