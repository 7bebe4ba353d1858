"""rollmesh.train.evaluation on the session's real mesh (tests/conftest.py ``mesh``: real
nats-server, local Ray, the demo model): an eval's prompts rolled out n_samples times with
purpose "eval", scored, failures counted, and the sample table written.

The demo model cannot answer anything, so the rewards are arranged for plumbing: ``exact_match``
against answers no output matches (0), ``always_one`` (1, so every scored sample passes), and
``final_text_length`` at weight 0 (the length of the final answer the reward saw, to compare with
the table's completion). A row without an answer makes ``exact_match`` refuse it: its samples fail
(invalid_request) and must be counted as failed, not as zeros.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from rollmesh.bus.connection import connect_bus
from rollmesh.bus.publisher import BusPublisher
from rollmesh.data import EmptyDatasetError
from rollmesh.messages import SamplingParams
from rollmesh.messages.subjects import ROLLOUT_REQUESTED
from rollmesh.run_config import EvalConfig, RewardSpec
from rollmesh.train.evaluation import TIMED_OUT, Evaluation

from support.fakes import RecordingPublisher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WAIT_S = float(os.environ.get("ROLLMESH_TEST_WAIT_S", "180"))
NEVER = "\u2603 no model says this \u2603"
ROWS = [
    {"prompt": "What is two plus two?", "answer": NEVER},
    {"question": "a bad row: no prompt field"},
    {"prompt": "Name a colour.", "answer": NEVER},
    {"prompt": "Say anything."},  # no answer: exact_match refuses it
    {"prompt": "Past the eval's size.", "answer": NEVER},
]
REWARDS = [RewardSpec(name="exact_match"), RewardSpec(fn="support.eval_test_rewards:always_one"),
           RewardSpec(fn="support.eval_test_rewards:final_text_length", weight=0.0)]


def _eval_config(tmp_path: Path, **overrides) -> EvalConfig:
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    settings = dict(name="held", data=str(data), size=3, rewards=REWARDS, n_samples=2,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=12), system_prompt="Answer briefly.")
    return EvalConfig(**{**settings, **overrides})


async def test_an_evaluation_scores_its_samples_counts_failures_and_writes_its_table(mesh, tmp_path: Path) -> None:
    nc = await connect_bus(mesh.info.nats_url, name="eval-test", connect_timeout_s=10.0)
    bad_rows = []
    try:
        evaluation = Evaluation(
            _eval_config(tmp_path), name="held", run_name="evaltest", run_dir=tmp_path / "run",
            publisher=BusPublisher(nc, nc.jetstream(), mesh.namespace), nc=nc, namespace=mesh.namespace,
            timeout_s=WAIT_S, on_bad_row=bad_rows.append)
        # Two evaluations at once (two steps): each waits for its own group's outcomes only.
        first, second = await asyncio.gather(evaluation.run(0), evaluation.run(7))
    finally:
        await nc.close()

    assert [error.row for error in bad_rows] == [2]  # reported once: the prompts are read once
    for result, step in ((first, 0), (second, 7)):
        assert (result.name, result.step) == ("held", step)
        assert result.path == tmp_path / "run" / "eval" / "held" / f"step_{step}.jsonl"
        table = [json.loads(line) for line in result.path.read_text().splitlines()]
        assert table == result.rows
        assert [(row["prompt_index"], row["sample"]) for row in table] == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                                             (2, 0), (2, 1)]
        assert [row["prompt"] for row in table[::2]] == ["What is two plus two?", "Name a colour.", "Say anything."]
        # The session's model samples at temperature 1 and, warm-started by other tests to call
        # a tool, may write a call the tool-less task's render does not reproduce token for
        # token: that sample fails (tokenization_error, strict tokenization) whatever this test
        # does. Such failures are counted like any other; every other sample of the answered
        # prompts is scored.
        output_failures = [row for row in table[:4] if row["failed"]]
        assert all(row["failed"] == "tokenization_error" for row in output_failures), output_failures
        # Three prompts (the bad row skipped, the fifth past size), two samples each; the
        # answerless prompt's two samples failed and are left out of the statistics.
        assert result.metrics == {"prompts": 3, "samples": 4 - len(output_failures), "failed": 2 + len(output_failures),
                                  "mean@2": 1.0, "pass@1": 1.0, "pass@2": 1.0, "majority@2": 1.0}
        scored = [row for row in table[:4] if not row["failed"]]
        failed = table[4:]
        for row in scored:
            assert row["failed"] == "" and row["reward"] == 1.0
            assert row["rewards"]["exact_match"] == 0.0 and row["rewards"]["always_one"] == 1.0
            # The completion is the final answer the reward saw (RolloutCompleted.final_text; the
            # untrained model is cut by max_new_tokens, so both are "" here: the agent loop's
            # tests check final_text on answers that end).
            assert isinstance(row["completion"], str)
            assert len(row["completion"]) == row["rewards"]["final_text_length"]
        for row in failed:
            assert row["failed"] == "invalid_request" and row["reward"] is None and row["completion"] is None


async def test_outcomes_that_never_come_count_as_failed_after_the_timeout(nats_client, namespace: str,
                                                                          tmp_path: Path) -> None:
    # Nothing serves this namespace: the requests go nowhere and no outcome ever comes.
    publisher = RecordingPublisher()
    evaluation = Evaluation(_eval_config(tmp_path, n_samples=3, pass_k=[2]), name="held", run_name="lonely",
                            run_dir=tmp_path / "run", publisher=publisher, nc=nats_client,
                            namespace=namespace, timeout_s=0.5)
    result = await evaluation.run(5)

    requests = publisher.messages(ROLLOUT_REQUESTED)
    assert len(requests) == 9 and len({request.rollout_id for request in requests}) == 9
    assert {(request.purpose, request.group_id, request.task) for request in requests} == {("eval", "eval-held-5", "dataset")}
    assert requests[0].rollout_id == "lonely-eval-held-s5-p0-0"
    assert requests[0].sampling.max_new_tokens == 12
    assert requests[0].task_input["messages"] == [{"role": "system", "content": "Answer briefly."},
                                                  {"role": "user", "content": "What is two plus two?"}]
    assert requests[0].task_input["answer"] == NEVER and requests[0].task_input["row"] == ROWS[0]
    assert [entry.get("fn") or entry.get("name") for entry in requests[0].task_input["rewards"]] == [
        "exact_match", "support.eval_test_rewards:always_one", "support.eval_test_rewards:final_text_length"]
    assert result.metrics == {"prompts": 3, "samples": 0, "failed": 9}
    assert {row["failed"] for row in result.rows} == {TIMED_OUT}
    assert len(result.path.read_text().splitlines()) == 9
