"""The KubeRay manifests (deploy/kuberay/): valid against KubeRay's CRD schemas and Kubernetes'
own, and consistent with rollmesh (its config loads, each role has a group that declares its
resources and holds its NATS password, the RayService's app builder builds the app).

The CRD schemas (the ``openAPIV3Schema`` of each CRD) are read from ``shared/schemas/kuberay/``
beside the repository (CI puts ``shared/`` there); they are not copied into the repository, and
where that folder is absent the CRD checks skip, saying so. They are checked strictly, as
``kubectl apply --validate=strict`` would: an object with declared properties takes no others
(unless the schema says ``x-kubernetes-preserve-unknown-fields``), and ``x-kubernetes-int-or-string``
takes an integer or a string. Core objects (and every pod template, as a Pod) are checked with
kubernetes-validate's strict schemas of Kubernetes ``KUBERNETES_VERSION``.
"""

from __future__ import annotations

import copy
import importlib
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rollmesh.config import PLACED_ROLES, load_config

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

REPO_ROOT = Path(__file__).resolve().parent.parent
KUBERAY_DIR = REPO_ROOT / "deploy" / "kuberay"
SCHEMAS_DIR = REPO_ROOT.parent / "shared" / "schemas" / "kuberay"
# hostUsers, procMount and appArmorProfile, which the CPU group uses, are all in 1.30+.
KUBERNETES_VERSION = "1.33.0"
CORE_FILES = ["common.yaml", "runtimeclass-gvisor.yaml", "networkpolicy.yaml"]
# ray.role_resources role -> the NATS user (deploy/nats/accounts.conf) its actors connect as.
NATS_USER_OF_ROLE = {"scheduler": "scheduler", "sandbox": "sandbox_broker", "prefill": "inference",
                     "decode": "inference", "trainer": "trainer", "resharder": "resharder",
                     "rollout": "rollout_worker"}
SECRET_ENV = {"ROLLMESH_API_KEY", "RAY_AUTH_TOKEN"}
RAY_AUTH_ENV = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
RAY_AUTH_SECRET = {"name": "rollmesh-ray-auth", "key": "auth_token"}
RAY_POD = {"ray.io/is-ray-node": "yes"}  # the label KubeRay gives every pod of a Ray cluster


def documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((KUBERAY_DIR / name).read_text()) if doc]


def ray_cluster() -> dict[str, Any]:
    (cluster,) = documents("raycluster.yaml")
    return cluster


def ray_service() -> dict[str, Any]:
    (service,) = documents("rayservice.yaml")
    return service


def config_map() -> dict[str, Any]:
    return next(doc for doc in documents("common.yaml") if doc["kind"] == "ConfigMap")


def mesh_config(tmp_path: Path):
    path = tmp_path / "rollmesh.toml"
    path.write_text(config_map()["data"]["rollmesh.toml"])
    return load_config(path, environ={})


