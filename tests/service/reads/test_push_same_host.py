"""Push on one host through real daemons (issue #57, ``same_host_writes``): a prefill daemon maps the decode
engine's shared memory read-write and copies its pushes there, only where both daemons allow it and the decode
daemon proved this host; every byte checked, the NIXL WRITE otherwise."""

import numpy as np
import pytest

from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.daemons import DaemonCluster
from kvxferd.rig.verify.models import ModelShape, model_groups, random_request

from tests.service.reads.test_push import eventually, expectations_kept, layers_as_expected

COPIES = "kvxferd_push_same_host_copies_total"


def _off_on(role: str, flag: str):
    """Daemon flags: ``flag`` on the daemons of ``role`` ("p": prefill, "d": decode) only."""
    return lambda daemon_id: (flag,) if daemon_id.rsplit("-", 1)[1].startswith(role) else ()


WAYS = [  # (id, flags by daemon, engines pass fds, the prefill daemons copy)
    ("copy", None, False, True),
    ("copy-fd", None, True, True),  # the decode engine passed its memory as an fd: opened via /proc/<pid>/fd
    ("prefill-off", _off_on("p", "--no-same-host-writes"), False, False),
    ("decode-off", _off_on("d", "--no-same-host-writes"), False, False),  # it names no memory: nothing to map
    # the decode daemon names its memory, the prefill daemons hold no host secret: nothing proved, nothing mapped
    ("unproved", _off_on("p", "--no-same-host-reads"), False, False),
]


@pytest.mark.parametrize("args_of, by_fd, copied", [w[1:] for w in WAYS], ids=[w[0] for w in WAYS])
def test_a_push_on_one_host_is_copied_only_where_both_daemons_allow_it(workdir, args_of, by_fd, copied):
    """Byte-exact either way, CONSUMED on the bus; one copy per prefill rank where allowed, none else."""
    prefill_groups, decode_groups = model_groups("gqa", ModelShape(prefill_block_size=32))
    request = random_request("r", prefill_groups, decode_groups, 70, np.random.default_rng(7))
    with DaemonCluster(prefill_groups, decode_groups, 2, 1, workdir=workdir, name="push-sh", args_of=args_of,
                       by_fd=by_fd) as cluster:
        cluster.reset_decode()
        completions = cluster.push(request)
        assert [(c.ok, c.error) for c in completions] == [(True, "")]
        assert cluster.verify(request) == ([], 0)
        assert [e.kind for e in cluster.hold_events(request)] == [pb.NotifyEvent.CONSUMED] * 2
        copies = sum(d.metric(COPIES) for d in cluster.prefill_daemons)
        assert copies == (2 if copied else 0)


def test_a_push_on_one_host_copies_each_layer_once_it_is_final(workdir):
    """Layer by layer on one host: each stage a copy, none before its layers are final."""
    prefill_groups, decode_groups = model_groups("gqa", ModelShape(prefill_block_size=32))
    request = random_request("staged", prefill_groups, decode_groups, 90, np.random.default_rng(8))
    with DaemonCluster(prefill_groups, decode_groups, 1, 1, workdir=workdir, name="push-sh-layers") as cluster:
        num_groups = len(prefill_groups)
        cluster.reset_decode()
        cluster.expect(request, deadline_s=20)
        cluster.hold(request, push=True, layers_final=[0] * num_groups)
        assert eventually(lambda: expectations_kept(cluster))
        cluster.final_layers(request, [1] * num_groups)
        assert eventually(lambda: layers_as_expected(cluster, request, 1) == [])
        # counted just after the copy, on the daemon's loop (the scrape may come between)
        assert eventually(lambda: cluster.prefill_daemons[0].metric(COPIES) == 1)
        cluster.final_layers(request, [2] * num_groups)
        assert [(c.ok, c.error) for c in cluster.completions(request)] == [(True, "")]
        assert cluster.verify(request) == ([], 0)
        assert cluster.prefill_daemons[0].metric(COPIES) == 2


@pytest.mark.parametrize("proved, allowed, kept", [(True, True, True), (False, True, False), (True, False, False)])
def test_a_push_target_keeps_the_memory_it_names_only_once_its_reader_proved_this_host(proved, allowed, kept):
    """A decode daemon names its engine's memory in its target before the holder checked its token: the prefill
    daemon drops those names unless the token proved this host (and ``same_host_writes`` is on there), so it
    never maps what an unproved caller names."""
    import asyncio
    import dataclasses
    from types import SimpleNamespace

    from kvxferd.plan.board import BoardInfo
    from kvxferd.plan.groups import HostShare
    from kvxferd.rig.verify.buffers import paper_cache
    from kvxferd.service.reads.writer import WritePath
    from kvxferd.wire.peerinfo import PeerInfo

    _, decode_groups = model_groups("gqa", ModelShape(prefill_block_size=32))
    cache = paper_cache("d", decode_groups, 1, 0)
    memory = tuple(tuple(dataclasses.replace(r, share=HostShare("kvxferd-named", 0, 1, 1)) for r in regions)
                   for regions in cache.memory)
    info = PeerInfo("i", b"", dataclasses.replace(cache, memory=memory), BoardInfo(1 << 20, 64, bytes(32)))
    connected = []
    writes = WritePath(SimpleNamespace(config=SimpleNamespace(same_host_writes=allowed),
                                       spawn=lambda coroutine: asyncio.run(coroutine)))

    async def connect(slot, info, owner, key):
        connected.append(info)

    writes._connect = connect
    writes.connect_target(SimpleNamespace(), info, "owner", same_host=proved)
    (taken,) = connected
    names = [r.share is not None for regions in taken.cache.memory for r in regions]
    assert names and (all(names) if kept else not any(names))
