"""Boxes of a tensor's index space: where stored chunks lie, and what a target layout needs.

Knows nothing but the standard library. A distributed checkpoint stores each global tensor as
chunks (a box: offsets and sizes per dimension, as in ``torch.distributed.checkpoint``'s
metadata); a target layout (HF: the whole tensor; tensor parallel N: N slices along one axis) is
also boxes. Resharding is then box intersection: each target box is filled from the parts of the
stored chunks that overlap it. ``plan_copies`` computes those parts; it never looks at data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes) or any(s < 0 for s in self.sizes) or any(o < 0 for o in self.offsets):
            raise ValueError(f"not a box: offsets {self.offsets}, sizes {self.sizes}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        count = 1
        for size in self.sizes:
            count *= size
        return count

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        """The common part, or None when they do not overlap."""
        if len(other.offsets) != len(self.offsets):
            raise ValueError("boxes of different ranks")
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        ends = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(e <= s for s, e in zip(starts, ends)):
            return None
        return Box(starts, tuple(e - s for s, e in zip(starts, ends)))

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """This box as index slices into a tensor holding ``outer``."""
        return tuple(slice(o - oo, o - oo + s) for o, s, oo in zip(self.offsets, self.sizes, outer.offsets))


def split_along(shape: Sequence[int], axis: int, parts: int) -> list[Box]:
    """The boxes of ``parts`` equal slices of a ``shape`` tensor along ``axis`` (tensor parallel)."""
    if parts < 1 or shape[axis] % parts:
        raise ValueError(f"dimension {axis} of {tuple(shape)} does not split into {parts} equal parts")
    step = shape[axis] // parts
    boxes = []
    for index in range(parts):
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[axis], sizes[axis] = index * step, step
        boxes.append(Box(tuple(offsets), tuple(sizes)))
    return boxes


@dataclass(frozen=True)
class Copy:
    """Copy ``region`` (global coordinates) from source chunk ``source`` into target ``target``."""

    target: int
    source: int
    region: Box


def plan_copies(targets: Sequence[Box], sources: Sequence[Box]) -> list[Copy]:
    """Every overlap of a target box with a stored chunk: together they fill each target once,
    provided the stored chunks tile the tensor (``check_tiling``)."""
    copies = []
    for t, target in enumerate(targets):
        for s, source in enumerate(sources):
            region = target.intersect(source)
            if region is not None:
                copies.append(Copy(t, s, region))
    return copies


def check_tiling(shape: Sequence[int], chunks: Iterable[Box]) -> None:
    """Raise unless ``chunks`` cover the ``shape`` tensor exactly once (no gap, no overlap)."""
    chunks = list(chunks)
    whole = Box.whole(shape)
    total = 0
    for index, chunk in enumerate(chunks):
        inside = chunk.intersect(whole)
        if inside is None or inside != chunk:
            raise ValueError(f"chunk {chunk} lies outside the tensor {tuple(shape)}")
        for other in chunks[index + 1:]:
            if chunk.intersect(other) is not None:
                raise ValueError(f"chunks {chunk} and {other} overlap")
        total += chunk.numel
    if total != whole.numel:
        raise ValueError(f"chunks cover {total} of the {whole.numel} elements of {tuple(shape)}")
