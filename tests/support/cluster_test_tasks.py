"""A task plugin for the two-node cluster test (tests/test_cluster_two_nodes.py), loaded by the
rollout workers by import path.

``NodeHeldMolarMassTask`` is the demo task, except on a Ray node started with
``ROLLMESH_TEST_HOLD_DIR`` in its environment: there a rollout never gets past its prompt. It
writes ``<dir>/<rollout_id>`` (so the test knows that node holds it) and blocks its worker, as a
worker on a node that is about to die would. Everywhere else it runs as the demo task.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rollmesh.rollout.molar_mass import MolarMassTask

HOLD_DIR_ENV = "ROLLMESH_TEST_HOLD_DIR"


class NodeHeldMolarMassTask(MolarMassTask):
    name = "node_held_molar_mass"

    def messages(self, task_input: dict[str, Any]) -> list[dict[str, Any]]:
        hold_dir = os.environ.get(HOLD_DIR_ENV)
        if hold_dir and "rollout_id" in task_input:
            (Path(hold_dir) / task_input["rollout_id"]).touch()
            # Blocks the worker's event loop on purpose: nothing it holds can finish, be
            # acknowledged or be handed back; only the node's death frees the request.
            while True:
                time.sleep(1.0)
        return super().messages(task_input)
