"""Larger NIXL sweep, on request: ``scripts/test.sh -m slow``."""

import numpy as np
import pytest

from kvxferd.rig.verify.cluster import LocalCluster
from kvxferd.rig.verify.models import MODELS, ModelShape, model_groups, random_request

TP_PAIRS = [(p, d) for p in (1, 2, 3, 4, 6, 8) for d in (1, 2, 3, 4, 8)]
SHAPES = [ModelShape(num_kv_heads=h, prefill_block_size=pb, decode_block_size=db, kernel_block_size=k, layout=layout)
          for h, pb, db, k, layout in [(1, 16, 16, None, "packed"), (5, 64, 16, 8, "nhd"), (16, 16, 48, 16, "legacy")]]


@pytest.mark.slow
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("p, d", TP_PAIRS, ids=[f"P{p}D{d}" for p, d in TP_PAIRS])
def test_nixl_reads_are_byte_exact_wide(model, shape, p, d):
    prefill_groups, decode_groups = model_groups(model, SHAPES[shape].with_(num_blocks=96))
    rng = np.random.default_rng(p * 10 + d + shape)
    with LocalCluster(prefill_groups, decode_groups, p, d, name=f"slow-{model}-{shape}-{p}-{d}") as cluster:
        for i, cached in enumerate((0, 48, 96)):
            request = random_request(f"r{i}", prefill_groups, decode_groups, 100 + 37 * i, rng, cached_tokens=cached,
                                     window_tokens=30, contiguous=i != 1)
            cluster.reset_decode()
            assert all(r.ok for r in cluster.read(request))
            assert cluster.check(request) == []
            ends = [cluster.holder_thread.wait_end(q, request.remote_request_id, 10) for q in range(p)]
            assert all(end is not None and end.kind == "CONSUMED" for end in ends), ends
