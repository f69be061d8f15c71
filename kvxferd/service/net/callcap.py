"""``max_concurrent_streams``: calls past the limit are answered RESOURCE_EXHAUSTED, not queued.

HTTP/2's own stream limit cannot answer: a client that has as many streams
open as the server's SETTINGS allow keeps the next call in its own queue,
where it waits for its deadline (or forever without one), and the server
never sees it. So the daemon counts calls itself and leaves HTTP/2 room to
deliver the calls it refuses::

    client ── call N+1 ──► HTTP/2 (limit N + HEADROOM_STREAMS) ──► CallCap: N running for this client
                                                                  └─► RESOURCE_EXHAUSTED "max_concurrent_streams: ..."

A client is what gRPC names as the peer: one TCP connection (its address
and port), or the engine's UNIX socket as a whole (gRPC names every UNIX
connection ``unix:``; all of them are the one engine's). The health and
reflection services are not counted, so a probe still answers while an
engine uses all its calls; HTTP/2's limit still bounds them per connection.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc

from kvxferd.errors import ResourceExhaustedError
from kvxferd.service.status import abort_with

HEADROOM_STREAMS = 16  # HTTP/2 streams past the limit, so that refused calls reach the daemon
UNCOUNTED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


def http2_stream_limit(max_concurrent_streams: int) -> int:
    """The HTTP/2 ``SETTINGS_MAX_CONCURRENT_STREAMS`` for a daemon that admits ``max_concurrent_streams``."""
    return max_concurrent_streams + HEADROOM_STREAMS


class CallCap(grpc.aio.ServerInterceptor):
    """Admit at most ``max_calls`` concurrent calls per client; refuse the rest at once.

    ``on_refused(method)`` counts a refusal (``method``: the RPC's short name).
    Runs on the server's event loop only, so the counts need no lock.
    """

    def __init__(self, max_calls: int, on_refused: Callable[[str], None] = lambda method: None) -> None:
        self.max_calls = max_calls
        self.on_refused = on_refused
        self.num_calls: dict[str, int] = {}  # per client (gRPC's peer name); absent at zero

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(UNCOUNTED_PREFIXES):
            return handler
        short_name = method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(short_name, handler.unary_unary))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._unary(short_name, handler.stream_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._streaming(short_name, handler.unary_stream))
        return handler._replace(stream_stream=self._streaming(short_name, handler.stream_stream))

    def _enter(self, short_name: str, context) -> str:
        client = context.peer()
        running = self.num_calls.get(client, 0)
        if running >= self.max_calls:
            self.on_refused(short_name)
            raise ResourceExhaustedError("max_concurrent_streams", f"{running} calls of this client run already "
                                                                   f"(limit {self.max_calls}); retry once one ended")
        self.num_calls[client] = running + 1
        return client

    def _leave(self, client: str) -> None:
        running = self.num_calls.pop(client) - 1
        if running:
            self.num_calls[client] = running

    def _unary(self, short_name: str, behaviour):
        async def counted(request, context):
            try:
                client = self._enter(short_name, context)
            except ResourceExhaustedError as err:
                await abort_with(context, err)
            try:
                return await behaviour(request, context)
            finally:
                self._leave(client)
        return counted

    def _streaming(self, short_name: str, behaviour):
        async def counted(request, context):
            try:
                client = self._enter(short_name, context)
            except ResourceExhaustedError as err:
                await abort_with(context, err)
            try:
                replies = behaviour(request, context)
                if inspect.isasyncgen(replies):
                    async for reply in replies:
                        yield reply
                else:  # a handler that writes with context.write and returns
                    await replies
            finally:
                self._leave(client)
        return counted
