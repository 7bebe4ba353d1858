"""Resharding geometry (box intersection) and the conversion planner, from metadata only:
hypothesis checks that every element is covered exactly once and every task fits its budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollmesh.checkpoint.chunk_geometry import Box, check_tiling, plan_copies, split_along
from rollmesh.checkpoint.convert_planner import (
    StoredChunk,
    TaskTooLargeError,
    TensorInfo,
    describe_plan,
    plan_tasks,
)

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
    tensors = []
    for index in range(draw(st.integers(1, 8))):
        expert = draw(st.booleans())
        rows = draw(st.integers(1, 6)) * (draw(st.integers(1, 4)) if expert else 1)
        shape = (rows, draw(st.integers(1, 4)), draw(st.integers(1, 4)))
        parts = draw(st.sampled_from([d for d in (1, 2, 3) if rows % d == 0]))
        boxes = split_along(shape, 0, parts)
        itemsize = draw(st.sampled_from([2, 4]))
        chunks = tuple(StoredChunk(f"t{index}", box, f"file{draw(st.integers(0, 3))}", box.numel * itemsize)
                       for box in boxes)
        tensors.append(TensorInfo(f"t{index}", shape, itemsize, chunks, expert_axis=expert))
    return tensors


@settings(max_examples=150, deadline=None)
@given(checkpoints(), st.integers(1, 4))
def test_planner_covers_every_element_once_within_the_budget_largest_first(tensors, slack):
    per_expert = max(t.nbytes // t.shape[0] for t in tensors)
    largest_whole = max((t.nbytes for t in tensors if not t.expert_axis), default=0)
    budget = max(largest_whole, per_expert) * slack
    tasks = plan_tasks(tensors, max_task_bytes=budget)
    assert all(task.nbytes <= budget for task in tasks)
    assert [task.nbytes for task in tasks] == sorted((task.nbytes for task in tasks), reverse=True)
    for tensor in tensors:
        regions = [unit.region for task in tasks for unit in task.units if unit.tensor == tensor.name]
        check_tiling(tensor.shape, regions)  # exactly once, whole tensors or runs of whole experts
        for unit in (u for task in tasks for u in task.units if u.tensor == tensor.name):
            assert unit.files == {c.file for c in tensor.chunks if c.box.intersect(unit.region)}
    assert sum(task.nbytes for task in tasks) == sum(t.nbytes for t in tensors)
    assert len(describe_plan(tasks)) == len(tasks)


def test_a_tensor_larger_than_the_budget_is_refused_by_name():
    dense = TensorInfo("decoder.layers.0.mlp.linear_fc1.weight", (8, 4), 4,
                       (StoredChunk("decoder.layers.0.mlp.linear_fc1.weight", Box.whole((8, 4)), "a.distcp", 128),))
    with pytest.raises(TaskTooLargeError, match="linear_fc1.weight: 128 bytes"):
        plan_tasks([dense], max_task_bytes=100)
    experts = TensorInfo("experts", (4, 8, 4), 4, (StoredChunk("experts", Box.whole((4, 8, 4)), "a.distcp", 512),),
                         expert_axis=True)
    tasks = plan_tasks([experts], max_task_bytes=256)  # two experts per task
    assert [unit.region.sizes[0] for task in tasks for unit in task.units] == [2, 2]


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
