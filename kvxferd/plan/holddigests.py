"""A hold's digests, and a read checked against them before decode uses a byte (issue #59).

::

    holder rank q, at the hold        digest every held block of every group, summed over the group's
                                      regions (layers), per field: [block, atom, chunk]   (layout/digests.py)
    it travels with the hold          HoldDigests.encode(): bytes beside the capability
    reader, once the data is in       digest the local blocks it wrote, in the holder's atoms;
                                      pair each read unit's atoms with the holder's (the plan's units)
                                      and compare the chunks read from q: a mismatch fails those blocks

The sums are over logical elements, so layouts, block sizes and TP slices
of the two sides need not match (a reader's unit is whole atoms of the
holder's). Pure: the caller hands in the memory as numpy arrays.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvxferd.errors import InvalidArgumentError, LayoutMismatchError, UnavailableError
from kvxferd.layout.digests import atom_tokens, atoms_per_block, field_chunks, field_digests, field_key
from kvxferd.layout.region import Region
from kvxferd.plan.groups import EngineCache, GroupPairing

MAGIC = b"KD\x02"  # 2: atoms of 8 tokens (1 had 16): a daemon of the other format refuses these, never calls them corrupt
MAX_ENCODED_BYTES = 16 << 20  # a hold's digests from the wire: bounded before anything is allocated
MAX_GROUPS, MAX_FIELDS = 64, 64  # per hold, per group: far above any cache (a few groups, a few fields)


@dataclass(frozen=True, eq=False)
class FieldDigests:
    """One field of one group, summed over the group's regions."""

    name: str
    chunk_ids: np.ndarray  # int64: the global chunks this rank's slice holds
    digests: np.ndarray  # uint64 [num_blocks, atoms_per_block, num_chunks]


@dataclass(frozen=True, eq=False)
class GroupDigests:
    block_ids: np.ndarray  # int64: the held blocks, in the rows of every field's digests
    tokens_per_atom: int
    fields: tuple[FieldDigests, ...]


@dataclass(frozen=True, eq=False)
class HoldDigests:
    """Every group's digests of one holder rank's part of a hold."""

    groups: tuple[GroupDigests, ...]

    def encode(self) -> bytes:
        """Bytes to travel with the hold (little-endian; :meth:`decode` reads them back)."""
        parts = [MAGIC, struct.pack("<H", len(self.groups))]
        for group in self.groups:
            parts += [struct.pack("<IHH", len(group.block_ids), group.tokens_per_atom, len(group.fields)),
                      group.block_ids.astype("<i8").tobytes()]
            for f in group.fields:
                name = f.name.encode()
                _, num_atoms, num_chunks = f.digests.shape
                parts += [struct.pack("<B", len(name)), name, struct.pack("<HH", num_atoms, num_chunks),
                          f.chunk_ids.astype("<u4").tobytes(), f.digests.astype("<u8").tobytes()]
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes, field: str = "digests") -> "HoldDigests":
        """Read :meth:`encode`'s bytes from an untrusted source: sizes checked before arrays are made
        (errors name ``field``)."""
        if len(data) > MAX_ENCODED_BYTES:
            raise InvalidArgumentError(field, f"{len(data)} bytes, at most {MAX_ENCODED_BYTES}")
        reader = _Reader(data, field)
        if reader.take(len(MAGIC)) != MAGIC:
            raise InvalidArgumentError(field, "not a hold's digests (magic)")
        (num_groups,) = reader.unpack("<H")
        if num_groups > MAX_GROUPS:
            raise InvalidArgumentError(field, f"{num_groups} groups, at most {MAX_GROUPS}")
        groups = []
        for _ in range(num_groups):
            num_blocks, tokens_per_atom, num_fields = reader.unpack("<IHH")
            if num_fields > MAX_FIELDS:
                raise InvalidArgumentError(field, f"{num_fields} fields in a group, at most {MAX_FIELDS}")
            block_ids = reader.array("<i8", num_blocks).astype(np.int64)
            fields = []
            for _ in range(num_fields):
                (name_len,) = reader.unpack("<B")
                name = reader.take(name_len).decode(errors="replace")
                num_atoms, num_chunks = reader.unpack("<HH")
                chunk_ids = reader.array("<u4", num_chunks).astype(np.int64)
                digests = reader.array("<u8", num_blocks * num_atoms * num_chunks).astype(np.uint64)
                fields.append(FieldDigests(name, chunk_ids, digests.reshape(num_blocks, num_atoms, num_chunks)))
            groups.append(GroupDigests(block_ids, tokens_per_atom, tuple(fields)))
        if reader.left:
            raise InvalidArgumentError(field, f"{reader.left} bytes after the last group")
        return cls(tuple(groups))


