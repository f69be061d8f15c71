"""A registered cache region: one or more named fields over the same bytes.

Most regions hold one field (an attention layer's ``(B, H, N, KV, C)``). A
Mamba page holds several: the conv state, whose channel dim concatenates
independently sharded segments (x, B, C), and the SSM state. Each segment is
its own field with its own shard, so TP narrowing is the same code for all::

    page of one block (rank r of T):
    | conv: W rows of [ x_r | B_r | C_r ] | ssm: heads_r x head_dim x state | pad |
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxferd.errors import InvalidArgumentError
from kvxferd.layout.strided import BLOCK_DIM, Layout
from kvxferd.tp.shards import check_extent, check_tp, owned_range

LAYER_DIM = "L"  # a region holding several layers (cross-layer, strided, multi-layer Mamba) names them so


@dataclass(frozen=True, slots=True)
class Shard:
    """How a field's ``dim`` is split across TP ranks, seen from one rank."""

    dim: str
    global_extent: int
    tp_size: int
    tp_rank: int

    def __post_init__(self) -> None:
        check_extent(self.global_extent, field=f"shard[{self.dim}].global_extent")
        check_tp(self.tp_size, self.tp_rank)

    @property
    def local_range(self) -> tuple[int, int]:
        """Global ``[start, stop)`` this rank holds."""
        return owned_range(self.global_extent, self.tp_size, self.tp_rank)

    @property
    def local_extent(self) -> int:
        start, stop = self.local_range
        return stop - start


@dataclass(frozen=True, eq=False)
class Field:
    """One strided view inside a region; ``shard`` is None when replicated."""

    name: str
    layout: Layout
    shard: Shard | None = None
    layer: int = 0  # the layer inside its region this field holds (after Region.by_layer); 0 otherwise

    def __post_init__(self) -> None:
        if self.shard is not None and self.layout.size(self.shard.dim) != self.shard.local_extent:
            raise InvalidArgumentError(
                f"fields[{self.name}].shard",
                f"dim {self.shard.dim!r} has size {self.layout.size(self.shard.dim)} but rank "
                f"{self.shard.tp_rank}/{self.shard.tp_size} holds {self.shard.local_extent} of {self.shard.global_extent}",
            )

    @property
    def global_extent(self) -> int:
        """Extent of the sharded piece; 1 for a replicated field."""
        return 1 if self.shard is None else self.shard.global_extent


@dataclass(frozen=True, eq=False)
class Region:
    """A contiguous byte range registered once; ``kind`` is informational."""

    kind: str
    fields: tuple[Field, ...]
    num_bytes: int

    def __post_init__(self) -> None:
        if not self.fields:
            raise InvalidArgumentError("fields", "a region needs at least one field")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise InvalidArgumentError("fields", f"field names must be unique, got {names}")
        blocks = {f.layout.num_blocks for f in self.fields}
        if len(blocks) != 1:
            raise InvalidArgumentError("fields", f"fields disagree on the number of blocks: {sorted(blocks)}")
        for f in self.fields:
            if BLOCK_DIM not in f.layout.dims:
                raise InvalidArgumentError(f"fields[{f.name}].dims", f"no block dim {BLOCK_DIM!r}")
            if f.layout.end_bytes > self.num_bytes:
                raise InvalidArgumentError(
                    f"fields[{f.name}]", f"view ends at byte {f.layout.end_bytes} beyond the region's {self.num_bytes} bytes"
                )

    @property
    def num_blocks(self) -> int:
        return self.fields[0].layout.num_blocks

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise InvalidArgumentError("field", f"no field {name!r}; fields are {[f.name for f in self.fields]}")

    def ungroup_blocks(self, k: int) -> "Region":
        """The same bytes viewed as ``k`` times as many, smaller blocks."""
        if k == 1:
            return self
        fields = tuple(Field(f.name, f.layout.ungroup_blocks(k), f.shard, f.layer) for f in self.fields)
        return Region(self.kind, fields, self.num_bytes)

    @property
    def num_layers(self) -> int:
        """Layers stored inside this region (its fields' ``L`` dim; 1 when they have none)."""
        sizes = {f.layout.size(LAYER_DIM) if LAYER_DIM in f.layout.dims else 1 for f in self.fields}
        if len(sizes) != 1:
            raise InvalidArgumentError("fields", f"fields hold different numbers of layers: {sorted(sizes)}")
        return sizes.pop()

    def by_layer(self) -> "Region":
        """The same bytes with every field split into one field per layer (issue #57: a push written layer
        by layer must not have a span cross from a layer that is final into one that is not)::

            field kv (L=3, B, H, N, C)  ->  kv@L0 (B, H, N, C) | kv@L1 | kv@L2     (layer 0, 1, 2)

        A region without an ``L`` dim is returned as it is (it holds one layer).
        """
        num_layers = self.num_layers
        if num_layers == 1 and not any(LAYER_DIM in f.layout.dims for f in self.fields):
            return self
        fields = tuple(Field(f"{f.name}@L{layer}", f.layout.select(LAYER_DIM, layer), f.shard, layer)
                       for layer in range(num_layers) for f in self.fields)
        return Region(self.kind, fields, self.num_bytes)
