"""Sequence packing for supervised steps: examples laid end to end in rows of at most
``max_seq_len`` tokens, with positions and attention reset at every example boundary, so a
packed row trains exactly what its examples would train one by one.

Knows token ids, loss masks and torch tensors; nothing of models, backends, chat templates or
datasets. The backends (``torch_backend``, ``megatron_backend``) feed ``collate_rows``' batch to
their models; what an example is and which tokens it trains is the caller's.

The target shift at a boundary: position t predicts token t+1, so a segment's last position
would predict the next segment's first token. ``collate_rows`` never trains that target (nor any
segment's first token: alone, it has no position before it), whatever the row's ``loss_mask``
says there, so a hand-built row cannot leak either.

First-fit decreasing is hand-written (a max segment tree over the rows' free space, O(n log n)):
it is twenty lines, and the bin-packing libraries on PyPI either lack a deterministic
first-fit-decreasing or want a fixed bin count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollmesh.training.errors import PackingError, SequenceTooLongError

# (ids, loss_mask): one example, as the backends' ``sft_step`` took it before packing.
Example = tuple[Sequence[int], Sequence[int]]

# torch is imported where tensors are made: the trainer's module (which the launcher imports for
# the actor class) reaches this file through the supervised loop, long before a batch exists.
if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PackedRow:
    """One row: ``ids`` and ``loss_mask`` (1 = the token is trained as a target) of its examples
    end to end, ``segment_lengths`` their lengths in order (summing to ``len(ids)``)."""

    ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    segment_lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(int(i) for i in self.ids))
        object.__setattr__(self, "loss_mask", tuple(int(m) for m in self.loss_mask))
        object.__setattr__(self, "segment_lengths", tuple(int(n) for n in self.segment_lengths))
        if len(self.loss_mask) != len(self.ids):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(self.ids)} ids")
        if sum(self.segment_lengths) != len(self.ids) or any(n <= 0 for n in self.segment_lengths):
            raise ValueError(f"segment_lengths {self.segment_lengths} are not positive lengths summing to "
                             f"{len(self.ids)}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask holds values other than 0 and 1")

    @classmethod
    def single(cls, ids: Sequence[int], loss_mask: Sequence[int]) -> "PackedRow":
        """A row of one example (what an unpacked ``(ids, loss_mask)`` pair becomes)."""
        return cls(tuple(ids), tuple(loss_mask), (len(ids),))


def pack_sequences(sequences: Sequence[Example], max_seq_len: int) -> list[PackedRow]:
    """``sequences`` packed first-fit decreasing into rows of at most ``max_seq_len`` tokens:
    longest first (ties by input order), each into the first row with room. Deterministic.
    An example longer than ``max_seq_len``: ``SequenceTooLongError`` (cutting an SFT example
    would train a truncated answer, silently; that choice belongs to the caller)."""
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len {max_seq_len} must be positive")
    for index, (ids, mask) in enumerate(sequences):
        if len(ids) == 0:
            raise PackingError("no tokens", index=index)
        if len(mask) != len(ids):
            raise PackingError(f"loss_mask has {len(mask)} entries for {len(ids)} ids", index=index)
        if len(ids) > max_seq_len:
            raise SequenceTooLongError(index=index, length=len(ids), max_seq_len=max_seq_len)
    order = sorted(range(len(sequences)), key=lambda i: (-len(sequences[i][0]), i))
    free = _FreeSpace(len(sequences), max_seq_len)
    rows: list[list[int]] = []
    for index in order:
        row = free.take_first(len(sequences[index][0]))
        if row == len(rows):
            rows.append([])
        rows[row].append(index)
    return [PackedRow(tuple(t for i in members for t in sequences[i][0]),
                      tuple(m for i in members for m in sequences[i][1]),
                      tuple(len(sequences[i][0]) for i in members)) for members in rows]


class _FreeSpace:
    """Free space of up to ``count`` rows of ``capacity`` in a max segment tree: the first row
    with room for ``size`` in O(log count) (unopened rows are empty, so one always has room)."""

    def __init__(self, count: int, capacity: int) -> None:
        self.leaves = 1
        while self.leaves < max(count, 1):
            self.leaves *= 2
        self.tree = [capacity] * (2 * self.leaves)

    def take_first(self, size: int) -> int:
        node = 1
        while node < self.leaves:
            node = 2 * node if self.tree[2 * node] >= size else 2 * node + 1
        self.tree[node] -= size
        row = node - self.leaves
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2
        return row


def position_ids(row: PackedRow) -> list[int]:
    """Each token's position in its own example: 0 at every segment start."""
    return [p for length in row.segment_lengths for p in range(length)]


def segment_ids(row: PackedRow) -> list[int]:
    """Each token's segment: 0, 1, ... in row order."""
    return [s for s, length in enumerate(row.segment_lengths) for _ in range(length)]


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, T, T] from segment ids [B, T]: True where query t may attend key s (s <= t,
    same segment). Padding must carry a segment id of its own (``collate_rows`` gives -1): its
    positions then attend each other, so no query row is all False (a fully masked softmax row
    is NaN in torch's attention, and NaN times a zero mask is still NaN)."""
    import torch

    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]


@dataclass(frozen=True)
class PackedBatch:
    """Rows right-padded to the longest, shifted for next-token prediction (T = longest - 1):
    ``inputs``/``targets`` [B, T] ids, ``mask`` [B, T] float (1 = target trained; never a
    segment's first token), ``positions`` [B, T] (reset per segment), ``segments`` [B, T] (-1 on
    padding), ``tokens`` real tokens (padding excluded)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    tokens: int

    @property
    def trained_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def attention(self) -> torch.Tensor:
        """The block-diagonal causal mask of ``inputs`` (``block_causal_mask``)."""
        return block_causal_mask(self.segments)


def collate_rows(rows: Sequence[PackedRow], *, pad_id: int) -> PackedBatch:
    """``rows`` as one right-padded ``PackedBatch`` (the shift and boundary rule: module docstring)."""
    if not rows:
        raise ValueError("no rows to collate")
    import torch

    length = max(len(row.ids) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length)
    positions = torch.zeros(len(rows), length, dtype=torch.long)
    segments = torch.full((len(rows), length), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        size = len(row.ids)
        ids[r, :size] = torch.tensor(row.ids)
        mask[r, :size] = torch.tensor(row.loss_mask, dtype=torch.float32)
        positions[r, :size] = torch.tensor(position_ids(row))
        # Padding continues the positions (any will do: it is never a target nor seen by a real token).
        positions[r, size:] = torch.arange(length - size)
        segments[r, :size] = torch.tensor(segment_ids(row))
    mask[positions == 0] = 0.0  # segment starts: the boundary target (module docstring)
    return PackedBatch(inputs=ids[:, :-1], targets=ids[:, 1:], mask=mask[:, 1:], positions=positions[:, :-1],
                       segments=segments[:, :-1], tokens=sum(len(row.ids) for row in rows))


def as_rows(batch: Sequence[PackedRow | Example]) -> list[PackedRow]:
    """A backend's ``sft_step`` input as rows: a ``PackedRow`` as it is, an (ids, loss_mask)
    pair as a one-example row."""
    return [item if isinstance(item, PackedRow) else PackedRow.single(*item) for item in batch]
