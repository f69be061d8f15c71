"""``python -m kvxferd.rig.soak.misplan serve ...``: the soak's daemons, with a planning bug it can switch on.

The fault ``misplanned_read`` (faults.py) stands for what issue #59 says only
a digest can catch: a plan made from a wrong belief about the holder's
layout. kvxferd's own planner and handshake leave no door for that, so the
soak runs its daemons through this wrapper: kvxferd's command line as is,
with :meth:`EngineTransferPlan.plan_request` wrapped. When the file
``<engine socket>.misplan`` names a request id, that one read's plan reads
the holder's spans into the wrong places (every time it is planned, until the
driver removes the file), as a plan that took one layer's K for its V would::

    planned            local ids  [ K of layer l | V of layer l ]      (two tables, equal spans)
                       remote ids [ K of layer l | V of layer l ]
    misplanned         remote ids [ V of layer l | K of layer l ]      (swapped; or, with no two such
                                                                         tables, one table's reversed)

The blocks and holds stay the same (capabilities, board checks and NIXL
see nothing wrong); only the bytes land wrong. What was done is written to
``<engine socket>.misplanned`` (JSON) for the driver to count. Never part of
a served daemon: this is a test rig's mutant.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import numpy as np

from kvxferd.plan.engine import EngineTransferPlan, PlannedRead


def misplan(plan: EngineTransferPlan, planned: PlannedRead) -> str:
    """Move ``planned``'s holder spans to wrong places, in place; how (``""``: nothing to move)."""
    for read in planned.reads:
        rank_plan = next(rp for rp in plan.rank_plans if rp.remote_rank == read.remote_rank)
        sizes = [len(planned.units[t.group][0]) * t.descriptors_per_unit for t in rank_plan.tables]
        starts = np.cumsum([0, *sizes])
        segments = [(t, int(starts[i]), n) for i, (t, n) in enumerate(zip(rank_plan.tables, sizes)) if n]
        for i, (a, a_start, n) in enumerate(segments):
            for b, b_start, m in segments[i + 1:]:
                if n == m and (a.local.span_bytes, a.remote.span_bytes) == (b.local.span_bytes, b.remote.span_bytes):
                    ids = read.remote_ids
                    ids[a_start:a_start + n], ids[b_start:b_start + n] = (ids[b_start:b_start + n].copy(),
                                                                          ids[a_start:a_start + n].copy())
                    return f"rank {read.remote_rank}: two tables' holder spans swapped"
        for _, start, n in segments:
            if n >= 2:
                read.remote_ids[start:start + n] = read.remote_ids[start:start + n][::-1].copy()
                return f"rank {read.remote_rank}: one table's holder spans reversed"
    return ""


def install(engine_socket: str) -> None:
    """Wrap the planner of this process: a read whose id ``<engine_socket>.misplan`` names is misplanned each
    time it is planned (a read planned on a stale link is planned again on the new one: both wrong), until
    the driver removes the switch."""
    flag, done = f"{engine_socket}.misplan", f"{engine_socket}.misplanned"
    plan_request = EngineTransferPlan.plan_request

    def planned_maybe_wrong(self: EngineTransferPlan, request) -> PlannedRead:
        planned = plan_request(self, request)
        try:
            with open(flag) as f:
                target = f.read().strip()
        except FileNotFoundError:
            return planned
        if target == request.request_id:
            with open(done + ".tmp", "w") as f:
                json.dump({"request_id": request.request_id, "how": misplan(self, planned)}, f)
            os.replace(done + ".tmp", done)
        return planned

    EngineTransferPlan.plan_request = planned_maybe_wrong


if __name__ == "__main__":
    install(sys.argv[sys.argv.index("--engine-socket") + 1])
    # then kvxferd's command line, as `python -m kvxferd serve ...` runs it (the same argv)
    runpy.run_module("kvxferd", run_name="__main__", alter_sys=True)
