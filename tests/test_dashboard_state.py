"""The dashboard's plain logic: events folded into bounded views, trace links, the trace reader,
the routes' answers without a mesh, its config and ``rollmesh dashboard``.

No NATS and no Ray here; the feed on a real nats-server is in test_dashboard_feed.py, the page in
a real Chromium in test_dashboard_browser.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rollmesh.cli import main
from rollmesh.config import ConfigError, DashboardConfig, load_config
from rollmesh.dashboard import DashboardRoutes, DashboardState, InvalidTraceIdError, read_trace, trace_link
from rollmesh.dashboard.views import SandboxPoolView
from rollmesh.mesh_address import MeshAddress, write_mesh_address
from rollmesh.messages import (
    RolloutCompleted,
    RolloutFailed,
    RolloutProgressed,
    RolloutRequested,
    SchedulerStatus,
    TrainerStepped,
    WeightsActivated,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TRACE = "0af7651916cd43dd8448eb211c80319c"
TURN_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def new_state(**config: object) -> DashboardState:
    return DashboardState(DashboardConfig(**config), namespace="ns", clock=Clock())


def requested(rollout_id: str, max_turns: int = 4) -> RolloutRequested:
    return RolloutRequested(rollout_id=rollout_id, task="molar_mass", max_turns=max_turns, group_id="g")


def completed(rollout_id: str, reward: float, trace_id: str = TRACE) -> RolloutCompleted:
    return RolloutCompleted(rollout_id=rollout_id, task="molar_mass", group_id="g", purpose="train",
                            reward=reward, turns=2, tool_calls=1, prompt_len=3, tokens=[1, 2, 3, 4],
                            loss_mask=[0, 0, 0, 1], logprobs=[0.0, 0.0, 0.0, -0.5],
                            versions=[-1, -1, -1, 3], trace_id=trace_id)


def status(reported_at: float, busy: float) -> SchedulerStatus:
    return SchedulerStatus(capacity=2, roles={"decode": 1, "trainer": 1},
                           jobs={"a": "running", "b": "queued", "c": "queued"},
                           allocated_utilization=1.0, busy_utilization=busy, preemptions=1, kills=0,
                           lost_accelerator_s=0.0, rl_queueing_s=0.0, reported_at=reported_at)


def test_a_rollout_goes_from_queued_to_running_with_progress_to_completed_with_its_reward():
    state = new_state()
    state.record(requested("r1"))
    (queued,) = state.snapshot().in_flight
    assert (queued.status, queued.turn, queued.progress, queued.max_turns) == ("queued", 0, 0.0, 4)

    state.record(RolloutProgressed(rollout_id="r1", turn=1, num_tokens=40, weight_version=3,
                                   trace_id=TRACE))
    (running,) = state.snapshot().in_flight
    assert (running.status, running.turn, running.progress, running.num_tokens) == ("running", 1, 0.25, 40)
    assert running.weight_version == 3
    assert running.trace_url == f"/dashboard/traces/{TRACE}"

    state.record(completed("r1", 0.75))
    snapshot = state.snapshot()
    assert snapshot.in_flight == []
    assert (snapshot.counts.requested, snapshot.counts.completed, snapshot.counts.in_flight) == (1, 1, 0)
    (done,) = snapshot.recent_completed
    assert (done.status, done.reward, done.turn, done.weight_version) == ("completed", 0.75, 2, 3)
    assert done.task == "molar_mass" and done.trace_id == TRACE
    assert [point.reward for point in snapshot.rewards] == [0.75]


def test_a_rollout_first_heard_of_by_its_progress_has_no_known_progress_fraction():
    state = new_state()
    state.record(RolloutProgressed(rollout_id="late", turn=2, num_tokens=9, weight_version=0))
    (view,) = state.snapshot().in_flight
    assert view.progress is None and view.max_turns == 0 and view.trace_url == ""


def test_a_request_folded_after_its_first_progress_fills_in_without_resetting_it():
    state = new_state()
    state.record(RolloutProgressed(rollout_id="r1", turn=1, num_tokens=9, weight_version=2))
    state.record(requested("r1", max_turns=4))
    (view,) = state.snapshot().in_flight
    assert (view.status, view.turn, view.progress, view.task) == ("running", 1, 0.25, "molar_mass")


def test_progress_arriving_after_the_outcome_does_not_bring_the_rollout_back():
    state = new_state()
    state.record(requested("r1"))
    state.record(completed("r1", 1.0))
    state.record(RolloutProgressed(rollout_id="r1", turn=2, num_tokens=9, weight_version=0))
    assert state.snapshot().in_flight == []


def test_failures_keep_their_typed_kind_and_reason_newest_last_and_bounded():
    state = new_state(max_failures=2)
    for index, kind in enumerate(["sandbox_timeout", "inference_error", "unknown_task"]):
        state.record(requested(f"r{index}"))
        state.record(RolloutFailed(rollout_id=f"r{index}", kind=kind, reason=f"because {index}",
                                   attempts=3, trace_id=TRACE if index == 2 else ""))
    snapshot = state.snapshot()
    assert [(f.kind, f.reason) for f in snapshot.failures] == [
        ("inference_error", "because 1"), ("unknown_task", "because 2")]
    assert snapshot.failures[-1].trace_url == f"/dashboard/traces/{TRACE}"
    assert snapshot.failures[0].trace_url == ""
    assert (snapshot.counts.failed, snapshot.counts.in_flight) == (3, 0)


def test_rollouts_in_flight_past_the_bound_forget_the_least_recently_heard_of():
    state = new_state(max_rollouts=2)
    for rollout_id in ("a", "b"):
        state.record(requested(rollout_id))
    state.record(RolloutProgressed(rollout_id="a", turn=1, num_tokens=1, weight_version=0))
    state.record(requested("c"))  # "b" was heard of longest ago
    snapshot = state.snapshot()
    assert [r.rollout_id for r in snapshot.in_flight] == ["a", "c"]
    assert snapshot.counts.evicted == 1


def test_reward_trainer_and_accelerator_series_keep_only_the_newest_points():
    state = new_state(max_points=3)
    for index in range(5):
        state.record(completed(f"r{index}", float(index)))
        state.record(TrainerStepped(step=index, weight_version=index, loss=0.1, reward_mean=index / 10,
                                    num_samples=2, num_groups=1))
        state.record(status(reported_at=100.0 + index, busy=index / 10))
    snapshot = state.snapshot()
    assert [p.reward for p in snapshot.rewards] == [2.0, 3.0, 4.0]
    assert [s.step for s in snapshot.trainer_steps] == [2, 3, 4]
    assert [a.busy_utilization for a in snapshot.accelerators] == [0.2, 0.3, 0.4]


def test_the_accelerator_timeline_counts_jobs_by_state_and_skips_a_report_seen_twice():
    state = new_state()
    state.record(status(reported_at=50.0, busy=0.5))
    state.record(status(reported_at=50.0, busy=0.5))  # published and asked for: the same report
    (sample,) = state.snapshot().accelerators
    assert sample.jobs == {"running": 1, "queued": 2}
    assert sample.roles == {"decode": 1, "trainer": 1}
    assert (sample.capacity, sample.allocated_utilization, sample.preemptions) == (2, 1.0, 1)


def test_weight_versions_per_worker_come_from_activations_and_polls():
    state = new_state()
    state.record_worker_version("decode-0", "decode", 0, staged_version=None)
    state.record(WeightsActivated(version=2, worker="decode-0", role="decode"))
    state.record(WeightsActivated(version=2, worker="prefill-0", role="prefill"))
    weights = state.snapshot().weights
    assert [(w.worker, w.role, w.version) for w in weights] == [("decode-0", "decode", 2),
                                                                 ("prefill-0", "prefill", 2)]


def test_sandbox_pool_numbers_are_kept_as_reported_with_when():
    state = new_state()
    state.record_sandbox_pool(SandboxPoolView(backend="bwrap", isolated=True, active_leases=3,
                                              warm_sandboxes={"default": 2}, max_sandboxes=8))
    pool = state.snapshot().sandbox_pool
    assert pool is not None
    assert (pool.backend, pool.active_leases, pool.warm_sandboxes, pool.max_sandboxes) == (
        "bwrap", 3, {"default": 2}, 8)
    assert pool.at > 0


def test_malformed_messages_are_counted_by_subject():
    state = new_state()
    state.record_malformed("rl.{ns}.rollout.completed")
    state.record_malformed("rl.{ns}.rollout.completed")
    assert state.snapshot().counts.malformed == {"rl.{ns}.rollout.completed": 2}


def test_the_snapshot_is_json_the_page_can_read():
    state = new_state()
    state.record(requested("r1"))
    decoded = json.loads(msgspec.json.encode(state.snapshot()))
    assert decoded["counts"]["in_flight"] == 1
    assert decoded["in_flight"][0]["rollout_id"] == "r1"
    assert decoded["refresh_s"] == 1.0


def test_trace_links_go_to_a_configured_trace_ui_else_to_the_dashboards_own_view():
    assert trace_link(TRACE, "") == f"/dashboard/traces/{TRACE}"
    assert trace_link(TRACE, "http://jaeger:16686/trace/{trace_id}") == f"http://jaeger:16686/trace/{TRACE}"
    assert trace_link("", "http://jaeger:16686/trace/{trace_id}") == ""
    state = new_state(trace_url="http://jaeger:16686/trace/{trace_id}")
    state.record(completed("r1", 1.0))
    assert state.snapshot().recent_completed[0].trace_url == f"http://jaeger:16686/trace/{TRACE}"


def test_a_trace_url_without_the_trace_id_placeholder_is_a_config_error():
    with pytest.raises(ConfigError, match="trace_id"):
        load_config(overrides={"dashboard.trace_url": "http://jaeger:16686/"})


# -- the trace reader ---------------------------------------------------------------------------


def span(name: str, trace_id: str, span_id: str, start: int, *, parent: str | None = None,
         links: list[str] = ()) -> str:
    return json.dumps({
        "name": name, "trace_id": trace_id, "span_id": span_id, "parent_span_id": parent,
        "kind": "INTERNAL", "start_ns": start, "end_ns": start + 10, "status": "UNSET",
        "service": "rollout-worker-0", "attributes": {"rl.rollout_id": "r1"},
        "links": [{"trace_id": t, "span_id": "aa" * 8, "attributes": {}} for t in links]})


def test_a_rollouts_trace_holds_its_own_spans_and_the_turn_traces_linking_to_it(tmp_path: Path):
    path = tmp_path / "traces.jsonl"
    other = "f" * 32
    path.write_text("\n".join([
        span("turn", TURN_TRACE, "b1" * 8, 20, links=[TRACE]),
        span("generate", TURN_TRACE, "b2" * 8, 25, parent="b1" * 8),
        span("rollout", TRACE, "aa" * 8, 10),
        span("unrelated", other, "c1" * 8, 5),
        '{"name": "cut sh',  # a line a crashed writer left half-written
    ]) + "\n")
    view = read_trace(path, TRACE)
    assert [s.name for s in view.spans] == ["rollout", "turn", "generate"]
    assert view.linked_trace_ids == [TURN_TRACE]
    assert view.note == "" and not view.truncated


def test_a_trace_with_nothing_ended_yet_or_without_a_file_says_why(tmp_path: Path):
    path = tmp_path / "traces.jsonl"
    assert "does not exist" in read_trace(path, TRACE).note
    path.write_text(span("rollout", "e" * 32, "aa" * 8, 1) + "\n")
    view = read_trace(path, TRACE)
    assert view.spans == [] and "no span" in view.note


@pytest.mark.parametrize("bad", ["", "xyz", TRACE.upper(), TRACE + "0", "../../etc/passwd"])
def test_a_bad_trace_id_is_a_typed_error(tmp_path: Path, bad: str):
    with pytest.raises(InvalidTraceIdError) as caught:
        read_trace(tmp_path / "traces.jsonl", bad)
    assert caught.value.status == 400 and caught.value.trace_id == bad


async def test_an_app_deployed_without_a_mesh_answers_404_on_every_dashboard_route():
    routes = DashboardRoutes.start(None)
    for response in (routes.page(), routes.state_answer(), routes.trace_page(TRACE),
                     await routes.trace_answer(TRACE)):
        assert response.status_code == 404
        assert json.loads(response.body)["error"]["code"] == "dashboard_off"


# -- rollmesh dashboard ------------------------------------------------------------------------


@pytest.fixture
def cli_logging():
    """``main`` sets up structlog once per process; that must not leak into later tests."""
    import structlog

    import rollmesh.telemetry.logging as logging_setup

    saved, configured = structlog.get_config(), logging_setup._configured
    yield
    structlog.configure(**saved)
    logging_setup._configured = configured


def write_run(root: Path, name: str, dashboard_url: str) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    write_mesh_address(MeshAddress(nats_url="nats://127.0.0.1:4222", namespace="ns", run_dir=str(run_dir),
                             serve_url="http://127.0.0.1:8000", dashboard_url=dashboard_url))
    return run_dir


def test_rollmesh_dashboard_prints_the_url_the_latest_mesh_wrote(tmp_path: Path, capsys, cli_logging):
    write_run(tmp_path, "20250101-000000-aaaaaa", "http://127.0.0.1:8000/dashboard")
    write_run(tmp_path, "20250102-000000-bbbbbb", "http://127.0.0.1:8001/dashboard")
    assert main(["--run-root", str(tmp_path), "dashboard"]) == 0
    assert capsys.readouterr().out.strip() == "http://127.0.0.1:8001/dashboard"
    first = tmp_path / "20250101-000000-aaaaaa"
    assert main(["--run-root", str(tmp_path), "dashboard", "--run-dir", str(first)]) == 0
    assert capsys.readouterr().out.strip() == "http://127.0.0.1:8000/dashboard"


def test_rollmesh_dashboard_of_a_mesh_without_one_or_without_a_mesh_is_an_error(
        tmp_path: Path, capsys, cli_logging):
    write_run(tmp_path, "20250101-000000-aaaaaa", "")
    assert main(["--run-root", str(tmp_path), "dashboard"]) == 1
    assert "serves no dashboard" in capsys.readouterr().err
    assert main(["--run-root", str(tmp_path / "none"), "dashboard"]) == 1
    assert "no runs under" in capsys.readouterr().err
