"""The P/D proxy over real HTTP on loopback, with stand-in prefill and decode servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the proxy runs where vLLM (and so aiohttp) is installed")
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402

from kvxferd.integrations.vllm.proxy import make_app  # noqa: E402
from kvxferd.plan.capability import push_key_digest  # noqa: E402

PARAMS = {"do_remote_prefill": True, "kvxferd": 1, "remote_engine_id": "p", "remote_block_ids": [[1]]}


def upstreams(seen: dict, *, prefill_params=PARAMS):
    async def prefill(request):
        seen["prefill"] = await request.json()
        seen["prefill_traceparent"] = request.headers.get("traceparent")
        return web.json_response({"choices": [{"token_ids": [9]}], "kv_transfer_params": prefill_params})

    async def decode(request):
        body = seen["decode"] = await request.json()
        seen["decode_traceparent"] = request.headers.get("traceparent")
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


async def through_proxy(seen, body, headers=None, **upstream_args):
    prefill_app, decode_app = upstreams(seen, **upstream_args)
    async with TestServer(prefill_app) as prefill, TestServer(decode_app) as decode:
        proxy_app = make_app(str(prefill.make_url("")).rstrip("/"), str(decode.make_url("")).rstrip("/"))
        async with TestServer(proxy_app) as proxy, aiohttp.ClientSession() as session:
            async with session.post(proxy.make_url("/v1/completions"), data=body, headers=headers) as answer:
                return answer.status, await answer.read()


def test_prefill_gets_one_token_and_decode_gets_the_params():
    seen = {}
    status, body = run(through_proxy(seen, json.dumps({"prompt": [1, 2, 3], "max_tokens": 8, "stream": False})))
    assert status == 200 and json.loads(body)["choices"][0]["token_ids"] == [7, 8]
    assert seen["prefill"]["max_tokens"] == 1 and seen["prefill"]["kv_transfer_params"] == {"do_remote_decode": True}
    assert seen["decode"]["max_tokens"] == 8 and seen["decode"]["kv_transfer_params"] == PARAMS


def test_otel_the_clients_trace_context_reaches_both_legs():
    """Issue #60: vLLM and the daemons join the client's trace only if both legs carry its traceparent."""
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    for headers, expected in (({"traceparent": traceparent}, traceparent), ({}, None)):  # none sent: none made up
        seen = {}
        status, _ = run(through_proxy(seen, json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}), headers))
        assert status == 200
        assert seen["prefill_traceparent"] == seen["decode_traceparent"] == expected


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


@contextlib.asynccontextmanager
async def push_proxy(prefill, decode):
    """A proxy in push mode in front of two stand-in servers (``prefill``, ``decode``: aiohttp handlers);
    yields it and a client session."""
    apps = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        apps.append(app)
    async with TestServer(apps[0]) as p, TestServer(apps[1]) as d:
        proxy_app = make_app(str(p.make_url("")).rstrip("/"), str(d.make_url("")).rstrip("/"), mode="push")
        async with TestServer(proxy_app) as proxy, aiohttp.ClientSession() as session:
            yield proxy, session


PULL_ANSWER = {**PARAMS, "remote_request_id": "r0", "remote_peer_addresses": ["127.0.0.1:4700"]}


