"""The soak's digest faults (issue #59): changes only a hold's digests can see, injected and judged.

::

    flip_held_byte / write_held_block   after the hold: the prefill engine damages the request's last
                                        token in its held blocks on every rank (a bit of one group's,
                                        or every group's and layer's: kvxferd.rig.verify.damage); put
                                        back after the read
    misplanned_read                     one decode daemon plans this read wrong, every time it plans it
                                        (misplan.py: its switch file names the request, until removed
                                        here); the daemon notes what it moved

    judged per read: a corruption it carried failed it corrupt (the misplanned rank itself, or some
    rank for a damaged holder); a read that failed otherwise first is unjudged (nothing was used); no
    read without a digest fault fails corrupt
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np

from kvxferd.rig.soak.faults import DIGEST_KINDS
from kvxferd.rig.soak.report import Report


class Corruptions:
    """Injects the digest faults and counts what the reads made of them (``report.digests``)."""

    def __init__(self, report: Report, rng: np.random.Generator) -> None:
        self.report, self.rng = report, rng

    def inject(self, kind: str, request, effect: dict, prefill, life) -> dict:
        """Strike ``request`` (held with digests) with ``kind``; ``life``: the decode daemon that misplans."""
        if kind == "misplanned_read":
            with open(f"{life.daemon.socket}.misplan", "w") as f:
                f.write(request.request_id)
            self.report.log(f"  {life.daemon.daemon_id} misplans {request.request_id}")
            effect.update(life=life, misplanned_rank=life.index)
        else:
            how = "flip" if kind == "flip_held_byte" else "write"
            effect["bytes"] = prefill.call("damage", request.remote_block_ids, request.num_tokens, how,
                                           int(self.rng.integers(2**31)))
            self.report.digests["bytes_damaged"] += effect["bytes"]
        return effect

    def undo(self, effect: dict, prefill) -> None:
        """The held bytes put back; a misplanning switch the read never reached turned off."""
        if effect["kind"] == "misplanned_read":
            misplanned(effect["life"])
        elif prefill is not None:
            prefill.call("undo")

    def judge(self, request, result: dict, effect: dict | None) -> None:
        """Every corruption a read carried failed it ``corrupt`` (where it was read); nothing else did."""
        kind = (effect or {}).get("kind")
        outcomes = [outcome["outcome"] for outcome in result["ranks"]]
        corrupt = [rank for rank, outcome in enumerate(outcomes) if outcome == "corrupt"]
        where = f"{request.request_id} (fault: {kind or 'none'})"
        if kind not in DIGEST_KINDS:
            if corrupt:
                self.report.violate("corruption_caught", f"{where}: decode ranks {corrupt} failed corrupt")
            return
        if kind == "misplanned_read":
            done = misplanned(effect["life"])
            if not done or done["request_id"] != request.request_id or not done["how"]:
                self.report.digests["not_injected"] += 1  # refused before planning, or nothing to move
                self.report.log(f"  not misplanned: {done}")
                return
            self.report.log(f"  misplanned: {done['how']}")
            rank = effect["misplanned_rank"]
            if [r for r in corrupt if r != rank]:  # the other ranks planned right: none may fail corrupt
                self.report.violate("corruption_caught", f"{where}: ranks {corrupt} failed corrupt, only rank "
                                                         f"{rank} was misplanned")
            judged = outcomes[rank]  # the misplanned rank's own outcome
        else:  # a damaged holder: some rank read the change (damage.py), so some rank must fail corrupt
            judged = "corrupt" if corrupt else "ok" if all(o == "ok" for o in outcomes) else "failed"
        self.report.digests["corruptions_injected"] += 1
        if judged == "corrupt":
            self.report.digests["corruptions_caught"] += 1
        elif judged != "ok":
            self.report.digests["corruptions_unjudged"] += 1  # failed for another reason first: nothing used
            self.report.log(f"  unjudged: {outcomes}")
        else:
            self.report.violate("corruption_caught", f"{where}: not caught, outcomes {outcomes}")


def misplanned(life) -> dict | None:
    """What ``life``'s daemon misplanned (misplan.py's note), its switch and note removed; None if nothing."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(f"{life.daemon.socket}.misplan")
    try:
        with open(f"{life.daemon.socket}.misplanned") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{life.daemon.socket}.misplanned")
