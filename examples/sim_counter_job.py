"""A simulation job that speaks rollmesh's preemption protocol: the smallest real example.

It advances a counter (its "simulation"), checkpoints it to ``$ROLLMESH_JOB_CHECKPOINT_DIR``
every ``--checkpoint-every`` steps, and on SIGTERM (the scheduler's ``PreemptionRequested``)
checkpoints at once and exits 0, which the job's runner reports as ``PreemptionAcknowledged``.
Started again, it resumes from its checkpoint, so a preemption loses at most the steps since the
last checkpoint, and an honoured preemption none. ``--ignore-preemption`` makes it a job that
ignores the request, which the scheduler kills at the deadline.

    ROLLMESH_JOB_CHECKPOINT_DIR=/tmp/job python examples/sim_counter_job.py --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path


def load(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["counter"])
    except FileNotFoundError:
        return 0


def save(path: Path, counter: int) -> None:
    # Atomic: a job killed while writing leaves the previous checkpoint, never a torn one.
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"counter": counter}))
    with open(partial, "rb+") as f:
        os.fsync(f.fileno())
    partial.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="counter value at which the job is done")
    parser.add_argument("--step-s", type=float, default=0.01, help="seconds per step")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--ignore-preemption", action="store_true", help="keep running on SIGTERM")
    options = parser.parse_args()
    checkpoint = Path(os.environ.get("ROLLMESH_JOB_CHECKPOINT_DIR", ".")) / "counter.json"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    counter = load(checkpoint)
    preempted = False

    def on_preemption(signum, frame) -> None:
        nonlocal preempted
        preempted = True

    signal.signal(signal.SIGTERM, signal.SIG_IGN if options.ignore_preemption else on_preemption)
    print(f"start {counter}", flush=True)  # where this attempt resumed
    while counter < options.steps:
        if preempted:
            save(checkpoint, counter)
            print(f"preempted {counter}", flush=True)
            return 0
        time.sleep(options.step_s)
        counter += 1
        print(f"step {counter}", flush=True)
        if counter % options.checkpoint_every == 0:
            save(checkpoint, counter)
    save(checkpoint, counter)
    print(f"done {counter}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
