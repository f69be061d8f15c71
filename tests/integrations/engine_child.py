"""A running engine for lifetime tests: the vLLM connector's worker side registers a host cache with a daemon.

``python -m tests.integrations.engine_child SOCKET ENGINE_ID NUM_BLOCKS [LIFELINE_PID]`` prints
``registered <bytes>`` and waits to be killed. ``LIFELINE_PID``: the negative control; the connector
passes a pidfd of that process instead of its own, so this process's death is not what the daemon watches.
"""

from __future__ import annotations

import os
import sys
import time

from kvxferd.integrations.vllm import worker as connector_worker
from kvxferd.integrations.vllm.settings import ConnectorSettings
from kvxferd.integrations.vllm.worker import WorkerSide
from tests.integrations.connector_pair import group, layer_cache


def main(socket: str, engine_id: str, num_blocks: str, lifeline_pid: str = "") -> None:
    if lifeline_pid:
        connector_worker.own_process_fd = lambda: os.pidfd_open(int(lifeline_pid))
    cache = layer_cache(num_blocks=int(num_blocks))
    side = WorkerSide(engine_id, 0, 1, ConnectorSettings(engine_socket=socket, heartbeat_s=5.0))
    side.register([group(cache, num_blocks=int(num_blocks))], cache)
    print("registered", sum(t.untyped_storage().nbytes() for t in list(cache.values())[:1]), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(*sys.argv[1:])
