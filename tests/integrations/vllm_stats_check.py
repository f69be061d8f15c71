"""The connector's ``vllm:kvxferd_*`` metrics as one vLLM ``LLM`` reports them (``LLM.get_metrics()``).

Meant for the end-to-end tests: take a snapshot before and after a batch of
P/D requests and compare the difference with the decode daemon's own counters::

    before = connector_metrics(pd.decode)
    read_before = metric(pd.decode_daemon, "kvxferd_read_bytes_total")
    outputs = pd.decode.generate(prompts_of(prompts), [greedy(8, p) for p in params], use_tqdm=False)
    after = connector_metrics(pd.decode)
    moved = {name: after[name] - before.get(name, 0.0) for name in after}
    assert moved["vllm:kvxferd_num_transfers"] == len(prompts)  # TP 1: one read per request
    assert moved["vllm:kvxferd_num_failed_transfers"] == 0
    assert moved["vllm:kvxferd_transferred_bytes"] == metric(pd.decode_daemon, "kvxferd_read_bytes_total") - read_before
    assert moved["vllm:kvxferd_transfer_time_seconds_count"] == len(prompts)

A failed read (a negative control) moves ``vllm:kvxferd_num_failed_transfers``
(and ``...{reason=read}``) and ``num_transfers``, never the bytes.

Caveats, both vLLM's: its Prometheus metrics are process-global and every new
``LLM`` takes them over, so in a process with a prefill and a decode ``LLM``
only the one built last reports here (the P/D tests build decode last); and
the ``LLM`` must be built with ``disable_log_stats=False`` (``get_metrics``
asserts it). Counts are per TP rank: a TP-2 decode counts two reads per request.
"""

from __future__ import annotations

PREFIX = "vllm:kvxferd_"
EXTRA_LABELS = ("reason", "how")  # the labels beyond vLLM's model_name and engine


def connector_metrics(llm) -> dict[str, float]:
    """``name -> value`` summed over engines: counters by name (labelled ones also as ``name{label=value}``,
    their total under the bare name), histograms as ``name_count`` and ``name_sum``."""
    out: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + float(value)

    for m in llm.get_metrics():
        if not m.name.startswith(PREFIX):
            continue
        if hasattr(m, "count"):  # a histogram
            add(f"{m.name}_count", m.count)
            add(f"{m.name}_sum", m.sum)
            continue
        add(m.name, m.value)
        for label in EXTRA_LABELS:
            if label in m.labels:
                add(f"{m.name}{{{label}={m.labels[label]}}}", m.value)
    return out
