"""A named-dim strided view of a cache region (pure; no I/O).

A :class:`Layout` is what a tensor view is (sizes, strides in elements, a
storage offset, an element size) plus a *name* for every dim. A logical dim
may be stored as several axes (*factors*, outer to inner): viewing two 8-token
kernel blocks as one 16-token logical block gives the token dim ``N`` the
factors ``(2 kernel blocks, stride of a kernel block)`` and ``(8, token
stride)``. Two layouts of the same data are compared dim by dim after both are
refined to the same factors (see :mod:`kvxferd.layout.match`).

The block dim is named ``B``; the token dim ``N``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from kvxferd.errors import InvalidArgumentError, LayoutMismatchError

BLOCK_DIM = "B"
TOKEN_DIM = "N"

# Element sizes of the dtypes caches use. Packed sub-byte formats (nvfp4) are
# described in bytes: dtype "uint8" with the content dim counted in bytes.
ITEMSIZES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4,
}


@dataclass(frozen=True, slots=True)
class Axis:
    """One stored axis: a factor of logical dim ``dim``."""

    dim: str
    size: int
    stride: int


def positive_int(value: object, field: str) -> int:
    """Validate external input: a positive integer (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(field, f"must be a positive integer, got {value!r}")
    return int(value)


def _nonnegative_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgumentError(field, f"must be a non-negative integer, got {value!r}")
    return int(value)


@dataclass(frozen=True, eq=False)
class Layout:
    """Named-dim strided view; axes are grouped by dim, outer to inner."""

    axes: tuple[Axis, ...]
    dtype: str
    itemsize: int
    offset: int = 0  # in elements, like torch's storage_offset

    # ---- construction -------------------------------------------------
    @classmethod
    def create(cls, dims, shape, strides, dtype: str, offset: int = 0) -> "Layout":
        """Validate external input and build a layout (one axis per dim)."""
        dims, shape, strides = tuple(dims), tuple(shape), tuple(strides)
        if not (len(dims) == len(shape) == len(strides)):
            raise InvalidArgumentError("dims", f"{len(dims)} dims for shape {shape} and strides {strides}")
        if len(set(dims)) != len(dims) or not all(isinstance(d, str) and d for d in dims):
            raise InvalidArgumentError("dims", f"dim names must be unique non-empty strings, got {dims}")
        if dtype not in ITEMSIZES:
            raise InvalidArgumentError("dtype", f"unknown dtype {dtype!r}; known: {sorted(ITEMSIZES)}")
        axes = tuple(
            Axis(d, positive_int(n, f"shape[{d}]"), _nonnegative_int(s, f"strides[{d}]"))
            for d, n, s in zip(dims, shape, strides)
        )
        layout = cls(axes, dtype, ITEMSIZES[dtype], _nonnegative_int(offset, "offset"))
        layout.check_no_overlap()
        return layout

    @classmethod
    def from_tensor(cls, tensor, dims) -> "Layout":
        """Build from anything shaped like a torch tensor (meta tensors too)."""
        dtype = str(tensor.dtype).removeprefix("torch.")
        return cls.create(dims, tuple(tensor.shape), tuple(tensor.stride()), dtype, tensor.storage_offset())

    def check_no_overlap(self) -> None:
        """Raise unless distinct elements live at distinct addresses."""
        span = 1
        for axis in sorted((a for a in self.axes if a.size > 1), key=lambda a: a.stride):
            if axis.stride < span:
                raise InvalidArgumentError(
                    f"strides[{axis.dim}]", f"stride {axis.stride} overlaps the {span} elements inside it"
                )
            span = axis.stride * axis.size

    # ---- queries -------------------------------------------------------
    @cached_property
    def dims(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a.dim for a in self.axes))

    def factors(self, dim: str) -> tuple[Axis, ...]:
        found = tuple(a for a in self.axes if a.dim == dim)
        if not found:
            raise InvalidArgumentError("dim", f"no dim {dim!r} in layout dims {self.dims}")
        return found

    def size(self, dim: str) -> int:
        return math.prod(a.size for a in self.factors(dim))

    @property
    def shape(self) -> dict[str, int]:
        return {d: self.size(d) for d in self.dims}

    @property
    def num_blocks(self) -> int:
        return self.size(BLOCK_DIM)

    @property
    def end_bytes(self) -> int:
        """One past the last byte this view touches."""
        last = self.offset + sum((a.size - 1) * a.stride for a in self.axes)
        return (last + 1) * self.itemsize

    def __repr__(self) -> str:
        body = ", ".join(f"{a.dim}:{a.size}@{a.stride}" for a in self.axes)
        return f"Layout({body}; {self.dtype}, offset={self.offset})"

    # ---- views ---------------------------------------------------------
    def _single(self, dim: str) -> int:
        idx = [i for i, a in enumerate(self.axes) if a.dim == dim]
        if not idx:
            raise InvalidArgumentError("dim", f"no dim {dim!r} in layout dims {self.dims}")
        if len(idx) > 1:
            raise LayoutMismatchError("dim", f"dim {dim!r} is stored as {len(idx)} factors; narrow/select need one")
        return idx[0]

    def narrow(self, dim: str, start: int, length: int) -> "Layout":
        """Keep elements ``[start, start+length)`` of ``dim`` (a TP slice)."""
        i = self._single(dim)
        axis = self.axes[i]
        start = _nonnegative_int(start, f"narrow[{dim}].start")
        length = positive_int(length, f"narrow[{dim}].length")
        if start + length > axis.size:
            raise InvalidArgumentError(f"narrow[{dim}]", f"[{start}, {start + length}) exceeds size {axis.size}")
        axes = self.axes[:i] + (Axis(dim, length, axis.stride),) + self.axes[i + 1 :]
        return replace(self, axes=axes, offset=self.offset + start * axis.stride)

    def select(self, dim: str, index: int) -> "Layout":
        """Fix ``dim`` at ``index`` and drop it (e.g. one layer of ``L``)."""
        i = self._single(dim)
        axis = self.axes[i]
        index = _nonnegative_int(index, f"select[{dim}]")
        if index >= axis.size:
            raise InvalidArgumentError(f"select[{dim}]", f"index {index} out of range for size {axis.size}")
        return replace(self, axes=self.axes[:i] + self.axes[i + 1 :], offset=self.offset + index * axis.stride)

    def refine(self, dim: str, sizes) -> "Layout":
        """Re-express ``dim`` with finer factors ``sizes`` (outer to inner).

        Every existing factor boundary must stay a boundary: ``[4, 4]`` can be
        refined to ``[2, 2, 4]`` but not to ``[8, 2]``.
        """
        sizes = [positive_int(s, f"refine[{dim}]") for s in sizes]
        old = self.factors(dim)
        if math.prod(sizes) != self.size(dim):
            raise InvalidArgumentError(f"refine[{dim}]", f"sizes {sizes} do not multiply to {self.size(dim)}")
        if self.size(dim) == 1:
            return self
        new: list[Axis] = []
        pending = [s for s in sizes if s > 1]  # size-1 factors carry no addressing
        for axis in reversed(old):  # inner to outer
            covered = 1
            while covered < axis.size:
                size = pending.pop()
                if (axis.size // covered) % size:
                    raise LayoutMismatchError(
                        f"refine[{dim}]", f"factors {[a.size for a in old]} cannot be split into {sizes}"
                    )
                new.append(Axis(dim, size, axis.stride * covered))
                covered *= size
        new.reverse()
        first = next(i for i, a in enumerate(self.axes) if a.dim == dim)
        rest = tuple(a for a in self.axes if a.dim != dim)
        return replace(self, axes=rest[:first] + tuple(new) + rest[first:])

    def group_blocks(self, k: int, token_dim: str = TOKEN_DIM) -> "Layout":
        """View ``k`` consecutive kernel blocks as one logical block.

        ``(B*k, .., Nk, ..)`` becomes ``(B, .., N=k*Nk, ..)`` where the token
        dim gains an outer factor that walks the kernel blocks::

            kernel blocks   0 1 | 2 3 | 4 5        (k = 2)
            logical blocks   0  |  1  |  2
        """
        k = positive_int(k, "kernel_blocks_per_block")
        i = self._single(BLOCK_DIM)
        block = self.axes[i]
        if block.size % k:
            raise InvalidArgumentError("kernel_blocks_per_block", f"{block.size} kernel blocks not divisible by {k}")
        self.factors(token_dim)
        if k == 1:
            return self
        axes = list(self.axes)
        axes[i] = Axis(BLOCK_DIM, block.size // k, block.stride * k)
        first_token = next(j for j, a in enumerate(axes) if a.dim == token_dim)
        axes.insert(first_token, Axis(token_dim, k, block.stride))
        return replace(self, axes=tuple(axes))

    def ungroup_blocks(self, k: int, token_dim: str = TOKEN_DIM) -> "Layout":
        """Inverse of :meth:`group_blocks`: view each block as ``k`` blocks.

        The outer token factors whose sizes multiply to ``k`` become inner
        block factors (splitting one factor if needed), so a block of 32
        tokens stored as 2 kernel blocks of 16 can be viewed as 4 blocks of 8.
        """
        k = positive_int(k, "blocks_per_block")
        sizes = [a.size for a in self.factors(token_dim)]
        if self.size(token_dim) % k:
            raise InvalidArgumentError("blocks_per_block", f"{token_dim} size {self.size(token_dim)} not divisible by {k}")
        if k == 1:
            return self
        split, remaining = [], k
        for size in sizes:
            if remaining == 1 or remaining % size == 0:
                split.append(size)
                remaining //= 1 if remaining == 1 else size
            elif size % remaining == 0:
                split += [remaining, size // remaining]
                remaining = 1
            else:
                raise LayoutMismatchError("blocks_per_block", f"{token_dim} factors {sizes} cannot give {k} sub-blocks")
        refined = self.refine(token_dim, split)
        moved, product = [], 1
        for axis in refined.factors(token_dim):
            if product == k:
                break
            moved.append(axis)
            product *= axis.size
        axes = [a for a in refined.axes if all(a is not m for m in moved)]
        if len(moved) == len(refined.factors(token_dim)):  # one token per block: keep the dim
            axes.insert(refined.axes.index(moved[0]), Axis(token_dim, 1, moved[-1].stride))
        last_block = max(j for j, a in enumerate(axes) if a.dim == BLOCK_DIM)
        axes[last_block + 1 : last_block + 1] = [Axis(BLOCK_DIM, m.size, m.stride) for m in moved]
        return replace(self, axes=tuple(axes))

    # ---- block addressing ---------------------------------------------
    @cached_property
    def block_table_bytes(self) -> np.ndarray:
        """Byte offset of every block id (relative to this view's offset)."""
        offsets = np.zeros(1, dtype=np.int64)
        for axis in self.factors(BLOCK_DIM):  # outer to inner: id = mixed radix
            steps = np.arange(axis.size, dtype=np.int64) * (axis.stride * self.itemsize)
            offsets = (offsets[:, None] + steps[None, :]).ravel()
        offsets.flags.writeable = False
        return offsets