class _Reader:
    def __init__(self, data: bytes, field: str) -> None:
        self.data, self.at, self.field = memoryview(data), 0, field

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, n: int) -> bytes:
        if n > self.left:
            raise InvalidArgumentError(self.field, f"truncated: {n} bytes wanted at byte {self.at}, {self.left} left")
        out = bytes(self.data[self.at:self.at + n])
        self.at += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def array(self, dtype: str, count: int) -> np.ndarray:
        return np.frombuffer(self.take(count * np.dtype(dtype).itemsize), dtype=dtype)


def digest_group(region: Region, memories, group: int, block_ids, block_size: int | None) -> GroupDigests:
    """The digests of ``block_ids`` of one group whose regions (layers) are ``memories`` (uint8 arrays)."""
    tokens_per_atom = atom_tokens(block_size)
    block_ids = np.asarray(block_ids, dtype=np.int64)
    fields = tuple(FieldDigests(f.name, field_chunks(f)[0], _over_regions(memories, f, group, block_ids, tokens_per_atom))
                   for f in region.fields)
    return GroupDigests(block_ids, tokens_per_atom, fields)


def digest_hold(cache: EngineCache, memories, block_ids) -> HoldDigests:
    """One rank's digests of a hold of ``block_ids`` (per group) in its cache, whose regions are
    ``memories[g][r]`` (uint8 arrays)."""
    return HoldDigests(tuple(digest_group(cache.region(g), memories[g], g, block_ids[g], group.block_size)
                             for g, group in enumerate(cache.groups)))


def _over_regions(memories, field, group: int, block_ids: np.ndarray, tokens_per_atom: int) -> np.ndarray:
    """A field's digests of ``block_ids`` summed over its group's regions (one numpy pass per layer, all the
    blocks at once)."""
    return sum(field_digests(memory, field, block_ids, field_key(group, r, field.name), tokens_per_atom)
               for r, memory in enumerate(memories))


@dataclass(frozen=True, eq=False)
class ReadCheck:
    """What one remote rank's part of a read looked like against its hold's digests."""

    bad_block_ids: tuple[np.ndarray, ...]  # per group: local blocks holding an atom that differs
    num_atoms_checked: int
    num_units_unverifiable: int  # units read whose atoms do not line up with the holder's: not checked
    malformed: str = ""  # the digests do not describe the holder's cache: every block read from it is bad


class LocalDigests:
    """The reader's digests of the blocks one read wrote, made once per group and field and shared by the
    checks of every holder rank (a TP engine's ranks each cover a slice)."""

    def __init__(self, cache: EngineCache, memories) -> None:
        self.cache, self.memories = cache, memories
        self.regions = tuple(cache.region(g) for g in range(len(cache.groups)))  # (made anew by each call)
        self._made: dict[tuple[int, str, int], tuple[np.ndarray, np.ndarray]] = {}

    def of(self, g: int, field, local_blocks: np.ndarray, tokens_per_atom: int) -> np.ndarray:
        made_key = (g, field.name, tokens_per_atom)
        made = self._made.get(made_key)
        if made is None or not np.array_equal(made[0], local_blocks):
            made = self._made[made_key] = (local_blocks, _over_regions(self.memories[g], field, g, local_blocks,
                                                                       tokens_per_atom))
        return made[1]


def check_read(local: LocalDigests, remote: EngineCache, units, pairings: tuple[GroupPairing, ...], groups_read,
               digests: HoldDigests) -> ReadCheck:
    """Compare what a read from holder rank ``remote`` wrote into the local cache with that rank's ``digests``.

    ``units[g]``: the read's (local, remote) unit ids (:attr:`PlannedRead.units`); ``groups_read``: the
    groups this holder rank supplied. The digests come from the wire: what they must hold is derived from
    ``remote``'s own description (its atoms, chunks and fields); digests that do not hold it name every
    block read from that rank bad (``malformed``), never pass."""
    bad, checked, unverifiable, malformed = [], 0, 0, ""
    for g, (local_units, remote_units) in enumerate(units):
        if g not in groups_read or not len(local_units):
            bad.append(np.zeros(0, np.int64))
            continue
        pairing = pairings[g]
        tokens_per_atom = atom_tokens(pairing.remote_block_size)
        pairs = _pair_atoms(pairing, local_units, remote_units, tokens_per_atom)
        if pairs is None:
            unverifiable += len(local_units)
            bad.append(np.zeros(0, np.int64))
            continue
        local_blocks, local_rows, local_atoms, remote_blocks, remote_atoms = pairs
        problem = _malformed(digests, g, remote.region(g), local.regions[g], tokens_per_atom)
        if problem:
            malformed = malformed or problem
            bad.append(local_blocks)
            continue
        held = digests.groups[g]
        order = np.argsort(held.block_ids, kind="stable")
        found = np.searchsorted(held.block_ids[order], remote_blocks).clip(0, max(len(order) - 1, 0))
        held_row = order[found] if len(order) else np.zeros(len(remote_blocks), np.int64)
        wrong = held.block_ids[held_row] != remote_blocks if len(order) else np.ones(len(remote_blocks), bool)
        theirs_by_name = {f.name: f for f in held.fields}
        for f in local.regions[g].fields:
            theirs = theirs_by_name[f.name]
            common, mine_at, theirs_at = np.intersect1d(field_chunks(f)[0], theirs.chunk_ids, return_indices=True)
            if not len(common):
                continue
            mine = local.of(g, f, local_blocks, tokens_per_atom)
            a = mine[local_rows, local_atoms][:, mine_at]
            b = theirs.digests[held_row, remote_atoms][:, theirs_at] if len(order) else a
            wrong |= (a != b).any(axis=1)
        checked += len(local_rows)
        bad.append(np.unique(local_blocks[local_rows[wrong]]))
    return ReadCheck(tuple(bad), checked, unverifiable, malformed)


