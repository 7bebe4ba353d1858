"""Helpers for tests that spawn rollmesh actors on the session's Ray themselves."""

from __future__ import annotations

import ray


def stop_and_kill(*actors) -> None:
    """Stop each actor (best effort, 10 s) and kill it, in the order given."""
    for actor in actors:
        try:
            ray.get(actor.stop.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - best effort: the actor is killed next anyway
            pass
        ray.kill(actor)
