"""The demo: ``rollmesh train`` on a built-in run file (run_file.py): a warm start (sft stage),
asynchronous GRPO on the molar-mass tool task (rl stage) and held-out evaluations ([[eval]]).
``demo_model`` builds its tiny model; ``curve`` draws reward curves.
"""

from rollmesh.demo.run_file import DEMO_RUN_FILE, demo_job_config, write_demonstrations

__all__ = ["DEMO_RUN_FILE", "demo_job_config", "write_demonstrations"]
