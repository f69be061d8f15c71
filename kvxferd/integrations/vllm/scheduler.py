"""The connector's scheduler side: holds on prefill, read orders on decode.

Prefill (a request that came with ``do_remote_decode``)::

    build_connector_meta ─► (a one-token request whose whole prompt runs in this step) Hold
                            sent on every rank's daemon, not waited for: it overlaps the
                            forward pass; renewed while the step runs (early.py)
    request_finished     ─► the Hold's answers (sent now if it was not sent early; released and
                            sent again if the blocks changed since, or half its lease is gone)
                            ─► delay_free=True + kv_transfer_params (engine id, peer addresses,
                            block ids, token count, lease expiry)

Holds, renewals and releases go on one control session per rank's daemon (the
reads socket, :mod:`kvxferd.client.control`): no gRPC call waits on a request's
path; a release returns once sent, and the daemon takes it before a new hold
of the same id sent after it.

An early hold gives nothing away: only ``request_finished``'s params carry its
capability, so no reader can use it before the prompt is computed. A hold
released here was never handed over, and the workers ignore its EXPIRED, so it
cannot end a later hold of the same request id. Engines whose blocks at the end
are not the prompt's (sliding windows, states, speculative decoding) hold at the
end only.

Push (issue #57, ``mode: push``): the proxy sends both legs at once with one
transfer id. The prefill leg is held under it (``kvxferd_transfer_id``, with ``kvxferd_push_digest``); the
decode leg (``kvxferd_push``) orders an expectation instead of a read: the
worker submits it, the decode daemon tells the prefill daemons, which write
once the hold is placed. A decode request that ends before it was scheduled
sends an empty expectation, so the prefill hold ends at once.

Decode (a request that came with ``do_remote_prefill``)::

    get_num_new_matched_tokens ─► the prompt minus what the local prefix cache has
    update_state_after_alloc   ─► one ReadOrder: the uncached local blocks <- the remote blocks
    build_connector_meta       ─► the orders go to the workers, which submit the reads

A full local prefix hit still orders an (empty) read: it reads nothing but
notifies the holders, so the prefill blocks are freed at once. Bad
``kv_transfer_params`` become a failed order: the worker reports the request
as a failed load and vLLM applies its ``kv_load_failure_policy``.

State groups (Mamba) hold one running state per request, not one entry per
token, so decode cannot recompute the last prompt token on top of a state
that already holds it (attention can: it rewrites the same slot). The
prefiller stops ``num_backoff_tokens`` short and decode loads only that many
fewer, then computes the rest itself::

    prompt       t1 t2 ... t(N-1) | tN
    prefill      computes ──────►   (dropped)     holds state h(N-1)
    decode       loads h(N-1)     | computes tN -> h(N), the first token

vLLM-free: requests and blocks are passed as plain values.
"""

from __future__ import annotations

import base64
import functools
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from kvxferd.client.engine import EngineClient
from kvxferd.client.session import Held
from kvxferd.errors import KvxferError
from kvxferd.integrations.vllm.early import EarlyHolds, SentHold
from kvxferd.integrations.vllm.params import (ParamsError, PushPrefill, RemotePrefill, failed_prefill_params,
                                              is_push, parse_push_prefill, parse_remote_prefill, push_hold_of,
                                              push_layers_of, verify_of)
from kvxferd.integrations.vllm.settings import ConnectorSettings
from kvxferd.wire.tracecontext import traceparent_of

log = logging.getLogger("kvxferd.vllm")
NULL_BLOCK_ID = 0  # vLLM's placeholder block (sliding-window and Mamba groups): never transferred


@dataclass(frozen=True)
class RankDaemon:
    """Where one TP rank's daemon is (its engine socket, its advertised peer address) and the
    session the rank's worker registered with, which the scheduler's holds must carry."""

    tp_rank: int
    engine_socket: str
    peer_address: str
    session: str = ""


