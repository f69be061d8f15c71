"""``max_concurrent_streams``: calls past the limit are answered RESOURCE_EXHAUSTED, not queued.

HTTP/2's own stream limit cannot answer: a client that has as many streams
open as the server's SETTINGS allow keeps the next call in its own queue,
where it waits for its deadline (or forever without one), and the server
never sees it. So the daemon counts calls itself and leaves HTTP/2 room to
deliver the calls it refuses::

    client ── call N+1 ──► HTTP/2 (limit N + HEADROOM_STREAMS) ──► CallCap: N running for this client
                                                                  └─► RESOURCE_EXHAUSTED "max_concurrent_streams: ..."

A client is what gRPC names as the peer together with the engine session
the call carries (``kvxferd-session``): one TCP connection, and on the
engine's UNIX socket (gRPC names every UNIX connection ``unix:``) one
registered engine, so no local process without an engine's session can
use up that engine's calls. Calls that keep leases alive or end them
(Heartbeat, RenewLease, Release, Deregister) and the health and reflection
services are never refused: a client at its limit still keeps its
registration and can let go of its holds (HTTP/2's limit still bounds them
per connection).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc

from kvxferd.errors import ResourceExhaustedError
from kvxferd.service.net.servicers import metadata_value
from kvxferd.service.base.status import abort_with
from kvxferd.wire.names import SESSION_KEY

HEADROOM_STREAMS = 16  # HTTP/2 streams past the limit, so that refused calls reach the daemon
UNCOUNTED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")
# Leases must not lapse at the limit, and what ends holds or registrations must not be put off.
UNCOUNTED_METHODS = frozenset({"Heartbeat", "RenewLease", "Release", "Deregister"})


def http2_stream_limit(max_concurrent_streams: int) -> int:
    """The HTTP/2 ``SETTINGS_MAX_CONCURRENT_STREAMS`` for a daemon that admits ``max_concurrent_streams``."""
    return max_concurrent_streams + HEADROOM_STREAMS


class CallCap(grpc.aio.ServerInterceptor):
    """Admit at most ``max_calls`` concurrent calls per client; refuse the rest at once.

    ``on_refused(method)`` counts a refusal (``method``: the RPC's short name).
    Runs on the server's event loop only, so the counts need no lock; only
    ``async`` handlers (all of the daemon's) are counted.
    """

    def __init__(self, max_calls: int, on_refused: Callable[[str], None] = lambda method: None) -> None:
        self.max_calls = max_calls
        self.on_refused = on_refused
        self.num_calls: dict[tuple[str, str], int] = {}  # per (peer, session); absent at zero

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        short_name = method.rsplit("/", 1)[-1]
        if handler is None or method.startswith(UNCOUNTED_PREFIXES) or short_name in UNCOUNTED_METHODS:
            return handler
        behaviour = handler.unary_unary or handler.stream_unary or handler.unary_stream or handler.stream_stream
        if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
            return handler  # a synchronous handler would need another wrapper: none exists here
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(short_name, handler.unary_unary))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._unary(short_name, handler.stream_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._streaming(short_name, handler.unary_stream))
        return handler._replace(stream_stream=self._streaming(short_name, handler.stream_stream))

    async def _admit(self, short_name: str, context) -> tuple[str, str]:
        """Count the call in, or answer it RESOURCE_EXHAUSTED (the abort raises: no return then)."""
        client = (context.peer(), metadata_value(context, SESSION_KEY))
        running = self.num_calls.get(client, 0)
        if running >= self.max_calls:
            self.on_refused(short_name)
            await abort_with(context, ResourceExhaustedError(
                "max_concurrent_streams", f"{running} calls of this client run already (limit {self.max_calls}); "
                                          "retry once one ended"))
        self.num_calls[client] = running + 1
        return client

    def _leave(self, client: tuple[str, str]) -> None:
        running = self.num_calls.pop(client) - 1
        if running:
            self.num_calls[client] = running

    def _unary(self, short_name: str, behaviour):
        async def counted(request, context):
            client = await self._admit(short_name, context)
            try:
                return await behaviour(request, context)
            finally:
                self._leave(client)
        return counted

    def _streaming(self, short_name: str, behaviour):
        async def counted(request, context):
            client = await self._admit(short_name, context)
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

