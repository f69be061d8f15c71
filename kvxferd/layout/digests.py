"""Digests of KV content in logical coordinates (issue #59): the same number on both sides of a read.

A reader's bytes sit in another layout, block size and TP slice than the
holder's, so a digest of bytes as stored could not be compared. This one is
a sum over the *logical* elements of a field::

    digest[atom, chunk] = sum over elements e in (atom, chunk) of  weight(e) * bits(e)   (mod 2**64)

    atom   ATOM_TOKENS consecutive tokens of one block (a block when the field has no tokens)
    chunk  a piece of the sharded dim (heads) no TP split cuts: the boundaries of every
           rank's range for TP sizes 1..DIGEST_MAX_TP (one chunk when replicated)
    weight a product of one odd 64-bit weight per logical index (layer, K/V, global head, token
           in the atom, channel, ...), keyed by group, region and field: a value in the wrong
           layer, head, token or K/V slot weighs differently

Any layout of the same logical field gives the same digest, however its
dims are ordered, split into kernel blocks or sliced by TP. It is linear, so
a change of one element always changes it (an odd weight times a nonzero
change is nonzero mod 2**64), and the sums of fields, layers and sub-blocks
add up. It is not a defence against someone forging bytes: it catches
corruption, wrong plans and stray writes.

Pure numpy on arrays the caller maps; no I/O.
"""

from __future__ import annotations

import functools
import math
import zlib

import numpy as np

from kvxferd.errors import InvalidArgumentError, LayoutMismatchError
from kvxferd.layout.region import Field
from kvxferd.layout.strided import BLOCK_DIM, TOKEN_DIM, Layout
from kvxferd.tp.shards import owned_range

WORD_DIM = "C"  # the channel dim: packed into 64-bit words where it is stored contiguous
ATOM_TOKENS = 8  # tokens per digest atom (fewer when a block holds fewer): 8-token blocks and kernel blocks read whole atoms
DIGEST_MAX_TP = 64  # chunks keep every TP split of up to this many ranks readable alone

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 in, uint64 out; wraps mod 2**64)."""
    x = np.array(x, dtype=np.uint64, ndmin=1) + _GOLDEN  # arrays: numpy wraps them silently, not scalars
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def field_key(group: int, region: int, field_name: str) -> int:
    """The key a field's weights derive from: which group, region (layer) and field it is."""
    name = zlib.crc32(field_name.encode())
    return int(mix64((group << 48) ^ (region << 32) ^ name)[0])


@functools.lru_cache(maxsize=4096)
def dim_weights(key: int, dim: str, size: int) -> np.ndarray:
    """Odd weight of each index ``0..size-1`` of logical ``dim`` under ``key`` (read-only; kept: a read's
    check weighs the same dims of the same layers every time)."""
    salt = mix64(key ^ zlib.crc32(dim.encode()))
    weights = mix64(salt + np.arange(size, dtype=np.uint64)) | np.uint64(1)
    weights.flags.writeable = False
    return weights


def atom_tokens(block_size: int | None) -> int:
    """Tokens per atom of blocks of ``block_size`` tokens (None: state pages, one atom a block)."""
    return 1 if block_size is None else math.gcd(ATOM_TOKENS, block_size)


@functools.lru_cache(maxsize=256)
def chunk_bounds(global_extent: int) -> np.ndarray:
    """Global boundaries of the chunks of a sharded dim: every TP rank's range ends on one (read-only)."""
    bounds = {0, global_extent}
    for tp_size in range(1, DIGEST_MAX_TP + 1):
        for tp_rank in range(tp_size):
            bounds.update(owned_range(global_extent, tp_size, tp_rank))
    out = np.array(sorted(bounds), dtype=np.int64)
    out.flags.writeable = False
    return out


def field_chunks(field: Field) -> tuple[np.ndarray, np.ndarray]:
    """``(chunk_ids, starts)``: the global chunk ids this rank's slice of ``field`` holds whole, and where
    each starts in the slice. A replicated field is one chunk (id 0)."""
    if field.shard is None:
        return np.zeros(1, np.int64), np.zeros(1, np.int64)
    start, stop = field.shard.local_range
    bounds = chunk_bounds(field.shard.global_extent)
    inside = bounds[(bounds >= start) & (bounds < stop)]
    if not len(inside) or inside[0] != start or stop not in bounds:  # TP above DIGEST_MAX_TP
        raise LayoutMismatchError("shard", f"rank slice [{start}, {stop}) is not whole digest chunks "
                                  f"(TP sizes up to {DIGEST_MAX_TP})")
    return np.searchsorted(bounds, inside).astype(np.int64), inside - start