def check_verifiable(pairings: tuple[GroupPairing, ...]) -> None:
    """Raise UnavailableError when a read on these pairings could not be checked against digests: a group
    whose read units are not whole atoms of the holder's (units under ATOM_TOKENS tokens that do not divide
    them). Checked before a read with digests is posted: never served as checked when it was not."""
    for g, pairing in enumerate(pairings):
        if not _whole_atoms(pairing):
            raise UnavailableError("remote_digests", f"group {g} reads units of {pairing.unit_tokens} tokens, not "
                                   f"whole digest atoms of {atom_tokens(pairing.remote_block_size)}: "
                                   "its reads cannot be checked (send them without digests)")


def _whole_atoms(pairing: GroupPairing) -> bool:
    """Whether each read unit of ``pairing`` is whole atoms of the holder's (state pages: a block is one)."""
    return pairing.unit_tokens is None or pairing.unit_tokens % atom_tokens(pairing.remote_block_size) == 0


def _malformed(digests: HoldDigests, g: int, remote_region: Region, local_region: Region, tokens_per_atom: int) -> str:
    """What group ``g`` of a holder's digests lacks against the holder's own region (its description at
    the handshake): "" when it has every field the reader needs, each with the holder's chunks and atoms."""
    if g >= len(digests.groups):
        return f"no digests of group {g}"
    held = digests.groups[g]
    if held.tokens_per_atom != tokens_per_atom:
        return f"group {g}: atoms of {held.tokens_per_atom} tokens, the holder's blocks make {tokens_per_atom}"
    theirs = {f.name: f for f in held.fields}
    remote_fields = {f.name: f for f in remote_region.fields}
    for f in local_region.fields:
        field, expected = theirs.get(f.name), remote_fields.get(f.name)
        if field is None or expected is None:
            return f"group {g}: no digests of field {f.name!r}"
        chunk_ids = field_chunks(expected)[0]
        shape = (len(held.block_ids), atoms_per_block(expected.layout, tokens_per_atom), len(chunk_ids))
        if not np.array_equal(field.chunk_ids, chunk_ids) or field.digests.shape != shape:
            return f"group {g} field {f.name!r}: digests of {field.digests.shape} over chunks " \
                   f"{field.chunk_ids.tolist()}, the holder's slice makes {shape} over {chunk_ids.tolist()}"
    return ""


def _pair_atoms(pairing: GroupPairing, local_units, remote_units, tokens_per_atom: int):
    """Each read unit's atoms on both sides: (local blocks touched, per atom: row into them, atom in the
    block, remote block, atom in it); None when a unit is not whole atoms of the holder's."""
    local_units, remote_units = np.asarray(local_units, np.int64), np.asarray(remote_units, np.int64)
    if pairing.unit_tokens is None:  # state pages: a block is one atom
        atoms_per_unit, k_local, k_remote = 1, 1, 1
    else:
        if not _whole_atoms(pairing):
            return None
        atoms_per_unit = pairing.unit_tokens // tokens_per_atom
        k_local, k_remote = pairing.local_units_per_block, pairing.remote_units_per_block
    step = np.arange(atoms_per_unit, dtype=np.int64)[None, :]
    local_block_of = local_units // k_local
    local_blocks, rows = np.unique(local_block_of, return_inverse=True)
    local_atoms = ((local_units % k_local)[:, None] * atoms_per_unit + step).ravel()
    remote_atoms = ((remote_units % k_remote)[:, None] * atoms_per_unit + step).ravel()
    rows = np.repeat(rows, atoms_per_unit)
    remote_blocks = np.repeat(remote_units // k_remote, atoms_per_unit)
    return local_blocks, rows, local_atoms, remote_blocks, remote_atoms
