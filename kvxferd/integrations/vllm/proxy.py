"""A small prefill/decode proxy for trying kvxferd with two ``vllm serve`` instances.

::

    client ──POST /v1/completions──► proxy ──(max_tokens=1, do_remote_decode)──► prefill
                                       │ ◄── kv_transfer_params ─────────────────┘
                                       └──(the request + kv_transfer_params)──► decode ──► client

The decode answer (streamed or not) goes back unchanged, with the prefill's
request id in ``X-Kvxferd-Prefill-Request-Id`` (the id the daemons' holds,
reads and bus events name; with ``KVXFERD_TRACE_DIR`` set the proxy stamps
its steps under it, see trace.py). A prefill that
answers without ``kv_transfer_params`` is a 502 naming the prefill URL.
``/v1/chat/completions`` works the same way. With ``--mode push`` (issue #57)
both legs go at once under one transfer id (the connectors must run
``mode: push``): the decode leg expects its blocks, the prefill daemon writes
them when the prefill ends; the first request goes as a pull, to learn where
the prefill engine is (every prefill answer after refreshes it). Run it where vLLM is installed
(it uses aiohttp, one of vLLM's dependencies)::

    python -m kvxferd.integrations.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import time
import uuid

from kvxferd.client.pushkeys import new_push_key
from kvxferd.integrations.vllm.trace import Trace

log = logging.getLogger("kvxferd.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
PREFILL_ID_HEADER = "X-Kvxferd-Prefill-Request-Id"


def prefill_request(body: dict) -> dict:
    """The prefill leg: one token, no streaming, and a request for kv_transfer_params."""
    leg = copy.deepcopy(body)
    leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    leg.pop("max_completion_tokens", None)
    leg.pop("stream_options", None)
    return leg


def decode_request(body: dict, kv_transfer_params: dict) -> dict:
    leg = copy.deepcopy(body)
    leg["kv_transfer_params"] = kv_transfer_params
    return leg


def push_legs(body: dict, transfer_id: str, where: dict, layers: bool | None = None) -> tuple[dict, dict]:
    """Push mode (issue #57): the prefill leg (held under ``transfer_id``) and the decode leg (expecting it
    from the prefill engine ``where`` names: its engine id and peer addresses), sent at once. ``layers``: the
    prefill leg asks for layer by layer (True) or one batch (False); None: the prefill connector's
    ``push_layer_min_tokens`` decides."""
    push_key, digest = new_push_key()  # the key goes to the decode leg only; the prefill hold keeps its digest
    prefill = prefill_request(body)
    prefill["kv_transfer_params"].update(kvxferd_transfer_id=transfer_id, kvxferd_push_digest=digest.hex())
    if layers is not None:
        prefill["kv_transfer_params"]["kvxferd_push_layers"] = layers
    decode = decode_request(body, {"do_remote_prefill": True, "kvxferd": 1, "kvxferd_push": True,
                                   "transfer_id": transfer_id, "push_key": push_key.hex(), **where})
    return prefill, decode


def trace_context(request) -> dict[str, str]:
    """The client's W3C trace context headers, passed on to both legs: vLLM (with ``--otlp-traces-endpoint``)
    and the daemons' spans then join the client's trace (docs/tracing.md)."""
    return {name: request.headers[name] for name in ("traceparent", "tracestate") if name in request.headers}


def prefill_location(params: dict | None) -> dict | None:
    """Where a prefill engine is, from its answer's ``kv_transfer_params`` (None: it named none)."""
    if not isinstance(params, dict) or not params.get("remote_engine_id") or not params.get("remote_peer_addresses"):
        return None
    return {"remote_engine_id": params["remote_engine_id"], "remote_peer_addresses": params["remote_peer_addresses"]}


