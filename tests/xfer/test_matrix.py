"""The data plane over real NIXL: every cache kind x TP pairing, byte-exact.

Each case runs a prefill and a decode engine with one NIXL agent (UCX,
loopback, host memory) per rank, posts two requests (a full read, then a
prefix-cache hit with a sliding window and scattered ids), checks every
decode byte against the oracle and waits for every prefill rank to release.
"""

import numpy as np
import pytest

from kvxferd.rig.verify.cluster import LocalCluster
from kvxferd.rig.verify.models import MODELS, ModelShape, model_groups, random_request
from kvxferd.xfer.holder import NoticeEvent

from tests.sampling import covering

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (4, 1), (1, 4), (2, 4), (4, 2), (3, 2), (2, 3), (8, 2)]
SHAPES = {
    # P/D logical block sizes differ (prefill 32, decode 16).
    "blocks_32_to_16": ModelShape(prefill_block_size=32),
    # Fewer KV heads than ranks (replicas), decode kernel blocks of 4 in an NHD layout.
    "replicated_kernel_split": ModelShape(num_kv_heads=2, kernel_block_size=4, layout="nhd"),
    # Uneven heads, decode blocks larger than prefill blocks, legacy decode layout.
    "blocks_16_to_32_uneven": ModelShape(num_kv_heads=3, decode_block_size=32, layout="legacy", num_layers=1),
}


# Every TP pair, model and shape in the default run; all 150 combinations with -m slow.
@pytest.mark.parametrize("pair, model, shape", covering(TP_PAIRS, MODELS, list(SHAPES),
                                                        ids=lambda pair, model, shape: f"P{pair[0]}D{pair[1]}-{model}-{shape}"))
def test_nixl_reads_are_byte_exact(pair, model, shape):
    p, d = pair
    check_pairing(model, SHAPES[shape], shape, p, d)


# Same-host copies (issue #37): the same sample of pairings, the decode ranks copying from the prefill
# ranks' shared memory themselves; board checks and notices as over NIXL.
@pytest.mark.parametrize("pair, model, shape", covering(TP_PAIRS, MODELS, list(SHAPES),
                                                        ids=lambda pair, model, shape: f"P{pair[0]}D{pair[1]}-{model}-{shape}"))
def test_same_host_copies_are_byte_exact(pair, model, shape):
    p, d = pair
    check_pairing(model, SHAPES[shape], shape, p, d, same_host=True)


@pytest.mark.parametrize("model", ["gqa", "swa"])
@pytest.mark.parametrize("p, d", [(1, 1), (2, 1), (1, 2), (3, 2)], ids=lambda x: str(x))
def test_kv_per_head_pairs_with_packed_hnd(model, p, d):
    """(B, H, KV, N, C) on decode, prefill packed HND, blocks 32 -> 16."""
    check_pairing(model, ModelShape(prefill_block_size=32, layout="kvhead"), "kvhead", p, d)


@pytest.mark.parametrize("blocks", [{"prefill_block_size": 32}, {"decode_block_size": 32}], ids=["32_to_16", "16_to_32"])
@pytest.mark.parametrize("p, d", [(1, 2), (2, 1)], ids=lambda x: str(x))
def test_vllm_cpu_cache_between_block_sizes(blocks, p, d):
    """vLLM's CPU cache (K transposed per head, ``kv_per_head_kt``) on both sides, block sizes differing."""
    check_pairing("gqa", ModelShape(layout="cpu", **blocks), "cpu", p, d)


def check_pairing(model: str, shape: ModelShape, name: str, p: int, d: int, *, same_host: bool = False) -> None:
    prefill_groups, decode_groups = model_groups(model, shape)
    rng = np.random.default_rng(p * 10 + d)
    requests = [random_request("full", prefill_groups, decode_groups, 70, rng),
                random_request("hit", prefill_groups, decode_groups, 90, rng, cached_tokens=32, window_tokens=24,
                               contiguous=False)]
    with LocalCluster(prefill_groups, decode_groups, p, d, name=f"{model}-{name}-{p}-{d}", same_host=same_host) as cluster:
        for request in requests:
            cluster.reset_decode()
            results = cluster.read(request)
            assert [r.error for r in results if not r.ok] == []
            assert cluster.check(request) == []
            notifiers = cluster.executors[0].remote(cluster.prefill_id).plan.expected_notifiers
            for q, holder in enumerate(cluster.holders):
                end = cluster.holder_thread.wait_end(q, request.remote_request_id, timeout_s=10)
                assert end is not None and end.kind == "CONSUMED" and not end.failed_readers, f"prefill rank {q}: {end}"
                assert holder.readers.get((cluster.decode_id, 0)).expected_readers == notifiers[q]
        # Every decode rank copied itself exactly when same-host (else every byte came over NIXL).
        assert [e.num_host_copies > 0 for e in cluster.executors] == [same_host] * d
        # Nothing refused or late (a new connection's first READs may wait: `waited` is not a fault).
        assert [(h.counts[NoticeEvent.BAD], h.counts[NoticeEvent.FOREIGN], h.counts[NoticeEvent.LATE]) for h in cluster.holders] == [(0, 0, 0)] * p