def test_push_mode_sends_both_legs_at_once_under_one_transfer_id():
    """Issue #57: the first request goes as a pull (the proxy learns where the prefill engine is); the next
    ones go to both servers at once: the stand-in prefill answers only once the decode leg arrived (a proxy
    that waited for prefill first would hang), and both legs name the same transfer id."""
    seen: dict = {"decode_bodies": []}

    async def scenario():
        decode_in = asyncio.Event()

        async def prefill(request):
            body = await request.json()
            seen.setdefault("prefill_bodies", []).append(body)
            if "kvxferd_transfer_id" in body["kv_transfer_params"]:
                await asyncio.wait_for(decode_in.wait(), 5)
            return web.json_response({"choices": [{"token_ids": [9]}], "kv_transfer_params": PULL_ANSWER})

        async def decode(request):
            seen["decode_bodies"].append(await request.json())
            decode_in.set()
            return web.json_response({"choices": [{"token_ids": [7, 8]}]})

        async with push_proxy(prefill, decode) as (proxy, session):
            answers = []
            for _ in range(2):
                async with session.post(proxy.make_url("/v1/completions"),
                                        json={"prompt": [1, 2], "max_tokens": 4}) as answer:
                    answers.append((answer.status, await answer.json(), answer.headers))
            return answers

    answers = run(scenario())
    assert [status for status, *_ in answers] == [200, 200]
    first, pushed = seen["decode_bodies"]
    assert first["kv_transfer_params"] == PULL_ANSWER  # the pull that located the prefill engine
    push = pushed["kv_transfer_params"]
    prefill_leg = seen["prefill_bodies"][1]["kv_transfer_params"]
    transfer_id = prefill_leg["kvxferd_transfer_id"]
    assert push == {"do_remote_prefill": True, "kvxferd": 1, "kvxferd_push": True, "transfer_id": transfer_id,
                    "push_key": push["push_key"], "remote_engine_id": "p", "remote_peer_addresses": ["127.0.0.1:4700"]}
    # The decode leg alone carries the push key; the prefill leg its digest (what the prefill hold keeps).
    assert prefill_leg["kvxferd_push_digest"] == push_key_digest(bytes.fromhex(push["push_key"])).hex()
    assert push["push_key"] not in json.dumps(seen["prefill_bodies"])
    assert answers[1][2]["X-Kvxferd-Prefill-Request-Id"] == transfer_id


def test_push_mode_ends_the_decode_leg_when_the_prefill_leg_fails():
    """A push whose prefill leg fails (here a 500 after the decode leg is in): the decode leg would wait for
    a write that never comes, so the proxy closes it at once (vLLM then aborts the request and lets its
    blocks go) and answers with the prefill's error. The control: a prefill that succeeds gets the decode
    leg's answer."""
    seen: dict = {"decode_closed": 0}

    async def scenario():
        decode_in, decode_closed, fail = asyncio.Event(), asyncio.Event(), {"now": False}

        async def prefill(request):
            body = await request.json()
            if "kvxferd_transfer_id" not in body["kv_transfer_params"]:
                return web.json_response({"choices": [{"token_ids": [9]}], "kv_transfer_params": PULL_ANSWER})
            await asyncio.wait_for(decode_in.wait(), 5)
            if fail["now"]:
                return web.json_response({"error": "prefill broke"}, status=500)
            return web.json_response({"choices": [{"token_ids": [9]}], "kv_transfer_params": PULL_ANSWER})

        async def decode(request):
            body = await request.json()
            if "kvxferd_push" in body["kv_transfer_params"]:
                decode_in.set()
                if fail["now"]:
                    try:
                        await asyncio.sleep(30)  # waits for KV that never comes
                    except asyncio.CancelledError:
                        seen["decode_closed"] += 1
                        decode_closed.set()
                        raise
            return web.json_response({"choices": [{"token_ids": [7, 8]}]})

        async with push_proxy(prefill, decode) as (proxy, session):
            answers = []
            for failing in (False, False, True):  # a pull (locates prefill), a push, a failing push
                fail["now"] = failing
                decode_in.clear()
                start = time.monotonic()
                async with session.post(proxy.make_url("/v1/completions"),
                                        json={"prompt": [1, 2], "max_tokens": 4}) as answer:
                    answers.append((answer.status, await answer.json(), time.monotonic() - start))
            await asyncio.wait_for(decode_closed.wait(), 5)  # the decode server saw its connection closed
            return answers

    answers = run(scenario())
    assert [status for status, *_ in answers] == [200, 200, 500]
    assert answers[1][1]["choices"][0]["token_ids"] == [7, 8]  # the control: the decode leg's answer
    assert answers[2][1] == {"error": "prefill broke"} and answers[2][2] < 5
    assert seen["decode_closed"] == 1
