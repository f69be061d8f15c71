"""Brute-force element addressing: the definition of a Layout, spelled out."""

import numpy as np


def dim_contribution(layout, dim):
    """Element offset contributed by each index of ``dim`` (mixed radix over its factors)."""
    factors = layout.factors(dim)
    out = []
    for i in range(layout.size(dim)):
        rest, total = i, 0
        for axis in reversed(factors):
            rest, digit = divmod(rest, axis.size)
            total += digit * axis.stride
        out.append(total)
    return np.array(out, dtype=np.int64)


def addresses(layout, dims=None):
    """Element offset of every logical element, shaped by ``dims`` (default: layout.dims)."""
    dims = dims or layout.dims
    out = np.full([1] * len(dims), layout.offset, dtype=np.int64)
    for i, dim in enumerate(dims):
        shape = [1] * len(dims)
        shape[i] = -1
        out = out + dim_contribution(layout, dim).reshape(shape)
    return out
