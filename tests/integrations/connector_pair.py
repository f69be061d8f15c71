"""Helpers for the connector's vLLM-free tests: a CPU cache like vLLM's, its group, and a prefill and a
decode worker registered with real daemons."""

from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import torch

from kvxferd.client import DaemonProcess
from kvxferd.integrations.vllm.describe import GroupLayout
from kvxferd.integrations.vllm.scheduler import RankDaemon, SchedulerSide
from kvxferd.integrations.vllm.settings import ConnectorSettings
from kvxferd.integrations.vllm.worker import WorkerSide


def layer_cache(num_blocks=16, heads=2, block=32, head_size=64, layers=2):
    """Like vLLM's CPU cache: one storage, a (B, H, N, 2C) view per layer."""
    storage = torch.zeros(layers, num_blocks, heads, block, 2 * head_size, dtype=torch.bfloat16)
    return {f"layer.{n}": storage[n] for n in range(layers)}


def group(names, num_blocks=16, heads=2, block=32, head_size=64):
    return GroupLayout("full", tuple(names), "kv_per_head", num_blocks, heads, head_size, block, block, "bfloat16")


def eventually(value, timeout_s: float = 5.0):
    """``value()`` once it is truthy, or its last value after ``timeout_s`` (a daemon counts a read just
    after it sends its completion)."""
    deadline = time.monotonic() + timeout_s
    while not (got := value()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def registered_pair(daemons, **settings) -> tuple[WorkerSide, WorkerSide, list[RankDaemon], dict, dict]:
    """A prefill worker ("p") on ``daemons[0]`` whose cache holds random values and a decode worker ("d")
    on ``daemons[1]`` whose cache is zeros, both registered (``settings``: more ConnectorSettings);
    ``(prefill, decode, prefill ranks, prefill cache, decode cache)``. The caller closes the workers."""
    prefill_cache, decode_cache = layer_cache(), layer_cache()
    for tensor in prefill_cache.values():
        tensor.copy_(torch.randn_like(tensor, dtype=torch.float32).to(torch.bfloat16))
    prefill = WorkerSide("p", 0, 1, ConnectorSettings(engine_socket=daemons[0].socket, **settings))
    decode = WorkerSide("d", 0, 1, ConnectorSettings(engine_socket=daemons[1].socket, **settings))
    try:
        ranks = [prefill.register([group(prefill_cache)], prefill_cache)]
        decode.register([group(decode_cache)], decode_cache)
    except BaseException:
        prefill.close()
        decode.close()
        raise
    return prefill, decode, ranks, prefill_cache, decode_cache


class Pair(NamedTuple):
    daemons: list
    prefill: WorkerSide
    decode: WorkerSide
    ranks: list[RankDaemon]
    prefill_cache: dict
    decode_cache: dict


@contextlib.contextmanager
def connector_pair(socket_dir, daemon_ids: tuple[str, str], **settings):
    """Two daemons and :func:`registered_pair` on them; everything stopped on the way out."""
    daemons = DaemonProcess.start_many(list(daemon_ids), socket_dir=str(socket_dir))
    try:
        prefill, decode, ranks, prefill_cache, decode_cache = registered_pair(daemons, **settings)
        try:
            yield Pair(daemons, prefill, decode, ranks, prefill_cache, decode_cache)
        finally:
            prefill.close()
            decode.close()
    finally:
        for daemon in daemons:
            daemon.terminate()


def read_held(scheduler: SchedulerSide, prefill: WorkerSide, decode: WorkerSide, params: dict,
              local_blocks: list[int], num_tokens: int = 64) -> None:
    """Decode (request ``d-<prefill id>``) reads what ``scheduler`` held (its ``params``) into ``local_blocks``;
    waits for the read and the prefill's CONSUMED, and checks both came, nothing failed."""
    decode_scheduler = SchedulerSide("d", decode.settings)
    request_id = "d-" + params["remote_request_id"]
    prefill.expect_held(scheduler.take_held())
    assert decode_scheduler.matched_tokens(request_id, params, num_tokens, 0) == (num_tokens, True)
    decode_scheduler.after_alloc(request_id, params, [local_blocks], num_tokens)
    decode.submit(decode_scheduler.take_orders())
    deadline, received, sent = time.monotonic() + 20, set(), set()
    while (not received or not sent) and time.monotonic() < deadline:
        time.sleep(0.01)
        got = decode.results()
        assert not got.failed_recving and not got.invalid_block_ids
        received |= got.finished_recving
        sent |= prefill.results().finished_sending
    assert (received, sent) == ({request_id}, {params["remote_request_id"]})
