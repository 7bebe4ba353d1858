"""GPU scheduler grants from declared counts, with fake clock and ids (no Ray, no GPUs)."""

from __future__ import annotations

import itertools

import pytest

from rollmesh.config import SchedulerConfig
from rollmesh.messages import GpuGranted, GpuReleased
from rollmesh.scheduling import (
    GpuScheduler,
    InvalidGrantError,
    MissingHolderError,
    OverCommittedError,
    UnknownGrantError,
)

pytestmark = pytest.mark.unit

HOLDERS = {"trainer": "trainer-0", "decode": "decode-0", "prefill": "prefill-0"}


def make_scheduler(**config) -> GpuScheduler:
    ids = (f"g{n}" for n in itertools.count())
    return GpuScheduler(SchedulerConfig(**config), clock=lambda: 100.0, new_id=lambda: next(ids))


def test_scheduler_grants_declared_counts_to_holders() -> None:
    scheduler = make_scheduler(total_gpus=4, grants={"trainer": 2, "decode": 0.5})
    granted = scheduler.initial_grants(HOLDERS)
    assert granted == [
        GpuGranted(grant_id="g0", holder="trainer-0", role="trainer", count=2,
                   resource="rollmesh_gpu", granted_at=100.0),
        GpuGranted(grant_id="g1", holder="decode-0", role="decode", count=0.5,
                   resource="rollmesh_gpu", granted_at=100.0),
    ]
    assert scheduler.grants() == granted


def test_scheduler_with_no_gpus_and_no_grants_grants_nothing() -> None:
    scheduler = make_scheduler()
    assert scheduler.initial_grants(HOLDERS) == []
    assert scheduler.ray_resources() == {}
    assert scheduler.actor_options("trainer") == {}


def test_scheduler_grants_each_role_once() -> None:
    scheduler = make_scheduler(total_gpus=2, grants={"trainer": 2})
    scheduler.initial_grants(HOLDERS)
    assert scheduler.initial_grants(HOLDERS) == []
    assert len(scheduler.grants()) == 1


def test_scheduler_refuses_to_over_commit_and_grants_nothing() -> None:
    scheduler = make_scheduler(total_gpus=2, grants={"trainer": 2, "decode": 1})
    with pytest.raises(OverCommittedError) as caught:
        scheduler.initial_grants(HOLDERS)
    error = caught.value
    assert (error.resource, error.total, error.held) == ("rollmesh_gpu", 2, 0)
    assert error.requested == {"trainer": 2, "decode": 1}
    assert scheduler.grants() == []


def test_scheduler_fractional_grants_that_fill_capacity_are_not_over_committed() -> None:
    scheduler = make_scheduler(total_gpus=1, grants={"a": 0.1, "b": 0.2, "c": 0.7})
    assert len(scheduler.initial_grants({"a": "a-0", "b": "b-0", "c": "c-0"})) == 3


@pytest.mark.parametrize("count", [-1.0, float("nan"), float("inf")])
def test_scheduler_rejects_counts_that_are_not_amounts(count: float) -> None:
    scheduler = make_scheduler(total_gpus=8, grants={"trainer": count})
    with pytest.raises(InvalidGrantError) as caught:
        scheduler.initial_grants(HOLDERS)
    assert caught.value.role == "trainer"
    assert scheduler.grants() == []


def test_scheduler_rejects_fractional_real_gpus_above_one_but_not_custom_ones() -> None:
    with pytest.raises(InvalidGrantError):
        scheduler = make_scheduler(total_gpus=8, resource="GPU", grants={"trainer": 1.5})
        scheduler.initial_grants(HOLDERS)
    custom = make_scheduler(total_gpus=8, grants={"trainer": 1.5})
    assert custom.initial_grants(HOLDERS)[0].count == 1.5


def test_scheduler_needs_a_holder_for_every_granted_role() -> None:
    scheduler = make_scheduler(total_gpus=2, grants={"simulator": 1})
    with pytest.raises(MissingHolderError) as caught:
        scheduler.initial_grants(HOLDERS)
    assert caught.value.role == "simulator"


def test_scheduler_release_frees_the_grant_once() -> None:
    scheduler = make_scheduler(total_gpus=2, grants={"trainer": 2})
    (grant,) = scheduler.initial_grants(HOLDERS)
    released = scheduler.release(grant.grant_id)
    assert released == GpuReleased(grant_id="g0", holder="trainer-0", count=2, released_at=100.0)
    assert scheduler.grants() == []
    assert scheduler.actor_options("trainer") == {}
    with pytest.raises(UnknownGrantError) as caught:
        scheduler.release(grant.grant_id)
    assert caught.value.grant_id == "g0"


def test_scheduler_options_use_a_custom_resource_on_cpu_only_clusters() -> None:
    scheduler = make_scheduler(total_gpus=4, resource="rollmesh_gpu", grants={"trainer": 1})
    scheduler.initial_grants(HOLDERS)
    assert scheduler.ray_resources() == {"rollmesh_gpu": 4.0}
    assert scheduler.actor_options("trainer") == {"resources": {"rollmesh_gpu": 1}}
    assert scheduler.actor_options("decode") == {}


def test_scheduler_options_use_num_gpus_for_real_gpus() -> None:
    scheduler = make_scheduler(total_gpus=4, resource="GPU", grants={"trainer": 2, "decode": 0.5})
    scheduler.initial_grants(HOLDERS)
    assert scheduler.ray_resources() == {}
    assert scheduler.actor_options("trainer") == {"num_gpus": 2}
    assert scheduler.actor_options("decode") == {"num_gpus": 0.5}


def test_scheduler_applies_a_custom_allocation_policy_within_capacity() -> None:
    class HalfPolicy:
        def allocate(self, requested, *, capacity, held):
            return {role: count / 2 for role, count in requested.items()}

    ids = iter(["only"])
    scheduler = GpuScheduler(
        SchedulerConfig(total_gpus=1, grants={"trainer": 2}),
        clock=lambda: 0.0, new_id=lambda: next(ids), policy=HalfPolicy(),
    )
    (grant,) = scheduler.initial_grants(HOLDERS)
    assert grant.count == 1


def test_scheduling_package_exports_what_it_states() -> None:
    import rollmesh.scheduling as package

    assert all(hasattr(package, name) for name in package.__all__)
