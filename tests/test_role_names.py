"""One ``<Role>Logic`` per role, in its domain package, wrapped directly by ``<Role>Actor``
(CONTRIBUTING.md, "Roles").

Each role shell declares the class it serves (``RoleActor.logic_class``), and ``RoleActor.start``
refuses a built logic of another class, so the declaration is what runs. The inference shells
serve their engine's ``WeightFollower`` (the engine is the role's logic, called directly by the
router), so for them only the "domain package" half of the rule applies.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import rollmesh.actors
from rollmesh.actors.role_base import RoleActor
from rollmesh.mesh_address import MeshAddress

pytestmark = pytest.mark.unit

DOMAIN_PACKAGES = ("engine", "rollout", "training", "sandbox", "checkpoint", "scheduling", "inference", "telemetry")
# Shells whose role logic is an inference engine; what they serve is its weight follower.
ENGINE_SHELLS = {"PrefillWorkerActor", "DecodeWorkerActor", "SGLangWorkerActor"}


def role_actors() -> list[type[RoleActor]]:
    found = {}
    for module_info in pkgutil.iter_modules(rollmesh.actors.__path__):
        module = importlib.import_module(f"rollmesh.actors.{module_info.name}")
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, RoleActor) and value is not RoleActor
                    and value.__module__ == module.__name__):
                found[name] = value
    return [found[name] for name in sorted(found)]


def test_every_role_shell_in_actors_is_found() -> None:
    names = {actor.__name__ for actor in role_actors()}
    assert {"RolloutWorkerActor", "TrainerActor", "SandboxBrokerActor", "ResharderActor", "GpuSchedulerActor",
            *ENGINE_SHELLS} <= names
    assert all(name.endswith("Actor") for name in names)


@pytest.mark.parametrize("actor", role_actors(), ids=lambda actor: actor.__name__)
def test_each_role_actor_wraps_its_role_logic_from_a_domain_package(actor: type[RoleActor]) -> None:
    logic = actor.logic_class
    assert logic is not object, f"{actor.__name__} declares no logic_class"
    package = logic.__module__.split(".")[1]
    assert package in DOMAIN_PACKAGES, f"{actor.__name__}'s logic lives in {logic.__module__}"
    if actor.__name__ not in ENGINE_SHELLS:
        assert logic.__name__ == actor.__name__.removesuffix("Actor") + "Logic"


async def test_a_shell_refuses_to_serve_logic_other_than_its_declared_class(tmp_path) -> None:
    class WidgetLogic:
        def subscriptions(self) -> list:
            return []

    class WidgetActor(RoleActor):
        role = "widget"
        logic_class = WidgetLogic

        async def build_logic(self, publisher):
            return object()

    actor = WidgetActor("widget", MeshAddress(namespace="ns", nats_url="nats://127.0.0.1:1", run_dir=str(tmp_path)))

    async def connected():
        return None

    actor.shell.connect = connected  # no bus: the check runs before anything is served
    with pytest.raises(TypeError, match="WidgetActor built a object, not its WidgetLogic"):
        await actor.start()
    assert actor.logic is None
