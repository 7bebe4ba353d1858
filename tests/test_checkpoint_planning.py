"""Resharding geometry (box intersection) and the conversion planner, from metadata only:
hypothesis checks that every element is covered exactly once and every task fits its budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollmesh.checkpoint.chunk_geometry import Box, check_tiling, plan_copies, split_along
from rollmesh.checkpoint.convert_planner import PlannedTensor, TaskTooLargeError, plan_tasks

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@st.composite
def layouts(draw):
    """A tensor shape, a stored tensor-parallel split and a target one (any axes, any degrees)."""
    rank = draw(st.integers(1, 3))
    source_axis, target_axis = draw(st.integers(0, rank - 1)), draw(st.integers(0, rank - 1))
    source_parts, target_parts = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    shape = [draw(st.integers(1, 3)) for _ in range(rank)]
    shape[source_axis] *= source_parts
    shape[target_axis] *= target_parts
    return tuple(shape), split_along(shape, source_axis, source_parts), split_along(shape, target_axis, target_parts)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_resharding_fills_every_target_element_exactly_once_from_the_stored_chunks(layout):
    shape, sources, targets = layout
    check_tiling(shape, sources)
    full = torch.arange(Box.whole(shape).numel).reshape(shape)
    stored = [full[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))].clone() for b in sources]
    copies = plan_copies(targets, sources)
    for index, target in enumerate(targets):
        mine = [copy.region for copy in copies if copy.target == index]
        check_tiling(target.sizes, [Box(tuple(o - t for o, t in zip(r.offsets, target.offsets)), r.sizes) for r in mine])
        out = torch.full(target.sizes, -1)
        for copy in (c for c in copies if c.target == index):
            out[copy.region.relative_to(target)] = stored[copy.source][copy.region.relative_to(sources[copy.source])]
        assert torch.equal(out, full[tuple(slice(o, o + s) for o, s in zip(target.offsets, target.sizes))])


def test_tiling_check_names_gaps_overlaps_and_strays():
    with pytest.raises(ValueError, match="cover 2 of the 4"):
        check_tiling((4,), [Box((0,), (2,))])
    with pytest.raises(ValueError, match="overlap"):
        check_tiling((4,), [Box((0,), (3,)), Box((2,), (2,))])
    with pytest.raises(ValueError, match="outside"):
        check_tiling((4,), [Box((0,), (4,)), Box((4,), (1,))])


@st.composite
def checkpoints(draw):
    """Canonical tensors as the planner sees them: stored in row pieces over a few files, some
    row-splittable (vocabulary tables, whose output may drop padding rows)."""
    tensors = []
    for index in range(draw(st.integers(1, 8))):
        rows, row_bytes = draw(st.integers(1, 12)), draw(st.sampled_from([2, 4, 8, 64]))
        parts = draw(st.sampled_from([d for d in (1, 2, 3) if rows % d == 0]))
        step = rows // parts
        row_files = tuple((p * step, (p + 1) * step, f"file{draw(st.integers(0, 3))}") for p in range(parts))
        splittable = draw(st.booleans())
        kept_rows = draw(st.integers(0, rows)) if splittable else rows  # vocabulary padding dropped
        out_row_bytes = draw(st.sampled_from([row_bytes, 2 * row_bytes]))  # a cast may change the size
        tensors.append(PlannedTensor(f"t{index}", rows, rows * row_bytes, kept_rows * out_row_bytes, row_files,
                                     row_splittable=splittable, kept_rows=kept_rows))
    return tensors


@settings(max_examples=200, deadline=None)
@given(checkpoints(), st.integers(1, 4), st.integers(1, 3))
def test_planner_covers_every_row_once_within_the_budget_largest_first(tensors, slack, task_share):
    largest_fixed = max((t.in_bytes + t.out_bytes for t in tensors if not t.row_splittable), default=0)
    row_max = max(t.in_bytes // t.rows + (t.out_bytes // t.kept_rows if t.kept_rows else 0) for t in tensors)
    budget = max(largest_fixed, row_max) * slack
    task_bytes = max(1, sum(t.out_bytes for t in tensors) // task_share)
    tasks = plan_tasks(tensors, max_task_bytes=task_bytes, max_unit_memory=budget)
    assert all(task.memory_bytes <= budget for task in tasks)
    assert [task.out_bytes for task in tasks] == sorted((task.out_bytes for task in tasks), reverse=True)
    units = [unit for task in tasks for unit in task.units]
    for tensor in tensors:
        mine = [unit for unit in units if unit.tensor == tensor.name]
        homes = {id(task) for task in tasks for unit in task.units if unit.tensor == tensor.name}
        assert len(homes) == 1  # a tensor's blocks fill one output tensor: one task, in order
        spans = [unit.rows or (0, tensor.rows) for unit in mine]
        check_tiling((tensor.rows,), [Box((start,), (stop - start,)) for start, stop in spans])
        assert [start for start, _ in spans] == sorted(start for start, _ in spans)
        assert sum(unit.in_bytes for unit in mine) == tensor.in_bytes
        assert sum(unit.out_bytes for unit in mine) == tensor.out_bytes
        for unit, (start, stop) in zip(mine, spans):
            assert unit.files == tensor.files(start, stop)
    for task in tasks:  # packed to the task size, unless one tensor alone is larger
        if len({unit.tensor for unit in task.units}) > 1:
            assert task.out_bytes <= task_bytes


def test_a_tensor_larger_than_the_budget_is_refused_by_name_unless_its_rows_can_split():
    dense = PlannedTensor("decoder.layers.0.mlp.linear_fc1.weight", 8, 128, 128, ((0, 8, "a.distcp"),))
    with pytest.raises(TaskTooLargeError, match="linear_fc1.weight: converting it holds 256 bytes"):
        plan_tasks([dense], max_task_bytes=1 << 20, max_unit_memory=200)
    table = PlannedTensor("embedding.word_embeddings.weight", 8, 128, 112, ((0, 4, "a.distcp"), (4, 8, "b.distcp")),
                          row_splittable=True, kept_rows=7)
    tasks = plan_tasks([table], max_task_bytes=1 << 20, max_unit_memory=128)  # 4 rows: 64 in + 64 out
    assert [(unit.rows, unit.files) for unit in tasks[0].units] == [((0, 4), {"a.distcp"}), ((4, 8), {"b.distcp"})]
    assert [unit.out_bytes for unit in tasks[0].units] == [64, 48]  # the last row is padding, dropped


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                        "decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.0.input_layernorm.weight"]),
       st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(1, 3), st.booleans())
def test_the_rank_boxes_of_every_rank_cover_a_split_tensor_exactly_once(name, tp, rows, cols, stacked):
    from rollmesh.checkpoint.tp_reshard import rank_boxes

    shape = (2 * tp * rows, tp * cols)
    whole = Box((1,) + (0, 0), (1,) + shape) if stacked else Box.whole(shape)
    boxes = [box for rank in range(tp) for box in rank_boxes(name, whole, rank, tp, stacked=stacked)]
    if name.endswith("layernorm.weight"):
        assert boxes == [whole] * tp  # replicated
    else:
        check_tiling(whole.sizes, [Box(tuple(o - w for o, w in zip(b.offsets, whole.offsets)), b.sizes)
                                   for b in boxes])
