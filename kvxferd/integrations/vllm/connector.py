"""``KvxferdConnector``: vLLM's v1 KV-connector API over kvxferd daemons (imports vLLM).

The connector holds no plan and no NIXL agent: the scheduler side turns
vLLM's block ids into holds and read orders (:mod:`.scheduler`), the worker
side hands the cache to the rank's daemon once and submits the reads
(:mod:`.worker`). All transfer logic stays in the daemon.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorHandshakeMetadata,
                                                                KVConnectorMetadata, KVConnectorRole,
                                                                KVConnectorTransferResults, SupportsHMA)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

from kvxferd.integrations.vllm.describe import GroupLayout, strided_group
from kvxferd.integrations.vllm.states import StateGroup, mamba_group
from kvxferd.integrations.vllm.scheduler import HeldRequest, RankDaemon, ReadOrder, SchedulerSide
from kvxferd.integrations.vllm.settings import load_settings
from kvxferd.integrations.vllm.stats import TransferPromMetrics, TransferStats
from kvxferd.integrations.vllm.trace import Trace
from kvxferd.integrations.vllm.vmmpool import KvCachePool
from kvxferd.wire.tracecontext import traceparent_of
from kvxferd.integrations.vllm.worker import TransferResults, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvxferd.vllm")

CPU_ISA_CONTENTS = {"vec": "k_transposed", "vec16": "k_transposed"}


def cpu_attention_content(vllm_config: "VllmConfig", layer, spec) -> str:
    """CPU_ATTN views each head's kernel block as ``(2N, C)`` and lets its kernels ("ISA") order K and V:
    the vec and vec16 kernels keep K transposed, ``(C, N)``, then V as ``(N, C)`` (measured with vLLM's
    own cpu_attn_reshape_and_cache). A whole block copies right whatever the order, but a block split
    into another block size's tokens does not, so an order kvxferd has not measured is refused.

    The kernels are the ones vLLM chose for the layer (``layer.isa``, set by its metadata builder),
    else chosen as vLLM chooses them: from the *model's* dtype and the group's block size."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = getattr(layer, "isa", None) or _get_attn_isa(vllm_config.model_config.dtype, spec.block_size,
                                                        spec.head_size, vllm_config.cache_config.cache_dtype)
    if isa not in CPU_ISA_CONTENTS:
        raise ValueError(f"kvxferd: vLLM's CPU attention uses its {isa!r} kernels here, whose K/V order kvxferd does "
                         f"not describe yet (only {sorted(CPU_ISA_CONTENTS)}); see docs/vllm.md, Limits")
    return CPU_ISA_CONTENTS[isa]


# The few backends whose kernels read a (head, token)'s K|V other than as "K then V", by class: a
# name cannot tell them apart (ROCm's AITER FA calls itself FLASH_ATTN too). Every other backend
# reads vLLM's [B, H, N, K|V] view as it is, in whatever physical order vLLM resolved.
CONTENT_READERS = {"vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend": cpu_attention_content}


@dataclass
class KvxferdMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    orders: list[ReadOrder] = field(default_factory=list)
    held: list[HeldRequest] = field(default_factory=list)
    layered: list[str] = field(default_factory=list)  # push transfer ids held layer by layer with this step


@dataclass
class KvxferdHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once: where this rank's daemon is, and the registration's session."""

    tp_rank: int
    engine_socket: str
    peer_address: str
    session: str


def _fence(tensor: torch.Tensor | None):
    """On a GPU, an event recorded now (the KV kernels queued so far end before it); None on a CPU, where the
    forward pass ran them already."""
    if (tensor is not None and tensor.is_cuda) or (tensor is None and torch.cuda.is_initialized()):
        event = torch.cuda.Event(blocking=True)  # its thread sleeps until the kernels end, not spins
        event.record()
        return event
    return None


def state_num_groups(hf_config) -> int | None:
    """The model's B/C groups (Mamba2 ``n_groups``) or key heads (GDN ``linear_num_key_heads``), if it names them."""
    for name in ("n_groups", "mamba_n_groups", "linear_num_key_heads"):
        if getattr(hf_config, name, None):
            return int(getattr(hf_config, name))
    return None


