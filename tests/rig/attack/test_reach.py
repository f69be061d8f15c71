"""The H1 harness works: widened metadata reads outside every registered range, and can kill the target.

The target is a bare NIXL agent in a process of its own (UCX over TCP, as
across hosts without RDMA) with a secret in its heap; the daemon's workers
are searched with the same harness (tests/service/worker).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvxferd.rig.attack.metadata import MetadataFormatError, registered_ranges, widened
from kvxferd.rig.attack.reach import NixlReach, data_mappings, read_state, search_process_memory
from kvxferd.xfer.nixl.agent import NixlAgent, NixlError, TransferState

TARGET = """
import os, sys, time, numpy as np
from kvxferd.xfer.nixl.agent import NixlAgent
secret = b"kvx-secret-" + os.urandom(24).hex().encode()  # made here: only in this heap
agent = NixlAgent("h1-target")
cache = np.zeros(1 << 16, dtype=np.uint8)
agent.register_array("cache", cache)
print(agent.metadata().hex(), secret.decode(), cache.ctypes.data, flush=True)
while True:
    agent.poll_notifications()
    time.sleep(0.001)
"""


@pytest.fixture
def target(monkeypatch):
    """(process, its metadata, the secret in its heap, its registered cache's address)."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # this process's agents too: UCX reads it when an agent is made
    process = subprocess.Popen([sys.executable, "-c", TARGET], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, UCX_TLS="tcp"))
    try:
        metadata_hex, secret, cache_address = process.stdout.readline().split()
        yield process, bytes.fromhex(metadata_hex), secret.encode(), int(cache_address)
    finally:
        process.kill()
        process.wait()


def test_registered_ranges_are_the_ranges_an_agent_registered():
    agent = NixlAgent("h1-ranges")
    arrays = [np.zeros(4096, dtype=np.uint8), np.zeros(12288, dtype=np.uint8)]
    try:
        for n, array in enumerate(arrays):
            agent.register_array(f"a{n}", array)
        metadata = agent.metadata()
        found = sorted((r.address, r.num_bytes) for r in registered_ranges(metadata))
        assert found == sorted((a.ctypes.data, a.nbytes) for a in arrays)
        wide = widened(metadata)
        assert len(wide) == len(metadata) and wide != metadata
        assert all(r.num_bytes > 1 << 46 for r in registered_ranges(wide))
    finally:
        agent.close()


def test_bytes_that_are_not_metadata_are_refused():
    with pytest.raises(MetadataFormatError):
        registered_ranges(b"nixlSerDes|Agent" + bytes(64))
    with pytest.raises(MetadataFormatError):
        registered_ranges(b"nixlSDList|t\x04" + bytes(5))  # cut short


def test_widened_metadata_reads_a_secret_outside_every_registered_range(target):
    process, metadata, secret, cache_address = target
    reach = NixlReach(metadata)
    try:
        found, num_read = reach.search(process.pid, {"secret": secret})
    finally:
        reach.close()
    assert num_read > 0 and found["secret"], "the harness read the target's heap and missed its secret"
    assert all(not cache_address <= a < cache_address + (1 << 16) for a in found["secret"])


def test_unwidened_metadata_reaches_only_the_registered_range(target):
    """The control: NIXL's own check on the initiator refuses the same READ when the metadata is left alone."""
    process, metadata, _, _ = target
    heap = next(m for m in data_mappings(process.pid) if m.name == "[heap]")
    agent = NixlAgent("h1-honest")
    try:
        name = agent.add_remote(metadata)
        with pytest.raises(NixlError):
            agent.prep_remote(name, np.array([[heap.start, 4096, 0, 4096, 1]], dtype=np.uint64), "DRAM")
    finally:
        agent.close()


def test_the_process_memory_search_finds_what_is_there_and_nothing_else(target):
    process, _, secret, _ = target
    found = search_process_memory(process.pid, {"secret": secret, "absent": b"kvx-absent-" + os.urandom(16).hex().encode()})
    assert found["secret"] and not found["absent"]


def test_a_read_of_an_unmapped_address_kills_the_target(target):
    process, metadata, _, _ = target
    assert read_state(metadata, 0x10000, 4096) is TransferState.ERR  # the target died under the READ
    assert process.wait(timeout=10) == -signal.SIGSEGV
