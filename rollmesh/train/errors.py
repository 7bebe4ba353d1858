"""Errors of the training jobs (``rollmesh train``), one tree under ``TrainError``. Imports nothing.

    TrainError
    ├── RunFileError(reason, stage), ValueError      (checks) a run file that cannot run
    └── TrainerSettingsError(stage, fields), RuntimeError
                                                     (job) the attached mesh's trainer runs other settings

The builtin second bases stay because callers catch them; the modules that raise them still
export them.
"""

from __future__ import annotations


class TrainError(Exception):
    """Root of the training jobs' errors."""
