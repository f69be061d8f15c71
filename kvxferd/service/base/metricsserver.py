"""The Prometheus endpoint: one thread, a bounded number of connections, each with a deadline.

prometheus_client's ``start_http_server`` gives every connection an OS
thread and no timeout: a client that connects and says nothing holds its
thread for ever, and a thousand of them hold a thousand threads. This
server runs an asyncio loop on one thread of its own (scrapes never wait
for the daemon's loop, nor it for them):

* a connection must send its request (headers of at most
  ``MAX_REQUEST_BYTES``) and take the whole answer within ``timeout_s``,
  else it is closed; one request per connection (``Connection: close``);
* at most ``max_connections`` are open at once. One more closes the oldest
  that has not sent its whole request yet (a scraper sends its request at
  once, so idle connections cannot crowd it out); when every one is being
  answered, the newcomer is closed instead.

It answers ``GET`` (any path, as prometheus_client does) with the registry
in the format the ``Accept`` header asks for.
"""

from __future__ import annotations

import asyncio
import socket
import threading

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvxferd.xfer.osutil.osthreads import name_this_thread

TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16
MAX_REQUEST_BYTES = 8192
LISTEN_BACKLOG = 64


class MetricsServer:
    """Serves one registry on ``host:port`` (0: a free port, then ``port`` says which) until :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, *, timeout_s: float = TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.registry, self.timeout_s, self.max_connections = registry, timeout_s, max_connections
        self.num_closed_idle = 0  # connections closed for their deadline or to make room
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}  # oldest first
        self._waiting: set[asyncio.Task] = set()  # connected, whole request not read yet
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self.port = listener.getsockname()[1]
        self._loop = asyncio.new_event_loop()  # its own thread's: the caller's may be running
        self._thread = threading.Thread(target=self._run, name="kvxferd-metrics", daemon=True)
        self._thread.start()
        try:
            self._server = asyncio.run_coroutine_threadsafe(
                asyncio.start_server(self._serve, sock=listener, limit=MAX_REQUEST_BYTES), self._loop).result(10)
        except BaseException:
            listener.close()
            self._stop_loop()
            raise

    def _run(self) -> None:
        name_this_thread()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        writer.transport.set_write_buffer_limits(high=0)  # drain() returns once the kernel has it all
        if not self._make_room():
            writer.transport.abort()
            return
        self._connections[task] = writer
        self._waiting.add(task)
        answered = False
        try:
            async with asyncio.timeout(self.timeout_s):
                head = await reader.readuntil(b"\r\n\r\n")
                self._waiting.discard(task)
                writer.write(self._answer(head))
                await writer.drain()
                answered = True
        except TimeoutError:
            self.num_closed_idle += 1
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError):
            pass  # gone, or a request too large: closed
        finally:
            self._connections.pop(task, None)
            self._waiting.discard(task)
            if answered:
                writer.close()  # our buffer is empty (drained): the kernel sends the rest
            else:
                writer.transport.abort()

    def _make_room(self) -> bool:
        """Room for one more connection: close the oldest still sending its request if need be."""
        if len(self._connections) < self.max_connections:
            return True
        oldest = next((task for task in self._connections if task in self._waiting), None)
        if oldest is None:
            return False
        self.num_closed_idle += 1
        self._waiting.discard(oldest)
        self._connections.pop(oldest).transport.abort()  # its read ends, and so does its task
        return True

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        method = lines[0].split(" ", 1)[0]
        if method != "GET":
            return _response("405 Method Not Allowed", "text/plain; charset=utf-8", b"GET only\n")
        accept = next((line.split(":", 1)[1].strip() for line in lines[1:]
                       if line.lower().startswith("accept:")), "")
        encoder, content_type = choose_encoder(accept)
        return _response("200 OK", content_type, encoder(self.registry))

    def close(self) -> None:
        """Stop listening, close every connection and end the thread."""
        if self._loop.is_closed():
            return

        async def stop() -> None:
            self._server.close()
            for writer in list(self._connections.values()):
                writer.transport.abort()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def _response(status: str, content_type: str, body: bytes) -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode("latin-1") + body
