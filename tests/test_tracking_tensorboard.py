"""The TensorBoard tracker against tensorboardX, read back from its event file: the config as a
text summary, two steps of scalars and a sample table as a Markdown text summary, all under
``<run_dir>/tensorboard/train``. TensorBoard itself is not installed, so the TFRecord framing
(length, crc, event, crc) is read here, the event itself by tensorboardX's protobuf."""

from __future__ import annotations

import json
import struct
import textwrap
from pathlib import Path

import pytest
from tensorboardX.proto import event_pb2

from rollmesh.run_config import TrackingConfig
from rollmesh.tracking import open_trackers

pytestmark = pytest.mark.unit

CONFIG = {"model": {"path": "/models/tiny"}, "trainer": {"lr": 1e-5}, "stages": [{"kind": "rl"}]}
ROWS = [{"prompt": "1+1=?", "completion": "2", "reward": 1.0, "rewards/math": 1.0},
        {"prompt": "2+2=?", "completion": "5\nor 4", "reward": 0.0, "rewards/math": 0.0}]


def events(directory: Path) -> list[event_pb2.Event]:
    found = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, position = path.read_bytes(), 0
        while position + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[position:position + 8])
            found.append(event_pb2.Event.FromString(data[position + 12:position + 12 + length]))
            position += 12 + length + 4
    return found


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    with open_trackers(TrackingConfig(backends=["tensorboard"]), run_dir=run_dir,
                       config=CONFIG) as trackers:
        trackers.log_scalars(1, {"rl/reward": 0.25, "rl/loss": 1.5})
        trackers.log_scalars(2, {"rl/reward": 0.75, "eval/arith/mean@4": 0.5})
        trackers.log_table("eval/arith/samples", 2, ROWS)
    return run_dir


def test_scalars_of_each_step_land_in_the_train_run(run_dir) -> None:
    scalars = {(value.tag, event.step): value.simple_value
               for event in events(run_dir / "tensorboard" / "train")
               for value in event.summary.value if value.metadata.plugin_data.plugin_name != "text"}
    assert scalars == {("rl/reward", 1): 0.25, ("rl/loss", 1): 1.5, ("rl/reward", 2): 0.75,
                       ("eval/arith/mean_at_4", 2): 0.5}  # TensorBoard tags have no '@'
    # The mesh's own scalars stay in tensorboard/ itself: TensorBoard shows two runs.
    assert not list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def text_summaries(run_dir: Path) -> dict[tuple[str, int], str]:
    return {(value.tag, event.step): value.tensor.string_val[0].decode()
            for event in events(run_dir / "tensorboard" / "train")
            for value in event.summary.value if value.metadata.plugin_data.plugin_name == "text"}


def test_config_is_a_text_summary_of_its_json(run_dir) -> None:
    (config_text,) = [text for (tag, step), text in text_summaries(run_dir).items()
                      if tag.startswith("config") and step == 0]
    assert json.loads(textwrap.dedent(config_text)) == CONFIG


def test_sample_table_is_a_markdown_text_summary_at_its_step(run_dir) -> None:
    (table,) = [text for (tag, step), text in text_summaries(run_dir).items()
                if tag.startswith("eval/arith/samples") and step == 2]
    assert table.splitlines() == [
        "| prompt | completion | reward | rewards/math |",
        "|---|---|---|---|",
        "| 1+1=? | 2 | 1 | 1 |",
        "| 2+2=? | 5<br>or 4 | 0 | 0 |",
    ]
