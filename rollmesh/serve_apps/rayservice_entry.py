"""The inference Serve app as a KubeRay ``RayService`` deploys it: an application builder.

serveConfigV2 names ``import_path: rollmesh.serve_apps.rayservice_entry:app_builder`` with
``args: {config: /etc/rollmesh/rollmesh.toml}``; Ray Serve calls ``app_builder(args)`` in the
cluster each time it deploys the application. Knows the config file and ``build_inference_app``;
never spawns or stops actors: the mesh's driver (``rollmesh up --no-serve`` in the head pod, see
deploy/kuberay/) spawned the prefill and decode workers this app finds by name.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
from ray.serve import Application

from rollmesh.config import ConfigError, load_config
from rollmesh.serve_apps.api_keys import required_api_key
from rollmesh.serve_apps.inference_app import build_inference_app

ARGS_SOURCE = "serveConfigV2 args"
# The HTTP proxy of a RayService listens on every interface of the head pod.
PROXY_HOST = "0.0.0.0"


class RayServiceArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # The rollmesh config file (the mesh's own, mounted from the same ConfigMap).
    config: str


def app_builder(args: dict[str, Any]) -> Application:
    """The inference app for the mesh ``args["config"]`` describes (``ConfigError`` if bad)."""
    try:
        parsed = msgspec.convert(args, RayServiceArgs)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc), source=ARGS_SOURCE) from exc
    config = load_config(parsed.config)
    if not config.model.path:
        # The mesh builds the demo model into its run directory; this app has none to look in.
        raise ConfigError("model.path must name the model directory the workers serve (on the "
                          "shared volume): a RayService app cannot use the demo's default",
                          source=parsed.config, path="model.path")
    # Beyond loopback, so a key is required: ROLLMESH_API_KEY or serve.api_key_file.
    api_key = required_api_key(config.serve.api_key_file, os.environ, host=PROXY_HOST,
                               security_enabled=config.security.enabled)
    inference = config.inference
    return build_inference_app(
        prefill_actor_names=[f"prefill-{i}" for i in range(inference.prefill_worker_count)],
        decode_actor_names=[f"decode-{i}" for i in range(inference.decode_worker_count)],
        # The launcher's Ray namespace (rollmesh.launcher.Mesh), where the workers are named.
        ray_namespace=f"rollmesh-{config.namespace}",
        model=config.model, api_key=api_key, telemetry=config.telemetry, sessions=config.serve,
    )
