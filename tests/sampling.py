"""Sampled grids: every case stays in the suite, most of them only in the slow run (``-m slow``).

The default run keeps a covering sample: the product of the first
``product_of`` axes, each of its combinations paired with the values of
the other axes in turn (a rotation), so every value of every axis appears
at least once. The other combinations carry the ``slow`` mark and run
with ``scripts/test.sh -m slow``.
"""

from __future__ import annotations

import itertools

import pytest


def covering(*axes, product_of: int = 1, ids=None):
    """Every combination of ``axes`` as ``pytest.param``; those outside the covering sample are marked slow.

    ``ids`` formats one combination as its test id (default: values joined by ``-``).
    """
    head, rest = axes[:product_of], axes[product_of:]
    heads = list(itertools.product(*head))
    longest = max([len(heads), *(len(axis) for axis in rest)])
    fast = {heads[i % len(heads)] + tuple(axis[i % len(axis)] for axis in rest) for i in range(longest)}
    params = []
    for combination in itertools.product(*axes):
        marks = () if combination in fast else (pytest.mark.slow,)
        name = ids(*combination) if ids else "-".join(str(v) for v in combination)
        params.append(pytest.param(*combination, marks=marks, id=name))
    return params
