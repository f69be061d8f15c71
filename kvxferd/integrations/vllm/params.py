"""``kv_transfer_params``: what prefill hands the proxy, and the proxy hands decode.

Prefill's scheduler returns these from ``request_finished`` once every
prefill rank holds the request's blocks; the proxy forwards them unchanged
in the decode request. They are external input on decode: parsed and
checked here, every problem naming the field::

    {"do_remote_prefill": true, "kvxferd": 1,
     "remote_engine_id": "prefill-0", "remote_request_id": "cmpl-1-0",
     "remote_peer_addresses": ["10.0.0.7:47100"],      # one per prefill TP rank
     "remote_block_ids": [[3, 4, 9]],                  # per KV cache group
     "remote_capabilities": ["9f2c...e1"],             # per prefill TP rank: 16 bytes, hex
     "remote_digests": ["S0QB..."],                     # optional, per prefill TP rank: base64 (issue #59)
     "remote_num_tokens": 80, "remote_lease_expiry_unix_s": 1795400000.0}

A capability seals one rank's hold of exactly these blocks for this request
(``kvxferd.plan.capability``): the decode daemon refuses a read whose blocks
or request id do not match it, before a byte moves.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from kvxferd.errors import first_error
from kvxferd.wire.tracecontext import check_traceparent

PARAMS_VERSION = 1
MAX_GROUPS = 64
MAX_TP_SIZE = 1024

Id = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
Capability = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]  # 16 bytes, lower-case hex
PushKey = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]  # 16 bytes, lower-case hex (kvxferd.plan.capability)
# A rank's HoldReply.digests in base64 (kvxferd.plan.holddigests; the daemon checks what they hold, bounded there)
Digests = Annotated[str, Field(min_length=4, max_length=24 << 20, pattern=r"^[A-Za-z0-9+/]+={0,2}$")]


class ParamsError(ValueError):
    """Malformed ``kv_transfer_params``; the message names the field."""


class RemotePrefill(BaseModel):
    """A prefilled request held on every prefill rank, ready to be read."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    kvxferd: int
    remote_engine_id: Id
    remote_request_id: Id
    remote_peer_addresses: Annotated[list[Id], Field(min_length=1, max_length=MAX_TP_SIZE)]
    remote_block_ids: Annotated[list[list[Annotated[int, Field(ge=0, lt=2**31)]]], Field(min_length=1, max_length=MAX_GROUPS)]
    remote_capabilities: Annotated[list[Capability], Field(min_length=1, max_length=MAX_TP_SIZE)]
    remote_num_tokens: Annotated[int, Field(ge=1, lt=2**31)]
    remote_lease_expiry_unix_s: float
    remote_digests: Annotated[list[Digests], Field(max_length=MAX_TP_SIZE)] = []  # none: the read is not checked
    traceparent: str = ""  # the request's W3C trace context (issue #60); one not taken is dropped, never refused

    @field_validator("kvxferd")
    @classmethod
    def _version(cls, value: int) -> int:
        if value != PARAMS_VERSION:
            raise ValueError(f"kvxferd params version {value}, this connector speaks {PARAMS_VERSION}")
        return value

    @field_validator("traceparent", mode="before")
    @classmethod
    def _traceparent(cls, value: Any) -> str:
        return check_traceparent(value) if isinstance(value, str) else ""

    @field_validator("remote_capabilities")
    @classmethod
    def _one_capability_per_rank(cls, value: list[str], info: ValidationInfo) -> list[str]:
        addresses = info.data.get("remote_peer_addresses")
        if addresses is not None and len(value) != len(addresses):
            raise ValueError(f"{len(value)} capabilities for {len(addresses)} prefill ranks")
        return value

    @field_validator("remote_digests")
    @classmethod
    def _digests_of_every_rank_or_none(cls, value: list[str], info: ValidationInfo) -> list[str]:
        addresses = info.data.get("remote_peer_addresses")
        if value and addresses is not None and len(value) != len(addresses):
            raise ValueError(f"{len(value)} ranks' digests for {len(addresses)} prefill ranks (all or none)")
        return value

    def capabilities(self) -> list[bytes]:
        """Each prefill rank's capability, as the daemon takes them."""
        return [bytes.fromhex(c) for c in self.remote_capabilities]

    def digests(self) -> list[bytes]:
        """Each prefill rank's digests of its hold, as the daemon takes them (none: the read is not checked)."""
        return [base64.b64decode(d, validate=True) for d in self.remote_digests]

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, **self.model_dump()}


