"""Workload traces the simulator replays: SWF job logs, a CSV of ML jobs, and an RL run's phases.

Knows msgspec, csv and the workload specs; no simulation. A line that cannot be read is a
``TraceFormatError`` naming the file and the line.

* SWF, the Standard Workload Format of the Parallel Workloads Archive
  (https://www.cs.huji.ac.il/labs/parallel/workload/swf.html): ';' starts a header comment
  ("; MaxProcs: 64"); every other non-blank line is one job of 18 whitespace-separated numbers,
  -1 meaning unknown. Processors are accelerators here. SWF says nothing of checkpointing, so SWF
  jobs take ``JobDefaults``.
* The ML jobs CSV (``ML_JOBS_HEADER``), '#' lines are comments; one job per row, times in seconds.
  ``expected_s`` empty: the job's duration is its estimate. ``checkpoint_s`` empty: it cannot save
  on request. ``checkpoint_interval_s`` 0: no periodic checkpoints.
* The RL phases TOML (``RlRunSpec``): the run's roles and shares, then its phases in order, each
  with its duration, each role's demand and the fraction of that demand busy computing, and how
  long before its end the run can tell when it ends (``notice_s``).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from rollmesh.scheduling.errors import TraceFormatError
from rollmesh.scheduling.workload import RoleShare, SimJob

SWF_FIELDS = (
    "job_number", "submit_time", "wait_time", "run_time", "allocated_processors",
    "average_cpu_time", "used_memory", "requested_processors", "requested_time",
    "requested_memory", "status", "user_id", "group_id", "executable_number", "queue_number",
    "partition_number", "preceding_job_number", "think_time",
)
# Fields that are times, memory or averages may be fractional; the rest are counts, ids and codes.
_SWF_FRACTIONAL = {"submit_time", "wait_time", "run_time", "average_cpu_time", "used_memory",
                   "requested_time", "requested_memory", "think_time"}
# SWF status 2-4 mark the partial executions of a checkpointed job; its summary line (0, 1 or 5)
# is the one to replay.
_SWF_PARTIAL = {2, 3, 4}

ML_JOBS_HEADER = ("job_id", "submit_s", "accelerators", "duration_s", "expected_s", "grace_s",
                  "checkpoint_interval_s", "checkpoint_s", "restart_cost_s")


@dataclass(frozen=True)
class SwfJob:
    """One SWF job line; None where the trace says -1 (unknown)."""

    job_number: int
    submit_time: float
    wait_time: float | None
    run_time: float | None
    allocated_processors: int | None
    average_cpu_time: float | None
    used_memory: float | None
    requested_processors: int | None
    requested_time: float | None
    requested_memory: float | None
    status: int | None
    user_id: int | None
    group_id: int | None
    executable_number: int | None
    queue_number: int | None
    partition_number: int | None
    preceding_job_number: int | None
    think_time: float | None
    line: int


@dataclass(frozen=True)
class SwfTrace:
    header: dict[str, str]  # "; Key: value" comments, e.g. {"MaxProcs": "64"}
    jobs: list[SwfJob]

    def max_processors(self) -> int | None:
        value = self.header.get("MaxProcs", "").strip()
        return int(value) if value.isdigit() and int(value) > 0 else None


@dataclass(frozen=True)
class JobDefaults:
    """What an SWF job does not say: its grace period and how it checkpoints."""

    grace_s: float = 120.0
    checkpoint_interval_s: float = 1800.0
    checkpoint_s: float | None = 30.0
    restart_cost_s: float = 60.0


@dataclass(frozen=True)
class TraceJob:
    """A job to replay: submitted at ``submit_s``, needing ``duration_s`` of work (the truth; its
    ``SimJob.expected_duration_s`` is the estimate the scheduler sees)."""

    submit_s: float
    duration_s: float
    job: SimJob


def read_swf(path: str | Path) -> SwfTrace:
    header: dict[str, str] = {}
    jobs: list[SwfJob] = []
    for number, text in enumerate(Path(path).read_text().splitlines(), start=1):
        line = text.strip()
        if not line:
            continue
        if line.startswith(";"):
            key, colon, value = line[1:].partition(":")
            if colon:
                header[key.strip()] = value.strip()
            continue
        tokens = line.split()
        if len(tokens) != len(SWF_FIELDS):
            raise TraceFormatError(f"{len(tokens)} fields, SWF has {len(SWF_FIELDS)}", path=str(path), line=number)
        values = {name: _swf_value(name, token, path, number) for name, token in zip(SWF_FIELDS, tokens)}
        if values["job_number"] is None or values["submit_time"] is None:
            raise TraceFormatError("job number and submit time must be known", path=str(path), line=number)
        jobs.append(SwfJob(**values, line=number))
    return SwfTrace(header, jobs)


def _swf_value(name: str, token: str, path: str | Path, line: int) -> float | int | None:
    try:
        value = float(token)
    except ValueError:
        raise TraceFormatError(f"{name} is {token!r}, not a number", path=str(path), line=line) from None
    if value == -1:
        return None
    if not math.isfinite(value) or value < 0:
        raise TraceFormatError(f"{name} is {token!r}: -1 (unknown) or >= 0", path=str(path), line=line)
    if name in _SWF_FRACTIONAL:
        return value
    if value != int(value):
        raise TraceFormatError(f"{name} is {token!r}, not a whole number", path=str(path), line=line)
    return int(value)


def swf_trace_jobs(trace: SwfTrace, defaults: JobDefaults = JobDefaults()) -> list[TraceJob]:
    """The jobs that ran: summary lines with a known run time and processor count. The estimate
    is the requested time when the trace has one (what a backfilling scheduler is told)."""
    jobs = []
    for swf in trace.jobs:
        processors = swf.allocated_processors or swf.requested_processors
        if swf.status in _SWF_PARTIAL or not swf.run_time or not processors:
            continue
        job = SimJob(job_id=str(swf.job_number), accelerators=processors,
                     expected_duration_s=swf.requested_time or swf.run_time, grace_s=defaults.grace_s,
                     checkpoint_interval_s=defaults.checkpoint_interval_s,
                     checkpoint_s=defaults.checkpoint_s, restart_cost_s=defaults.restart_cost_s)
        jobs.append(TraceJob(submit_s=swf.submit_time, duration_s=swf.run_time, job=job))
    return jobs


def read_ml_jobs(path: str | Path) -> list[TraceJob]:
    # One row per line (no quoted newlines in this format), so each row keeps its line number.
    lines = [(number, text) for number, text in enumerate(Path(path).read_text().splitlines(), start=1)
             if text.strip() and not text.lstrip().startswith("#")]
    if not lines or tuple(name.strip() for name in next(csv.reader([lines[0][1]]))) != ML_JOBS_HEADER:
        raise TraceFormatError(f"the header must be {','.join(ML_JOBS_HEADER)}", path=str(path),
                               line=lines[0][0] if lines else None)
    jobs = []
    seen: set[str] = set()
    for line, text in lines[1:]:
        row = next(csv.reader([text]))
        if len(row) != len(ML_JOBS_HEADER):
            raise TraceFormatError(f"{len(row)} columns, the header has {len(ML_JOBS_HEADER)}",
                                   path=str(path), line=line)
        job = _ml_job(dict(zip(ML_JOBS_HEADER, (cell.strip() for cell in row))), path, line)
        if job.job.job_id in seen:
            raise TraceFormatError(f"job {job.job.job_id!r} appears twice", path=str(path), line=line)
        seen.add(job.job.job_id)
        jobs.append(job)
    return jobs


def _ml_job(cells: dict[str, str], path: str | Path, line: int) -> TraceJob:
    def number(name: str, *, optional: bool = False) -> float | None:
        text = cells[name]
        if not text and optional:
            return None
        try:
            value = float(text)
        except ValueError:
            raise TraceFormatError(f"{name} is {text!r}, not a number", path=str(path), line=line) from None
        if not math.isfinite(value) or value < 0:
            raise TraceFormatError(f"{name} is {text!r}: must be >= 0", path=str(path), line=line)
        return value

    accelerators = number("accelerators")
    duration = number("duration_s")
    if not cells["job_id"]:
        raise TraceFormatError("job_id is empty", path=str(path), line=line)
    if accelerators != int(accelerators) or accelerators < 1:  # type: ignore[operator]
        raise TraceFormatError(f"accelerators is {cells['accelerators']!r}: a whole number >= 1",
                               path=str(path), line=line)
    if not duration:
        raise TraceFormatError("duration_s must be > 0", path=str(path), line=line)
    job = SimJob(job_id=cells["job_id"], accelerators=int(accelerators),  # type: ignore[arg-type]
                 expected_duration_s=number("expected_s", optional=True) or duration,
                 grace_s=number("grace_s"), checkpoint_interval_s=number("checkpoint_interval_s"),
                 checkpoint_s=number("checkpoint_s", optional=True), restart_cost_s=number("restart_cost_s"))
    return TraceJob(submit_s=number("submit_s"), duration_s=duration, job=job)  # type: ignore[arg-type]


class RlPhase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    duration_s: Annotated[float, Meta(gt=0)]
    # Role -> accelerators it computes with in this phase (roles not named demand 0).
    demand: dict[str, Annotated[int, Meta(ge=0)]] = {}
    # Role -> share of its demand busy computing (1 when not named).
    busy: dict[str, Annotated[float, Meta(ge=0, le=1)]] = {}
    # How long before this phase ends the run knows when (or as soon as it knows when the phase
    # starts, if later); it announces the next phase's demand then.
    notice_s: Annotated[float, Meta(ge=0)] = 0.0


class RlRunSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    run_id: str = "rl"
    weight: Annotated[float, Meta(gt=0)] = 1.0
    roles: dict[str, RoleShare]
    phases: Annotated[list[RlPhase], Meta(min_length=1)]

    def duration_s(self) -> float:
        return sum(phase.duration_s for phase in self.phases)

    def peak_demand(self) -> int:
        return max(sum(phase.demand.values()) for phase in self.phases)


def read_rl_phases(path: str | Path) -> RlRunSpec:
    try:
        spec = msgspec.toml.decode(Path(path).read_bytes(), type=RlRunSpec)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TraceFormatError(str(exc), path=str(path)) from exc
    for index, phase in enumerate(spec.phases):
        unknown = (set(phase.demand) | set(phase.busy)) - set(spec.roles)
        if unknown:
            raise TraceFormatError(f"phases[{index}] ({phase.name}) names roles {sorted(unknown)} "
                                   f"that [roles] does not declare", path=str(path))
    return spec