def layers_can_be_pushed(vllm_config: "VllmConfig") -> bool:
    """Whether this engine's pushes may go layer by layer, each written while the forward pass goes on.

    Each layer's KV must be in the cache when ``save_kv_layer`` says so: the CPU runs its kernels at once, a
    CUDA stream is fenced (an event); other devices, and layers run once per micro-batch, not. And vLLM
    must not free a prompt's blocks while its step may still run: with overlapping batches (async
    scheduling) it defers that free only for a KV consumer (``kv_both``, ``kv_consumer``); a
    ``kv_producer`` could have a preempted prefill's blocks given to another request while its last
    layers are written, and the push would report them written right.
    """
    device = vllm_config.device_config.device_type
    fenced = device in ("cpu", "cuda") and not getattr(vllm_config.parallel_config, "use_ubatching", False)
    transfer = vllm_config.kv_transfer_config
    overlapping = vllm_config.max_concurrent_batches > 1
    return fenced and (not overlapping or (transfer is not None and transfer.is_kv_consumer))


class KvxferdConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill holds and decode reads through the kvxferd daemon of each rank."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        parallel = vllm_config.parallel_config
        for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
            # Context parallelism splits a request's tokens (an MLA latent's too) over ranks that the
            # daemons would take for replicas, and gives two GPUs one TP rank: refused, not misread.
            if getattr(parallel, name, 1) > 1:
                raise ValueError(f"kvxferd: context parallelism ({name}={getattr(parallel, name)}) is not supported yet")
        if parallel.pipeline_parallel_size > 1:
            # Each stage registers only its own layers, and a read would have to pair stages of two
            # engines whose layer splits may differ: not built yet, so refused before anything starts.
            raise ValueError(f"kvxferd: pipeline parallelism (pipeline_parallel_size={parallel.pipeline_parallel_size}) "
                             "is not supported yet; run prefill and decode with pipeline_parallel_size=1")
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.engine_id = transfer.engine_id
        self.settings = load_settings(transfer.kv_connector_extra_config)
        device = vllm_config.device_config.device_type
        if self.settings.push_layer_min_tokens is None:  # layer by layer where it was measured: CPU engines
            self.settings = self.settings.model_copy(update={"push_layer_min_tokens": 1 if device == "cpu" else 0})
        push_layers_allowed = layers_can_be_pushed(vllm_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            groups = kv_cache_config.kv_cache_groups
            has_states = any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups)
            # Early holds where the prompt's blocks are the blocks handed over: full attention only
            # (windows and states drop blocks by the end), no speculative lookahead (extra blocks).
            plain = all(type(g.kv_cache_spec) in (FullAttentionSpec, MLAAttentionSpec) for g in groups)
            self.scheduler = SchedulerSide(self.engine_id, self.settings, num_backoff_tokens=int(has_states),
                                           early_holds=plain and vllm_config.speculative_config is None,
                                           push_layers_allowed=push_layers_allowed)
            self._trace = Trace(f"{self.engine_id}-scheduler", self.settings.trace_dir)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker = WorkerSide(self.engine_id, get_tensor_model_parallel_rank(), parallel.tensor_parallel_size,
                                     self.settings, dp_rank=parallel.data_parallel_rank_local or 0,
                                     dp_size=max(parallel.data_parallel_size_local, 1))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """The physical order kvxferd asks for: LBHNC unless ``kv_connector_extra_config.kv_cache_layout`` says otherwise.

        kvxferd reads any order (the description comes from the layer views), but
        transfers differ: LBHNC keeps a block's heads contiguous inside each
        layer, so a remote TP rank's share of a block is one span per layer,
        whatever the two sides' TP sizes; a layer-outer order also lets vLLM
        split blocks into kernel blocks. MLA has one head: the order is the
        backend's (None). vLLM drops the request, with a warning, when the
        backends cannot use the order (FLEX_ATTENTION, TURBOQUANT: LBNHC only).
        """
        transfer = vllm_config.kv_transfer_config
        layout = load_settings(transfer.kv_connector_extra_config if transfer else None).kv_cache_layout
        model = vllm_config.model_config
        if layout == "auto" or (model is not None and model.use_mla):
            return None
        return layout

    # ---- worker side ------------------------------------------------------------------
    def get_mem_pool_context(self):
        """Where vLLM allocates the KV cache: RDMA-capable shareable VMM memory when ``kv_cache_memory`` asks
        for it on a GPU (vmmpool.py); otherwise vLLM's own allocation (None)."""
        if self.settings.kv_cache_memory == "torch" or not torch.cuda.is_available():
            return None
        self._kv_pool = KvCachePool(require_rdma=self.settings.kv_cache_memory == "require_rdma_vmm")
        return self._kv_pool.context(torch)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(self._group_layouts(kv_caches), kv_caches)

    def _group_layouts(self, kv_caches: dict[str, torch.Tensor]) -> list[GroupLayout | StateGroup]:
        """The daemon's view of every KV cache group: vLLM's spec, and the strides of its layer views."""
        config = self._vllm_config
        context = config.compilation_config.static_forward_context
        total_heads = config.model_config.get_total_num_kv_heads()
        layouts = []
        for g, group in enumerate(self._kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            names = group.layer_names
            if isinstance(spec, MambaSpec):  # Mamba2 / GDN state pages: conv then SSM state per block
                from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

                hf = config.model_config.hf_config
                try:
                    layouts.append(mamba_group(names, [kv_caches[n] for n in names], spec,
                                               conv_dim_first=is_conv_state_dim_first(),
                                               num_groups=state_num_groups(hf),
                                               tp_size=self.worker.tp_size, tp_rank=self.worker.tp_rank))
                except ValueError as err:
                    raise ValueError(f"kvxferd: KV cache group {g} (Mamba): {err}") from None
                continue
            if isinstance(spec, SlidingWindowSpec):
                kind = "swa"
            elif isinstance(spec, MLAAttentionSpec):
                kind = "mla"
            elif isinstance(spec, FullAttentionSpec):
                kind = "full"
            else:
                raise ValueError(f"kvxferd: KV cache group {g} ({type(spec).__name__}) is not supported yet "
                                 "(full attention, sliding window, MLA, Mamba2 and GDN are)")
            layer = context[names[0]]
            backend = layer.attn_backend
            reader = CONTENT_READERS.get(f"{backend.__module__}.{backend.__qualname__}")
            try:
                layouts.append(strided_group(kind, names, [kv_caches[n] for n in names], spec,
                                             total_heads, reader and functools.partial(reader, config, layer, spec),
                                             tp_size=self.worker.tp_size, tp_rank=self.worker.tp_rank))
            except ValueError as err:
                raise ValueError(f"kvxferd: KV cache group {g} ({kind}, backend {backend.get_name()}, layout "
                                 f"{config.cache_config.kv_cache_layout}): {err}") from None
        return layouts

    def get_handshake_metadata(self) -> KvxferdHandshake | None:
        worker = self.worker
        return KvxferdHandshake(worker.tp_rank, worker.socket, worker.peer_address, worker.client.session)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, KvxferdMetadata):
            self.worker.expect_held(metadata.held)
            self.worker.submit(metadata.orders)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass (vLLM starts async loads only after it): this step's layer-by-layer pushes."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvxferdMetadata):
            self.worker.layers.start(connector_metadata.layered)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # reads complete between steps (async loads), never inside a forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """A push written layer by layer: this layer's KV is in the cache (layers.py); else nothing."""
        layers = self.worker.layers
        if layers.transfer_ids:
            layers.layer_saved(layer_name, _fence(kv_layer))

    def wait_for_save(self) -> None:
        layers = self.worker.layers
        if layers.transfer_ids:
            layers.step_ended(_fence(None))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results: TransferResults = self.worker.results()
        self._load_errors |= results.invalid_block_ids
        return KVConnectorTransferResults(finished_sending=results.finished_sending,
                                          finished_recving=results.finished_recving,
                                          failed_recving=results.failed_recving)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- stats: vLLM's /metrics (stats.py) ---------------------------------------------
    def get_kv_connector_stats(self) -> TransferStats | None:
        """Worker: the reads and holds that ended since the last call (None when none did)."""
        return self.worker.take_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TransferStats:
        """Frontend: the stats again from the payload vLLM carried (``TransferStats.to_dict()``)."""
        return TransferStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> TransferPromMetrics:
        """Frontend: the ``vllm:kvxferd_*`` metrics (docs/vllm.md, "vLLM's own metrics")."""
        return TransferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()
            self._trace.close()

    # ---- scheduler side ----------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.scheduler.set_ranks([RankDaemon(m.tp_rank, m.engine_socket, m.peer_address, m.session)
                                  for m in metadata.values()])

    def on_new_request(self, request: "Request") -> None:
        """A P/D request's trace context goes with its params (issue #60): the prefill's to its holds and on in
        its kv_transfer_params, so that decode's read joins the same trace (a decode leg keeps the one its
        params brought, else takes its own). A prefill request on an engine with state groups stops one prompt
        token short (scheduler.py)."""
        params, traceparent = request.kv_transfer_params, traceparent_of(request.trace_headers)
        if params and traceparent and not traceparent_of(params):
            request.kv_transfer_params = {**params, "traceparent": traceparent}  # (a new dict: n > 1 share it)
        num_dropped = self.scheduler.prompt_tokens_to_drop(request.kv_transfer_params, request.num_prompt_tokens)
        if not num_dropped or request.get_skip_reading_prefix_cache():
            return  # (prompt logprobs: decode will not read the cache, and recomputes the whole prompt)
        # New lists and dicts, never cut in place: n > 1 sibling requests share the originals.
        if request.prompt_token_ids is not None:
            request.prompt_token_ids = request.prompt_token_ids[:-num_dropped]
        if request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-num_dropped]
        if getattr(request, "prompt_is_token_ids", None) is not None:
            request.prompt_is_token_ids = request.prompt_is_token_ids[:-num_dropped]
        del request._all_token_ids[-num_dropped:]  # the request's own copy; all_token_ids is a view of it
        request.num_prompt_tokens -= num_dropped
        request.max_tokens = 1
        request.kv_transfer_params = {**request.kv_transfer_params, "kvxferd_prompt_cut": True}

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._trace.enabled and request.kv_transfer_params:  # the first stamp: the scheduler saw the request
            params = request.kv_transfer_params  # remote: what joins the legs (a push's: its transfer id)
            self._trace.stamp("matched", (request.request_id,), remote=params.get("remote_request_id")
                              or params.get("transfer_id") or params.get("kvxferd_transfer_id"))
        return self.scheduler.matched_tokens(request.request_id, request.kv_transfer_params,
                                             request.num_prompt_tokens, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))  # a read restores every group

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler.prefill_allocated(request.request_id, request.kv_transfer_params, request.num_prompt_tokens,
                                         request.max_tokens)
        self.scheduler.after_alloc(request.request_id, request.kv_transfer_params,
                                   blocks.get_unhashed_block_ids_all_groups(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvxferdMetadata:
        for new in scheduler_output.scheduled_new_reqs:  # a prefill's hold goes out with its last step
            if self.scheduler.prefill_scheduled(new.req_id, new.block_ids, new.num_computed_tokens,
                                                scheduler_output.num_scheduled_tokens.get(new.req_id, 0)):
                self._trace.stamp("hold_sent", (new.req_id,))
        return KvxferdMetadata(orders=self.scheduler.take_orders(), held=self.scheduler.take_held(),
                               layered=self.scheduler.take_layered())

    def update_connector_output(self, connector_output) -> None:
        """Only stamps (when tracing): the scheduler learns which reads ended and which holds let go."""
        super().update_connector_output(connector_output)
        self._trace.stamp("told_recving", connector_output.finished_recving or ())
        self._trace.stamp("told_sending", connector_output.finished_sending or ())

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # decode: ended before its read was ordered
            self.scheduler.finished_before_scheduled(request.request_id, params)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            self.scheduler.drop_early(request.request_id)
            return False, None  # aborted: nothing to hand over
        self._trace.stamp("hold_start", (request.request_id,))
        delay_free, out = self.scheduler.hold(request.request_id, block_ids, request.num_computed_tokens,
                                              request.kv_transfer_params)
        self._trace.stamp("hold_end", (request.request_id,))
        return delay_free, out
