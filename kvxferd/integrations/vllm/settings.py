"""The connector's settings: ``kv_connector_extra_config`` (validated, defaults that match the daemon).

Which daemon a rank talks to: ``engine_socket`` (a path; ``{rank}`` is the
TP rank, ``{dp_rank}`` the host-local data-parallel rank, ``{host_rank}``
the rank's place among this host's ranks, ``dp_rank * tp_size + rank``),
else ``$KVXFERD_SOCKET_DIR/gpu{host_rank}.sock`` (the Helm chart's
sockets), else ``kvxferd serve``'s default socket for a single-rank engine.
Two ranks of one host never share a daemon: each daemon serves one GPU.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvxferd.errors import first_error
from kvxferd.wire.names import default_engine_socket


class ConnectorSettings(BaseModel):
    """Options of ``kv_connector_extra_config`` (unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    engine_socket: str | None = Field(None, description="daemon engine socket; {rank}: TP rank, {dp_rank}: host-local DP "
                                                        "rank, {host_rank}: dp_rank * tp_size + rank")
    lease_s: float = Field(30.0, gt=0, le=600, description="how long prefill holds blocks for decode to read (s)")
    deadline_s: float = Field(30.0, gt=0, le=600, description="how long a decode read may take (s)")
    timeout_s: float = Field(10.0, gt=0, le=120, description="timeout of each call to the local daemon (s)")
    heartbeat_s: float = Field(5.0, gt=0, le=60, description="heartbeat interval of each rank's registration (s)")
    daemon_uid: int | None = Field(None, ge=0, description="uid the daemons run as (default: $KVXFERD_DAEMON_UID, "
                                                          "else this engine's own); a socket of any other user gets "
                                                          "nothing from the connector")
    trace_dir: str | None = Field(None, description="write per-request timestamps there (default: $KVXFERD_TRACE_DIR; "
                                                   "unset: none); a benchmark's tool, see trace.py")
    kv_cache_memory: Literal["torch", "shareable_vmm", "require_rdma_vmm"] = Field(
        "torch", description="how the GPU KV cache is allocated: torch (vLLM's own allocation, shared by CUDA IPC "
                             "handle: a NIC cannot read it from the daemon, reads from other hosts are emulated over "
                             "TCP), shareable_vmm (RDMA-capable, fd-shareable VMM memory the daemon maps and "
                             "registers; a warning on a GPU that cannot make it RDMA-capable), require_rdma_vmm "
                             "(the same; such a GPU fails the engine's start). docs/gpu.md")
    mode: Literal["pull", "push"] = Field(
        "pull", description="pull: decode reads once prefill handed over its blocks (the proxy sends the legs one "
                            "after the other); push (issue #57): both legs at once with one transfer id, decode "
                            "expects its blocks and the prefill daemon writes them when the prefill ends. An "
                            "engine in pull mode refuses push params, so both sides must say push")
    push_layer_min_tokens: int | None = Field(
        None, ge=0, description="push mode, prefill side: a prompt of at least this many tokens is written layer by "
                                "layer while its forward pass runs (vLLM's save_kv_layer), shorter ones in one batch "
                                "after it; 0: never. Unset: 1 on a CPU engine (measured faster at every length, "
                                "docs/push.md), 0 on a GPU (its event-fenced reports have not run on one yet). "
                                "Full-attention and MLA models only (where the hold can go with the prompt's step)")
    verify_share: float = Field(
        0.0, ge=0.0, le=1.0, description="pull mode, prefill side: the share of requests whose KV the decode daemon "
                                         "checks against digests of the hold before decode uses a byte (issue #59, "
                                         "docs/integrity.md); a mismatch fails the read (the engine recomputes under "
                                         "its policy). 0 (the default: checking every read took a 128 MiB read from "
                                         "0.97 to 0.39 of raw NIXL on CPU here) to 1; a request's kv_transfer_params "
                                         "{\"kvxferd_verify\": true|false} decide for it")
    kv_cache_layout: Literal["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "auto"] = Field(
        "LBHNC", description="the physical KV cache order the connector asks vLLM for (auto: the backend's choice); "
                             "VLLM_KV_CACHE_LAYOUT still wins, and kvxferd reads any order")

    def socket_for(self, rank: int, tp_size: int, dp_rank: int = 0, dp_size: int = 1) -> str:
        """The engine socket path of TP rank ``rank`` of host-local data-parallel rank ``dp_rank`` (of ``dp_size``)."""
        host_rank = dp_rank * tp_size + rank
        if self.engine_socket:
            if dp_size > 1 and "{dp_rank}" not in self.engine_socket and "{host_rank}" not in self.engine_socket:
                raise ValueError(f"kv_connector_extra_config.engine_socket: {dp_size} data-parallel ranks run on this "
                                 "host, so {rank} alone would give two GPUs one daemon; use {host_rank} "
                                 "(e.g. \"/run/kvxferd/gpu{host_rank}.sock\")")
            try:
                return self.engine_socket.format(rank=rank, dp_rank=dp_rank, host_rank=host_rank)
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(f"kv_connector_extra_config.engine_socket: {self.engine_socket!r} names an unknown "
                                 f"field ({err}); known: {{rank}}, {{dp_rank}}, {{host_rank}}") from None
        if socket_dir := os.environ.get("KVXFERD_SOCKET_DIR"):
            return os.path.join(socket_dir, f"gpu{host_rank}.sock")
        if tp_size == 1 and dp_size == 1:
            return default_engine_socket()  # what `kvxferd serve` with no options listens on
        raise ValueError("kv_connector_extra_config.engine_socket: set it (e.g. \"/run/kvxferd/gpu{host_rank}.sock\") "
                         "or KVXFERD_SOCKET_DIR when the engine has more than one rank on this host")


def load_settings(extra_config: dict[str, Any] | None) -> ConnectorSettings:
    """Settings from vLLM's extra config; a bad option is a ``ValueError`` naming it."""
    try:
        return ConnectorSettings.model_validate(extra_config or {})
    except ValidationError as err:
        where, message = first_error(err)
        raise ValueError(f"kv_connector_extra_config.{where}: {message}") from None
