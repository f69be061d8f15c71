"""Remote agents on one NIXL agent: named before loading, never reloaded with other bytes, reference-counted."""

import time

import numpy as np
import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.xfer.nixl.agent import NixlAgent, agent_name_of


@pytest.fixture(scope="module")
def agents():
    holder, reader = NixlAgent("remotes-holder"), NixlAgent("remotes-reader")
    memory = np.zeros(1 << 16, dtype=np.uint8)
    reader.raw.register_memory([(memory.ctypes.data, memory.nbytes, 0, "")], "DRAM")  # a memory section
    return holder, reader, memory


def delivered(holder: NixlAgent, reader: NixlAgent, message: bytes) -> bool:
    holder.notify(reader.name, message)
    for _ in range(200):
        holder.poll_notifications()
        if message in reader.poll_notifications().get(holder.name, []):
            return True
        time.sleep(0.005)
    return False


def test_the_name_is_read_from_the_header(agents):
    holder, reader, _ = agents
    assert agent_name_of(reader.metadata()) == "remotes-reader"
    metadata = bytearray(reader.metadata())
    metadata[metadata.index(b"remotes-reader")] = 0xD8
    for bad in (bytes(metadata), b"", b"nixlSerDes|Agent", b"nixlSerDes|Agent" + bytes(8), b"junk" * 40,
                b"nixlSerDes|Agent\x05\x00\x00\x00\x00\x00\x00\x00abc"):
        with pytest.raises(InvalidArgumentError) as err:
            holder.add_remote(bad, "reader_agent_metadata")
        assert err.value.field == "reader_agent_metadata"
    with pytest.raises(InvalidArgumentError, match="itself"):
        holder.add_remote(holder.metadata())


def test_a_truncated_copy_of_a_known_agent_is_refused_and_the_link_keeps_working(agents):
    holder, reader, _ = agents
    metadata = reader.metadata()
    assert holder.add_remote(metadata) == reader.name and delivered(holder, reader, b"before")
    cut = metadata[: metadata.index(b"MemSection") + 40]
    with pytest.raises(InvalidArgumentError, match="other metadata"):
        holder.add_remote(cut)
    assert delivered(holder, reader, b"after")
    holder.remove_remote(reader.name)


def test_references_are_counted_and_the_last_one_unloads(agents):
    holder, reader, _ = agents
    metadata = reader.metadata()
    assert [holder.add_remote(metadata) for _ in range(3)] == [reader.name] * 3 and holder.num_remotes() == 1
    holder.remove_remote(reader.name)
    holder.remove_remote(reader.name)
    assert holder.num_remotes() == 1 and delivered(holder, reader, b"still loaded")
    holder.remove_remote(reader.name)
    assert holder.num_remotes() == 0
    holder.remove_remote(reader.name)  # unknown now: nothing to do
    assert holder.add_remote(metadata) == reader.name and delivered(holder, reader, b"loaded again")
    holder.remove_remote(reader.name)


@pytest.mark.parametrize("call, level", [("create_agent", "INFO"), ("transfer", "WARNING")])
def test_a_slow_call_is_logged_with_its_name_a_warning_only_on_the_data_path(agents, caplog, monkeypatch, call, level):
    holder, _, _ = agents
    monkeypatch.setattr("kvxferd.xfer.nixl.agent.SLOW_CALL_S", 0.0)  # every call counts as slow
    with caplog.at_level("INFO", logger="kvxferd.xfer.nixl.agent"):
        holder._call(call, lambda: None)
    (record,) = [r for r in caplog.records if r.name == "kvxferd.xfer.nixl.agent"]
    assert record.levelname == level and call in record.getMessage() and holder.name in record.getMessage()
