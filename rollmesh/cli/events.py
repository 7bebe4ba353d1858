"""How the CLI shows rollout and trainer events: one plain line each, and compact version ranges.

Knows the wire contract only. Used by ``submit --wait`` and ``watch``; plain lines are what a
non-terminal (a log file, CI) gets, so they are stable ``key=value`` text.
"""

from __future__ import annotations

from rollmesh.messages import RolloutCompleted, RolloutFailed, RolloutProgressed, TrainerStepped


def weight_versions(versions: list[int]) -> str:
    """The weight versions that generated a trajectory's tokens, e.g. ``3`` or ``2-4`` or ``1,3``.

    Prompt and tool-output tokens carry -1 and are left out; ``-`` when no token was generated.
    """
    found = sorted({v for v in versions if v >= 0})
    if not found:
        return "-"
    runs: list[str] = []
    start = previous = found[0]
    for version in [*found[1:], None]:
        if version is not None and version == previous + 1:
            previous = version
            continue
        runs.append(str(start) if start == previous else f"{start}-{previous}")
        if version is not None:
            start = previous = version
    return ",".join(runs)


def completed_versions(event: RolloutCompleted) -> str:
    """``weight_versions`` of a completed rollout; ``..N`` (newest N) when its trace is stored."""
    if event.trajectory is None and event.trajectory_ref:
        return f"..{event.weight_version}" if event.weight_version >= 0 else "-"
    return weight_versions(event.token_trace().versions)


def progressed_line(event: RolloutProgressed) -> str:
    return (f"progressed {event.rollout_id} turn={event.turn} tokens={event.num_tokens} "
            f"weights=v{event.weight_version} status={event.status}")


def completed_line(event: RolloutCompleted) -> str:
    return (f"completed  {event.rollout_id} reward={event.reward:.3f} turns={event.turns} "
            f"tool_calls={event.tool_calls} versions={completed_versions(event)}")


def failed_line(event: RolloutFailed) -> str:
    return f"failed     {event.rollout_id} kind={event.kind} reason={event.reason!r}"


def stepped_line(event: TrainerStepped) -> str:
    return (f"trainer    step={event.step} reward={event.reward_mean:.3f} "
            f"weights=v{event.weight_version} loss={event.loss:.4f} samples={event.num_samples} "
            f"max_lag={event.max_generation_lag}")
