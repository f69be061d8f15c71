"""The soak driver: pairings drawn at random, a stream of requests, faults, and the invariants.

One run::

    daemons (4 prefill + 4 decode ranks, real kvxferd serve processes)
    repeat until --duration:
        draw a pairing ─► start a prefill and a decode engine process (kill -9 targets)
        requests: hold on every prefill rank ─► read on every decode rank ─► check every byte
                  with a fault now and then (faults.py), recovery after it
        close the engines (deregister)
    then: every hold ended exactly once? every daemon not killed still alive? leaks?
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from multiprocessing import shared_memory

import numpy as np

from kvxferd.plan.capability import CAPABILITY_BYTES, PUSH_KEY_BYTES, push_key_digest
from kvxferd.rig.soak import badinput
from kvxferd.rig.soak.configs import SoakConfig, draw_config
from kvxferd.rig.daemons import DaemonLife, DaemonSet, leaks, measure
from kvxferd.rig.engines import SoakDecode, SoakPrefill
from kvxferd.rig.soak.faults import DIGEST_KINDS, NET_KINDS, FaultPlan
from kvxferd.rig.hosts import SoakHosts
from kvxferd.rig.soak.netfaults import WINDOW_S, NetworkFaults
from kvxferd.rig.soak.corruption import Corruptions
from kvxferd.rig.soak.forged import NoticeForger
from kvxferd.rig.soak.holds import HoldLedger
from kvxferd.rig.soak.report import Report
from kvxferd.rig.soak.workers import CaRotations, WorkerKills
from kvxferd.rig.verify.process import EngineFailed, EngineProcess
from kvxferd.service.base.config import DaemonConfig

HOLD_LEASE_S = 3.0  # hold lease of a normal request
ENGINE_LEASE_S = 2.0  # registration lease: a killed engine is noticed within it
REAP_MARGIN_S = 3.0  # past a lease: the daemon's sweep reaps a lapsed registration within it
DEADLINE_S = 2.0  # read deadline
GRACE_S = 2.0  # a completion must come within deadline + GRACE_S (+ the time its own daemon was frozen)
# A failed push waits for its silent writers up to this (the daemons' default, as the soak runs them)
PUSH_SETTLE_S = DaemonConfig.model_fields["push_settle_s"].default
FORGED_COUNTED_S = 2.0  # how long a holder may take to count forged notices as dropped
AFTER_THE_HOLD = ("early_release", "forged_notices", *DIGEST_KINDS)  # faults that act after the hold, before the read
DAEMON_MODULE = "kvxferd.rig.soak.misplan"  # kvxferd serve, with the misplanned_read fault's switch (misplan.py)
RETRANSMIT_S = 8.0  # TCP retransmits with a doubling timeout: after a few seconds dark, the next try may wait as long
STOP_SHORT_S = (0.1, 1.0)
STOP_LONG_S = (HOLD_LEASE_S + 0.5, HOLD_LEASE_S + 1.5)


class Soak:
    """Everything one soak run owns."""

    def __init__(self, args, workdir: str, report: Report) -> None:
        self.args, self.report = args, report
        self.rng = np.random.default_rng(args.seed)
        self.faults = FaultPlan(self.rng, args.fault_rate, args.faults.split(","))
        # (push into a rank a data-plane worker serves is not built: refused, so none is sent there)
        self.push_share = 0.0 if getattr(args, "dataplane_workers", False) else getattr(args, "push_share", 0.0)
        # (a reader worker checks no digests: none are asked for where one reads)
        reader_workers = getattr(args, "dataplane_workers", False) and getattr(args, "dataplane_reader_workers", False)
        self.verify_share = 0.0 if reader_workers else getattr(args, "verify_share", 0.0)
        # INFO: each registration and deregistration with its reason, for a failure's post-mortem (--logs)
        daemon_args = ("--log-level", "INFO", "--peer-check-s", "0.3")
        self.workers = WorkerKills(report) if getattr(args, "dataplane_workers", False) else None
        if self.workers is not None:  # replaced (rotate_ca) at most every 3 s; readers probe every 0.3 s
            daemon_args += ("--dataplane-workers", "--worker-retire-grace-s", "2", "--worker-replace-interval-s", "3")
            if getattr(args, "dataplane_reader_workers", False):
                daemon_args += ("--dataplane-reader-workers",)
        self.hosts = self.net = None
        if getattr(args, "hosts", 0):
            # A read aborted mid-transfer over TCP waits for it up to abort_drain_s: within the soak's wait.
            daemon_args += ("--abort-drain-s", str(WINDOW_S[1] + RETRANSMIT_S))
            self.hosts = SoakHosts(args.hosts, args.max_tp, workdir, daemon_args, module=DAEMON_MODULE)
            self.daemons = self.hosts.daemons
        else:
            self.daemons = DaemonSet.loopback(args.max_tp, args.max_tp, workdir, daemon_args, module=DAEMON_MODULE)
        self.rotations = None
        try:
            if self.hosts:
                self.net = NetworkFaults(self.hosts.links, report, self.rng)
                if self.workers is not None:
                    self.rotations = CaRotations(report, str(self.hosts.pki.ca.cert_path), workdir)
            self.ledger = HoldLedger([life.daemon.addresses["notify"] for life in self.daemons.prefill],
                                     report.violate, netns=self.hosts.prefill_host.netns if self.hosts else None)
        except BaseException:
            (self.hosts or self.daemons).close()
            raise
        self.prefill = self.decode = None
        self.config: SoakConfig | None = None
        self.epoch = 0
        self._timers: list[threading.Timer] = []
        self._arenas: dict[str, list[str]] = {}
        self._hung: list[tuple[int, int, float]] = []  # (prefill rank, daemon life, SIGSTOP time)
        self.forger: NoticeForger | None = None  # made on the first forged_notices fault
        self.corruptions = Corruptions(report, self.rng)  # the digest faults (issue #59)

    # ---- engines ---------------------------------------------------------------------------------
    def _start_engine(self, role: str) -> EngineProcess:
        config = self.config
        prefill_groups, decode_groups = config.groups()
        lives = self._lives(role)
        factory, groups = (SoakPrefill, prefill_groups) if role == "prefill" else (SoakDecode, decode_groups)
        engine = EngineProcess(role, self._engine_id(role), groups, [life.daemon.engine_target for life in lives],
                               factory=factory, lease_s=ENGINE_LEASE_S, start_timeout_s=90,
                               **(self.hosts.role_options(role) if self.hosts else {}))
        self._arenas[role] = engine.call("arena_names")
        return engine

    def _engine_id(self, role: str) -> str:
        return f"e{self.epoch}-{role}"

    def _peer_addresses(self) -> list[str]:
        return [life.daemon.peer_address for life in self._lives("prefill")]

    def _handshake(self, ranks=None) -> None:
        outcome = self.decode.call("handshake", self._engine_id("prefill"), self._peer_addresses(), ranks,
                                   timeout_s=120)
        if any(result != "ok" for result in outcome):
            self.report.violate("recovery", f"decode could not handshake again: {outcome}")

    def start_epoch(self) -> None:
        """A new pairing: new engine processes with new engine ids on the same daemons."""
        self.epoch += 1
        if self.hosts:
            self.report.log(f"pairing {self.epoch} reads on {self.hosts.use_pairing(self.epoch).name}")
        self.config, refused = draw_config(self.rng, self.args.max_tp)
        self.report.new_config(self.config, refused)
        self.ledger.follow(self._engine_id("prefill"))
        self.prefill = self._start_engine("prefill")
        self.decode = self._start_engine("decode")
        self._handshake()
        time.sleep(0.3)  # the bus subscription reaches the daemons

    def end_epoch(self) -> None:
        if self.net is not None:
            self.net.settle()
        for engine in (self.decode, self.prefill):
            if engine is not None:
                engine.close()
        self.prefill = self.decode = None

    def _kill_engine(self, role: str) -> None:
        engine = self.prefill if role == "prefill" else self.decode
        engine.process.kill()
        engine.process.join()
        for name in self._arenas.get(role, ()):  # what the dead engine can no longer remove
            with contextlib.suppress(FileNotFoundError):
                shared_memory.SharedMemory(name=name).unlink()

    def _restart_engine(self, role: str) -> None:
        start = time.monotonic()
        engine = self._start_engine(role)
        if role == "prefill":
            self.prefill = engine
        else:
            self.decode = engine
        self._handshake()
        self.report.figure(f"{role}_engine_back_s", time.monotonic() - start)

    # ---- faults ----------------------------------------------------------------------------------
    def _lives(self, role: str) -> list[DaemonLife]:
        """The daemons of the ranks the current pairing uses on one side."""
        if role == "prefill":
            return self.daemons.prefill[: self.config.prefill_tp]
        return self.daemons.decode[: self.config.decode_tp]

    def _pick(self, role: str) -> DaemonLife | None:
        """A daemon of the pairing on ``role``'s side that is not frozen now (None if all are)."""
        lives = [life for life in self._lives(role) if life.stopped_since is None]
        return lives[int(self.rng.integers(len(lives)))] if lives else None

    def _freeze(self, life: DaemonLife, seconds: float) -> None:
        self.daemons.stop(life)
        timer = threading.Timer(seconds, self.daemons.cont, (life,))
        timer.start()
        self._timers.append(timer)

    def act(self, kind: str, request, mid: bool = False) -> dict:
        """Inject ``kind``; returns what recovery needs to know afterwards."""
        effect: dict = {"kind": kind}
        self.report.log(f"{kind} ({'mid-read' if mid else 'before the hold'}) on {request.request_id}")
        if kind in NET_KINDS:  # a window: requests go on through it (netfaults.py)
            self.net.start(kind, self.hosts.prefill_host, self.hosts.decode_host)
        elif kind in ("kill_prefill_daemon", "kill_decode_daemon"):
            life = self._pick("prefill" if kind == "kill_prefill_daemon" else "decode")
            if life is None:
                return self._skip(effect)
            self.report.log(f"  kill -9 {life.daemon.daemon_id}")
            if life.role == "prefill":
                self.ledger.daemon_killed(life.index)
            self.daemons.kill(life)
            effect["life"] = life
        elif kind in ("kill_prefill_engine", "kill_decode_engine"):
            effect["role"] = "prefill" if kind == "kill_prefill_engine" else "decode"
            self._kill_engine(effect["role"])
        elif kind in ("stop_short", "stop_long", "slow_read"):
            life = self._pick("prefill" if kind == "slow_read" or self.rng.random() < 0.5 else "decode")
            if life is None:  # one freeze per daemon at a time: a second would end the first early
                return self._skip(effect)
            low, high = {"stop_short": STOP_SHORT_S, "stop_long": STOP_LONG_S,
                         "slow_read": (HOLD_LEASE_S / 3, HOLD_LEASE_S * 0.8)}[kind]
            seconds = float(self.rng.uniform(low, high))
            self._freeze(life, seconds)
            if life.role == "prefill" and kind == "stop_long":  # a hung holder: how long until its holds end?
                self._hung.append((life.index, self.ledger.lives[life.index], time.monotonic()))
            self.report.log(f"  SIGSTOP {life.daemon.daemon_id} for {seconds:.2f} s")
            effect["life"] = life
        elif kind == "kill_worker":
            life = self._pick("prefill" if self.rng.random() < 0.5 else "decode")
            worker = life and self.workers.kill(life, lambda n: int(self.rng.integers(n)))
            if not worker:  # every daemon frozen, or its last worker's successor still starting
                return self._skip(effect, "no worker up to kill")
            effect.update(life=life, worker=worker)
        elif kind == "rotate_ca":
            effect["expected"] = self.rotations.rotate(self.daemons.all)
        elif kind == "early_release":
            self.prefill.call("release", request.remote_request_id)
        elif kind == "forged_notices":
            return self._forge(request, effect)
        elif kind in DIGEST_KINDS:
            if not request.remote_digests:  # a rank could not hold: the read is refused, nothing to corrupt
                return self._skip(effect, "no digests: a hold failed")
            life = self._pick("decode") if kind == "misplanned_read" else None
            if kind == "misplanned_read" and life is None:
                return self._skip(effect)
            return self.corruptions.inject(kind, request, effect, self.prefill, life)
        elif kind == "bad_input":
            awake = [life for life in self.daemons.all if life.stopped_since is None]  # a frozen one cannot answer
            if not awake:
                return self._skip(effect)
            life = awake[int(self.rng.integers(len(awake)))]
            self.report.log(f"  bad input on {life.daemon.daemon_id}")
            sent, wrong = badinput.burst(life.daemon, self._engine_id(life.role), self.rng)
            self.report.count("bad_messages", sent)
            for problem in wrong:
                self.report.violate("bad_input_refused", problem)
        return effect

    def _forge(self, request, effect: dict) -> dict:
        """Forged notices to one awake prefill rank: each must be counted as dropped, and the hold must live on."""
        life = self._pick("prefill")
        if life is None:
            return self._skip(effect)
        daemon, prefill_id = life.daemon, self._engine_id("prefill")

        def dropped_so_far() -> dict[str, float]:
            return {reason: daemon.metric("kvxferd_notices_dropped_total", f'reason="{reason}"')
                    for reason in ("foreign", "malformed")}

        before = dropped_so_far()
        if self.forger is None:
            self.forger = NoticeForger()
        sent = dict(zip(before, self.forger.forge(daemon.peer_address, prefill_id, life.index,
                                                  request.remote_request_id, self._engine_id("decode"),
                                                  self.config.decode_tp, self.rng)))
        self.report.log(f"  {sent} forged notices to {daemon.daemon_id}")
        self.report.count("forged_notices", sum(sent.values()))
        deadline = time.monotonic() + FORGED_COUNTED_S
        while True:  # the holder counts them on its next poll (every poll_interval_s)
            dropped = {reason: count - before[reason] for reason, count in dropped_so_far().items()}
            if all(dropped[r] >= sent[r] for r in sent) or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if any(dropped[r] < sent[r] for r in sent):
            self.report.violate("forged_notices_dropped", f"{daemon.daemon_id}: {dropped} dropped of {sent} forged")
        self.ledger.drain()
        hold = self.ledger.holds.get((life.index, self.ledger.lives[life.index], prefill_id, request.remote_request_id))
        if hold is not None and hold.ends:
            self.report.violate("forged_notices_dropped", f"{daemon.daemon_id}: {request.remote_request_id!r} ended "
                                                          f"{hold.ends} after forged notices, before it was read")
        effect["forged_on"] = life
        return effect

    def _skip(self, effect: dict, why: str = "every daemon it could strike is frozen") -> dict:
        self.report.log(f"  skipped: {why}")
        self.report.count("faults_skipped")
        return {"kind": "skipped"}

    def recover(self, effect: dict) -> None:
        """Bring back what the fault took: daemons at the same addresses, engines, registrations."""
        kind = effect["kind"]
        if kind in ("kill_prefill_daemon", "kill_decode_daemon"):
            life = effect["life"]
            self.report.figure("daemon_restart_s", self.daemons.restart(life))
            if life.role == "prefill":
                self.ledger.daemon_restarted(life.index)
                self.prefill.call("register", life.index, timeout_s=60)
                time.sleep(0.3)  # the bus subscription reaches the new daemon before its first event
            else:
                self.decode.call("register", life.index, timeout_s=60)
                self._handshake([life.index])
        elif kind in ("kill_prefill_engine", "kill_decode_engine"):
            self._restart_engine(effect["role"])
        elif kind == "kill_worker":
            self.workers.wait_back(effect["life"], effect["worker"])
        elif kind == "rotate_ca":
            self.rotations.wait_replaced(effect["expected"])
        elif kind in DIGEST_KINDS:
            self.corruptions.undo(effect, self.prefill)

    # ---- one request ---------------------------------------------------------------------------
    def one_request(self, n: int) -> None:
        """Hold, read, check; a fault before or during it; recovery after it."""
        # One network fault at a time, and nothing else until reads came back (the cycle waits: no kind
        # loses its turn).
        kind, mid = (None, False) if self.net is not None and self.net.busy else self.faults.next()
        request = self.config.request(f"e{self.epoch}-r{n}", self.rng)
        lease_s = float(self.rng.uniform(0.05, 0.5)) if kind == "lease_expiry" else HOLD_LEASE_S
        deadline_s = HOLD_LEASE_S * 1.5 if kind == "slow_read" else DEADLINE_S
        effect = None
        if kind:
            self.report.faults[kind] += 1
        if kind and not mid and kind not in AFTER_THE_HOLD:
            effect = self.act(kind, request)
        prefill_id = self._engine_id("prefill")
        # Push (issue #57): a share of requests are pushes: the decode ranks expect (before the hold or after
        # it, as the two legs race), the prefill hold carries the key's digest, the prefill daemons write.
        push_key = self.rng.bytes(PUSH_KEY_BYTES) if self.rng.random() < self.push_share and kind not in DIGEST_KINDS \
            else b""
        # Digests (issue #59): every read a digest fault strikes, and a share of the others (not pushes: a
        # push's writes are not checked yet)
        verify = not push_key and (kind in DIGEST_KINDS or self.rng.random() < self.verify_share)
        wait_s = deadline_s + GRACE_S + STOP_LONG_S[1] + 1.0 + (WINDOW_S[1] + RETRANSMIT_S if self.net else 0.0) + (
            PUSH_SETTLE_S if push_key else 0.0)
        sent_s = None
        if push_key:
            self.report.pushes += 1
            # (a fault that strikes between hold and read keeps that order: its checks assume the read comes after)
            if self.rng.random() < 0.5 and kind not in AFTER_THE_HOLD and self.decode.process.is_alive():
                self.decode.send("read", request, prefill_id, self.config.groups()[0], deadline_s, wait_s, push_key)
                sent_s = time.monotonic()
        if self.prefill.process.is_alive():
            # half the pushes held layer by layer: no layer final, then each said final in turn
            by_layer = bool(push_key) and self.rng.random() < 0.5
            self.report.layered_pushes += by_layer
            answers = self.prefill.call("hold", request.remote_request_id, request.remote_block_ids, lease_s,
                                        push_key_digest(push_key) if push_key else b"", by_layer, verify)
            for rank, (answer, _, _) in enumerate(answers):
                self.ledger.placed(rank, prefill_id, request.remote_request_id, answer)
            # A rank that could not hold gives no capability: the read is then refused before it moves a
            # byte (an engine would not send it at all). Digests go with the read only from every rank.
            capabilities = tuple(capability or bytes(CAPABILITY_BYTES) for _, capability, _ in answers)
            digests = tuple(d for _, _, d in answers)
            request = dataclasses.replace(request, remote_capabilities=capabilities,
                                          remote_digests=digests if verify and all(digests) else ())
        if kind in AFTER_THE_HOLD and not mid:
            effect = self.act(kind, request)
        if kind == "lease_expiry":
            time.sleep(float(self.rng.uniform(0.0, 0.5)))
        result = None
        if sent_s is not None or self.decode.process.is_alive():
            if sent_s is None:
                self.decode.send("read", request, prefill_id, self.config.groups()[0], deadline_s, wait_s, push_key,
                                 request.remote_digests)
                self.report.digests["reads_with_digests"] += bool(request.remote_digests)
                sent_s = time.monotonic()
            if kind and mid:
                time.sleep(float(self.rng.uniform(0.0, 0.02)))
                effect = self.act(kind, request, mid=True)
            try:
                result = self.decode.answer("read", wait_s + 30)
            except EngineFailed:
                if kind != "kill_decode_engine":
                    raise
        self.report.requests += 1
        if result is not None:
            self._check_read(request, result, deadline_s, effect, sent_s, push=bool(push_key))
            if push_key:
                self.report.push_outcomes.update(rank["outcome"] for rank in result["ranks"])
            if effect is not None and "forged_on" in effect:
                self._check_forged_read(request, result, sent_s)
            if not push_key:
                self.corruptions.judge(request, result, effect)
        if effect is not None:
            self.recover(effect)
        failed = result is None or any(rank["outcome"] != "ok" for rank in result["ranks"])
        if self.net is not None and result is not None:
            self.net.read_done(not failed)
        if failed and self.rng.random() < 0.5:  # an engine frees the blocks of a failed read; or the lease does
            self.prefill.call("release", request.remote_request_id)
        self.ledger.drain()
        for problem in self.daemons.crashed():
            self.report.violate("daemon_alive", problem)
            raise RuntimeError(f"a daemon died that nothing killed: {problem}")

    def _check_read(self, request, result: dict, deadline_s: float, effect: dict | None, sent_s: float, *,
                    push: bool = False) -> None:
        life = (effect or {}).get("life")
        lives = self.daemons.decode
        for rank, outcome in enumerate(result["ranks"]):
            self.report.outcomes[outcome["outcome"]] += 1
            self.report.verified_bytes += outcome["verified_bytes"]
            for problem in outcome["problems"]:
                self.report.violate("bytes_right", problem)
            mine = life is not None and life.role == "decode" and life.index == rank
            frozen_s = lives[rank].frozen_during(sent_s, sent_s + outcome["latency_s"])
            bound_s = deadline_s + GRACE_S + frozen_s + self._drain_allowance_s(sent_s, outcome["latency_s"])
            if push and outcome["outcome"] != "ok":  # its blocks wait for a silent writer's word, as documented
                bound_s += PUSH_SETTLE_S
            fault = effect["kind"] if effect else "none"
            where = f"{request.request_id} decode rank {rank} (fault: {fault})"
            late_s = outcome["latency_s"] - deadline_s - frozen_s
            if late_s > 0 and outcome["outcome"] not in ("missing", "lost"):  # a completion past its
                self.report.figure(f"past_deadline_s.{fault}", late_s)  # deadline, by fault: the grace it needs
            if outcome["outcome"] == "missing":
                self.report.violate("completion_in_time", f"{where}: no completion after {outcome['latency_s']:.1f} s")
            elif outcome["outcome"] == "lost" and not (mine and effect["kind"] == "kill_decode_daemon"):
                self.report.violate("completion_in_time", f"{where}: the completion stream broke "
                                                          f"({outcome.get('error', '')})")
            elif outcome["latency_s"] > bound_s:
                self.report.violate("completion_in_time", f"{where}: completion after {outcome['latency_s']:.2f} s "
                                                          f"(bound {bound_s:.2f} s)")
            elif outcome["outcome"] != "ok" and life is not None and life.role == "prefill" \
                    and effect["kind"] == "stop_long":
                self.report.figure("hung_prefill_failed_read_s", outcome["latency_s"])

    def _drain_allowance_s(self, sent_s: float, latency_s: float) -> float:
        """Over TCP (--hosts) a read aborted mid-transfer ends only once its transfer did (UCX cannot stop
        it): while the link was broken or its holder frozen, and TCP's next retransmission after that."""
        if self.net is None:
            return 0.0
        end_s = sent_s + latency_s
        stalled_s = self.net.overlap_s(sent_s, end_s) + max(
            (life.frozen_during(sent_s, end_s) for life in self.daemons.prefill), default=0.0)
        return stalled_s + RETRANSMIT_S if stalled_s else 0.0

    def _check_forged_read(self, request, result: dict, sent_s: float) -> None:
        """The real readers still read a hold that forged notices named: ok, unless a daemon was frozen meanwhile
        or a decode rank refused it while re-handshaking with a holder the last fault restarted (a push's
        expectation is refused then: its engine sends it again; the forged notices are not why)."""
        now = time.monotonic()
        if any(life.stopped_since is not None or life.frozen_during(sent_s, now) for life in self.daemons.all):
            return
        failed = [f"rank {r}: {o.get('error') or o['outcome']}" for r, o in enumerate(result["ranks"])
                  if o["outcome"] != "ok" and not (o["outcome"] == "refused" and "handshaken again" in o.get("error", ""))]
        if failed:
            self.report.violate("forged_notices_dropped", f"{request.request_id}: the read after forged notices "
                                                          f"failed: {failed}")

    # ---- the run -------------------------------------------------------------------------------
    def run(self) -> None:
        end_s = time.monotonic() + self.args.duration
        n = 0
        while time.monotonic() < end_s or self.epoch == 0:
            self.start_epoch()
            num_requests = 0
            # A pairing ends after its requests, or later while a network fault's reads have not come back.
            while num_requests < self.args.epoch_requests or (self.net is not None and self.net.busy):
                self.one_request(n)
                n += 1
                num_requests += 1
                self.report.line(len(self.ledger.open_holds()))
                if time.monotonic() >= end_s:
                    break
            self._settle()
            if self.workers is not None:
                self.workers.check(self.daemons.all)
            self.end_epoch()
            if self.epoch == 1:
                self._measure("start")
        self._finish()

    def _settle(self) -> None:
        for timer in self._timers:  # every frozen daemon runs again
            timer.join()
        self._timers.clear()

    def _measure(self, when: str) -> None:
        """What each daemon holds, once its engines' registrations are gone.

        An engine that closed deregisters, but a deregistration may fail (its
        daemon restarted under it, a frozen peer): that registration is then
        the daemon's to reap when its lease lapses. So the end waits until no
        daemon has an engine left, up to a lease and a sweep past the last
        deregistration; what is left after that is a leak.
        """
        time.sleep(1.0)  # deregistrations finish
        give_up_s = time.monotonic() + ENGINE_LEASE_S + REAP_MARGIN_S
        while when == "end" and time.monotonic() < give_up_s and any(
                leaks(None, measure(life)) for life in self.daemons.all):
            time.sleep(0.2)
        for life in self.daemons.all:
            self.report.usage.setdefault(life.daemon.daemon_id, {})[when] = measure(life)

    def _finish(self) -> None:
        self._measure("end")
        for key in self.ledger.wait_ended(HOLD_LEASE_S + ENGINE_LEASE_S + 10):
            self.report.violate("hold_ends_once", f"rank {key[0]} life {key[1]}: {key[3]!r} never ended")
        self.report.holds = self.ledger.counts()
        for rank, life, stopped_at in self._hung:
            ended = self.ledger.ended_after(rank, life, stopped_at)
            if ended:
                self.report.figure("hung_prefill_holds_ended_s", max(ended))
        self.report.count("failed_events", self.ledger.num_failed_events)
        for daemon_id, entry in self.report.usage.items():
            for problem in leaks(entry.get("start"), entry["end"]):
                self.report.violate("no_leaks", f"{daemon_id}: {problem}")

    def close(self) -> None:
        self._settle()
        with contextlib.suppress(Exception):
            self.end_epoch()
        self.ledger.close()
        if self.forger is not None:
            self.forger.close()
        if self.hosts is not None:
            self.hosts.close()  # faults cleared, daemons stopped, namespaces removed
        else:
            self.daemons.close()