@dataclass(frozen=True)
class HeldRequest:
    """Scheduler -> workers: ``request_id`` is held on every rank; per rank, the incarnation of the
    registration holding it (a worker whose registration was replaced since knows the hold is gone)."""

    request_id: str
    incarnations: tuple[str, ...]
    hold_id: str = ""  # the id the daemons hold it by, when not request_id (a push's transfer id)

    @property
    def held_as(self) -> str:
        return self.hold_id or self.request_id


@dataclass(frozen=True)
class ReadOrder:
    """Scheduler -> worker: read ``remote`` into ``local_block_ids`` (per group), or fail with ``error``.

    ``awaited``: vLLM parked the request until this read finishes, so the worker
    reports it (finished or failed). An order with nothing to load (a full local
    prefix hit, a request that ended before its read) only tells the holders to
    let go; vLLM is not waiting for it and must not hear of it.
    """

    request_id: str
    remote: dict | None  # RemotePrefill.to_params() (a push: PushPrefill.to_params()); None when the params were bad
    local_block_ids: tuple[tuple[int, ...], ...]
    error: str = ""
    awaited: bool = True

    @property
    def push(self) -> bool:
        """A push's expectation (the prefill daemons write), not a read."""
        return is_push(self.remote)


def _raise(err: BaseException):
    raise err


def describe_error(err: Exception) -> str:
    """An error as one line: a gRPC error's status and details, any other error's message."""
    return f"{err.code().name}: {err.details()}" if isinstance(err, grpc.RpcError) else str(err)


