"""The order a stage reads its dataset in, over epochs: file order, or shuffled by a seed.

A global ``position`` (0, 1, 2, ... across epochs) maps to ``(epoch, index)``: the epoch is
``position // num_rows``; within it, rows come in file order or in
``numpy.random.default_rng([seed, epoch]).permutation(num_rows)`` (PCG64 seeded through
SeedSequence, which uses no Python ``hash``: the same in every process and Python version). The
order's whole state is ``(num_rows, shuffle, seed)``, so a durable cursor that stores a position
resumes exactly. Knows numpy; nothing of files or rows.
"""

from __future__ import annotations

import numpy as np


class EpochOrder:
    """Which row comes at each position, epoch after epoch."""

    def __init__(self, num_rows: int, *, shuffle: bool, seed: int) -> None:
        if num_rows < 1:
            raise ValueError(f"an order needs at least one row (got {num_rows})")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (got {seed}): numpy's SeedSequence takes no negative")
        self.num_rows, self.shuffle, self.seed = num_rows, shuffle, seed
        # One epoch's permutation is kept (4 bytes a row below 2**32 rows): positions are read
        # mostly in order, so it is drawn again only when the epoch changes.
        self._epoch = -1
        self._permutation: np.ndarray | None = None

    def at(self, position: int) -> tuple[int, int]:
        """``(epoch, index)`` of the row read at ``position``."""
        if position < 0:
            raise ValueError(f"position must be >= 0 (got {position})")
        epoch, offset = divmod(position, self.num_rows)
        if not self.shuffle:
            return epoch, offset
        return epoch, int(self.permutation(epoch)[offset])

    def permutation(self, epoch: int) -> np.ndarray:
        """Row indices in the order ``epoch`` reads them (shuffled orders only)."""
        if epoch != self._epoch or self._permutation is None:
            # Shuffling an arange in place is what Generator.permutation(n) does, in the
            # narrowest dtype: the same order without an int64 copy of every index.
            dtype = np.uint32 if self.num_rows <= np.iinfo(np.uint32).max else np.int64
            permutation = np.arange(self.num_rows, dtype=dtype)
            np.random.default_rng([self.seed, epoch]).shuffle(permutation)
            self._permutation, self._epoch = permutation, epoch
        return self._permutation

    def __repr__(self) -> str:
        return f"EpochOrder({self.num_rows}, shuffle={self.shuffle}, seed={self.seed})"
