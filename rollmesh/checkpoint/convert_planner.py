"""The conversion plan, from a checkpoint's metadata only: byte-sized tasks, largest first,
grouped by source file, each unit of work within a memory budget.

Knows the chunk geometry; nothing of torch or files' contents. The unit of work is one canonical
Megatron tensor (a layer's, or one expert's): its HF tensors need all of it (QKV de-interleave,
gate/up split). Vocabulary tables, whose size grows with the vocabulary rather than with a layer,
may be split into blocks of rows, so the largest tensor of a big-vocabulary model need not fit the
budget whole. A worker holds one unit's input and output at a time, so the budget bounds memory
per worker whatever the task or model size. Units are packed into tasks (one task writes one
output shard) of at most ``max_task_bytes`` of output, preferring units that read the same
source files (small leftovers are then folded into larger tasks), then sorted largest first so
parallel workers finish together (LPT). A unit that
cannot be split and does not fit the budget is an error that names it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollmesh.checkpoint.chunk_geometry import Box
from rollmesh.checkpoint.errors import TaskTooLargeError


@dataclass(frozen=True)
class StoredChunk:
    """One chunk of a global tensor as the checkpoint stores it."""

    tensor: str
    box: Box
    file: str
    nbytes: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    itemsize: int
    chunks: tuple[StoredChunk, ...]

    @property
    def nbytes(self) -> int:
        return Box.whole(self.shape).numel * self.itemsize


@dataclass(frozen=True)
class PlannedTensor:
    """A canonical tensor to convert, as the planner sees it."""

    name: str
    rows: int  # length of axis 0
    in_bytes: int  # read from the checkpoint
    out_bytes: int  # written to the output
    # (first row, end row, file) of each stored piece: which files a block of rows reads.
    row_files: tuple[tuple[int, int, str], ...]
    row_splittable: bool = False
    # The leading rows that give output (the rest are vocabulary padding, dropped); None: all.
    kept_rows: int | None = None

    def files(self, start: int = 0, stop: int | None = None) -> frozenset[str]:
        stop = self.rows if stop is None else stop
        return frozenset(file for first, end, file in self.row_files if first < stop and start < end)


@dataclass(frozen=True)
class WorkUnit:
    """One tensor, or (``rows`` set) one block of its rows: what a worker holds at once."""

    tensor: str
    rows: tuple[int, int] | None
    in_bytes: int
    out_bytes: int
    files: frozenset[str]

    @property
    def memory_bytes(self) -> int:
        return self.in_bytes + self.out_bytes


@dataclass
class ConvertTask:
    """The units one worker converts into one output shard, in order."""

    units: list[WorkUnit] = field(default_factory=list)

    @property
    def out_bytes(self) -> int:
        return sum(unit.out_bytes for unit in self.units)

    @property
    def in_bytes(self) -> int:
        return sum(unit.in_bytes for unit in self.units)

    @property
    def memory_bytes(self) -> int:
        return max((unit.memory_bytes for unit in self.units), default=0)

    @property
    def files(self) -> frozenset[str]:
        return frozenset(f for unit in self.units for f in unit.files)


def work_units(tensor: PlannedTensor, *, max_unit_memory: int, split_above: int | None = None) -> list[WorkUnit]:
    """The tensor whole, or (row-splittable, holding more than ``split_above``, default
    ``max_unit_memory``) in blocks of rows each holding at most that much. Only a unit that
    cannot be split and holds more than ``max_unit_memory`` is refused."""
    memory = tensor.in_bytes + tensor.out_bytes
    target = min(split_above or max_unit_memory, max_unit_memory)
    if memory <= target or tensor.rows <= 1 or not tensor.row_splittable:
        if memory > max_unit_memory:
            raise TaskTooLargeError(tensor.name, memory, max_unit_memory)
        return [WorkUnit(tensor.name, None, tensor.in_bytes, tensor.out_bytes, tensor.files())]
    kept = tensor.rows if tensor.kept_rows is None else tensor.kept_rows
    per_row_in, per_row_out = tensor.in_bytes // tensor.rows, (tensor.out_bytes // kept if kept else 0)
    block = target // (per_row_in + per_row_out)
    if block < 1:
        raise TaskTooLargeError(f"{tensor.name} (one row)", per_row_in + per_row_out, target)
    units = []
    for start in range(0, tensor.rows, block):
        stop = min(start + block, tensor.rows)
        out_rows = max(0, min(stop, kept) - start)
        units.append(WorkUnit(tensor.name, (start, stop), (stop - start) * per_row_in, out_rows * per_row_out,
                              tensor.files(start, stop)))
    return units


def plan_tasks(tensors: Sequence[PlannedTensor], *, max_task_bytes: int, max_unit_memory: int,
               split_above: int | None = None) -> list[ConvertTask]:
    """Pack every tensor's units into tasks (see the module docstring); largest task first. The
    blocks of one tensor stay together, in order, since they fill one output tensor."""
    groups: dict[frozenset[str], list[list[WorkUnit]]] = defaultdict(list)
    for tensor in tensors:
        groups[tensor.files()].append(work_units(tensor, max_unit_memory=max_unit_memory, split_above=split_above))
    tasks: list[ConvertTask] = []
    for files in sorted(groups, key=sorted):
        open_tasks: list[ConvertTask] = []
        items = sorted(groups[files], key=lambda item: (-sum(u.out_bytes for u in item), item[0].tensor))
        for item in items:
            size = sum(unit.out_bytes for unit in item)
            home = next((t for t in open_tasks if t.out_bytes + size <= max_task_bytes), None)
            if home is None:  # a tensor larger than the limit gets a task of its own
                home = ConvertTask()
                open_tasks.append(home)
            home.units += item
        tasks += open_tasks
    # Groups read by few tensors (replicated norms live in one rank's file) leave small tasks:
    # fold each into a larger one it fits, rather than writing a shard of a few kilobytes.
    tasks.sort(key=lambda t: (-t.out_bytes, t.units[0].tensor))
    merged: list[ConvertTask] = []
    for task in tasks:
        home = next((t for t in merged if t.out_bytes + task.out_bytes <= max_task_bytes), None)
        if home is not None and task.out_bytes < max_task_bytes // 4:
            home.units += task.units
        else:
            merged.append(task)
    return sorted(merged, key=lambda t: (-t.out_bytes, t.units[0].tensor))

