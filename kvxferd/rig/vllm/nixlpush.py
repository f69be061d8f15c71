"""A proxy for vLLM's own push connector (``NixlPushConnector``), the benchmark's comparison (issue #57).

Both legs at once, as vLLM's push demo describes them: one ``X-Request-Id`` for both (vLLM pairs the
legs by it), the prefill leg one token with ``do_remote_decode``, the decode leg naming the prefill
engine's static coordinates (engine id, NIXL side channel, TP and PP size). Run it where vLLM is
installed (aiohttp)::

    python -m kvxferd.rig.vllm.nixlpush --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --engine-id nixl-push-prefill --side-port 8150 --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

from kvxferd.integrations.vllm.proxy import ROUTES, decode_request, prefill_request


def legs(body: dict, request_id: str, engine_id: str, side_port: int) -> tuple[dict, dict]:
    """The prefill and the decode leg of one request for vLLM's NixlPushConnector."""
    prefill = prefill_request(body)
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    decode = decode_request(body, {"do_remote_prefill": True, "do_remote_decode": False,
                                   "remote_engine_id": engine_id, "remote_host": "127.0.0.1",
                                   "remote_port": side_port, "tp_size": 1, "pp_size": 1,
                                   "remote_request_id": request_id})
    return prefill, decode


def make_app(prefill_url: str, decode_url: str, engine_id: str, side_port: int, *, timeout_s: float = 600.0):
    from aiohttp import ClientSession, ClientTimeout, web

    session_key = web.AppKey("session", ClientSession)

    async def start(app):
        app[session_key] = ClientSession(timeout=ClientTimeout(total=timeout_s))

    async def stop(app):
        await app[session_key].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session, request_id = request.app[session_key], uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        prefill_leg, decode_leg = legs(body, request_id, engine_id, side_port)

        async def prefill():
            async with session.post(prefill_url + request.path, json=prefill_leg, headers=headers) as answer:
                return answer.status, await answer.read()

        task = asyncio.ensure_future(prefill())
        try:
            async with session.post(decode_url + request.path, json=decode_leg, headers=headers) as answer:
                if not body.get("stream"):
                    return web.Response(body=await answer.read(), status=answer.status,
                                        content_type="application/json")
                response = web.StreamResponse(status=answer.status, headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            await task

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    for route in ROUTES:
        app.router.add_post(route, forward)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvxferd.rig.vllm.nixlpush", description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--engine-id", required=True, help="the prefill server's engine_id")
    parser.add_argument("--side-port", type=int, required=True, help="the prefill server's NIXL side-channel port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    from aiohttp import web

    web.run_app(make_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.engine_id, args.side_port),
                host=args.host, port=args.port)


if __name__ == "__main__":
    main()