def all_pod_templates(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """"head" and each worker group's name -> its pod template."""
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates.update({group["groupName"]: group["template"] for group in spec["workerGroupSpecs"]})
    return templates


# -- CRD schemas -------------------------------------------------------------------------------

def crd_schema(file_name: str, kind: str) -> dict[str, Any]:
    if not SCHEMAS_DIR.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {SCHEMAS_DIR} (CI puts shared/ beside the "
                    "clone); the CRD checks need them")
    path = SCHEMAS_DIR / file_name
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return _strict_crd_schema(str(path), kind)


@cache
def _strict_crd_schema(path: str, kind: str) -> dict[str, Any]:
    crd = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == kind
    # The version the manifests use (apiVersion ray.io/v1) is the CRD's storage version.
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(version["schema"]["openAPIV3Schema"])


def _strict(schema: Any) -> Any:
    """The CRD's structural schema as JSON Schema: closed objects, int-or-string unions."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()
           if key not in ("properties", "additionalProperties")}
    if "properties" in schema:
        out["properties"] = {name: _strict(sub) for name, sub in schema["properties"].items()}
    if "additionalProperties" in schema:
        out["additionalProperties"] = _strict(schema["additionalProperties"])
    elif "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    return out


def crd_errors(instance: Any, schema: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
            for error in validator.iter_errors(instance)]


def test_strict_crd_schema_refuses_an_unknown_field_and_takes_int_or_string():
    schema = _strict({"type": "object", "properties": {
        "a": {"type": "string"},
        "port": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]},
        "size": {"x-kubernetes-int-or-string": True},
        "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {}}}})
    assert crd_errors({"a": "x", "port": 80, "size": "10Gi", "open": {"anything": 1}}, schema) == []
    assert crd_errors({"a": "x", "typo": 1}, schema)
    assert crd_errors({"size": [1]}, schema)


def test_raycluster_is_valid_against_the_raycluster_crd():
    schema = crd_schema("ray.io_rayclusters.yaml", "RayCluster")
    assert crd_errors(ray_cluster(), schema) == []


def test_raycluster_with_a_typo_is_refused_by_the_crd_check():
    schema = crd_schema("ray.io_rayclusters.yaml", "RayCluster")
    broken = copy.deepcopy(ray_cluster())
    broken["spec"]["workerGroupSpecs"][0]["replica"] = 1
    assert any("replica" in error for error in crd_errors(broken, schema))


def test_rayservice_is_valid_against_the_kuberay_crds():
    """Against the RayService CRD where shared/schemas/kuberay has one; otherwise its
    rayClusterConfig is checked against the RayCluster CRD's ``spec`` schema (the same type)."""
    service = ray_service()
    if (SCHEMAS_DIR / "ray.io_rayservices.yaml").is_file():
        schema = crd_schema("ray.io_rayservices.yaml", "RayService")
        assert crd_errors(service, schema) == []
    else:
        schema = crd_schema("ray.io_rayclusters.yaml", "RayCluster")["properties"]["spec"]
        assert crd_errors(service["spec"]["rayClusterConfig"], schema) == []


# -- core objects ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CORE_FILES)
def test_core_objects_are_valid_kubernetes(name):
    for doc in documents(name):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayservice.yaml"])
def test_every_pod_template_is_a_valid_pod(manifest):
    (doc,) = documents(manifest)
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterConfig"]
    for group, template in all_pod_templates(spec).items():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"rollmesh-{group}"},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


