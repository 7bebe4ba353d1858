"""The chunk plan of the offloaded optimizer: all parameters laid end to end as one flat range,
cut into fixed-size chunks, each chunk listing the pieces of parameters it covers.

Pure arithmetic on element counts; knows no tensors, devices or optimizers.
"""

from __future__ import annotations

from typing import NamedTuple


class Segment(NamedTuple):
    """Elements ``[param_start, param_start + length)`` of parameter ``param_index`` sit at
    ``[chunk_start, chunk_start + length)`` of their chunk."""

    param_index: int
    param_start: int
    chunk_start: int
    length: int


class Chunk(NamedTuple):
    """Elements ``[start, stop)`` of the flat range."""

    start: int
    stop: int
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_chunks(numels: list[int], chunk_numel: int) -> list[Chunk]:
    """Cut the concatenation of parameters with ``numels`` elements into chunks of
    ``chunk_numel`` (the last one shorter). A parameter may span several chunks and a chunk
    several parameters; empty parameters appear in none."""
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be at least 1, got {chunk_numel}")
    offsets = [0]
    for numel in numels:
        offsets.append(offsets[-1] + numel)
    total = offsets[-1]
    chunks = []
    index = 0
    for start in range(0, total, chunk_numel):
        stop = min(start + chunk_numel, total)
        segments = []
        position = start
        while position < stop:
            while offsets[index + 1] <= position:  # skip parameters that end before here
                index += 1
            length = min(offsets[index + 1], stop) - position
            segments.append(Segment(index, position - offsets[index], position - start, length))
            position += length
        chunks.append(Chunk(start, stop, tuple(segments)))
    return chunks
