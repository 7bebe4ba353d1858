"""The conversion plan, from a checkpoint's metadata only: byte-sized tasks, largest first,
grouped by source file, each within a memory budget.

Knows the chunk geometry; nothing of torch or files' contents. Each stored tensor is a unit of
work (its HF tensors need all of it: QKV de-interleave, gate/up split), except grouped expert
tensors, which split into runs of whole experts so one huge MoE tensor never has to sit in memory
at once. Units are packed into tasks of at most ``max_task_bytes``, preferring units that read the
same source files (a task opens few files, and a file is read by few tasks), then sorted largest
first so parallel workers finish together (LPT). A unit larger than the budget on its own is an
error that names it: the budget could never hold it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollmesh.checkpoint.chunk_geometry import Box


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
    expert_axis: bool = False  # a grouped-experts tensor: axis 0 counts experts

    @property
    def nbytes(self) -> int:
        return Box.whole(self.shape).numel * self.itemsize


@dataclass(frozen=True)
class WorkUnit:
    """A tensor, or a run of whole experts of one: ``region`` is the part of it to convert."""

    tensor: str
    region: Box
    nbytes: int
    files: frozenset[str]


@dataclass
class ConvertTask:
    units: list[WorkUnit] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(unit.nbytes for unit in self.units)

    @property
    def files(self) -> frozenset[str]:
        return frozenset(f for unit in self.units for f in unit.files)


class TaskTooLargeError(ValueError):
    def __init__(self, tensor: str, nbytes: int, budget: int) -> None:
        super().__init__(f"{tensor}: {nbytes} bytes cannot fit a task budget of {budget} bytes")
        self.tensor, self.nbytes, self.budget = tensor, nbytes, budget


def work_units(tensor: TensorInfo, *, max_task_bytes: int) -> list[WorkUnit]:
    """The tensor whole, or (experts) runs of whole experts of at most ``max_task_bytes``."""
    whole = Box.whole(tensor.shape)
    if tensor.nbytes <= max_task_bytes or not tensor.expert_axis:
        if tensor.nbytes > max_task_bytes:
            raise TaskTooLargeError(tensor.name, tensor.nbytes, max_task_bytes)
        return [WorkUnit(tensor.name, whole, tensor.nbytes, frozenset(c.file for c in tensor.chunks))]
    per_expert = tensor.nbytes // tensor.shape[0]
    run = max_task_bytes // per_expert
    if run < 1:
        raise TaskTooLargeError(f"{tensor.name} (one expert)", per_expert, max_task_bytes)
    units = []
    for first in range(0, tensor.shape[0], run):
        count = min(run, tensor.shape[0] - first)
        region = Box((first,) + whole.offsets[1:], (count,) + whole.sizes[1:])
        files = frozenset(c.file for c in tensor.chunks if c.box.intersect(region) is not None)
        units.append(WorkUnit(tensor.name, region, count * per_expert, files))
    return units


def plan_tasks(tensors: Sequence[TensorInfo], *, max_task_bytes: int) -> list[ConvertTask]:
    """Pack every tensor's units into tasks (see the module docstring); largest task first."""
    units = [unit for tensor in tensors for unit in work_units(tensor, max_task_bytes=max_task_bytes)]
    # Group by the files a unit reads, then first-fit-decreasing within and across groups.
    by_files: dict[frozenset[str], list[WorkUnit]] = defaultdict(list)
    for unit in units:
        by_files[unit.files].append(unit)
    tasks: list[ConvertTask] = []
    for files in sorted(by_files, key=lambda f: sorted(f)):
        open_tasks: list[ConvertTask] = []
        for unit in sorted(by_files[files], key=lambda u: (-u.nbytes, u.tensor, u.region.offsets)):
            home = next((t for t in open_tasks if t.nbytes + unit.nbytes <= max_task_bytes), None)
            if home is None:
                home = ConvertTask()
                open_tasks.append(home)
            home.units.append(unit)
        tasks += open_tasks
    return sorted(tasks, key=lambda t: (-t.nbytes, sorted(t.files)))


def describe_plan(tasks: Sequence[ConvertTask]) -> list[str]:
    """Lines for ``--dry-run``: one per task (bytes, files, tensors)."""
    lines = []
    for index, task in enumerate(tasks):
        names = sorted({unit.tensor for unit in task.units})
        lines.append(f"task {index}: {task.nbytes} bytes, {len(task.files)} file(s), {len(task.units)} unit(s): "
                     f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
    return lines
