"""The connector's worker side: one engine rank and its local daemon.

::

    register_kv_caches ─► describe the cache (no copy) ─► fds over the fd socket ─► Register
    start_load_kv      ─► Handshake a new remote engine once ─► one Reads batch per step
    get_transfer_results
        decode:  completions ─► finished_recving; a failed read ─► its invalid block ids
                 (one KV cache group) or failed_recving (several groups: block ids
                 are not unique across groups, vLLM can only fail the request)
        prefill: CONSUMED / EXPIRED on the bus ─► finished_sending (the blocks may go)
        both:    each read vLLM waited for and each hold that ended ─► TransferStats
                 (get_kv_connector_stats ─► vLLM's /metrics)

A read that cannot even be submitted (unknown remote, daemon error, bad
params) is a failed load of that request, never an exception in vLLM's step.

vLLM-free: the connector passes plain values.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from kvxferd.client.engine import EngineClient
from kvxferd.client.notify import RELEASED, TERMINAL, NotifySubscriber
from kvxferd.integrations.vllm.describe import GroupLayout, describe_engine
from kvxferd.integrations.vllm.layers import LayerReports
from kvxferd.integrations.vllm.params import PushPrefill, RemotePrefill
from kvxferd.integrations.vllm.scheduler import HeldRequest, RankDaemon, ReadOrder, describe_error
from kvxferd.integrations.vllm.settings import ConnectorSettings
from kvxferd.integrations.vllm.stats import TransferStats
from kvxferd.integrations.vllm.trace import Trace
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.client.fdsend import MAX_FDS_PER_MESSAGE, own_process_fd, send_fds
from kvxferd.wire.names import fd_socket_path

log = logging.getLogger("kvxferd.vllm")


@dataclass
class TransferResults:
    """One snapshot for vLLM: request ids, and block ids that failed to load."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


