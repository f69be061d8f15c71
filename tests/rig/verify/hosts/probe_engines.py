"""A decode engine for the late-write tests: it fingerprints its memory when each completion arrives."""

import hashlib

from kvxferd.rig.engines import SoakDecode


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