def atoms_per_block(layout: Layout, tokens_per_atom: int) -> int:
    """Atoms of ``tokens_per_atom`` in one block of ``layout`` (1 when it has no token dim)."""
    if TOKEN_DIM not in layout.dims:
        return 1
    num_tokens = layout.size(TOKEN_DIM)
    if num_tokens % tokens_per_atom:
        raise LayoutMismatchError("atom_tokens", f"blocks of {num_tokens} tokens are not whole atoms of {tokens_per_atom}")
    return num_tokens // tokens_per_atom


def elements_per_word(layout: Layout) -> int:
    """Elements of the channel dim ``C`` that weigh as one 64-bit word (1: none packed).

    With ``e`` channels a word and ``h = e / 2``, channel ``c = w * e + j`` weighs
    ``A(w) << (8 * itemsize * j)``, plus ``B(w) << (8 * itemsize * (j - h))`` when ``j >= h``: where ``C`` is
    stored innermost and contiguous, that is ``A(w) * word + B(w) * (word >> 32)``, two products per word
    (against 4 or 8 for 16- or 8-bit values one by one); elsewhere each element is weighed alone, to the
    same sum. Every element's weight keeps at least 40 of its 64 bits (48 for 16-bit values): a change of
    one element always shows, and two changes cancel with a chance of about ``2**-40`` at worst (with
    ``A`` alone the top element of a word kept 16 bits, and two sign flips there always cancelled)."""
    if WORD_DIM not in layout.dims or (layout.size(WORD_DIM) * layout.itemsize) % 8:
        return 1
    return 8 // layout.itemsize


def field_digests(memory: np.ndarray, field: Field, block_ids: np.ndarray, key: int, tokens_per_atom: int) -> np.ndarray:
    """Digests of ``field``'s blocks ``block_ids`` in ``memory`` (its region's bytes, uint8):
    ``uint64[len(block_ids), atoms_per_block, num_chunks]``, chunks as :func:`field_chunks`. The holder
    chooses ``tokens_per_atom`` (:func:`atom_tokens` of its block size); a reader uses the holder's."""
    layout = field.layout
    k = atoms_per_block(layout, tokens_per_atom)
    _, starts = field_chunks(field)
    ids = np.asarray(block_ids, dtype=np.int64)
    if not len(ids):
        return np.zeros((0, k, len(starts)), np.uint64)
    atoms = layout.ungroup_blocks(k) if k > 1 else layout  # block dim: (block, atom in block)
    per_word = elements_per_word(layout)
    last = atoms.axes[-1]
    packed = per_word > 1 and last.dim == WORD_DIM and last.stride == 1 and len(atoms.factors(WORD_DIM)) == 1
    view = _element_view(memory, atoms, per_word if packed else 1)
    block_axes = [i for i, a in enumerate(atoms.axes) if a.dim == BLOCK_DIM]
    shard_dim = None if field.shard is None else field.shard.dim
    shard_axes = [i for i, a in enumerate(atoms.axes) if a.dim == shard_dim]
    if len(shard_axes) > 1 or block_axes != list(range(block_axes[0], block_axes[0] + len(block_axes))):
        raise LayoutMismatchError("layout", f"no digest for a layout whose blocks or shards are split: {atoms}")
    view = np.take(view, ids, axis=block_axes[0])  # the held blocks only (a copy: one pass over them)
    weighted = [i for i in range(len(atoms.axes)) if i not in block_axes]  # the shard dim too: a head in
    # the wrong place of its chunk must weigh differently; it is also kept, to be summed per chunk below
    offsets = {} if field.shard is None else {field.shard.dim: field.shard.local_range[0]}
    letters = "abcdefghijklmnopqrstuvwxyz"
    kept = block_axes + shard_axes
    spec = (f"{letters[:len(atoms.axes)]},{''.join(letters[i] for i in weighted)}->"
            f"{''.join(letters[i] for i in kept)}")
    if packed:  # A(w) * word + B(w) * (word >> 32), as elements_per_word says
        digests = np.einsum(spec, view, _weights(atoms, key, weighted, offsets, per_word, "A"),
                            dtype=np.uint64, casting="unsafe")
        high = view.view(np.uint32)[..., 1::2]  # word >> 32 without a copy: each little-endian word's high half
        digests += np.einsum(spec, high, _weights(atoms, key, weighted, offsets, per_word, "B"),
                             dtype=np.uint64, casting="unsafe")
    else:
        digests = np.einsum(spec, view, _weights(atoms, key, weighted, offsets, per_word, ""),
                            dtype=np.uint64, casting="unsafe")
    digests = digests.reshape(len(ids), k, -1)  # (block, atom, shard index in the slice)
    return np.add.reduceat(digests, starts, axis=2, dtype=np.uint64)