class WorkerSide:
    """One TP rank's connection to its daemon."""

    def __init__(self, engine_id: str, tp_rank: int, tp_size: int, settings: ConnectorSettings, *,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        self.engine_id, self.tp_rank, self.tp_size = engine_id, tp_rank, tp_size
        self.settings = settings
        self.socket = settings.socket_for(tp_rank, tp_size, dp_rank, dp_size)  # host-local DP rank and size
        self.client: EngineClient | None = None
        self.subscriber: NotifySubscriber | None = None
        self.peer_address = ""
        self.num_groups = 0
        self._remotes: dict[str, tuple[str, ...]] = {}  # remote engine -> addresses handshaked
        self._reading: dict[str, float] = {}  # reads vLLM waits for -> when submitted (monotonic)
        self._failed_now: set[str] = set()  # orders that failed before reaching the daemon
        self._releasing: set[str] = set()  # release-only reads (vLLM does not wait): a refusal is logged
        self._held: dict[str, str] = {}  # prefill requests the scheduler held (by hold id) -> incarnation holding it
        self._vllm_ids: dict[str, str] = {}  # push holds: transfer id -> the vLLM request it frees
        self._ended: set[str] = set()  # holds that ended before the worker heard they were held
        self._incarnation = ""  # of the current registration (the one handshakes were made on)
        self.stats = TransferStats()  # since the last take_stats
        self.trace = Trace(f"{engine_id}-worker{tp_rank}", settings.trace_dir)
        self.layers = LayerReports((), self._final_layers)  # a push's layers, as they become final (layers.py)

    # ---- registration ---------------------------------------------------------------
    def register(self, groups: Sequence[GroupLayout], tensors: Mapping[str, torch.Tensor]) -> RankDaemon:
        """Hand the cache to the daemon (once); a missing daemon is a clear error naming the socket."""
        if not os.path.exists(self.socket):
            raise RuntimeError(f"kvxferd: no daemon listens on {self.socket} (start `kvxferd serve --engine-socket "
                               f"{self.socket}` next to this engine, or set kv_connector_extra_config.engine_socket)")
        engine, fds = describe_engine(self.engine_id, self.tp_rank, self.tp_size, groups, tensors)
        # Last, this process's pidfd: the daemon lets go of the cache the moment this process exits. Where
        # there is none (a kernel before 5.3, a seccomp profile refusing pidfd_open) or no room for it in one
        # message, the registration's lease alone ends it, as before.
        process_fd_index = None
        if len(fds) < MAX_FDS_PER_MESSAGE:
            try:
                fds, process_fd_index = [*fds, own_process_fd()], len(fds)
            except OSError as err:
                log.warning("kvxferd: no pidfd of this process (%s): the daemon lets go of the cache only when "
                            "its lease runs out", err)
        self.num_groups = len(groups)
        self.layers = LayerReports([g.layer_names for g in groups], self._final_layers)

        def pass_fds() -> str:
            token = uuid.uuid4().hex
            send_fds(fd_socket_path(self.socket), token, fds, timeout_s=self.settings.timeout_s,
                     daemon_uid=self.settings.daemon_uid)
            return token

        token = pass_fds() if fds else ""
        self.client = EngineClient(f"unix:{self.socket}", timeout_s=self.settings.timeout_s,
                                   daemon_uid=self.settings.daemon_uid)
        lease_s = max(3 * self.settings.heartbeat_s, 10.0)
        # A restarted engine finds its previous registration alive until that lease runs out.
        give_up_s = time.monotonic() + lease_s + 5.0
        while True:
            try:
                # After a daemon restart the heartbeat registers again, passing host memory's fds anew.
                reply = self.client.register(engine, lease_s=lease_s, heartbeat_s=self.settings.heartbeat_s,
                                             fd_token=token, fd_source=pass_fds if fds else None,
                                             process_fd_index=process_fd_index)
                break
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.ALREADY_EXISTS and time.monotonic() < give_up_s:
                    time.sleep(0.5)
                    continue
                raise RuntimeError(f"kvxferd: the daemon at {self.socket} refused the KV cache: "
                                   f"{err.code().name}: {err.details()}") from None
        self.peer_address, self._incarnation = reply.peer_address, self.client.incarnation
        self.subscriber = NotifySubscriber(self.client)
        log.info("kvxferd: KV cache registered", extra={"engine_id": self.engine_id, "tp_rank": self.tp_rank,
                                                        "socket": self.socket, "peer": self.peer_address})
        return RankDaemon(self.tp_rank, self.socket, self.peer_address, self.client.session)

    # ---- decode: reads ----------------------------------------------------------------
    def submit(self, orders: Sequence[ReadOrder]) -> None:
        """Submit this step's orders as one batch on the Reads stream; a failure fails that request only.

        A read the daemon refuses comes back as a failed completion (``refused_code``).
        """
        self._follow_registration()
        specs = []
        for order in orders:
            try:
                specs.append(self._spec(order))
            except (grpc.RpcError, ValueError) as err:
                reason = describe_error(err)
                log.warning("kvxferd: read not submitted", extra={"request_id": order.request_id, "error": reason})
                if order.awaited:
                    self._failed_now.add(order.request_id)
                    self.stats.record_failed_read("not_submitted")
                continue
            if order.awaited:  # else only the holders hear of it (their blocks may go); vLLM does not wait
                self._reading[order.request_id] = time.monotonic()
            else:
                self._releasing.add(order.request_id)
        if specs:
            submitted_s = time.time()
            self.client.reads.submit_reads(specs)
            if self.trace.enabled:
                self.trace.stamp("submitted", self._reading.keys() & {spec.request_id for spec in specs}, submitted_s)

    def _spec(self, order: ReadOrder):
        if order.remote is None:
            raise ValueError(order.error)
        if order.push:
            return self._push_spec(order)
        remote = RemotePrefill.model_validate(order.remote)
        self._handshake(remote.remote_engine_id, tuple(remote.remote_peer_addresses))
        return self.client.read_spec(order.request_id, remote.remote_engine_id, remote.remote_request_id,
                                     order.local_block_ids, remote.remote_block_ids,
                                     num_tokens=remote.remote_num_tokens, deadline_s=self.settings.deadline_s,
                                     remote_capabilities=remote.capabilities(), remote_digests=remote.digests(),
                                     traceparent=remote.traceparent)

    def _push_spec(self, order: ReadOrder):
        """A push's expectation (issue #57): these blocks, written by the prefill daemons once their engine
        holds the transfer; its completion comes as a read's. An empty one lets the prefill hold go."""
        remote = PushPrefill.model_validate(order.remote)
        self._handshake(remote.remote_engine_id, tuple(remote.remote_peer_addresses))
        local = order.local_block_ids or tuple(() for _ in range(self.num_groups))
        spec = self.client.push_spec(order.request_id, remote.remote_engine_id, remote.transfer_id, remote.key(),
                                     local, num_tokens=remote.remote_num_tokens, deadline_s=self.settings.deadline_s)
        spec.traceparent = remote.traceparent
        return spec

    def _handshake(self, remote_engine_id: str, addresses: tuple[str, ...]) -> None:
        if self._remotes.get(remote_engine_id) != addresses:
            self.client.handshake(remote_engine_id, addresses)
            self._remotes[remote_engine_id] = addresses

    # ---- prefill: holds ---------------------------------------------------------------
    def expect_held(self, held: Sequence[HeldRequest]) -> None:
        """Requests the scheduler held (on every rank): they end on CONSUMED / EXPIRED, or with their registration.
        A push's hold is known to the daemons by its transfer id: its end frees the vLLM request it names."""
        self._held.update((h.held_as, h.incarnations[self.tp_rank]) for h in held)
        self._vllm_ids.update((h.hold_id, h.request_id) for h in held if h.hold_id)

    def _final_layers(self, transfer_id: str, layers_final: Sequence[int]) -> None:
        self.client.final_layers(transfer_id, layers_final)

    # ---- both: what finished ---------------------------------------------------------
    def results(self) -> TransferResults:
        """Everything that finished since the last call (never blocks)."""
        out = TransferResults()
        if self.client is None:
            return out
        self._follow_registration()
        now = time.monotonic()
        lost = self.client.reads.take_lost()
        self._releasing -= lost  # their holds end with the lost registration or their lease
        for request_id in lost & self._reading.keys():  # in flight when the daemon went away
            self.stats.record_failed_read("lost", now - self._reading.pop(request_id))
            self._failed_now.add(request_id)
        for request_id in self._failed_now:
            self._reading.pop(request_id, None)
            out.finished_recving.add(request_id)
            out.failed_recving.add(request_id)
        self._failed_now.clear()
        for completion, arrived_s in self.client.reads.take_completions_timed():
            submitted = self._reading.pop(completion.request_id, None)
            if self.trace.enabled and submitted is not None:
                self._stamp_read(completion, arrived_s)
            if submitted is None:
                if completion.request_id in self._releasing and not completion.ok:
                    log.warning("kvxferd: a release-only read was refused; the prefill hold ends at its lease",
                                extra={"request_id": completion.request_id, "error": completion.error})
                self._releasing.discard(completion.request_id)
                continue
            out.finished_recving.add(completion.request_id)
            if completion.ok:
                self.stats.record_read(completion.num_bytes, completion.duration_s, now - submitted)
                continue
            self.stats.record_failed_read("refused" if completion.refused_code else "read", now - submitted)
            log.warning("kvxferd: read failed", extra={"request_id": completion.request_id, "error": completion.error,
                                                         "failure": completion.failure})  # (corrupt: issue #59)
            lists = completion.invalid_block_ids
            if self.num_groups == 1 and lists and lists[0].ids:
                out.invalid_block_ids.update(int(b) for b in lists[0].ids)
            else:  # several groups (ids are not unique across them) or nothing named: fail the request
                out.failed_recving.add(completion.request_id)
        try:
            events = self.subscriber.poll()
        except grpc.RpcError as err:  # the daemon is down or restarting: its events are fetched later
            log.debug("kvxferd: notify catch-up failed", extra={"error": err.code().name})
            events = []
        for event in events:
            if event.kind == pb.NotifyEvent.EXPIRED and event.reason == RELEASED:
                # Only this engine's scheduler releases, and only holds it never handed over (an early
                # hold it sends again, a hold not placed on every rank): no reader, no blocks to free.
                # Counting it as an end would end a later hold of the same request id.
                continue
            if event.kind in TERMINAL:
                self._ended.add(event.request_id)
                self.trace.stamp("bus_ended", (event.request_id,))
                self.stats.record_hold_ended("consumed" if event.kind == pb.NotifyEvent.CONSUMED else "expired")
        gone = set(self.client.incarnations[:-1])  # registrations replaced since: their holds are gone
        done = {r for r, incarnation in self._held.items() if r in self._ended or incarnation in gone}
        self._ended -= done
        for request_id in done:
            del self._held[request_id]
        out.finished_sending = {self._vllm_ids.pop(hold_id, hold_id) for hold_id in done}
        return out

    def _stamp_read(self, completion: pb.Completion, arrived_s: float) -> None:
        """Trace: the daemon's stages of a read (its completion's own figures), the completion's arrival
        here, and now (vLLM asked)."""
        ids = (completion.request_id,)
        got_s = completion.done_unix_s - completion.duration_s
        self.trace.stamp("daemon_got", ids, got_s)
        self.trace.stamp("daemon_posted", ids, got_s + completion.post_s)
        self.trace.stamp("daemon_moved", ids, got_s + completion.post_s + completion.transfer_s)
        self.trace.stamp("daemon_done", ids, completion.done_unix_s)
        self.trace.stamp("completion_arrived", ids, arrived_s)
        self.trace.stamp("completion_taken", ids)

    def take_stats(self) -> TransferStats | None:
        """What was recorded since the last call (None when nothing was); recording starts over."""
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def _follow_registration(self) -> None:
        """After the client registered again (the daemon restarted or lost the lease): the daemon
        knows no remote engine any more, so handshakes are redone on the next read; and the holds
        of the old registration are gone with it, so their blocks may go. Holds are matched by the
        incarnation the daemon answered each Hold with, so a hold the scheduler already made on the
        new registration is never let go early. (The new registration keeps the session, so the
        scheduler's later holds work.)"""
        incarnation = self.client.incarnation
        if incarnation == self._incarnation:
            return
        log.warning("kvxferd: registered again with the daemon; holds of the old registration ended",
                    extra={"engine_id": self.engine_id, "tp_rank": self.tp_rank})
        self._incarnation = incarnation
        self._remotes.clear()

    def close(self) -> None:
        self.layers.close()
        self.trace.close()
        if self.subscriber is not None:
            self.subscriber.close()
        if self.client is not None:
            try:
                self.client.deregister()
            except grpc.RpcError:
                pass  # the daemon is gone already
            self.client.close()
