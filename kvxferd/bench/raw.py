"""The raw-NIXL baseline the benchmarks compare against: the plan's descriptors, nothing else."""

from __future__ import annotations

import numpy as np

from kvxferd.plan.descriptors import expand_rows
from kvxferd.plan.engine import RankPlan, RankRead


def prepare_raw(raw_agent, remote_agent_name: str, rank_plan: RankPlan, read: RankRead) -> tuple[object, object, np.ndarray]:
    """Descriptor lists holding exactly ``read``'s descriptors, and the ids that select all of them."""
    descs = []
    for rows, ids in ((rank_plan.local_rows, read.local_ids), (rank_plan.remote_rows, read.remote_ids)):
        addresses, lengths = expand_rows(rows)
        descs.append(np.stack([addresses[ids], lengths[ids], np.zeros(len(ids), np.int64)], axis=1).astype(np.uint64))
    local = raw_agent.prep_xfer_dlist("", descs[0], "DRAM")
    remote = raw_agent.prep_xfer_dlist(remote_agent_name, descs[1], "DRAM")
    return local, remote, np.arange(len(read.local_ids), dtype=np.int32)


def raw_read(raw_agent, local_list, remote_list, ids: np.ndarray, notification: bytes = b"") -> None:
    """make_prepped_xfer + transfer + poll, straight on nixl."""
    handle = raw_agent.make_prepped_xfer("READ", local_list, ids, remote_list, ids, notification)
    state = raw_agent.transfer(handle)
    while state == "PROC":
        state = raw_agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"raw NIXL transfer ended {state}")
    handle.release()
