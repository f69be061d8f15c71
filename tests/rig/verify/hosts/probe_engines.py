"""Engines for the namespace-host tests: a decode that fingerprints its memory as each completion arrives (late
writes), a prefill that watches how its holds end (shutdown order)."""

import hashlib

from kvxferd.client.notify import NotifySubscriber
from kvxferd.proto.v1 import kvxfer_pb2 as pb
from kvxferd.rig.engines import SoakDecode, SoakPrefill


class FingerprintDecode(SoakDecode):
    """:class:`SoakDecode` that keeps a digest of each rank's memory as it was when its completion came."""

    at_completion: list[str] = []

    def _check(self, rank, completion, *args):
        self.at_completion = [*self.at_completion[:rank], _digest(self.ranks[rank].arena)]
        return super()._check(rank, completion, *args)

    def fingerprints(self) -> tuple[list[str], list[str]]:
        """(digests when the completions came, digests now)."""
        return list(self.at_completion), [_digest(rank.arena) for rank in self.ranks]


def _digest(arena) -> str:
    return hashlib.sha256(arena.tobytes()).hexdigest()


class WatchedPrefill(SoakPrefill):
    """:class:`SoakPrefill` subscribed to its daemons' buses: how its holds end."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.subscribers = [NotifySubscriber(client) for client in self.clients]

    def hold_end(self, request_id: str, timeout_s: float) -> list[str | None]:
        """Per rank, the event that ended the hold of ``request_id`` (CONSUMED or EXPIRED), None if none came."""
        events = [subscriber.wait_for(request_id, timeout_s=timeout_s) for subscriber in self.subscribers]
        return [None if e is None else pb.NotifyEvent.Kind.Name(e.kind) for e in events]

    def close(self) -> None:
        for subscriber in self.subscribers:
            subscriber.close()
        super().close()
