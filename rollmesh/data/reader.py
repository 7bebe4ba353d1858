"""Rows of a dataset in a stage's reading order, bad rows reported and skipped.

``read(position)`` returns the first good row at or after ``position`` and the position after it,
so a caller that stores the returned position resumes exactly, skipping the same bad rows again:
the same position always gives the same row. Each bad row is reported through ``on_bad_row`` once
per epoch and counted in ``bad_rows``; when every row is bad, ``EmptyDatasetError`` ends the
search instead of a loop. Knows datasets, row mapping and order; nothing of NATS, Ray or torch.
"""

from __future__ import annotations

from collections.abc import Callable

from rollmesh.data.dataset import Dataset
from rollmesh.data.errors import BadRowError, EmptyDatasetError
from rollmesh.data.order import EpochOrder
from rollmesh.data.rows import PromptRow, map_row
from rollmesh.run_config import FieldMap, StageKind


class PromptReader:
    """A stage's dataset read position by position over epochs."""

    def __init__(self, dataset: Dataset, fields: FieldMap, kind: StageKind, order: EpochOrder,
                 on_bad_row: Callable[[BadRowError], None] | None = None) -> None:
        if len(dataset) == 0:
            raise EmptyDatasetError(dataset.path, bad_rows=0)
        if order.num_rows != len(dataset):
            raise ValueError(f"an order over {order.num_rows} rows for {dataset.path}, "
                             f"which has {len(dataset)}")
        self.dataset, self.fields, self.kind, self.order = dataset, fields, kind, order
        self.on_bad_row = on_bad_row
        self.bad_rows = 0  # reports so far: a bad row counts once in each epoch it is met
        # Indices known bad (rows do not change while a file is read): when all are, no epoch
        # can yield a row. Bad rows are few, so this stays small.
        self._bad_indices: set[int] = set()
        self._reported_epoch = -1
        self._reported: set[int] = set()

    def read(self, position: int) -> tuple[int, PromptRow, int, int]:
        """``(next_position, row, epoch, index)``: the first good row at or after ``position``."""
        while True:
            epoch, index = self.order.at(position)
            try:
                raw = self.dataset.raw_row(index)
                row = map_row(raw, self.fields, kind=self.kind, path=self.dataset.path,
                              row=self.dataset.row_label(index))
            except BadRowError as exc:
                self._report(epoch, index, exc)
                position += 1
                continue
            return position + 1, row, epoch, index

    def _report(self, epoch: int, index: int, error: BadRowError) -> None:
        if epoch != self._reported_epoch:
            self._reported_epoch, self._reported = epoch, set()
        if index not in self._reported:
            self._reported.add(index)
            self.bad_rows += 1
            if self.on_bad_row is not None:
                self.on_bad_row(error)
        self._bad_indices.add(index)
        if len(self._bad_indices) == len(self.dataset):
            raise EmptyDatasetError(self.dataset.path, bad_rows=len(self._bad_indices))
