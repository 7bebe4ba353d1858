"""Routed-expert sidecars in the JetStream object store (real nats-server), and the blob format."""

from __future__ import annotations

import numpy as np
import pytest

from rollmesh.bus.routed_experts_store import ObjectStoreRoutedExperts
from rollmesh.routed_expert_rows import RoutedExpertsError, decode_rows, encode_rows, join_turns

pytestmark = pytest.mark.timeout(60)


def rows(start: int, end: int) -> np.ndarray:
    """[positions, layers, top_k] expert ids (uint16: a model with more than 256 experts)."""
    return (np.arange(start * 6, end * 6) % 65_536).astype(np.uint16).reshape(-1, 3, 2)


def test_a_turns_blob_round_trips_with_its_start_and_dtype():
    start, back = decode_rows(encode_rows(17, rows(17, 40)))
    assert start == 17 and back.dtype == np.uint16 and np.array_equal(back, rows(17, 40))


def test_turns_join_in_position_order_and_a_gap_or_a_bad_blob_is_refused():
    assert np.array_equal(join_turns([(10, rows(10, 25)), (0, rows(0, 10))]), rows(0, 25))
    with pytest.raises(RoutedExpertsError, match="previous turn ended at 10"):
        join_turns([(0, rows(0, 10)), (11, rows(11, 20))])
    with pytest.raises(RoutedExpertsError):
        decode_rows(b"\x00" * 8 + b"not npy")


async def test_object_store_keeps_every_turn_and_a_retried_turn_replaces_its_rows(nats_client, namespace):
    store = ObjectStoreRoutedExperts(nats_client.jetstream(), namespace)
    big = rows(0, 120_000)  # 1.4 MiB: past one NATS message, chunked by the object store
    ref = await store.save_turn("rollout/with spaces", 1, 0, np.zeros((5, 3, 2), np.uint16))
    assert await store.save_turn("rollout/with spaces", 1, 0, big) == ref  # turn 1 run again
    await store.save_turn("rollout/with spaces", 2, 120_000, rows(120_000, 120_050))
    assert np.array_equal(await store.load(ref), rows(0, 120_050))
    # A second client (another worker, after a restart) reads the same rows.
    again = ObjectStoreRoutedExperts(nats_client.jetstream(), namespace)
    assert len(await again.load(ref)) == 120_050
