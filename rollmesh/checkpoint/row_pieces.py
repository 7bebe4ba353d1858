"""Writing a tensor's HF outputs straight from the checkpoint's bytes, without assembling it.

Knows the architecture maps (only through ``ArchMap.to_hf``) and the torch_dist reader's chunk
views; nothing of shards beyond ``StreamedShard.append``. Every map in ``arch_maps`` only selects
and reorders whole rows (QKV de-interleave, the gate/up split, vocabulary padding, identity), so
running it on a column of row numbers (``row_runs``) says which source rows make each output, as
runs of consecutive rows. When the checkpoint splits the tensor on rows only (column-parallel
weights, vocabulary tables, replicated ones), each run lies in stored chunks that are mapped from
the file (``chunk_view``), and the output is written piece by piece from those pages: the bytes
are never copied into a buffer of ours. Maps that do anything else fail the trace's checks, and
tensors split on other axes (row-parallel weights) are assembled as before.
"""

from __future__ import annotations

import torch

from rollmesh.checkpoint.arch_maps import ArchMap
from rollmesh.checkpoint.convert_planner import StoredChunk
from rollmesh.checkpoint.torch_dist_reader import LayerSource, TorchDistCheckpoint

Run = tuple[int, int]  # source rows [start, stop)


def row_runs(arch: ArchMap, name: str, shape: tuple[int, ...]) -> dict[str, list[Run]] | None:
    """Each HF output of ``name`` (canonical shape ``shape``) as runs of source rows, in order;
    None unless the map only selects whole rows."""
    rows = shape[0] if shape else 0
    if rows == 0:
        return None
    index = torch.arange(rows) if len(shape) == 1 else torch.arange(rows).reshape(rows, 1)
    try:
        traced = arch.to_hf(name, index)
    except (RuntimeError, ValueError):  # the map needs the real trailing shape
        return None
    runs: dict[str, list[Run]] = {}
    for hf_name, picked in traced.items():
        if picked.dim() != index.dim() or (picked.dim() == 2 and picked.shape[1] != 1):
            return None  # not a selection of whole rows
        flat = picked.reshape(-1)
        if flat.numel() == 0:
            runs[hf_name] = []
            continue
        breaks = (torch.nonzero(flat[1:] - flat[:-1] != 1).reshape(-1) + 1).tolist()
        starts = [0, *breaks]
        ends = [*breaks, flat.numel()]
        runs[hf_name] = [(int(flat[a]), int(flat[a]) + (b - a)) for a, b in zip(starts, ends)]
    return runs


def row_chunks(checkpoint: TorchDistCheckpoint, source: LayerSource) -> list[tuple[int, int, StoredChunk]] | None:
    """The stored chunks of ``source`` as (first row, end row, chunk), when each lies wholly in
    it and spans all of it but rows; None otherwise."""
    lead = int(source.stacked)
    box = source.box
    if len(box.sizes) <= lead:
        return None
    blocks = []
    for chunk in checkpoint.tensor(source.stored).chunks:
        overlap = chunk.box.intersect(box)
        if overlap is None:
            continue
        whole_rows = all(overlap.sizes[axis] == box.sizes[axis] for axis in range(len(box.sizes)) if axis != lead)
        if overlap != chunk.box or not whole_rows:
            return None
        first = overlap.offsets[lead] - box.offsets[lead]
        blocks.append((first, first + overlap.sizes[lead], chunk))
    return sorted(blocks, key=lambda block: block[0])


def write_from_pages(checkpoint: TorchDistCheckpoint, source: LayerSource, arch: ArchMap, name: str,
                     outputs: tuple[str, ...], append: object, dtype: torch.dtype | None) -> bool:
    """Append every output of ``name`` (``append(hf_name, rows)``, in ``outputs`` order) from
    views of the mapped file; False, having appended nothing, if this tensor cannot be."""
    lead = int(source.stacked)
    shape = source.box.sizes[lead:]
    blocks = row_chunks(checkpoint, source)
    runs = row_runs(arch, name, shape) if blocks is not None else None
    if blocks is None or runs is None or set(runs) != set(outputs):
        return False
    views = []
    for first, end, chunk in blocks:
        view = checkpoint.chunk_view(chunk)
        if view is None:
            return False
        views.append((first, end, view.reshape((end - first, *shape[1:]))))
    for hf_name in outputs:
        for start, stop in runs[hf_name]:
            for first, end, view in views:  # a run may cross from one stored chunk to the next
                low, high = max(start, first), min(stop, end)
                if low < high:
                    piece = view[low - first:high - first]
                    append(hf_name, piece.to(dtype) if dtype is not None else piece)  # type: ignore[operator]
    return True
