"""A directory of the image cache built aside and renamed into place, so a crash never leaves a
half-built one under its final name, and two brokers building the same one at once both end up
with the first one's.

Knows the file system only.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_dir(final: Path, *, built: Callable[[Path], bool]) -> Iterator[Path]:
    """Yields an empty staging directory beside ``final``; renamed to ``final`` when the block
    ends, or removed when it raises. ``built(final)`` says whether a directory already at
    ``final`` is complete (another broker finished first: ours is dropped)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(mode=0o755)
    try:
        yield staging
        try:
            staging.rename(final)
        except OSError:
            if not built(final):
                raise
            shutil.rmtree(staging)  # another broker finished the same directory first
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
