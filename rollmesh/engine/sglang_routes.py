"""SGLang's routed-expert payload (``meta_info.routed_experts``) as our compact rows.

Knows numpy and the payload's layout; knows nothing of HTTP or servers (``sglang_client``).
Checked against sgl-project/sglang read through the code index:
- ``python/sglang/srt/layers/moe/routed_experts_capturer.py`` (both stored versions): the capture
  buffers are ``[tokens, hf_text_config.num_hidden_layers, num_experts_per_tok]``, written only by the MoE
  layers, so a dense layer's entries stay 0. Our rows are [rows, sparse layers, top_k] (what
  routing replay trains on), so a full-width row is cut to the sparse layers' columns
  (``RoutedExpertsShape.sparse_layers``); a build that sends only the sparse layers is read as is.
  A request that stops may come back with one row more than ``seqlen - 1`` (the "stop edge": the
  final token was forwarded too); Miles (``miles/rollout/sglang_rollout.py``) drops that row, and
  so do we.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rollmesh.engine.models.hf_config import HFModelConfig


@dataclass(frozen=True, slots=True)
class RoutedExpertsShape:
    """What a routed-expert row looks like: SGLang sends flat int32, so the client must know it."""

    num_layers: int  # the sparse (MoE) layers: the width of the rows we return
    top_k: int
    num_experts: int
    # The decoder layers that are sparse, out of ``num_hidden_layers`` (SGLang's row width).
    # None: every layer is sparse, and SGLang's rows are num_layers wide.
    sparse_layers: tuple[int, ...] | None = None
    num_hidden_layers: int | None = None

    def __post_init__(self) -> None:
        if self.sparse_layers is None and self.num_hidden_layers not in (None, self.num_layers):
            raise ValueError(f"{self.num_hidden_layers} hidden layers and {self.num_layers} sparse "
                             "ones need sparse_layers to say which")
        if self.sparse_layers is not None:
            if len(self.sparse_layers) != self.num_layers or self.num_hidden_layers is None:
                raise ValueError(f"sparse_layers {self.sparse_layers} must name num_layers={self.num_layers} "
                                 "layers out of num_hidden_layers")
            if any(not 0 <= layer < self.num_hidden_layers for layer in self.sparse_layers):
                raise ValueError(f"sparse_layers {self.sparse_layers} outside [0, {self.num_hidden_layers})")

    @classmethod
    def of_model(cls, config: HFModelConfig) -> RoutedExpertsShape | None:
        """The shape of a model directory's routes (``read_hf_config``); None for a dense model."""
        moe = config.moe
        if moe is None:
            return None
        return cls(num_layers=len(moe.sparse_layers), top_k=moe.num_experts_per_tok,
                   num_experts=moe.num_experts, sparse_layers=tuple(moe.sparse_layers),
                   num_hidden_layers=config.num_hidden_layers)

    @property
    def wire_layers(self) -> int:
        """SGLang's row width: every decoder layer."""
        return self.num_hidden_layers if self.num_hidden_layers is not None else self.num_layers

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        return np.uint8 if self.num_experts <= 256 else np.uint16


def decode_routed_experts(
    encoded: str, shape: RoutedExpertsShape, *, seqlen: int, start_len: int
) -> tuple[np.ndarray, bool]:
    """Base64 int32 rows -> compact [rows, sparse layers, top_k] for ``[start_len, seqlen - 1)``.

    Rows may come ``num_hidden_layers`` wide (SGLang's capturer; cut to the sparse layers here) or
    sparse-layers wide, and with one row more than asked (the stop edge, dropped as Miles does).
    Returns the rows and whether the server ignored ``routed_experts_start_len`` (some builds
    return the full ``[0, seqlen - 1)`` anyway; joining those per-turn blobs over-counts and
    crashes replay, strands-sglang PR #72), in which case the rows are sliced here.
    Raises ValueError for a payload that fits no reading or holds out-of-range experts.
    """
    try:
        flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype="<i4")
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"routed_experts is not base64 of int32: {exc}") from exc
    full_rows, wanted_rows = seqlen - 1, max(0, seqlen - 1 - start_len)
    # (rows sent, rows to skip at the start): as asked, or from position 0 (start ignored); each
    # with the stop edge's extra row or without.
    readings = [(wanted_rows, 0), (wanted_rows + 1, 0)]
    if start_len > 0:
        readings += [(full_rows, start_len), (full_rows + 1, start_len)]
    for width in dict.fromkeys((shape.wire_layers, shape.num_layers)):  # SGLang's width first
        for sent, skip in readings:
            if flat.size == sent * width * shape.top_k:
                rows = flat.reshape(sent, width, shape.top_k)[skip:skip + wanted_rows]
                if width != shape.num_layers:
                    rows = rows[:, list(shape.sparse_layers or ()), :]
                return _checked_experts(rows, shape), skip > 0
    raise ValueError(
        f"{flat.size} expert ids fit no reading of positions [{start_len}, {full_rows}) in rows of "
        f"{shape.wire_layers} (or {shape.num_layers} sparse) layers x top {shape.top_k}"
    )


def _checked_experts(rows: np.ndarray, shape: RoutedExpertsShape) -> np.ndarray:
    if rows.size and (rows.min() < 0 or rows.max() >= shape.num_experts):
        raise ValueError(f"expert ids outside [0, {shape.num_experts})")
    return rows.astype(shape.dtype)
