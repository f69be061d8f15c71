"""The demo driver: arguments, checks, daemons, engines, requests."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile

import numpy as np
from tqdm import tqdm

from kvxferd.client import DaemonProcess
from kvxferd.rig.demo import shm
from kvxferd.rig.demo import summary as figures
from kvxferd.rig.engines import DecodeEngine, PrefillEngine
from kvxferd.rig.hosts import DemoHosts
from kvxferd.errors import KvxferError, UnavailableError
from kvxferd.plan.groups import GroupPairing
from kvxferd.plan.holddigests import check_verifiable
from kvxferd.tp.shards import check_tp
from kvxferd.rig.verify.buffers import check_pairing
from kvxferd.rig.verify.hosts.policy import MAX_HOSTS, HostsUnavailable
from kvxferd.rig.verify.models import DECODE_LAYOUTS, MODELS, ModelShape, model_groups, random_request
from kvxferd.rig.verify.process import EngineFailed, EngineProcess


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (every preset dimension can be overridden)")
    model.add_argument("--model", choices=MODELS + ("all",), default="all",
                       help="gqa: packed K/V; fp8: split K/V heads in fp8; mla: latent cache; swa: sliding window "
                            "+ full attention; hybrid: Mamba + attention; all (default): each in turn")
    model.add_argument("--num-layers", type=int, default=4, help="layers per cache group (default 4)")
    model.add_argument("--num-kv-heads", type=int, default=8, help="KV heads in total (default 8)")
    model.add_argument("--head-size", type=int, default=128, help="channels per head (default 128)")
    model.add_argument("--block-size", type=int, default=16, help="tokens per block on both sides (default 16)")
    model.add_argument("--prefill-block-size", type=int, help="prefill tokens per block (default: --block-size)")
    model.add_argument("--decode-block-size", type=int, help="decode tokens per block (default: --block-size)")
    model.add_argument("--kernel-block-size", type=int, help="decode tokens per kernel block (splits each block)")
    model.add_argument("--num-blocks", type=int, default=64, help="decode blocks per cache (default 64)")
    model.add_argument("--layout", choices=sorted(DECODE_LAYOUTS), default="packed",
                       help="decode attention layout: packed HND (default), nhd, or legacy (2, B, N, H, C); "
                            "prefill is packed HND")
    run = parser.add_argument_group("run")
    run.add_argument("--prefill-tp", type=int, default=4, help="prefill TP size: one daemon per rank (default 4)")
    run.add_argument("--decode-tp", type=int, default=2, help="decode TP size: one daemon per rank (default 2)")
    run.add_argument("--requests", type=int, default=4, help="requests per model (default 4)")
    run.add_argument("--num-tokens", type=int, default=512, help="prompt tokens per request (default 512)")
    run.add_argument("--cached-tokens", type=int, default=32, help="decode prefix-cache hit on every other request")
    run.add_argument("--window-tokens", type=int, default=64, help="sliding window of the swa preset (tokens)")
    run.add_argument("--timeout-s", type=float, default=30.0, help="deadline of each read (default 30)")
    run.add_argument("--seed", type=int, default=0, help="seed of the request generator")
    run.add_argument("--verify-share", type=float, default=0.0,
                     help="share of the timed reads the decode daemons check against their holds' digests "
                          "(issue #59; default 0: timed like raw NIXL; each preset's warm-up read is checked)")
    run.add_argument("--no-same-host", action="store_true", help="daemons read each other over NIXL only (by "
                     "default a decode daemon copies from a prefill engine's shared memory itself: issue 37)")
    run.add_argument("--hosts", type=int, default=0, metavar="N",
                     help="run across N network namespaces as hosts (root only): prefill on h0, decode on h1..; "
                          "peer ports on mutual TLS, UCX over TCP, the chart's NetworkPolicy as packet filters "
                          "(default: every daemon on loopback)")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object")


MAX_DEMO_DAEMONS = 16  # every rank's daemon runs on this one host


class BadArguments(ValueError):
    """Arguments the demo cannot run with (exit 2, one line)."""


def check_arguments(args: argparse.Namespace) -> tuple[ModelShape, list[str]]:
    """Everything the daemons would refuse, refused here first, naming the flag or field."""
    for flag in ("requests", "num_tokens", "prefill_tp", "decode_tp"):
        if getattr(args, flag) < 1:
            raise BadArguments(f"--{flag.replace('_', '-')} must be at least 1")
    if args.hosts and not 2 <= args.hosts <= MAX_HOSTS:
        raise BadArguments(f"--hosts must be 2..{MAX_HOSTS} (one prefill host and at least one decode host)")
    num_daemons = _num_daemons(args)
    if num_daemons > MAX_DEMO_DAEMONS:
        raise BadArguments(f"--prefill-tp + --decode-tp (x decode hosts) must be at most {MAX_DEMO_DAEMONS} (one "
                           f"daemon per rank, all on this machine), got {num_daemons}")
    if args.cached_tokens < 0 or args.timeout_s <= 0 or not 0 <= args.verify_share <= 1:
        raise BadArguments("--cached-tokens must be >= 0, --timeout-s > 0 and --verify-share in [0, 1]")
    shape = ModelShape(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                       block_size=args.block_size, kernel_block_size=args.kernel_block_size,
                       prefill_block_size=args.prefill_block_size, decode_block_size=args.decode_block_size,
                       num_blocks=args.num_blocks, layout=args.layout)
    models = list(MODELS) if args.model == "all" else [args.model]
    try:
        check_tp(args.prefill_tp, 0, field="prefill_tp")
        check_tp(args.decode_tp, 0, field="decode_tp")
        for model in models:
            prefill_groups, decode_groups = model_groups(model, shape)
            check_pairing(prefill_groups, decode_groups, args.prefill_tp, args.decode_tp)
            random_request("check", prefill_groups, decode_groups, args.num_tokens, np.random.default_rng(0))
    except KvxferError as err:
        raise BadArguments(str(err)) from None
    except ValueError as err:  # more blocks per request than the cache has
        raise BadArguments(f"{err} (try a larger --num-blocks or fewer --num-tokens)") from None
    return shape, models


def _num_daemons(args: argparse.Namespace) -> int:
    return args.prefill_tp + args.decode_tp * max(1, args.hosts - 1)


def run_model(model: str, shape: ModelShape, daemons: dict[str, list[DaemonProcess]], args: argparse.Namespace,
              rng: np.random.Generator, progress: tqdm, engine_options: tuple[dict, dict] = ({}, {})) -> dict:
    """Every request of one preset through the daemons, checked; then the same transfers over raw NIXL.
    ``engine_options``: more options of the prefill and the decode engine process (their host, with --hosts)."""
    prefill_groups, decode_groups = model_groups(model, shape)
    prefill_id, decode_id = f"{model}-prefill", f"{model}-decode"
    row = figures.new_row(model, args.prefill_tp, args.decode_tp, "+".join(g.kind for g in decode_groups))
    peer_addresses = [d.peer_address for d in daemons["prefill"]]
    lease_s = max(30.0, 2 * args.timeout_s)
    prefill = decode = None
    try:
        prefill = EngineProcess("prefill", prefill_id, prefill_groups, [d.engine_target for d in daemons["prefill"]],
                                factory=PrefillEngine, lease_s=lease_s, wait=False, **engine_options[0])
        decode = EngineProcess("decode", decode_id, decode_groups, [d.engine_target for d in daemons["decode"]],
                               factory=DecodeEngine, lease_s=lease_s, wait=False, **engine_options[1])
        prefill.wait_started()
        decode.wait_started()
        decode.call("handshake", prefill_id, peer_addresses)
        requests, released = [], []
        copies_before = _decode_count(daemons, "kvxferd_same_host_copies_total")
        checkable = _checkable(prefill_groups, decode_groups)  # (else the daemons refuse reads with digests)

        def read(name: str, cached_tokens: int, contiguous: bool, verify: bool = False) -> dict:
            request = random_request(f"{model}-{name}", prefill_groups, decode_groups, args.num_tokens, rng,
                                     cached_tokens=cached_tokens, window_tokens=args.window_tokens,
                                     contiguous=contiguous)
            capabilities, digests = prefill.call("hold", request, verify)
            request = dataclasses.replace(request, remote_capabilities=capabilities)
            result = decode.call("read", request, prefill_id, prefill_groups, args.timeout_s,
                                 digests if verify else (), timeout_s=args.timeout_s + 30)
            if not result["ok"]:  # what an engine does: give the blocks back at once
                prefill.call("release", request)
                released.append(request.remote_request_id)
            requests.append(request)
            return result

        # Untimed, as raw NIXL's warm-up rounds are: a new registration's first read pays for opening its
        # connections (and its holders poll fast until a reader's first notice). Checked like the others.
        # The warm-up read (and --verify-share of the timed ones) checked by the decode daemons against the
        # holds' digests too (issue #59); the timed ones, by default, as raw NIXL's are: unchecked.
        checked_before = _decode_count(daemons, "kvxferd_digest_checked_bytes_total")
        warm_up = read("warm-up", 0, True, verify=checkable)
        row["warm_up_ms"] = round(warm_up["latency_s"] * 1e3, 2)
        row["problems"] += [f"warm-up read: {p}" for p in warm_up["errors"] + warm_up["mismatches"]]
        row["verified_bytes"] += warm_up["verified_bytes"]
        row["mismatched_bytes"] += warm_up["mismatched_bytes"]
        for i in range(args.requests):
            cached = args.cached_tokens if i % 2 else 0  # every other request: a decode prefix-cache hit
            verify = checkable and int((i + 1) * args.verify_share) > int(i * args.verify_share)  # evenly spread
            figures.add_read(row, read(str(i), cached, i % 3 != 2, verify=verify))
            progress.update(1)
        events = prefill.call("events", [r.remote_request_id for r in requests], released, 10.0,
                              timeout_s=60 + 20 * len(requests))
        figures.add_events(row, events, len(requests) * args.prefill_tp)
        row["same_host_copies"] = _decode_count(daemons, "kvxferd_same_host_copies_total") - copies_before
        row["digest_checked_bytes"] = _decode_count(daemons, "kvxferd_digest_checked_bytes_total") - checked_before
        row["read_paths"] = sorted({path for d in daemons["decode"] for path in d.transport_paths()})
        raw = decode.call("raw", requests[1:], prefill_id, peer_addresses)  # the timed ones
        row["raw_s"], row["raw_bytes"] = raw["seconds"], raw["bytes"]
        row["raw_warm_up_ms"] = [round(s * 1e3, 2) for s in raw["warm_up_s"]]  # untimed: connections opening
    finally:
        for engine in (decode, prefill):
            if engine is not None:
                engine.close()
    return figures.finish_row(row)


def _decode_count(daemons: dict[str, list[DaemonProcess]], metric: str) -> int:
    """A counter summed over the decode daemons so far: parts of reads copied same-host
    (``kvxferd_same_host_copies_total``), bytes checked against digests (``kvxferd_digest_checked_bytes_total``)."""
    return int(sum(d.metric(metric) for d in daemons["decode"]))


def _checkable(prefill_groups, decode_groups) -> bool:
    """Whether reads of this pairing can be checked against digests (each read unit whole digest atoms:
    else the daemons refuse reads with digests, and the demo reads these unchecked)."""
    try:
        check_verifiable(tuple(GroupPairing(d.policy, d.block_size, p.block_size, 0, 0)
                               for p, d in zip(prefill_groups, decode_groups)))
        return True
    except UnavailableError:
        return False


def _fail(message: str, code: int) -> int:
    print(f"kvxferd demo: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every byte matched, every request succeeded and every hold ended CONSUMED; 1 otherwise; 2 on bad
    arguments or too little room in /dev/shm."""
    try:
        shape, models = check_arguments(args)
    except BadArguments as err:
        return _fail(str(err), 2)
    too_small = shm.shortfall(*shm.needed_bytes(models, shape, args.prefill_tp, args.decode_tp, _num_daemons(args)))
    if too_small:  # before anything starts: else the first engine dies allocating, and says only that
        return _fail(too_small, 2)
    rng = np.random.default_rng(args.seed)
    rows, started, hosts = [], [], None
    daemon_args = ("--log-level", "WARNING", *(("--no-same-host-reads",) if args.no_same_host else ()))
    with tempfile.TemporaryDirectory(prefix="kvxferd-demo-") as workdir:
        try:
            if args.hosts:
                hosts = DemoHosts(args.hosts, args.prefill_tp, args.decode_tp, workdir, daemon_args)
                started = hosts.daemons
            else:
                ids = [f"prefill{q}" for q in range(args.prefill_tp)] + [f"decode{r}" for r in range(args.decode_tp)]
                started = DaemonProcess.start_many(ids, socket_dir=workdir, extra_args=daemon_args)
            if not args.json:
                where = (f" on {args.hosts} namespace hosts (mutual TLS, UCX over TCP, the chart's NetworkPolicy)"
                         if hosts else "")
                print(f"{len(started)} kvxferd daemons{where}: prefill TP={args.prefill_tp}, decode TP="
                      f"{args.decode_tp} (logs in {workdir} while it runs)", file=sys.stderr)
            with tqdm(total=len(models) * args.requests, unit="req", file=sys.stderr, disable=None,
                      dynamic_ncols=True) as progress:
                for index, model in enumerate(models):
                    progress.set_description(f"{model} {args.prefill_tp}->{args.decode_tp}")
                    if hosts:
                        daemons, *options = hosts.turn(index)
                    else:
                        daemons = {"prefill": started[: args.prefill_tp], "decode": started[args.prefill_tp:]}
                        options = ({}, {})
                    rows.append(run_model(model, shape, daemons, args, rng, progress, tuple(options)))
            described = hosts.describe() if hosts else None
        except HostsUnavailable as err:
            return _fail(str(err), 2)
        except (EngineFailed, RuntimeError) as err:
            return _fail(str(err).splitlines()[0] if args.json else str(err), 1)
        finally:
            if hosts:
                hosts.close()
            for daemon in started:
                daemon.terminate()
    summary = figures.summarize(rows)
    if described:
        summary["hosts"] = described
    print(json.dumps(summary) if args.json else figures.format_table(summary))
    return 0 if summary["ok"] else 1
