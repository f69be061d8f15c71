"""NIXL merges exactly the descriptors the plan says are contiguous on both sides."""

import numpy as np
import pytest

from kvxferd.plan.engine import EngineTransferPlan
from kvxferd.rig.verify.buffers import allocate_engine, check_buffers, expected_buffers
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request
from kvxferd.xfer.nixl.agent import NixlAgent
from kvxferd.rig.verify.holderthread import HolderThread


# hybrid from TP 2: each prefill rank fills half of every decode block, so nothing merges.
@pytest.mark.parametrize("model, p, merges", [("gqa", 1, True), ("swa", 1, True), ("hybrid", 2, False), ("mla", 2, True)])
def test_merged_count_matches_nixl_telemetry(model, p, merges):
    prefill_groups, decode_groups = model_groups(model, ModelShape(num_layers=3))
    prefill = [allocate_engine("P", prefill_groups, p, q, tagged=True) for q in range(p)]
    decode = allocate_engine("D", decode_groups, 1, 0, tagged=False)
    prefill_agents = [NixlAgent(f"tel-{model}-p{q}") for q in range(p)]
    reader = NixlAgent(f"tel-{model}-d", telemetry=True)
    for agent, engine in zip(prefill_agents, prefill):
        agent.register(engine.cache)
    reader.register(decode.cache)
    plan = EngineTransferPlan(decode.cache, [e.cache for e in prefill])
    names = [reader.add_remote(a.metadata()) for a in prefill_agents]
    lists = {rp.remote_rank: (reader.prep_local(rp.local_rows, "DRAM"), reader.prep_remote(names[rp.remote_rank], rp.remote_rows, "DRAM"))
             for rp in plan.rank_plans}
    rng = np.random.default_rng(0)
    with HolderThread(prefill_agents + [reader]):
        for contiguous in (True, False):
            decode.reset()
            request = random_request("r", prefill_groups, decode_groups, 100, rng, contiguous=contiguous)
            planned = plan.plan_request(request)
            moved = 0
            for read in planned.reads:
                local_list, remote_list = lists[read.remote_rank]
                handle = reader.make_read(local_list, read.local_ids, remote_list, read.remote_ids, b"")
                state = reader.post(handle)
                while state == "PROC":
                    state = reader.state(handle)
                assert state == "DONE"
                moved += reader.descriptors_moved(handle)
                reader.release(handle)
            assert moved == planned.count_merged_descriptors()
            assert (moved < sum(r.num_descriptors for r in planned.reads)) == (contiguous and merges)
            assert check_buffers(decode, expected_buffers(decode.cache, prefill_groups, request)) == []
