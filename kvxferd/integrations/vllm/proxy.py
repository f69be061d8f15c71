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
``/v1/chat/completions`` works the same way. Run it where vLLM is installed
(it uses aiohttp, one of vLLM's dependencies)::

    python -m kvxferd.integrations.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

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


def make_app(prefill_url: str, decode_url: str, *, timeout_s: float = 600.0):
    """The aiohttp application forwarding ``ROUTES``."""
    from aiohttp import ClientSession, ClientTimeout, web

    session_key = web.AppKey("session", ClientSession)
    trace = Trace("proxy")

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
        prefill_sent_s = time.time()
        async with session.post(prefill_url + request.path, json=prefill_request(body)) as answer:
            prefilled = await answer.json(content_type=None)
            if answer.status != 200:
                return web.json_response(prefilled, status=answer.status)
        params = prefilled.get("kv_transfer_params") if isinstance(prefilled, dict) else None
        if not params:
            return web.json_response({"error": f"prefill {prefill_url} returned no kv_transfer_params "
                                               "(is it running with the KvxferdConnector?)"}, status=502)
        prefill_id = str(params.get("remote_request_id", ""))
        ids = (prefill_id,) if prefill_id else ()  # (failed params name no request: nothing to stamp)
        trace.stamp("proxy_in", ids, arrived_s)
        trace.stamp("prefill_sent", ids, prefill_sent_s)
        trace.stamp("prefill_back", ids)
        headers = {PREFILL_ID_HEADER: prefill_id}
        async with session.post(decode_url + request.path, json=decode_request(body, params)) as answer:
            trace.stamp("decode_answered", ids)
            if not body.get("stream"):
                return web.json_response(await answer.json(content_type=None), status=answer.status, headers=headers)
            response = web.StreamResponse(status=answer.status,
                                          headers={"Content-Type": "text/event-stream", **headers})
            await response.prepare(request)
            first = True
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
                if first and b'"choices"' in chunk:  # (vLLM's first chunk carries the first token)
                    trace.stamp("first_chunk_out", ids)
                    first = False
            await response.write_eof()
            return response

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
    args = parser.parse_args(argv)
    from aiohttp import web

    web.run_app(make_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