def make_app(prefill_url: str, decode_url: str, *, timeout_s: float = 600.0, mode: str = "pull",
             push_layers: bool | None = None):
    """The aiohttp application forwarding ``ROUTES``. ``mode="push"``: both legs at once with one transfer
    id once the prefill engine's location is known (from its first answer, and every answer after);
    ``push_layers``: as :func:`push_legs`' ``layers``."""
    from aiohttp import ClientError, ClientSession, ClientTimeout, web

    session_key = web.AppKey("session", ClientSession)
    trace = Trace("proxy")
    where: dict = {}  # push mode: the prefill engine's id and peer addresses, as its last answer named them

    async def start(app):
        app[session_key] = ClientSession(timeout=ClientTimeout(total=timeout_s))

    async def stop(app):
        await app[session_key].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        arrived_s = time.time()
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the request body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the request body must be a JSON object"}, status=400)
        session = request.app[session_key]
        if mode == "push" and where:
            return await pushed(request, body, session, arrived_s)
        prefill_sent_s = time.time()
        context = trace_context(request)
        async with session.post(prefill_url + request.path, json=prefill_request(body), headers=context) as answer:
            prefilled = await answer.json(content_type=None)
            if answer.status != 200:
                return web.json_response(prefilled, status=answer.status)
        params = prefilled.get("kv_transfer_params") if isinstance(prefilled, dict) else None
        if not params:
            return web.json_response({"error": f"prefill {prefill_url} returned no kv_transfer_params "
                                               "(is it running with the KvxferdConnector?)"}, status=502)
        where.update(prefill_location(params) or {})
        prefill_id = str(params.get("remote_request_id", ""))
        ids = (prefill_id,) if prefill_id else ()  # (failed params name no request: nothing to stamp)
        trace.stamp("proxy_in", ids, arrived_s)
        trace.stamp("prefill_sent", ids, prefill_sent_s)
        trace.stamp("prefill_back", ids)
        headers = {PREFILL_ID_HEADER: prefill_id}
        async with session.post(decode_url + request.path, json=decode_request(body, params),
                                headers=context) as answer:
            return await relay(request, body, answer, headers, ids)

    async def relay(request, body: dict, answer, headers: dict, ids: tuple, started: list | None = None
                    ) -> web.StreamResponse:
        """The decode leg's answer, back to the client as it comes (``started`` gets True once the client's
        response went out)."""
        trace.stamp("decode_answered", ids)
        if not body.get("stream"):
            return web.json_response(await answer.json(content_type=None), status=answer.status, headers=headers)
        response = web.StreamResponse(status=answer.status, headers={"Content-Type": "text/event-stream", **headers})
        await response.prepare(request)
        if started is not None:
            started.append(True)
        first = True
        async for chunk in answer.content.iter_any():
            await response.write(chunk)
            if first and b'"choices"' in chunk:  # (vLLM's first chunk carries the first token)
                trace.stamp("first_chunk_out", ids)
                first = False
        await response.write_eof()
        return response

    async def pushed(request, body: dict, session, arrived_s: float) -> web.StreamResponse:
        """Push mode: both legs at once. A prefill leg that fails ends the decode leg (closing it aborts the
        request in vLLM) and its answer is the client's; else the decode leg's answer is."""
        transfer_id = f"push-{uuid.uuid4().hex}"
        ids = (transfer_id,)
        prefill_leg, decode_leg = push_legs(body, transfer_id, dict(where), push_layers)
        trace.stamp("proxy_in", ids, arrived_s)
        headers, context = {PREFILL_ID_HEADER: transfer_id}, trace_context(request)

        async def prefill() -> tuple[int, object]:
            trace.stamp("prefill_sent", ids)
            try:
                async with session.post(prefill_url + request.path, json=prefill_leg, headers=context) as answer:
                    prefilled = await answer.json(content_type=None)
            except (ClientError, ValueError) as err:  # unreachable, or not JSON: the leg failed
                return 502, {"error": f"push: the prefill leg to {prefill_url} failed: {err}"}
            trace.stamp("prefill_back", ids)
            params = prefilled.get("kv_transfer_params") if isinstance(prefilled, dict) else None
            where.update(prefill_location(params) or {})  # a restarted prefill engine is followed
            return answer.status, prefilled

        started: list = []

        async def decode() -> web.StreamResponse:
            async with session.post(decode_url + request.path, json=decode_leg, headers=context) as answer:
                return await relay(request, body, answer, headers, ids, started)

        prefill_task, decode_task = asyncio.ensure_future(prefill()), asyncio.ensure_future(decode())
        try:
            await asyncio.wait((prefill_task, decode_task), return_when=asyncio.FIRST_COMPLETED)
            if not decode_task.done():
                status, prefilled = prefill_task.result()
                if status != 200:  # the decode leg would wait for a write that never comes: end it now
                    decode_task.cancel()  # (its connection closes: vLLM aborts the request, its blocks go)
                    await asyncio.gather(decode_task, return_exceptions=True)
                    log.warning("push: the prefill leg failed", extra={"transfer_id": transfer_id, "status": status})
                    if not started:
                        return web.json_response(prefilled, status=status)
                    raise ConnectionResetError("push: the prefill leg failed mid-stream")
            return await decode_task
        finally:
            for task in (prefill_task, decode_task):
                if not task.done():
                    task.cancel()
            await asyncio.gather(prefill_task, decode_task, return_exceptions=True)

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    for route in ROUTES:
        app.router.add_post(route, forward)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvxferd.integrations.vllm.proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", required=True, help="base URL of the prefill vLLM server")
    parser.add_argument("--decode", required=True, help="base URL of the decode vLLM server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--mode", choices=("pull", "push"), default="pull",
                        help="push: both legs at once with one transfer id (the connectors run mode: push); the "
                             "first request goes as a pull, to learn where the prefill engine is")
    parser.add_argument("--push-layers", choices=("auto", "on", "off"), default="auto",
                        help="push mode: the prefill leg written layer by layer while its forward pass runs (on), "
                             "in one batch after it (off), or as the prefill connector's push_layer_min_tokens "
                             "says (auto)")
    args = parser.parse_args(argv)
    from aiohttp import web

    layers = {"auto": None, "on": True, "off": False}[args.push_layers]
    web.run_app(make_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), mode=args.mode, push_layers=layers),
                host=args.host, port=args.port)


if __name__ == "__main__":
    main()
