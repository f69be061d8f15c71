"""Room in /dev/shm for the demo, checked before any daemon or engine starts.

The demo's engines allocate their KV caches in POSIX shared memory, and UCX
maps shared memory of its own for every NIXL agent. A container runtime's
default /dev/shm is 64 MB (Docker, Podman): there the first engine died
while it allocated, and the demo said only "prefill engine did not start
... Socket closed". So the demo adds up what it will allocate and refuses
to start, in one line that says what to do, when it does not fit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from kvxferd.rig.verify.buffers import arena_layout
from kvxferd.rig.verify.models import ModelShape, model_groups

SHM_DIR = "/dev/shm"
# UCX's shared-memory transports map about 6 MiB per NIXL agent (unlinked files, so only `df /dev/shm`
# shows them: 48 MiB for the default demo's 8 agents, measured); rounded up.
UCX_BYTES_PER_AGENT = 8 << 20
MIB = 1 << 20


def engine_bytes(groups, tp_size: int) -> int:
    """Shared memory of one engine, every TP rank: the arenas :func:`kvxferd.rig.verify.buffers.allocate_engine` asks for."""
    return sum(arena_layout(groups, tp_size, rank)[2] for rank in range(tp_size))


def needed_bytes(models: Sequence[str], shape: ModelShape, prefill_tp: int, decode_tp: int,
                 num_daemons: int) -> tuple[int, int]:
    """``(cache bytes, UCX bytes)`` at the demo's peak: one preset's engines at a time (each frees its caches
    before the next starts), one NIXL agent per daemon plus the raw baseline's one per decode rank."""
    caches = max(engine_bytes(prefill, prefill_tp) + engine_bytes(decode, decode_tp)
                 for prefill, decode in (model_groups(model, shape) for model in models))
    return caches, UCX_BYTES_PER_AGENT * (num_daemons + decode_tp)


def shortfall(cache_bytes: int, ucx_bytes: int,
              statvfs: Callable[[str], os.statvfs_result] | None = None) -> str | None:
    """The one-line complaint when /dev/shm has less room than the demo needs; None when it fits."""
    try:
        info = (statvfs or os.statvfs)(SHM_DIR)
    except OSError:  # no /dev/shm to measure: let the engines say what they find
        return None
    free, needed = info.f_bavail * info.f_frsize, cache_bytes + ucx_bytes
    if free >= needed:
        return None
    return (f"{SHM_DIR} has {free / MIB:.0f} MiB free, the demo needs about {needed / MIB:.0f} MiB "
            f"(engines' KV caches {cache_bytes / MIB:.0f} MiB + UCX {ucx_bytes / MIB:.0f} MiB); in a container, "
            f"give it more shared memory: docker run --shm-size=1g ... (or podman run --shm-size=1g), "
            f"or ask for less (--model, --num-blocks, --num-layers)")