def real_blocks(block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Per group, the block ids without vLLM's null placeholders (out-of-window or unused slots)."""
    return tuple(tuple(int(b) for b in group if b != NULL_BLOCK_ID) for group in block_ids)


class SchedulerSide:
    """Scheduler-process state of one engine (prefill, decode, or both)."""

    def __init__(self, engine_id: str, settings: ConnectorSettings, num_backoff_tokens: int = 0,
                 early_holds: bool = True, push_layers_allowed: bool = True) -> None:
        self.engine_id = engine_id
        self.settings = settings
        # False where a worker cannot tell when a layer's KV is in the cache (kernels it cannot fence, a layer
        # run once per micro-batch): every push is then written in one batch, whatever a leg asks
        self.push_layers_allowed = push_layers_allowed
        self.num_backoff_tokens = num_backoff_tokens  # 1 when a group holds running states (Mamba)
        # False where the blocks vLLM allocates for a prompt differ from those it hands over at the end
        # (sliding windows and states drop blocks, speculative decoding reserves more): held at the end
        self.early_holds = early_holds
        self.ranks: list[RankDaemon] = []
        self._clients: dict[int, EngineClient] = {}
        self._orders: list[ReadOrder] = []
        self._held: list[HeldRequest] = []  # held since the last build_connector_meta
        self._pending: dict[str, RemotePrefill | PushPrefill | ParamsError] = {}  # decode requests not scheduled yet
        self._hold_ids: dict[str, str] = {}  # push prefills (issue #57): request id -> the transfer id held
        self._layer_digests: dict[str, bytes] = {}  # push prefills written layer by layer: their push key digests
        self._layered: list[str] = []  # transfer ids held layer by layer with the step being built
        # remote-decode prefills allocated, not scheduled whole yet -> (prompt tokens, W3C trace context)
        self._prefills: dict[str, tuple[int, str]] = {}
        self._early = EarlyHolds(settings.lease_s, self._renew)  # holds sent before request_finished

    # ---- the daemons of every rank ---------------------------------------------------
    def set_ranks(self, ranks: Sequence[RankDaemon]) -> None:
        """Every TP rank's daemon, as the workers registered there (handshake metadata)."""
        self.ranks = sorted(ranks, key=lambda r: r.tp_rank)
        if [r.tp_rank for r in self.ranks] != list(range(len(self.ranks))):
            raise ValueError(f"kvxferd: handshake metadata of TP ranks {[r.tp_rank for r in self.ranks]}, "
                             "expected every rank once")

    def _client(self, rank: RankDaemon) -> EngineClient:
        client = self._clients.get(rank.tp_rank)
        if client is None:
            client = self._clients[rank.tp_rank] = EngineClient(f"unix:{rank.engine_socket}",
                                                                timeout_s=self.settings.timeout_s,
                                                                daemon_uid=self.settings.daemon_uid)
            client.engine_id = self.engine_id  # the workers registered it; this process only holds
            client.session = rank.session
        return client

    # ---- prefill ------------------------------------------------------------------------
    def prompt_tokens_to_drop(self, params: dict | None, num_prompt_tokens: int) -> int:
        """How many trailing prompt tokens a prefill request must not compute (decode computes them).

        0 unless this engine has state groups; 0 for a prompt no longer than the
        back-off (decode computes all of it) and for a request already cut.
        """
        if not params or not params.get("do_remote_decode") or params.get("kvxferd_prompt_cut"):
            return 0
        return self.num_backoff_tokens if num_prompt_tokens > self.num_backoff_tokens else 0

    def prefill_allocated(self, request_id: str, params: dict | None, num_prompt_tokens: int, max_tokens: int) -> None:
        """``update_state_after_alloc``: note a remote-decode prefill whose hold may go out early: one that
        ends at the step that computes its prompt (one token; the proxy's prefill leg), so the blocks
        held then are the blocks ``request_finished`` hands over."""
        if params and params.get("do_remote_decode") and self.settings.mode == "push":
            try:
                push, layers = push_hold_of(params), push_layers_of(params)
            except ParamsError:
                push = None  # refused when it is held (request_finished)
            if push is not None:
                self._hold_ids[request_id] = push[0]
                if layers is None:  # the leg does not say: long prompts go layer by layer
                    layers = 0 < (self.settings.push_layer_min_tokens or 0) <= num_prompt_tokens
                if layers and self.push_layers_allowed:
                    self._layer_digests[request_id] = push[1]
        if params and params.get("do_remote_decode") and not params.get("do_remote_prefill") and max_tokens == 1:
            self._prefills[request_id] = (num_prompt_tokens, traceparent_of(params))

    def prefill_scheduled(self, request_id: str, block_ids: Sequence[Sequence[int]], num_computed_tokens: int,
                          num_scheduled_tokens: int) -> bool:
        """``build_connector_meta``: a noted prefill scheduled whole (its last prompt token in this step, its
        blocks all allocated) ends at this step's end; its hold goes out now and :meth:`hold` collects the
        answers, so the round trips overlap the forward pass instead of following it (issue #41). Whether
        it went out. A prompt computed in chunks is held in :meth:`hold`, as before."""
        num_prompt_tokens, traceparent = self._prefills.pop(request_id, (None, ""))
        if num_prompt_tokens is None or num_computed_tokens + num_scheduled_tokens < num_prompt_tokens:
            return False
        if not self.early_holds or not self.ranks or request_id in self._early:
            return False  # (in _early: scheduled whole again after a preemption; hold() checks the blocks)
        blocks = real_blocks(block_ids)
        if request_id in self._hold_ids:  # a push's hold starts its writes: only of layers the forward pass computed
            digest = self._layer_digests.pop(request_id, None)
            if digest is None:
                return False  # one batch, held once the whole forward pass ended (request_finished)
            transfer_id = self._hold_ids[request_id]  # layer by layer: none final yet, the workers say when
            self._early.put(request_id, self._send(transfer_id, blocks, digest, layers_final=(0,) * len(blocks),
                                                   traceparent=traceparent))
            self._layered.append(transfer_id)
            return True
        self._early.put(request_id, self._send(request_id, blocks, traceparent=traceparent))
        return True

    def take_layered(self) -> list[str]:
        """The transfer ids held layer by layer with this step (the workers say when each layer is final)."""
        layered, self._layered = self._layered, []
        return layered

    def drop_early(self, request_id: str) -> None:
        """A prefill that ended without being handed over (aborted): let its early hold go."""
        self._prefills.pop(request_id, None)
        self._layer_digests.pop(request_id, None)
        hold_id = self._hold_ids.pop(request_id, request_id)
        early = self._early.pop(request_id)
        if early is not None:
            self._let_go(hold_id, early)

    def _send(self, request_id: str, blocks, push_digest: bytes = b"", layers_final=(), *,
              want_digests: bool = False, traceparent: str = "") -> SentHold:
        """Every rank's hold in flight at once (one after another, a TP engine's cost a round trip per
        rank, issue #41); never raises: a rank that could not even be asked answers with its error.
        ``traceparent``: the request's W3C trace context, for the daemons' spans of the hold (issue #60)."""
        # Before the calls: the daemons' leases start after this. Both clocks read here, each for its use
        # (a wall time rebuilt from monotonic ages drifts by rounding: issue #54's runs saw 1.4 µs).
        sent_s, sent_unix_s = time.monotonic(), time.time()
        answers = []
        for rank in self.ranks:
            try:
                answers.append(self._client(rank).hold_started(request_id, blocks, lease_s=self.settings.lease_s,
                                                               push_key_digest=push_digest, layers_final=layers_final,
                                                               want_digests=want_digests, traceparent=traceparent))
            except (grpc.RpcError, KvxferError) as err:
                answers.append(functools.partial(_raise, err))
        return SentHold(blocks, sent_s, tuple(answers), sent_unix_s)

    def _let_go(self, request_id: str, sent: SentHold) -> None:
        """Release ``sent`` on the ranks that held it (waits for their answers)."""
        self._release(request_id, [rank for rank, answer in zip(self.ranks, sent.answers) if self._answered(answer)])

    @staticmethod
    def _answered(answer: Callable[[], Held]) -> bool:
        try:
            answer()
            return True
        except (grpc.RpcError, KvxferError):
            return False

    def _renew(self, request_ids: list[str]) -> set[str]:
        """Renew early holds on every rank (the early holds' thread); the ids a rank did not know. A rank
        that cannot be asked is left out: its holds run on their leases."""
        unknown: set[str] = set()
        for rank in self.ranks:
            try:
                unknown.update(self._client(rank).renew(request_ids, lease_s=self.settings.lease_s))
            except (grpc.RpcError, KvxferError):
                continue
        return unknown

    def _release(self, request_id: str, ranks: Sequence[RankDaemon]) -> None:
        for rank in ranks:
            try:
                self._client(rank).release(request_id)
            except grpc.RpcError:
                pass  # it expires on its own

    def hold(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int,
             params: dict | None = None) -> tuple[bool, dict]:
        """Hold a finished prefill on every rank; ``(delay_free, kv_transfer_params)``. A push's prefill leg
        (``kvxferd_transfer_id`` in ``params``, push mode) is held under its transfer id: the decode ranks'
        expectations name it, and the prefill daemons write once it is held."""
        self._hold_ids.pop(request_id, None)
        self._layer_digests.pop(request_id, None)  # (a prompt not held with its step: computed in chunks, say)
        try:
            push = push_hold_of(params) if self.settings.mode == "push" else None
            push_layers_of(params)  # checked (it was used when the prompt was scheduled)
            verify = verify_of(params)
        except ParamsError as err:
            self.drop_early(request_id)
            return False, failed_prefill_params(str(err))
        if push is None:
            if verify is None:  # the connector's share, the same choice for a request id every time
                verify = zlib.crc32(request_id.encode()) < self.settings.verify_share * 2**32
            return self._hold(request_id, request_id, block_ids, num_tokens, verify=verify,
                              traceparent=traceparent_of(params))
        transfer_id, push_digest = push
        return self._hold(request_id, transfer_id, block_ids, num_tokens, push_digest,
                          traceparent=traceparent_of(params))

    def _hold(self, request_id: str, hold_id: str, block_ids: Sequence[Sequence[int]],
              num_tokens: int, push_digest: bytes = b"", *, verify: bool = False,
              traceparent: str = "") -> tuple[bool, dict]:
        if not self.ranks:
            return False, failed_prefill_params("kvxferd: no rank of this engine registered with a daemon")
        blocks = real_blocks(block_ids)
        self._prefills.pop(request_id, None)
        sent = self._early.pop(request_id)
        if sent is not None and (sent.blocks != blocks or time.monotonic() - sent.sent_s > self.settings.lease_s / 2
                                 or verify):  # (an early hold went before the KV was final: no digests of it)
            # Other blocks (preempted and scheduled again, say), or half the lease gone although the
            # early holds' thread renews it (early.py; a rank forgot it, or the thread was starved): let
            # it go and hold anew. The workers ignore a released hold's EXPIRED (worker.py), so it cannot end
            # the new hold of the same id.
            self._let_go(hold_id, sent)
            sent = None
        if sent is None:
            sent = self._send(hold_id, blocks, push_digest, want_digests=verify, traceparent=traceparent)
        held_since_s = sent.sent_unix_s
        held: list[RankDaemon] = []
        incarnations: list[str] = []
        capabilities: list[str] = []
        digests: list[str] = []
        error = ""
        for rank, answer in zip(self.ranks, sent.answers):
            try:
                hold = answer()
            except (grpc.RpcError, KvxferError) as err:
                error = error or f"rank {rank.tp_rank} ({rank.engine_socket}): {describe_error(err)}"
                continue
            incarnations.append(hold.incarnation)
            capabilities.append(hold.capability.hex())
            if hold.digests:
                digests.append(base64.b64encode(hold.digests).decode())
            held.append(rank)
        if error:
            self._release(hold_id, held)  # all ranks or none
            log.warning("kvxferd: could not hold a finished prefill", extra={"request_id": request_id, "error": error})
            return False, failed_prefill_params(error)
        self._held.append(HeldRequest(request_id, tuple(incarnations), "" if hold_id == request_id else hold_id))
        params = RemotePrefill(kvxferd=1, remote_engine_id=self.engine_id, remote_request_id=hold_id,
                               remote_peer_addresses=[r.peer_address for r in self.ranks],
                               remote_block_ids=[list(g) for g in blocks], remote_capabilities=capabilities,
                               remote_digests=digests if len(digests) == len(capabilities) else [],
                               remote_num_tokens=num_tokens,
                               remote_lease_expiry_unix_s=held_since_s + self.settings.lease_s,
                               traceparent=traceparent)  # decode's read joins the request's trace (issue #60)
        return True, params.to_params()

    def take_held(self) -> list[HeldRequest]:
        held, self._held = self._held, []
        return held

    # ---- decode -------------------------------------------------------------------------
    def matched_tokens(self, request_id: str, params: dict | None, num_prompt_tokens: int,
                       num_computed_tokens: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: the remote prompt beyond the local prefix cache, loaded async."""
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if is_push(params):
            return self._matched_push(request_id, params, num_prompt_tokens, num_computed_tokens)
        try:
            remote = self._pending[request_id] = parse_remote_prefill(params)
            num_tokens = min(remote.remote_num_tokens, self.loadable_tokens(num_prompt_tokens))
            if self.num_backoff_tokens and num_tokens != remote.remote_num_tokens:
                # A running state is after exactly remote_num_tokens tokens; it has no prefix to
                # load. Decode computes the whole prompt, and the empty read releases the hold
                # (the normal case for a prompt no longer than the back-off: not worth a warning).
                if remote.remote_num_tokens > self.num_backoff_tokens:
                    log.warning("kvxferd: the prefill state is after %d tokens, decode can load %d: computing "
                                "the prompt", remote.remote_num_tokens, num_tokens, extra={"request_id": request_id})
                num_tokens = 0
        except ParamsError as err:
            self._pending[request_id] = err
            # a failed load (at least one token, so vLLM hears of it): the policy decides
            num_tokens = max(self.loadable_tokens(num_prompt_tokens), 1)
        count = num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _matched_push(self, request_id: str, params: dict, num_prompt_tokens: int,
                      num_computed_tokens: int) -> tuple[int, bool]:
        """A push's decode leg: the prefill computes the whole loadable prompt and writes it; decode expects
        what its prefix cache does not hold. Bad params, or push params in pull mode: a failed load."""
        num_tokens = self.loadable_tokens(num_prompt_tokens)
        try:
            if self.settings.mode != "push":
                raise ParamsError("kv_transfer_params.kvxferd_push: this engine's connector runs in pull mode "
                                  "(kv_connector_extra_config.mode)")
            self._pending[request_id] = parse_push_prefill(params).model_copy(update={"remote_num_tokens": num_tokens})
        except ParamsError as err:
            self._pending[request_id] = err
            num_tokens = max(num_tokens, 1)
        count = num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def loadable_tokens(self, num_prompt_tokens: int) -> int:
        """The prompt tokens a read may restore: all of them, less the back-off for state groups.

        A prompt no longer than the back-off loads nothing (its state would already
        hold the token decode must compute).
        """
        return max(num_prompt_tokens - self.num_backoff_tokens, 0)

    def after_alloc(self, request_id: str, params: dict | None, new_block_ids: Sequence[Sequence[int]],
                    num_external_tokens: int) -> None:
        """``update_state_after_alloc``: one read order per request (an empty one on a full local hit)."""
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if called again
        remote = self._take_remote(request_id, params)
        local = real_blocks(new_block_ids) if num_external_tokens > 0 else ()
        self._order(request_id, remote, local, awaited=num_external_tokens > 0)

    def finished_before_scheduled(self, request_id: str, params: dict | None) -> None:
        """A decode request that ended before its read: release the prefill hold with an empty read."""
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        remote = self._take_remote(request_id, params)  # parsed now if aborted before it was ever matched
        if isinstance(remote, (RemotePrefill, PushPrefill)):  # a push: an empty expectation lets the hold go
            self._order(request_id, remote, (), awaited=False)

    def _take_remote(self, request_id: str, params: dict) -> RemotePrefill | ParamsError:
        """The params ``matched_tokens`` parsed for this request, else ``params`` parsed now."""
        remote = self._pending.pop(request_id, None)
        if remote is None:
            try:
                if is_push(params) and self.settings.mode == "push":
                    remote = parse_push_prefill(params)
                else:
                    remote = parse_remote_prefill({**params, "do_remote_prefill": True})
            except ParamsError as err:
                remote = err
        return remote

    def _order(self, request_id: str, remote: RemotePrefill | PushPrefill | ParamsError, local, *,
               awaited: bool) -> None:
        if isinstance(remote, ParamsError):
            self._orders.append(ReadOrder(request_id, None, (), str(remote), awaited))
            return
        if isinstance(remote, PushPrefill):  # the worker fills in empty groups (it knows how many)
            self._orders.append(ReadOrder(request_id, remote.to_params(), tuple(local), awaited=awaited))
            return
        if not local:
            local = tuple(() for _ in remote.remote_block_ids)
        elif len(local) != len(remote.remote_block_ids):
            self._orders.append(ReadOrder(request_id, None, (), f"kv_transfer_params.remote_block_ids: "
                                          f"{len(remote.remote_block_ids)} groups, this engine has {len(local)}",
                                          awaited))
            return
        self._orders.append(ReadOrder(request_id, remote.to_params(), tuple(local), awaited=awaited))

    def take_orders(self) -> list[ReadOrder]:
        orders, self._orders = self._orders, []
        return orders

    def close(self) -> None:
        self._early.close()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
