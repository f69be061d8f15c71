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

from kvxferd.errors import InvalidArgumentError, LayoutMismatchError
from kvxferd.layout.digests import atom_tokens, field_chunks, field_digests, field_key
from kvxferd.layout.region import Region
from kvxferd.plan.groups import GroupPairing

MAGIC = b"KD\x01"
MAX_ENCODED_BYTES = 64 << 20  # a hold's digests from the wire: bounded before anything is allocated


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
    def decode(cls, data: bytes) -> "HoldDigests":
        """Read :meth:`encode`'s bytes from an untrusted source: sizes checked before arrays are made."""
        if len(data) > MAX_ENCODED_BYTES:
            raise InvalidArgumentError("digests", f"{len(data)} bytes, at most {MAX_ENCODED_BYTES}")
        reader = _Reader(data)
        if reader.take(len(MAGIC)) != MAGIC:
            raise InvalidArgumentError("digests", "not a hold's digests (magic)")
        (num_groups,) = reader.unpack("<H")
        groups = []
        for _ in range(num_groups):
            num_blocks, tokens_per_atom, num_fields = reader.unpack("<IHH")
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
            raise InvalidArgumentError("digests", f"{reader.left} bytes after the last group")
        return cls(tuple(groups))


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = memoryview(data), 0

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, n: int) -> bytes:
        if n > self.left:
            raise InvalidArgumentError("digests", f"truncated: {n} bytes wanted at byte {self.at}, {self.left} left")
        out = bytes(self.data[self.at:self.at + n])
        self.at += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def array(self, dtype: str, count: int) -> np.ndarray:
        return np.frombuffer(self.take(count * np.dtype(dtype).itemsize), dtype=dtype)


def digest_group(region: Region, memories, group: int, block_ids, block_size: int | None) -> GroupDigests:
    """The digests of ``block_ids`` of one group whose regions (layers) are ``memories`` (uint8 arrays)."""
    tokens_per_atom = 1 if block_size is None else atom_tokens(block_size)
    block_ids = np.asarray(block_ids, dtype=np.int64)
    fields = []
    for f in region.fields:
        total = None
        for r, memory in enumerate(memories):  # one numpy pass per layer: its blocks all at once
            part = field_digests(memory, f, block_ids, field_key(group, r, f.name), tokens_per_atom)
            total = part if total is None else total + part
        fields.append(FieldDigests(f.name, field_chunks(f)[0], total))
    return GroupDigests(block_ids, tokens_per_atom, tuple(fields))


@dataclass(frozen=True, eq=False)
class ReadCheck:
    """What one remote rank's part of a read looked like against its hold's digests."""

    bad_block_ids: tuple[np.ndarray, ...]  # per group: local blocks holding an atom that differs
    num_atoms_checked: int
    num_unverifiable: int  # atoms read that no digest covers (a pairing of atoms that do not line up)


def check_read(local_region_of, local_memories, units, pairings: tuple[GroupPairing, ...], groups_read,
               digests: HoldDigests) -> ReadCheck:
    """Compare what a read from one holder rank wrote into the local cache with that rank's ``digests``.

    ``local_region_of(g)``: the local rank's region layout of group ``g``; ``local_memories[g][r]``: its
    regions' bytes; ``units[g]``: the read's (local, remote) unit ids (:attr:`PlannedRead.units`);
    ``groups_read``: the groups this holder rank supplied."""
    bad, checked, unverifiable = [], 0, 0
    for g, (local_units, remote_units) in enumerate(units):
        if g not in groups_read or not len(local_units) or g >= len(digests.groups):
            bad.append(np.zeros(0, np.int64))
            continue
        held = digests.groups[g]
        pairs = _pair_atoms(pairings[g], local_units, remote_units, held.tokens_per_atom)
        if pairs is None:
            unverifiable += len(local_units)
            bad.append(np.zeros(0, np.int64))
            continue
        local_blocks, local_rows, local_atoms, remote_blocks, remote_atoms = pairs
        order = np.argsort(held.block_ids, kind="stable")
        found = np.searchsorted(held.block_ids[order], remote_blocks).clip(0, max(len(order) - 1, 0))
        held_row = order[found] if len(order) else found
        unheld = (held.block_ids[held_row] != remote_blocks) if len(order) else np.ones(len(remote_blocks), bool)
        wrong = unheld.copy()
        region = local_region_of(g)
        names = {f.name: f for f in held.fields}
        for f in region.fields:
            theirs = names.get(f.name)
            if theirs is None:
                raise LayoutMismatchError(f"digests.groups[{g}]", f"the holder sent no digests of field {f.name!r}")
            mine = sum(field_digests(memory, f, local_blocks, field_key(g, r, f.name), held.tokens_per_atom)
                       for r, memory in enumerate(local_memories[g]))
            common, mine_at, theirs_at = np.intersect1d(field_chunks(f)[0], theirs.chunk_ids, return_indices=True)
            if not len(common):
                continue
            outside = remote_atoms >= theirs.digests.shape[1]  # the holder's blocks have fewer atoms
            a = mine[local_rows, local_atoms][:, mine_at]
            b = theirs.digests[held_row, np.where(outside, 0, remote_atoms)][:, theirs_at]
            wrong |= outside | (a != b).any(axis=1)
        checked += len(local_rows)
        bad.append(np.unique(local_blocks[local_rows[wrong]]))
    return ReadCheck(tuple(bad), checked, unverifiable)


def _pair_atoms(pairing: GroupPairing, local_units, remote_units, tokens_per_atom: int):
    """Each read unit's atoms on both sides: (local blocks touched, per atom: row into them, atom in the
    block, remote block, atom in it); None when a unit is not whole atoms of the holder's."""
    local_units, remote_units = np.asarray(local_units, np.int64), np.asarray(remote_units, np.int64)
    if pairing.unit_tokens is None:  # state pages: a block is one atom
        atoms_per_unit, k_local, k_remote = 1, 1, 1
    else:
        if pairing.unit_tokens % tokens_per_atom:
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
