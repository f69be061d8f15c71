"""Coordinate tags written through an engine's layer views, read back where kvxferd's description says.

vLLM-free (the GPU tests use it too). ``tag_through_views`` writes, through
the engine's own ``[B, H, N, C]`` layer views, a byte tag derived from every
byte's (layer, logical block, global head, logical token, content byte);
``read_our_way`` reads the same bytes where kvxferd's description of the
group says they are. ``strided_layer_views`` lays a cache out as vLLM's
allocator does (one int8 buffer, one strided view per layer), on any device;
``pd_read`` moves one request through real daemons with the connector's
worker and scheduler pieces.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from kvxferd.integrations.vllm.describe import GroupLayout
from kvxferd.layout.builders import order_strides
from tests.layout.brute import addresses


def byte_tags(layer, block, head, token, content_byte) -> np.ndarray:
    """A byte from the coordinates (broadcast); a wrong mapping hits another tag ~255 times in 256."""
    with np.errstate(over="ignore"):
        h = (np.asarray(layer, np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.asarray(block, np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
             ^ np.asarray(head, np.uint64) * np.uint64(0x94D049BB133111EB))
        h = (h ^ (h >> np.uint64(29))) * np.uint64(0xD6E8FEB86659FD93) + np.asarray(token, np.uint64) * np.uint64(31337)
        h = (h ^ (h >> np.uint64(32))) * np.uint64(0xC2B2AE3D27D4EB4F) + np.asarray(content_byte, np.uint64)
        h = h ^ (h >> np.uint64(31))
    return (h * np.uint64(0x9E3779B97F4A7C15) >> np.uint64(56)).astype(np.uint8)


def tag_through_views(layers, block_size: int, first_head: int, *, first_layer: int = 0, block_ids=None) -> None:
    """Write every byte of every layer through vLLM's view (``first_head``: this TP rank's first global head;
    ``block_ids``: only these blocks, as a group whose bytes other groups overlay owns only its blocks)."""
    for l, view in enumerate(layers, first_layer):
        raw = view.view(torch.uint8)  # [Bk, H, Nk, content bytes]
        num_kernel_blocks, heads, kernel, width = raw.shape
        k = block_size // kernel
        bk = np.arange(num_kernel_blocks).reshape(-1, 1, 1, 1)
        tags = byte_tags(l, bk // k, np.arange(heads).reshape(1, -1, 1, 1) + first_head,
                         (bk % k) * kernel + np.arange(kernel).reshape(1, 1, -1, 1), np.arange(width).reshape(1, 1, 1, -1))
        if block_ids is None:
            raw.copy_(torch.from_numpy(tags))
            continue
        k_ids = [b * k + i for b in block_ids for i in range(k)]
        raw[k_ids] = torch.from_numpy(tags[k_ids]).to(raw.device)


def storage_bytes(tensor: torch.Tensor) -> np.ndarray:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy()


def read_our_way(group: GroupLayout, layers, tp_size: int, tp_rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per field: (the bytes kvxferd's region addresses, the tags vLLM's views wrote there).

    The expected tags follow each content's own reading of a (head, token):
    ``kv`` K then V (every GPU backend splits C so, e.g. ``split(self.head_size, dim=-1)`` in
    vllm/v1/attention/backends/flash_attn.py); ``latent`` and ``bytes`` whole;
    ``k_transposed`` as vLLM's CPU attention reads a head's kernel block, from
    vllm/v1/attention/backends/cpu_attn.py (vLLM 0.32)::

        kv_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))
        key_cache, value_cache = kv_cache.chunk(2, dim=2)

    with its vec kernels storing K as C x N inside the first half (measured).
    """
    region = group.spec().region(tp_size, tp_rank)
    base = layers[0].data_ptr() - layers[0].untyped_storage().data_ptr()
    memory = storage_bytes(layers[0])
    item = np.dtype(np.uint8).itemsize if group.dtype == "uint8" else layers[0].element_size()
    out = {}
    for field in region.fields:
        dims = field.layout.dims
        where = addresses(field.layout, dims)[..., None] * item + np.arange(item) + base
        coords = {d: np.arange(field.layout.size(d)).reshape([-1 if i == j else 1 for j in range(len(dims))] + [1])
                  for i, d in enumerate(dims)}
        byte = np.arange(item)
        head = coords.get("H", 0) + (field.shard.local_range[0] if field.shard else 0)
        kernel = group.kernel_block_size
        if field.name in ("k", "v"):  # k_transposed: position inside the head's kernel block of 2 x N x C
            n, c = coords["N"], coords["C"]
            flat = c * kernel + n % kernel if field.name == "k" else kernel * group.head_size + (n % kernel) * group.head_size + c
            token = (n // kernel) * kernel + flat // (2 * group.head_size)
            content_byte = (flat % (2 * group.head_size)) * item + byte
        else:
            token = coords["N"]
            channel = coords["C"] + coords.get("KV", 0) * group.head_size
            content_byte = channel * item + byte
        expected = byte_tags(coords["L"], coords["B"], head, token, content_byte)
        out[field.name] = memory[where], np.broadcast_to(expected, where.shape)
    return out


def strided_layer_views(order: str, num_layers: int, num_blocks: int, num_heads: int, block_size: int, head_size: int,
                        dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    """A K|V cache in vLLM's physical ``order``: one zeroed int8 buffer, a ``[B, H, N, 2C]`` view per layer."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    strides = order_strides(order, "kv", num_layers=num_layers, num_blocks=num_blocks, num_heads=num_heads,
                            block_size=block_size, head_size=head_size * itemsize)  # in bytes: C counts bytes
    buffer = torch.zeros(num_layers * num_blocks * num_heads * block_size * 2 * head_size * itemsize, dtype=torch.int8,
                         device=device)
    shape = (num_blocks, num_heads, block_size, 2 * head_size * itemsize)
    return [buffer.as_strided(shape, (strides.block, strides.head, strides.token, 1), l * strides.layer).view(dtype)
            for l in range(num_layers)]


def attention_spec(num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype) -> SimpleNamespace:
    """The fields of vLLM's FullAttentionSpec that the connector reads, without vLLM."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return SimpleNamespace(num_kv_heads=num_kv_heads, head_size=head_size, head_size_v=head_size, block_size=block_size,
                           num_head_slots=None, tokens_per_state=1, state_content_size_bytes=2 * head_size * itemsize)


def pd_read(tmp_path, prefill_groups, prefill_tensors, decode_groups, decode_tensors, remote_ids, decode_ids,
            num_tokens: int) -> None:
    """Hold ``remote_ids`` (one list per group) on every prefill rank and read them into ``decode_ids`` (one decode
    rank), through real daemons with the connector's worker and scheduler sides; returns when decode has the request.

    ``prefill_groups[r]`` / ``prefill_tensors[r]``: rank r's GroupLayouts and ``{layer name: view}``.
    """
    from kvxferd.client import DaemonProcess
    from kvxferd.integrations.vllm.scheduler import SchedulerSide
    from kvxferd.integrations.vllm.settings import ConnectorSettings
    from kvxferd.integrations.vllm.worker import WorkerSide

    tp = len(prefill_groups)
    daemons = DaemonProcess.start_many([f"sp{r}" for r in range(tp)] + ["sd0"], socket_dir=str(tmp_path))
    workers = []
    try:
        prefill = [WorkerSide("p", r, tp, ConnectorSettings(engine_socket=daemons[r].socket)) for r in range(tp)]
        decode = WorkerSide("d", 0, 1, ConnectorSettings(engine_socket=daemons[tp].socket))
        workers = [*prefill, decode]
        ranks = [w.register(groups, tensors) for w, groups, tensors in zip(prefill, prefill_groups, prefill_tensors)]
        decode.register(decode_groups, decode_tensors)
        prefill_scheduler, decode_scheduler = SchedulerSide("p", prefill[0].settings), SchedulerSide("d", decode.settings)
        prefill_scheduler.set_ranks(ranks)
        _delay, params = prefill_scheduler.hold("req", tuple(remote_ids), num_tokens)
        held = prefill_scheduler.take_held()
        for worker in prefill:
            worker.expect_held(held)
        assert decode_scheduler.matched_tokens("dreq", params, num_tokens, 0) == (num_tokens, True)
        decode_scheduler.after_alloc("dreq", params, list(decode_ids), num_tokens)
        decode.submit(decode_scheduler.take_orders())
        deadline, received = time.monotonic() + 30, set()
        while not received and time.monotonic() < deadline:
            time.sleep(0.02)
            got = decode.results()
            assert not got.failed_recving and not got.invalid_block_ids
            received |= got.finished_recving
        assert received == {"dreq"}
    finally:
        for worker in workers:
            worker.close()
        for daemon in daemons:
            daemon.terminate()


def one_group_read(tmp_path, prefill_groups, prefill_layers, decode_group, decode_layers, remote_ids, decode_ids,
                   num_tokens: int) -> None:
    """:func:`pd_read` of one group whose layers are named ``l0``, ``l1``, ..."""
    names = [f"l{i}" for i in range(len(decode_layers))]
    pd_read(tmp_path, [[g] for g in prefill_groups], [dict(zip(names, layers)) for layers in prefill_layers],
            [decode_group], dict(zip(names, decode_layers)), [remote_ids], [decode_ids], num_tokens)


def wrong_decode_blocks(decode_layers, decode_block_size: int, decode_ids, remote_ids, remote_block_size: int, *,
                        first_layer: int = 0, other_ids=()):
    """``(layer, block)`` of every decode block whose bytes are not prefill's tags for the same tokens;
    every block the read did not name (nor ``other_ids``: another group's) must still be zero."""
    wrong = []
    for layer, view in enumerate(decode_layers, first_layer):
        raw = view.view(torch.uint8).cpu()
        kernel, width, heads = raw.shape[2], raw.shape[3], raw.shape[1]
        k = decode_block_size // kernel
        raw = raw.unflatten(0, (-1, k))  # [block, kernel block, H, N, bytes]
        for i, block in enumerate(decode_ids):
            token = i * decode_block_size + np.arange(k).reshape(-1, 1, 1, 1) * kernel + np.arange(kernel).reshape(1, 1, -1, 1)
            expected = byte_tags(layer, np.asarray(remote_ids)[token // remote_block_size],
                                 np.arange(heads).reshape(1, -1, 1, 1), token % remote_block_size,
                                 np.arange(width).reshape(1, 1, 1, -1))
            if not np.array_equal(raw[block].numpy(), np.broadcast_to(expected, raw[block].shape)):
                wrong.append((layer, block))
        untouched = [b for b in range(raw.shape[0]) if b not in decode_ids and b not in other_ids]
        assert not raw[untouched].any()
    return wrong
