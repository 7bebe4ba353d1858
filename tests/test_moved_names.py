"""Names moved or renamed in issue 24 still import from their old paths and names for one release: the
same object, with a DeprecationWarning that names the new path."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.unit

MOVED = [  # (old module, name, new module, or "new module:new name" where it was renamed)
    ("rollmesh.actors.inference_router", "InferenceRouter", "rollmesh.inference.router"),
    ("rollmesh.actors.inference_router", "generation_attributes", "rollmesh.inference.router"),
    ("rollmesh.actors.inference_router", "DEFAULT_MAX_SESSIONS", "rollmesh.inference.router"),
    ("rollmesh.actors.decode_loans", "DecodeLoanRoster", "rollmesh.inference.decode_loans"),
    ("rollmesh.bus.trace_headers", "inject_trace_headers", "rollmesh.telemetry.trace_headers"),
    ("rollmesh.bus.trace_headers", "extract_trace_context", "rollmesh.telemetry.trace_headers"),
    ("rollmesh.bus", "inject_trace_headers", "rollmesh.telemetry.trace_headers"),
    ("rollmesh.bus", "extract_trace_context", "rollmesh.telemetry.trace_headers"),
    ("rollmesh.rollout.routed_experts", "RoutedExpertsError", "rollmesh.routed_expert_rows"),
    ("rollmesh.rollout.routed_experts", "encode_rows", "rollmesh.routed_expert_rows"),
    ("rollmesh.rollout.routed_experts", "decode_rows", "rollmesh.routed_expert_rows"),
    ("rollmesh.rollout.routed_experts", "join_turns", "rollmesh.routed_expert_rows"),
    ("rollmesh.rollout.routed_experts", "rollout_ref", "rollmesh.routed_expert_rows"),
    ("rollmesh.train.prompt_ids", "PromptRef", "rollmesh.training.prompt_ids"),
    ("rollmesh.train.prompt_ids", "parse_group_id", "rollmesh.training.prompt_ids"),
    ("rollmesh.train.sft_render", "SftExample", "rollmesh.training.sft_render"),
    ("rollmesh.train.sft_render", "render_text_example", "rollmesh.training.sft_render"),
    ("rollmesh.train.sft_render", "render_chat_example", "rollmesh.training.sft_render"),
    # The in-sandbox helper process is the guest, no longer "agent" (some names renamed too).
    ("rollmesh.sandbox.agent", "Agent", "rollmesh.sandbox.guest:Guest"),
    ("rollmesh.sandbox.agent", "main", "rollmesh.sandbox.guest"),
    ("rollmesh.sandbox.agent_calls", "error_from_frame", "rollmesh.sandbox.guest_calls"),
    ("rollmesh.sandbox.agent_client", "AgentSandbox", "rollmesh.sandbox.guest_client:GuestSandbox"),
    ("rollmesh.sandbox.agent_client", "START_TIMEOUT_S", "rollmesh.sandbox.guest_client"),
    ("rollmesh.sandbox.agent_files", "Workspace", "rollmesh.sandbox.guest_files"),
    ("rollmesh.sandbox.agent_pipes", "AgentPipes", "rollmesh.sandbox.guest_pipes:GuestPipes"),
    ("rollmesh.sandbox.agent_start", "bounded_tail", "rollmesh.sandbox.guest_start"),
    ("rollmesh.sandbox.agent_streams", "StreamedUploads", "rollmesh.sandbox.guest_streams"),
    ("rollmesh.sandbox.agent_transfers", "Transfers", "rollmesh.sandbox.guest_transfers"),
    ("rollmesh.sandbox.agent_wire", "FrameReader", "rollmesh.sandbox.guest_wire"),
    ("rollmesh.sandbox.tool_paths", "AGENT_FILES", "rollmesh.sandbox.tool_paths:GUEST_FILES"),
    ("rollmesh.sandbox.bwrap_backend", "AGENT_MOUNT", "rollmesh.sandbox.bwrap_backend:GUEST_MOUNT"),
    ("rollmesh.sandbox.runsc_backend", "AGENT_MOUNT", "rollmesh.sandbox.runsc_backend:GUEST_MOUNT"),
    # The role logic classes (issue 24): each in its domain package, named <Role>Logic.
    ("rollmesh.actors.sandbox_broker", "CONCURRENCY", "rollmesh.sandbox.broker_logic"),
    ("rollmesh.actors.sandbox_broker", "SandboxBrokerService", "rollmesh.sandbox.broker_logic:SandboxBrokerLogic"),
    ("rollmesh.actors.resharder", "ResharderService", "rollmesh.checkpoint.resharder:ResharderLogic"),
    ("rollmesh.checkpoint.resharder", "CheckpointResharder", "rollmesh.checkpoint.resharder:ResharderLogic"),
    ("rollmesh.checkpoint", "CheckpointResharder", "rollmesh.checkpoint.resharder:ResharderLogic"),
    ("rollmesh.actors.gpu_scheduler", "RayJobHandle", "rollmesh.scheduling.ray_jobs"),
    ("rollmesh.actors.gpu_scheduler", "SchedulerLogic", "rollmesh.scheduling.gpu_scheduler_logic:GpuSchedulerLogic"),
    ("rollmesh.actors.metrics_hub", "HUB_NAME", "rollmesh.metrics_hub_shell"),
    ("rollmesh.actors.metrics_hub", "ROLLOUT_WORKERS_DURABLE", "rollmesh.metrics_hub_shell"),
    ("rollmesh.actors.metrics_hub", "MetricsHubService", "rollmesh.metrics_hub_shell:MetricsHubShell"),
    ("rollmesh.telemetry.metrics_hub", "MetricsHub", "rollmesh.telemetry.metrics_hub:MetricsHubLogic"),
    ("rollmesh.telemetry", "MetricsHub", "rollmesh.telemetry.metrics_hub:MetricsHubLogic"),
    ("rollmesh.actors.rollout_worker", "RolloutWorkerLogic", "rollmesh.rollout.agent_loop"),
    ("rollmesh.rollout.agent_loop", "RolloutRunner", "rollmesh.rollout.agent_loop:RolloutWorkerLogic"),
    ("rollmesh.actors.gpu_scheduler", "RayJobLauncher", "rollmesh.scheduling.ray_jobs"),
    ("rollmesh.actors.gpu_scheduler", "RoleGrantGroups", "rollmesh.scheduling.ray_jobs"),
    ("rollmesh.actors.gpu_scheduler", "RL_ROLES", "rollmesh.scheduling.gpu_scheduler_logic"),
    ("rollmesh.rollout.rollout_state", "conversation_of", "rollmesh.rollout.saved_state"),
    ("rollmesh.rollout.rollout_state", "with_progress", "rollmesh.rollout.saved_state"),
    ("rollmesh.rollout.rollout_state", "InMemoryRolloutStates", "rollmesh.rollout.saved_state"),
    ("rollmesh.training.optimizer_errors", "OptimizerError", "rollmesh.training.errors"),
    ("rollmesh.training.optimizer_errors", "OptimizerSetupError", "rollmesh.training.errors"),
    ("rollmesh.training.optimizer_errors", "MissingGradientError", "rollmesh.training.errors"),
    # Names that said something else than what they hold (issue 24: names that collide or mislead).
    ("rollmesh.training.megatron_ranks", "MegatronRanksFailed", "rollmesh.training.errors:MegatronRanksError"),
    ("rollmesh.sandbox.errors", "CapacityError", "rollmesh.sandbox.errors:SandboxCapacityError"),
    ("rollmesh.actors.rollout_worker", "ElasticDecodeFollower",
     "rollmesh.rollout.decode_loan_follower:RolloutDecodeLoanFollower"),
    # "Where is the mesh" had four types (issue 24): one MeshAddress, with one connect().
    ("rollmesh.actors.role_base", "MeshContext", "rollmesh.mesh_address:MeshAddress"),
    ("rollmesh.cli.target", "MeshTarget", "rollmesh.mesh_address:MeshAddress"),
    ("rollmesh.cli.target", "read_cli_mesh_info", "rollmesh.cli.target:read_cli_mesh_address"),
    ("rollmesh.dashboard.feed", "DashboardSource", "rollmesh.mesh_address:MeshAddress"),
    ("rollmesh.dashboard", "DashboardSource", "rollmesh.mesh_address:MeshAddress"),
    ("rollmesh.mesh_info", "MeshInfo", "rollmesh.mesh_address:MeshAddress"),
    ("rollmesh.mesh_info", "read_mesh_info", "rollmesh.mesh_address:read_mesh_address"),
    ("rollmesh.mesh_info", "write_mesh_info", "rollmesh.mesh_address:write_mesh_address"),
    ("rollmesh.mesh_info", "MESH_FILE", "rollmesh.mesh_address"),
    ("rollmesh.mesh_info", "MeshNotFoundError", "rollmesh.mesh_address"),
    ("rollmesh.mesh_info", "nats_url_for_clients", "rollmesh.mesh_address"),
    ("rollmesh.mesh_info", "new_run_dir", "rollmesh.mesh_address"),
    ("rollmesh.mesh_info", "latest_run_dir", "rollmesh.mesh_address"),
    ("rollmesh.sandbox_brokers", "broker_context", "rollmesh.sandbox_brokers:broker_address"),
    # Out of the torch module, so that the rollout workers and the Serve app read a config.json
    # without importing torch.
    ("rollmesh.engine.paged_model", "describe_served_model", "rollmesh.engine.served_model"),
    ("rollmesh.engine.paged_model", "ServedModelFacts", "rollmesh.engine.served_model"),
]



@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_an_old_import_path_warns_and_gives_the_moved_object(old: str, name: str, new: str) -> None:
    new_module, _, new_name = new.partition(":")
    new_name = new_name or name
    with pytest.warns(DeprecationWarning, match=f"moved to {new_module}.{new_name};") as warned:
        moved = getattr(importlib.import_module(old), name)
    assert moved is getattr(importlib.import_module(new_module), new_name)
    assert warned[0].filename == __file__  # points at the importer, not at the alias


@pytest.mark.parametrize("old", sorted({old for old, _, _ in MOVED}))
def test_an_old_module_still_refuses_a_name_it_never_had(old: str) -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(importlib.import_module(old), "no_such_name")


def test_the_wire_contract_s_renamed_holder_constant_warns_and_keeps_its_wire_value() -> None:
    # rollmesh.messages imports nothing of ours, so its alias is hand-written, not forward_moved_names.
    from rollmesh.messages import sim_jobs

    with pytest.warns(DeprecationWarning, match="ELASTIC_DECODE_HOLDER is now .*DECODE_LOAN_HOLDER") as warned:
        old = sim_jobs.ELASTIC_DECODE_HOLDER
    assert old == sim_jobs.DECODE_LOAN_HOLDER == "decode.elastic"  # on the wire: actors of the last release match it
    assert warned[0].filename == __file__
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(sim_jobs, "no_such_name")



def test_lazy_exports_finds_a_name_in_its_module_caches_it_and_forwards_moved_names() -> None:
    from rollmesh.moved_names import lazy_exports

    package: dict = {}
    getter = lazy_exports("demo_pkg", {"JSONDecoder": "json.decoder"}, cache=package,
                          moved={"OldDecoder": "json.decoder:JSONDecoder"})
    assert package == {}  # nothing looked up yet
    decoder = getter("JSONDecoder")
    assert decoder.__module__ == "json.decoder" and package == {"JSONDecoder": decoder}
    with pytest.warns(DeprecationWarning, match=r"demo_pkg\.OldDecoder moved to json\.decoder\.JSONDecoder"):
        assert getter("OldDecoder") is decoder
    with pytest.raises(AttributeError, match="demo_pkg"):
        getter("Missing")