def _element_view(memory: np.ndarray, layout: Layout, per_word: int) -> np.ndarray:
    """Every element of ``layout`` in ``memory`` as unsigned integers of its width, axis by axis; with
    ``per_word`` > 1 the innermost (contiguous) axis as 64-bit words of that many elements."""
    if layout.itemsize not in _UINTS:
        raise InvalidArgumentError("dtype", f"no digest of {layout.itemsize}-byte elements")
    if layout.end_bytes > memory.nbytes:
        raise InvalidArgumentError("memory", f"{memory.nbytes} bytes, the layout reaches byte {layout.end_bytes}")
    size = layout.itemsize
    shape = [a.size for a in layout.axes]
    strides = [a.stride * size for a in layout.axes]
    if per_word > 1:
        shape[-1], strides[-1] = shape[-1] // per_word, 8
    return np.ndarray(tuple(shape), dtype=_UINTS[8 if per_word > 1 else size], buffer=memory,
                      offset=layout.offset * size, strides=tuple(strides))


def _weights(layout: Layout, key: int, weighted: list[int], offsets: dict[str, int], per_word: int,
             words: str) -> np.ndarray:
    """:func:`_weights_of`, kept: a read's check weighs the same layers' fields every time (read-only)."""
    dims = tuple((layout.axes[i].dim, layout.axes[i].size) for i in weighted)
    return _weights_of(dims, key, tuple(sorted(offsets.items())), per_word, words)


@functools.lru_cache(maxsize=256)  # a product is one atom's elements of a slice (tens of KiB) per field and layer
def _weights_of(dims: tuple, key: int, offsets: tuple, per_word: int, words: str) -> np.ndarray:
    """The product of every weighted dim's weights over axes ``weighted`` (a dim split into several axes
    is indexed outer to inner, so its weight depends on the logical index only; a sharded dim's index is
    global: ``offsets`` gives where this rank's slice starts). Channels weigh as :func:`elements_per_word`
    says: ``words`` "A" or "B", the innermost axis holds words and this is that term's weight of each;
    "", each channel's whole weight."""
    offsets = dict(offsets)
    shape = [size for _, size in dims]
    if words:
        shape[-1] //= per_word
    total = np.ones(shape, dtype=np.uint64)
    for dim in dict.fromkeys(d for d, _ in dims):
        positions = [n for n, (d, _) in enumerate(dims) if d == dim]
        sizes = [shape[n] for n in positions]
        start = offsets.get(dim, 0)
        if dim == WORD_DIM:
            w = _channel_weights(key, math.prod(sizes), per_word, words)
        else:
            w = dim_weights(key, dim, start + math.prod(sizes))[start:]
        w = w.reshape(sizes)
        total = total * w.reshape([shape[n] if n in positions else 1 for n in range(len(shape))])
    total.flags.writeable = False
    return total


def _channel_weights(key: int, size: int, per_word: int, words: str) -> np.ndarray:
    """The channel dim's weights: of each of ``size`` words for term ``words`` ("A" or "B"), or of each of
    ``size`` channels ("": both terms folded into each channel's weight)."""
    num_words = size if words else size // per_word
    a = dim_weights(key, WORD_DIM, num_words)
    if per_word == 1:
        return a
    b = dim_weights(key, WORD_DIM + ">>32", num_words)
    if words:
        return a if words == "A" else b
    bits = np.uint64(64 // per_word)
    places = np.arange(per_word, dtype=np.uint64)
    half = per_word // 2
    weights = a[:, None] << (places * bits)[None, :]
    weights[:, half:] += b[:, None] << (places[: per_word - half] * bits)[None, :]
    return weights.ravel()
