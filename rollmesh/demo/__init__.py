"""The demo: warm start, then asynchronous GRPO on the molar-mass tool task, with evaluation.

Public names: ``run_demo`` (start a mesh, drive it, stop it) and ``DemoDriver`` (drive a running mesh).
"""

from rollmesh.demo.driver import DemoDriver, run_demo

__all__ = ["DemoDriver", "run_demo"]
