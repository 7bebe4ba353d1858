"""The trainer gives freed heap memory back after each step (glibc's malloc_trim)."""

from __future__ import annotations

import pytest

from rollmesh.training.heap import return_freed_memory

pytestmark = pytest.mark.unit


def test_freed_heap_memory_is_returned_to_the_os_on_glibc():
    blocks = [bytearray(256 * 1024) for _ in range(64)]  # 16 MiB, then freed
    del blocks
    assert return_freed_memory() is True, "glibc's malloc_trim is expected on the Linux CI machine"