class PushPrefill(BaseModel):
    """Push (issue #57): the decode leg of a request whose prefill leg runs at the same time, under the same
    ``transfer_id``; the prefill daemons write into the decode blocks once the prefill holds them. The
    proxy knows the prefill engine before it answers (from an earlier answer's params)::

        {"do_remote_prefill": true, "kvxferd": 1, "kvxferd_push": true, "transfer_id": "7f3a...",
         "push_key": "<32 hex>", "remote_engine_id": "prefill-0", "remote_peer_addresses": ["10.0.0.7:47100"]}

    The prefill leg carries ``{"do_remote_decode": true, "kvxferd_transfer_id": "7f3a...",
    "kvxferd_push_digest": "<64 hex>"}``: the digest of the ``push_key`` the decode leg carries.
    """

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    kvxferd: int
    kvxferd_push: Literal[True]
    transfer_id: Id
    push_key: PushKey  # the decode leg's secret: the prefill leg carries only its digest
    remote_engine_id: Id
    remote_peer_addresses: Annotated[list[Id], Field(min_length=1, max_length=MAX_TP_SIZE)]
    remote_num_tokens: Annotated[int, Field(ge=0, lt=2**31)] = 0  # the scheduler's: prompt tokens to load
    traceparent: str = ""  # the decode request's W3C trace context (issue #60), as in RemotePrefill

    _version = field_validator("kvxferd")(RemotePrefill._version.__func__)
    _traceparent = field_validator("traceparent", mode="before")(RemotePrefill._traceparent.__func__)

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, **self.model_dump()}

    def key(self) -> bytes:
        """The push key, as the daemon takes it."""
        return bytes.fromhex(self.push_key)


def is_push(params: dict[str, Any] | None) -> bool:
    """Whether ``kv_transfer_params`` are a push's decode leg (:class:`PushPrefill`)."""
    return isinstance(params, dict) and bool(params.get("kvxferd_push"))


def parse_push_prefill(params: dict[str, Any]) -> PushPrefill:
    """A push's decode-leg params; raises :class:`ParamsError` naming the field."""
    try:
        return PushPrefill.model_validate(params)
    except ValidationError as err:
        where, message = first_error(err)
        raise ParamsError(f"kv_transfer_params{'.' + where if where else ''}: {message}") from None


def transfer_id_of(params: dict[str, Any] | None) -> str | None:
    """A push's prefill leg names the transfer its hold is known by (``kvxferd_transfer_id``); None: a pull's."""
    if not isinstance(params, dict) or params.get("kvxferd_transfer_id") is None:
        return None
    value = params["kvxferd_transfer_id"]
    if not isinstance(value, str) or not 1 <= len(value) <= 256 or not all("\x21" <= c <= "\x7e" for c in value):
        raise ParamsError("kv_transfer_params.kvxferd_transfer_id: 1..256 printable ASCII characters expected")
    return value


def verify_of(params: dict[str, Any] | None) -> bool | None:
    """Whether a pull's prefill leg asks for its KV to be checked on decode (``kvxferd_verify``: true) or not
    (false); None: it does not say (the connector's ``verify_share`` decides)."""
    value = params.get("kvxferd_verify") if isinstance(params, dict) else None
    if value is not None and not isinstance(value, bool):
        raise ParamsError("kv_transfer_params.kvxferd_verify: true or false expected")
    return value


def push_layers_of(params: dict[str, Any] | None) -> bool | None:
    """Whether a push's prefill leg asks to be written layer by layer (``kvxferd_push_layers``: true) or in one
    batch (false); None: it does not say (the connector's ``push_layer_min_tokens`` decides)."""
    value = params.get("kvxferd_push_layers") if isinstance(params, dict) else None
    if value is not None and not isinstance(value, bool):
        raise ParamsError("kv_transfer_params.kvxferd_push_layers: true or false expected")
    return value


def push_hold_of(params: dict[str, Any] | None) -> tuple[str, bytes] | None:
    """A push's prefill leg: the transfer id its hold is known by and the digest of the transfer's push key
    (``kvxferd_push_digest``, 64 lower-case hex: only a decode leg presenting the key gets the blocks);
    None: a pull's. Raises :class:`ParamsError` naming the field."""
    transfer_id = transfer_id_of(params)
    if transfer_id is None:
        return None
    digest = params.get("kvxferd_push_digest")
    if not isinstance(digest, str) or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise ParamsError("kv_transfer_params.kvxferd_push_digest: 64 lower-case hex digits expected (the digest "
                          "of the transfer's push key)")
    return transfer_id, bytes.fromhex(digest)


def parse_remote_prefill(params: dict[str, Any] | None) -> RemotePrefill:
    """The decode side's view of ``kv_transfer_params``; raises :class:`ParamsError` naming the field."""
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params: expected an object, got {type(params).__name__}")
    if params.get("error"):
        raise ParamsError(f"kv_transfer_params.error: the prefill side could not hold the blocks: {params['error']}")
    try:
        return RemotePrefill.model_validate(params)
    except ValidationError as err:
        where, message = first_error(err)
        raise ParamsError(f"kv_transfer_params{'.' + where if where else ''}: {message}") from None


def failed_prefill_params(error: str) -> dict[str, Any]:
    """What prefill returns when it could not hold the blocks: decode fails (or recomputes) that request."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "kvxferd": PARAMS_VERSION, "error": error}
