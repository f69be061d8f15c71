"""The connector's settings: ``kv_connector_extra_config`` (validated, defaults that match the daemon).

Which daemon a rank talks to: ``engine_socket`` (a path, ``{rank}`` is the
local TP rank), else ``$KVXFERD_SOCKET_DIR/gpu{rank}.sock`` (the Helm
chart's sockets), else ``kvxferd serve``'s default socket for a
single-rank engine.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvxferd.service.config import first_error
from kvxferd.wire.names import default_engine_socket


class ConnectorSettings(BaseModel):
    """Options of ``kv_connector_extra_config`` (unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    engine_socket: str | None = Field(None, description="daemon engine socket; {rank} is the local TP rank")
    lease_s: float = Field(30.0, gt=0, le=600, description="how long prefill holds blocks for decode to read (s)")
    deadline_s: float = Field(30.0, gt=0, le=600, description="how long a decode read may take (s)")
    timeout_s: float = Field(10.0, gt=0, le=120, description="timeout of each call to the local daemon (s)")
    heartbeat_s: float = Field(5.0, gt=0, le=60, description="heartbeat interval of each rank's registration (s)")

    def socket_for(self, rank: int, tp_size: int) -> str:
        """The engine socket path of local TP rank ``rank``."""
        if self.engine_socket:
            return self.engine_socket.format(rank=rank)
        if socket_dir := os.environ.get("KVXFERD_SOCKET_DIR"):
            return os.path.join(socket_dir, f"gpu{rank}.sock")
        if tp_size == 1:
            return default_engine_socket()  # what `kvxferd serve` with no options listens on
        raise ValueError("kv_connector_extra_config.engine_socket: set it (e.g. \"/run/kvxferd/gpu{rank}.sock\") or "
                         "KVXFERD_SOCKET_DIR when the engine has more than one TP rank")


def load_settings(extra_config: dict[str, Any] | None) -> ConnectorSettings:
    """Settings from vLLM's extra config; a bad option is a ``ValueError`` naming it."""
    try:
        return ConnectorSettings.model_validate(extra_config or {})
    except ValidationError as err:
        where, message = first_error(err)
        raise ValueError(f"kv_connector_extra_config.{where}: {message}") from None
