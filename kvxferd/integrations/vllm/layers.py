"""A push written layer by layer (issue #57), prefill worker side: say when each layer's KV is final.

The scheduler holds a long prompt's push with the step that computes it, no
layer final yet (``layers_final`` all 0), and names its transfer id in that
step's metadata. vLLM calls ``save_kv_layer`` after each attention layer
wrote its KV into the cache; this rank then tells its daemon how many
layers of each cache group are final, and the daemon writes those at once.
``wait_for_save`` (the forward pass ended) says every layer is final: the
last write, and the push's end::

    step metadata: layered = [T]         hold(T, layers_final=[0, 0]) sent by the scheduler
    save_kv_layer("model.layers.0.attn") ─► FinalLayers(T, [1, 0])    daemon writes layer 0 of group 0
    save_kv_layer("model.layers.1.attn") ─► FinalLayers(T, [2, 0])    ... layer 1
    wait_for_save()                       ─► FinalLayers(T, [2, 2])    the rest (state groups), notice

A group's count is the length of the run of its layers, in the group's own
order, that are final: a layer reported out of order counts once the ones
before it are. On a GPU the KV is written by kernels still queued when
``save_kv_layer`` runs: each report waits for a CUDA event recorded then, on a
thread of its own, so the forward pass never waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

log = logging.getLogger("kvxferd.vllm")

Send = Callable[[str, Sequence[int]], None]  # (transfer id, layers final per group)


class LayerReports:
    """Which layers of this step's layer-by-layer pushes are final, told to the daemon as they become so."""

    def __init__(self, layer_names: Sequence[Sequence[str]], send: Send) -> None:
        self.send = send
        self.totals = tuple(len(names) for names in layer_names)
        # layer name -> (group, index in the group): a layer may be in one group only
        self.positions = {name: (g, i) for g, names in enumerate(layer_names) for i, name in enumerate(names)}
        self.transfer_ids: list[str] = []
        self._done = [np.zeros(n, dtype=bool) for n in self.totals]
        self._counts = [0] * len(self.totals)
        self._fenced: FencedSender | None = None

    def start(self, transfer_ids: Sequence[str]) -> None:
        """A step begins: these transfers are held layer by layer with it (none final yet)."""
        self.transfer_ids = list(transfer_ids)
        for done in self._done:
            done[:] = False
        self._counts = [0] * len(self.totals)

    def layer_saved(self, layer_name: str, fence=None) -> None:
        """vLLM's ``save_kv_layer``: ``layer_name``'s KV is in the cache (once ``fence`` is reached, on a GPU)."""
        if not self.transfer_ids:
            return
        position = self.positions.get(layer_name)
        if position is None:
            return  # a layer kvxferd does not hold (none of the registered groups')
        g, i = position
        done = self._done[g]
        done[i] = True
        count = int(np.argmin(done)) if not done.all() else len(done)  # the run of final layers from the first
        if count != self._counts[g]:
            self._tell(tuple(self._counts[:g]) + (count,) + tuple(self._counts[g + 1:]), fence)

    def step_ended(self, fence=None) -> None:
        """vLLM's ``wait_for_save``: the forward pass ended, every layer is final (the pushes' last writes)."""
        if self.transfer_ids:
            if tuple(self._counts) != self.totals:  # (the last layer's report said every layer is final already)
                self._tell(self.totals, fence)
            self.transfer_ids = []

    def close(self) -> None:
        if self._fenced is not None:
            self._fenced.close()

    def _tell(self, counts: tuple[int, ...], fence) -> None:
        self._counts = list(counts)
        if fence is None:
            for transfer_id in self.transfer_ids:
                self._send(transfer_id, counts)
            return
        if self._fenced is None:
            self._fenced = FencedSender(self._send)
        for transfer_id in self.transfer_ids:
            self._fenced.put(fence, transfer_id, counts)

    def _send(self, transfer_id: str, counts: Sequence[int]) -> None:
        try:
            self.send(transfer_id, counts)
        except Exception as err:  # never in vLLM's forward pass: the push fails by its deadline instead
            log.warning("kvxferd: could not say layers are final", extra={"transfer_id": transfer_id,
                                                                          "error": str(err)})


class FencedSender:
    """Sends each report once its fence (a CUDA event; anything with ``synchronize()``) was reached, in order,
    on a thread of its own."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvxferd-layers", daemon=True)
        self._thread.start()

    def put(self, fence, transfer_id: str, counts: Sequence[int]) -> None:
        self._queue.put((fence, transfer_id, counts))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fence, transfer_id, counts = item
            try:
                fence.synchronize()
            except Exception as err:  # never said final: the push fails by its deadline, the thread goes on
                log.warning("kvxferd: a layer's KV could not be waited for", extra={"transfer_id": transfer_id,
                                                                                   "error": str(err)})
                continue
            self._send(transfer_id, counts)