def test_kubernetes_validate_refuses_a_pod_with_a_typo():
    template = all_pod_templates(ray_cluster()["spec"])["cpu"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {**template["spec"], "hostUser": False}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


# -- consistency with rollmesh -----------------------------------------------------------------

def test_rayservice_runs_the_rayclusters_cluster_with_the_driver_serving_nothing():
    cluster_spec = copy.deepcopy(ray_cluster()["spec"])
    service_spec = ray_service()["spec"]["rayClusterConfig"]
    for spec in (cluster_spec, service_spec):
        driver = next(c for c in spec["headGroupSpec"]["template"]["spec"]["containers"]
                      if c["name"] == "rollmesh-mesh")
        driver["has_no_serve"] = "--no-serve" in driver["command"]
        driver["command"] = [arg for arg in driver["command"] if arg != "--no-serve"]
    assert _driver(service_spec)["has_no_serve"] and not _driver(cluster_spec)["has_no_serve"]
    _driver(service_spec).pop("has_no_serve"), _driver(cluster_spec).pop("has_no_serve")
    assert service_spec == cluster_spec


def _driver(spec: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in spec["headGroupSpec"]["template"]["spec"]["containers"]
                if c["name"] == "rollmesh-mesh")


def test_the_config_map_is_a_valid_rollmesh_config(tmp_path):
    config = mesh_config(tmp_path)
    assert config.nats.replicas == 3 and config.security.enabled
    assert config.sandbox.backend == "bwrap"  # never the process backend in a cluster
    assert config.sandbox.brokers == "per_node"  # tool code on every CPU pod, not on one
    assert set(config.ray.role_resources) == set(PLACED_ROLES)


def test_each_role_has_a_worker_group_declaring_room_for_all_its_actors(tmp_path):
    config = mesh_config(tmp_path)
    actors = {"rollout": config.rollout.num_workers, "decode": config.inference.num_decode_workers,
              "prefill": config.inference.prefill_worker_count}
    declared: dict[str, float] = {}
    for group in ray_cluster()["spec"]["workerGroupSpecs"]:
        for resource, amount in group.get("resources", {}).items():
            declared[resource] = declared.get(resource, 0.0) + float(amount) * group["replicas"]
    needed: dict[str, float] = {}
    for role, resources in config.ray.role_resources.items():
        for resource, amount in resources.items():
            needed[resource] = needed.get(resource, 0.0) + amount * actors.get(role, 1)
    for resource, amount in needed.items():
        assert declared.get(resource, 0.0) >= amount, (resource, amount, declared)


def test_accelerator_groups_declare_the_gpus_the_scheduler_grants(tmp_path):
    config = mesh_config(tmp_path)
    assert config.scheduler.resource == "GPU"
    groups = {g["groupName"]: g for g in ray_cluster()["spec"]["workerGroupSpecs"]}
    total = 0
    for role in ("trainer", "decode", "prefill"):
        group = groups[role]
        (container,) = group["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert group["rayStartParams"]["num-gpus"] == str(gpus), role
        assert f"rollmesh_{role}" in group["resources"], role
        assert config.scheduler.grants[role] <= gpus, role
        total += gpus * group["replicas"]
    assert config.scheduler.total_gpus <= total


def test_each_pod_holds_the_nats_passwords_of_the_roles_it_hosts_and_no_others(tmp_path):
    config = mesh_config(tmp_path)
    password_env = {user: creds.password_env for user, creds in config.security.credentials.items()}
    groups = ray_cluster()["spec"]["workerGroupSpecs"]
    for group in groups:
        hosted = {NATS_USER_OF_ROLE[role] for role, resources in config.ray.role_resources.items()
                  if set(resources) & set(group.get("resources", {}))}
        (container,) = group["template"]["spec"]["containers"]
        held = {env["name"] for env in container.get("env", [])} - RAY_AUTH_ENV
        assert held == {password_env[user] for user in hosted}, group["groupName"]
    driver = _driver(ray_cluster()["spec"])
    assert password_env["mesh"] in {env["name"] for env in driver["env"]}


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayservice.yaml"])
def test_secrets_come_from_kubernetes_secrets_never_from_the_manifest(manifest):
    (doc,) = documents(manifest)
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterConfig"]
    for template in all_pod_templates(spec).values():
        for container in template["spec"]["containers"]:
            for env in container.get("env", []):
                if env["name"].endswith("_PASSWORD") or env["name"] in SECRET_ENV:
                    assert "value" not in env and "secretKeyRef" in env["valueFrom"], env


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayservice.yaml"])
def test_every_container_of_the_cluster_has_ray_token_auth_from_the_secret(manifest):
    (doc,) = documents(manifest)
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterConfig"]
    assert spec["authOptions"] == {"mode": "token", "secretName": RAY_AUTH_SECRET["name"]}
    containers = [c for template in all_pod_templates(spec).values() for c in template["spec"]["containers"]]
    assert len(containers) == 6  # ray-head and the mesh's driver, one per worker group
    for container in containers:
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}, container["name"]
        assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {"secretKeyRef": RAY_AUTH_SECRET}, container["name"]


def test_the_network_policy_opens_ray_ports_to_the_clusters_pods_only():
    (policy,) = documents("networkpolicy.yaml")
    assert policy["metadata"]["namespace"] == ray_cluster()["metadata"]["namespace"]
    assert policy["spec"]["podSelector"] == {"matchLabels": RAY_POD}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    any_port_from = [rule["from"] for rule in policy["spec"]["ingress"] if "ports" not in rule]
    assert any_port_from == [[{"podSelector": {"matchLabels": RAY_POD}}]]
    opened = {(port["port"], bool(rule.get("from"))) for rule in policy["spec"]["ingress"] if "ports" in rule
              for port in rule["ports"]}
    # The API to anyone (it wants a key); the dashboard to the KubeRay operator only.
    assert opened == {(8000, False), (8265, True)}
    head_ports = {p["containerPort"] for c in all_pod_templates(ray_cluster()["spec"])["head"]["spec"]["containers"]
                  for p in c.get("ports", [])}
    assert {8000, 8265} <= head_ports


def test_sandbox_group_is_confined_but_not_privileged():
    (container,) = all_pod_templates(ray_cluster()["spec"])["cpu"]["spec"]["containers"]
    context = container["securityContext"]
    assert not context.get("privileged", False)
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["allowPrivilegeEscalation"] is False


def test_rayservice_app_builder_builds_the_inference_app_from_the_mounted_config(tmp_path, monkeypatch):
    serve_config = yaml.safe_load(ray_service()["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    module, _, attribute = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attribute)
    # The config path the app is given is where every pod mounts the ConfigMap.
    mounts = {m["mountPath"] for m in _driver(ray_cluster()["spec"])["volumeMounts"]}
    assert app["args"]["config"] in mounts
    # The app loads model.path, a directory on the shared volume, which the head pod's init
    # container fills with the demo's model before the driver starts. Here the volume is a
    # temporary directory, and the init container's own command builds the model into it.
    model_path = mesh_config(tmp_path).model.path
    shared = _shared_volume_mount(_driver(ray_cluster()["spec"]))
    assert model_path.startswith(shared + "/")
    init = _demo_model_init_container(ray_service()["spec"]["rayClusterConfig"])
    assert init["command"][-1] == model_path and _shared_volume_mount(init) == shared
    local_model = str(tmp_path / "shared") + model_path[len(shared):]
    command = [sys.executable if arg == "python" else arg for arg in init["command"][:-1]]
    subprocess.run([*command, local_model], check=True, timeout=120)
    config_path = tmp_path / "rollmesh.toml"
    config_text = config_map()["data"]["rollmesh.toml"]
    assert f'path = "{model_path}"' in config_text
    config_path.write_text(config_text.replace(f'path = "{model_path}"', f'path = "{local_model}"'))
    monkeypatch.delenv("ROLLMESH_MODEL__PATH")  # the config's model, not the session's
    monkeypatch.setenv("ROLLMESH_API_KEY", "test-key")
    from ray.serve import Application

    assert isinstance(builder({**app["args"], "config": str(config_path)}), Application)


def test_rayservice_app_builder_refuses_a_model_path_that_holds_no_model(tmp_path, monkeypatch):
    from rollmesh.engine.models.errors import ModelConfigError
    from rollmesh.serve_apps.rayservice_entry import app_builder

    config_path = tmp_path / "rollmesh.toml"
    config_path.write_text(f'namespace = "default"\n[model]\npath = "{tmp_path / "nothing"}"\n')
    monkeypatch.delenv("ROLLMESH_MODEL__PATH")
    monkeypatch.setenv("ROLLMESH_API_KEY", "test-key")
    # At deploy time, not in each replica's start again and again.
    with pytest.raises(ModelConfigError) as raised:
        app_builder({"config": str(config_path)})
    assert raised.value.path.startswith(str(tmp_path / "nothing"))


def test_both_manifests_build_the_demo_model_where_the_config_names_it(tmp_path):
    model_path = mesh_config(tmp_path).model.path
    for spec in (ray_cluster()["spec"], ray_service()["spec"]["rayClusterConfig"]):
        init = _demo_model_init_container(spec)
        assert init["image"] == _driver(spec)["image"] and init["command"][-1] == model_path


def _demo_model_init_container(spec: dict[str, Any]) -> dict[str, Any]:
    (init,) = spec["headGroupSpec"]["template"]["spec"]["initContainers"]
    return init


def _shared_volume_mount(container: dict[str, Any]) -> str:
    return next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "shared")


def test_rayservice_app_builder_refuses_without_an_api_key(tmp_path, monkeypatch):
    from rollmesh.serve_apps.rayservice_entry import app_builder

    config_path = tmp_path / "rollmesh.toml"
    config_path.write_text('namespace = "default"\n')
    monkeypatch.delenv("ROLLMESH_API_KEY", raising=False)
    with pytest.raises(Exception, match="API key"):
        app_builder({"config": str(config_path)})


def test_rayservice_app_builder_refuses_unknown_args(tmp_path):
    from rollmesh.config import ConfigError
    from rollmesh.serve_apps.rayservice_entry import app_builder

    with pytest.raises(ConfigError, match="unknown field `conf`"):
        app_builder({"conf": str(tmp_path / "x.toml")})


def test_dockerfile_builds_on_the_ray_of_the_manifests():
    dockerfile = (KUBERAY_DIR / "Dockerfile").read_text()
    version = ray_cluster()["spec"]["rayVersion"]
    assert f"FROM rayproject/ray:{version}-" in dockerfile
    assert "bubblewrap" in dockerfile
