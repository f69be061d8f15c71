"""The prefill worker's reports of final layers (a push written layer by layer, issue #57): counts per group
are runs of final layers from the first, told once per change, every layer at the step's end; none outside a
step that holds layer by layer; on a GPU, each report after its fence."""

import threading

from kvxferd.integrations.vllm.layers import LayerReports

NAMES = (("attn.0", "attn.1", "attn.2"), ("mamba.0", "mamba.1"))


def reports():
    sent = []
    return LayerReports(NAMES, lambda transfer_id, counts: sent.append((transfer_id, tuple(counts)))), sent


def test_layers_in_order_are_told_as_they_become_final_and_all_at_the_end():
    layers, sent = reports()
    layers.start(["T", "U"])
    layers.layer_saved("attn.0")
    layers.layer_saved("attn.1")
    layers.step_ended()
    assert sent == [("T", (1, 0)), ("U", (1, 0)), ("T", (2, 0)), ("U", (2, 0)), ("T", (3, 2)), ("U", (3, 2))]


def test_a_layer_out_of_order_counts_once_those_before_it_are_final():
    layers, sent = reports()
    layers.start(["T"])
    layers.layer_saved("attn.1")  # not a run from the first layer: nothing to tell
    layers.layer_saved("other")  # not a registered layer
    assert sent == []
    layers.layer_saved("attn.0")
    assert sent == [("T", (2, 0))]
    layers.layer_saved("attn.0")  # again: no change, nothing told
    assert sent == [("T", (2, 0))]


def test_nothing_is_told_outside_a_layered_step_and_a_new_step_starts_from_none():
    layers, sent = reports()
    layers.layer_saved("attn.0")
    layers.step_ended()
    assert sent == []
    layers.start(["T"])
    layers.layer_saved("attn.0")
    layers.step_ended()
    layers.start(["V"])
    layers.layer_saved("attn.0")
    assert sent == [("T", (1, 0)), ("T", (3, 2)), ("V", (1, 0))]


def test_a_fenced_report_waits_for_its_fence_and_a_failed_send_never_raises():
    class Fence:
        def __init__(self):
            self.reached = threading.Event()

        def synchronize(self):
            self.reached.wait(5)

    told = threading.Event()
    sent = []

    def send(transfer_id, counts):
        if transfer_id == "bad":
            raise RuntimeError("daemon gone")
        sent.append((transfer_id, tuple(counts)))
        told.set()

    layers = LayerReports(NAMES, send)
    layers.start(["bad", "T"])
    fence = Fence()
    layers.layer_saved("attn.0", fence)
    assert not told.wait(0.2) and sent == []  # the KV kernels have not ended
    fence.reached.set()
    assert told.wait(5) and sent == [("T", (1, 0))]
    layers.close()


def test_a_step_whose_last_layer_made_every_layer_final_says_nothing_more_at_its_end():
    layers = LayerReports((("a", "b"),), None)
    sent = []
    layers.send = lambda transfer_id, counts: sent.append((transfer_id, tuple(counts)))
    layers.start(["T"])
    layers.layer_saved("a")
    layers.layer_saved("b")
    layers.step_ended()  # the push ended with layer b's write: nothing is said of a hold that is gone
    assert sent == [("T", (1,)), ("T", (2,))]
