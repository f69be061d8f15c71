"""The reads socket's writer: frames from the event loop and another thread arrive whole and in the order
each wrote them, an engine that does not read fills a bounded buffer (and gets everything once it
reads), a closed writer writes nothing more, and a gone peer is reported to the session."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading

import pytest
import uvloop

from kvxferd.service.net import framewriter as framewriter_module
from kvxferd.service.net.framewriter import FrameWriter
from kvxferd.wire.frames import FrameReader, encode_frame


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    """Each test on both loops: the daemon runs uvloop, whose add_writer and transports differ."""
    return asyncio.run if request.param == "asyncio" else uvloop.run


@contextlib.asynccontextmanager
async def _connection(high_water_bytes: int = 1 << 30, on_broken=lambda err: None):
    """A writer on the daemon's end of a socket pair with a small send buffer (most frames go through
    the writer's own buffer), and both ends; everything closed afterwards."""
    daemon_side, engine_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    daemon_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    daemon_side.setblocking(False)
    writer = FrameWriter(asyncio.get_running_loop(), daemon_side.fileno(), high_water_bytes=high_water_bytes,
                         on_broken=on_broken)
    try:
        yield writer, daemon_side, engine_side
    finally:
        writer.close()
        await asyncio.sleep(0)  # its descriptor is closed on the loop
        daemon_side.close()
        engine_side.close()


def _read_frames(engine_side: socket.socket, count: int) -> list[bytes]:
    frames, reader = [], FrameReader(1 << 24)
    engine_side.settimeout(10)
    while len(frames) < count:
        data = engine_side.recv(1 << 16)
        assert data, f"closed after {len(frames)} of {count} frames"
        frames += reader.feed(data)
    return frames


def test_frames_of_the_loop_and_a_thread_arrive_whole_and_each_in_its_order(run):
    async def main():
        async with _connection() as (writer, _, engine_side):
            num_each, payload = 300, b"x" * 700  # far more than the socket buffer: most go through the buffer

            def from_thread():
                for n in range(num_each):
                    assert writer.write(encode_frame(b"T%04d" % n + payload))

            thread = threading.Thread(target=from_thread)
            thread.start()
            for n in range(num_each):
                assert writer.write(encode_frame(b"L%04d" % n + payload))
                if n % 50 == 0:
                    await asyncio.sleep(0)  # the loop flushes meanwhile
            reading = asyncio.get_running_loop().run_in_executor(None, _read_frames, engine_side, 2 * num_each)
            thread.join()
            frames = await reading
            assert writer.num_buffered_bytes == 0
            for tag in (b"T", b"L"):
                mine = [f[:5] for f in frames if f[:1] == tag]
                assert mine == [tag + b"%04d" % n for n in range(num_each)]
            assert all(f[5:] == payload for f in frames)

    run(main())


def test_an_engine_that_does_not_read_fills_a_bounded_buffer_then_gets_everything(run):
    async def main():
        async with _connection(high_water_bytes=32 << 10) as (writer, _, engine_side):
            sent = 0
            while writer.writable:
                assert writer.write(encode_frame(b"%06d" % sent + b"y" * 1000))
                sent += 1
            assert writer.num_buffered_bytes > 32 << 10 and sent < 200  # it stopped taking frames early
            waiting = asyncio.ensure_future(writer.wait_writable())
            await asyncio.sleep(0.05)
            assert not waiting.done()  # nobody reads: no room
            frames = await asyncio.get_running_loop().run_in_executor(None, _read_frames, engine_side, sent)
            await asyncio.wait_for(waiting, 5)
            assert [f[:6] for f in frames] == [b"%06d" % n for n in range(sent)] and writer.writable

    run(main())


def test_a_closed_writer_writes_nothing_and_closes_only_its_own_descriptor(run):
    async def main():
        async with _connection() as (writer, daemon_side, engine_side):
            own_fd = writer._sock.fileno()
            writer.close()
            await asyncio.sleep(0)
            assert not writer.write(encode_frame(b"late")) and not writer.writable
            with pytest.raises(OSError):
                os.fstat(own_fd)  # its duplicate is closed
            daemon_side.send(encode_frame(b"still open"))  # the connection itself is not
            assert _read_frames(engine_side, 1) == [b"still open"]

    run(main())


def test_the_last_frames_are_flushed_before_the_close_and_a_gone_peer_is_reported(run):
    async def main():
        loop = asyncio.get_running_loop()
        broken: list[OSError] = []
        async with _connection(on_broken=broken.append) as (writer, _, engine_side):
            for n in range(100):
                writer.write(encode_frame(b"%03d" % n + b"z" * 1000))
            closed = loop.create_future()
            writer.close_when_flushed(lambda: closed.set_result(True))
            assert not closed.done()  # far more than the socket holds: it waits for the engine to read
            frames = await loop.run_in_executor(None, _read_frames, engine_side, 100)
            await asyncio.wait_for(closed, 5)
            assert len(frames) == 100 and writer.closed

        async with _connection(on_broken=broken.append) as (writer, _, engine_side):
            engine_side.close()
            while writer.write(encode_frame(b"anyone?")):
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.01)
            assert len(broken) == 1 and isinstance(broken[0], OSError) and writer.closed

    run(main())


def test_an_engine_that_never_takes_its_last_frames_is_closed_anyway(run, monkeypatch):
    monkeypatch.setattr(framewriter_module, "CLOSE_FLUSH_S", 0.05)

    async def main():
        loop = asyncio.get_running_loop()
        async with _connection() as (writer, _, _):
            for _ in range(100):
                writer.write(encode_frame(b"w" * 1000))
            closed = loop.create_future()
            writer.close_when_flushed(lambda: closed.set_result(True))
            await asyncio.wait_for(closed, 5)
            assert writer.closed and writer.num_buffered_bytes == 0

    run(main())
