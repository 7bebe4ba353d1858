"""Routed-expert rows of a rollout (MoE models): what each forwarded position was routed to, kept
turn by turn in a sidecar next to the rollout's state, for routing replay in training. This module
holds their blob format and how turns join; the stores that implement
``rollmesh.ports.RoutedExpertsStore`` (the JetStream object store in
``rollmesh.bus.routed_experts_store``, the in-memory one in ``rollmesh.rollout.routed_experts``)
both use it. Top-level, as ``ports.py`` is, because the bus must not import a domain package.

Knows numpy; nothing of NATS. A turn's rows cover positions ``[start, start + len(rows))`` of the
trajectory: the first turn from 0, each later one from where the previous ended (the engine's
``routed_experts_start_len``), so the turns of a finished rollout join into one array with a row
per position but the last.
"""

from __future__ import annotations

import io
import struct

import numpy as np

_START = struct.Struct("<q")


class RoutedExpertsError(ValueError):
    """Stored rows that do not join up (a gap or an overlap between turns, a bad blob)."""


def encode_rows(start: int, rows: np.ndarray) -> bytes:
    """One turn's rows as bytes: its start position, then the array in ``.npy`` format."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(rows), allow_pickle=False)
    return _START.pack(start) + buffer.getvalue()


def decode_rows(data: bytes) -> tuple[int, np.ndarray]:
    if len(data) < _START.size:
        raise RoutedExpertsError(f"a routed-experts blob of {len(data)} bytes")
    (start,) = _START.unpack_from(data)
    try:
        rows = np.load(io.BytesIO(data[_START.size:]), allow_pickle=False)
    except ValueError as exc:
        raise RoutedExpertsError(f"undecodable routed-experts rows: {exc}") from exc
    return start, rows


def join_turns(turns: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """The turns' rows as one array, in position order; raises if they leave a gap or overlap."""
    if not turns:
        raise RoutedExpertsError("no routed-experts rows")
    ordered = sorted(turns, key=lambda turn: turn[0])
    expected = ordered[0][0]
    if expected != 0:
        raise RoutedExpertsError(f"the rows start at position {expected}, not 0")
    for start, rows in ordered:
        if start != expected:
            raise RoutedExpertsError(f"rows from position {start}, but the previous turn ended at {expected}")
        expected = start + len(rows)
    return np.concatenate([rows for _, rows in ordered])


def rollout_ref(prefix: str, rollout_key: str) -> str:
    return f"{prefix}/{rollout_key}"

