"""The utilization-over-time plot of a simulation, as a PNG.

Knows matplotlib (Agg: no display needed) and the simulator's result; imported only by whoever
writes the plot, so the scheduler itself never pulls matplotlib in.
"""

from __future__ import annotations

from pathlib import Path

from rollmesh.scheduling.simulator import SimulationResult


def write_utilization_png(result: SimulationResult, path: str | Path, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = [(sample.start + sample.end) / 2 / 3600 for sample in result.samples]
    share = [1.0 / result.capacity] * len(result.samples)
    figure, axes = plt.subplots(figsize=(10, 4), dpi=100)
    try:
        axes.fill_between(hours, [s.rl_held * k for s, k in zip(result.samples, share)], step="mid",
                          alpha=0.3, color="tab:orange", label="held by RL roles")
        axes.plot(hours, [s.allocated * k for s, k in zip(result.samples, share)], drawstyle="steps-mid",
                  color="tab:blue", label="allocated")
        axes.plot(hours, [s.busy * k for s, k in zip(result.samples, share)], drawstyle="steps-mid",
                  color="tab:green", label="busy")
        figures = result.figures()
        axes.set_title(f"{title}: busy {figures['busy_utilization']:.3f}, allocated "
                       f"{figures['allocated_utilization']:.3f}, RL slowdown {figures['rl_slowdown']:.3f}")
        axes.set_xlabel("hours")
        axes.set_ylabel(f"share of {result.capacity} accelerators")
        axes.set_ylim(0, 1.05)
        axes.legend(loc="center right")
        figure.tight_layout()
        figure.savefig(path)
    finally:
        plt.close(figure)
    return Path(path)
