"""The P/D proxy over real HTTP on loopback, with stand-in prefill and decode servers."""

from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy runs where vLLM (and so aiohttp) is installed")
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402

from kvxferd.integrations.vllm.proxy import make_app  # noqa: E402

PARAMS = {"do_remote_prefill": True, "kvxferd": 1, "remote_engine_id": "p", "remote_block_ids": [[1]]}


def upstreams(seen: dict, *, prefill_params=PARAMS):
    async def prefill(request):
        seen["prefill"] = await request.json()
        return web.json_response({"choices": [{"token_ids": [9]}], "kv_transfer_params": prefill_params})

    async def decode(request):
        body = seen["decode"] = await request.json()
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for token in (7, 8):
                await response.write(f"data: {json.dumps({'choices': [{'token_ids': [token]}]})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response({"choices": [{"token_ids": [7, 8]}]})

    apps = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        apps.append(app)
    return apps


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


async def through_proxy(seen, body, **upstream_args):
    prefill_app, decode_app = upstreams(seen, **upstream_args)
    async with TestServer(prefill_app) as prefill, TestServer(decode_app) as decode:
        proxy_app = make_app(str(prefill.make_url("")).rstrip("/"), str(decode.make_url("")).rstrip("/"))
        async with TestServer(proxy_app) as proxy, aiohttp.ClientSession() as session:
            async with session.post(proxy.make_url("/v1/completions"), data=body) as answer:
                return answer.status, await answer.read()


def test_prefill_gets_one_token_and_decode_gets_the_params():
    seen = {}
    status, body = run(through_proxy(seen, json.dumps({"prompt": [1, 2, 3], "max_tokens": 8, "stream": False})))
    assert status == 200 and json.loads(body)["choices"][0]["token_ids"] == [7, 8]
    assert seen["prefill"]["max_tokens"] == 1 and seen["prefill"]["kv_transfer_params"] == {"do_remote_decode": True}
    assert seen["decode"]["max_tokens"] == 8 and seen["decode"]["kv_transfer_params"] == PARAMS


def test_streams_are_passed_through():
    seen = {}
    status, body = run(through_proxy(seen, json.dumps({"prompt": [1], "max_tokens": 2, "stream": True})))
    assert status == 200 and body.count(b"data: {") == 2 and body.endswith(b"data: [DONE]\n\n")
    assert seen["prefill"]["stream"] is False


def test_bad_bodies_and_a_prefill_without_params_are_clear_errors():
    status, body = run(through_proxy({}, "not json"))
    assert status == 400 and b"not JSON" in body
    status, body = run(through_proxy({}, json.dumps({"prompt": [1]}), prefill_params=None))
    assert status == 502 and b"no kv_transfer_params" in body
