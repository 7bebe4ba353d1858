"""Chunked optimizer offload: bit-exact against the plain mixed-precision AdamW for any chunking,
the chunk plan, and the device memory each variant holds during the step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollmesh.training.device_memory import DeviceMemoryAccount, measure_peak
from rollmesh.training.optimizer_adamw import AdamWConfig, MixedPrecisionAdamW, adamw_update_
from rollmesh.training.optimizer_chunks import Segment, plan_chunks
from rollmesh.training.errors import MissingGradientError, OptimizerSetupError
from rollmesh.training.optimizer_offload import ChunkedOffloadAdamW

pytestmark = pytest.mark.unit

# A large learning rate, so that the bf16 parameters change at every step and a wrong chunk
# boundary would show in them, not only in the fp32 masters.
CONFIG = AdamWConfig(lr=1e-2, weight_decay=0.1)
# Mixed shapes: matrices, vectors, a 3-d tensor, a single element and an empty parameter.
SHAPES = [(37, 53), (53,), (11, 53), (11,), (3, 5, 7), (1,), (0,)]
TOTAL = sum(torch.Size(shape).numel() for shape in SHAPES)  # 2714
LARGEST = 37 * 53


def mixed_parameters(device: str = "cpu") -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(7)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(shape, generator=generator).to(torch.bfloat16).to(device)))
            for i, shape in enumerate(SHAPES)]


def give_random_gradients(*named_lists, generator: torch.Generator) -> None:
    """The same random bf16 gradient for the same parameter in every list."""
    for group in zip(*named_lists):
        grad = torch.randn(group[0][1].shape, generator=generator).to(torch.bfloat16)
        for _, param in group:
            param.grad = grad.to(param.device)


def assert_bit_identical(plain, plain_named, offload, offload_named) -> None:
    for (name, a), (_, b) in zip(plain_named, offload_named):
        assert torch.equal(a.cpu(), b.cpu()), f"bf16 parameter {name}"
        for part, x, y in zip(("master", "exp_avg", "exp_avg_sq"), plain.state_of(name), offload.state_of(name)):
            assert torch.equal(x.cpu(), y.cpu()), f"{part} of {name}"


def run_both(chunk_bytes: int, copies: str, steps: int = 3):
    plain_named, offload_named = mixed_parameters(), mixed_parameters()
    plain = MixedPrecisionAdamW(plain_named, config=CONFIG, device="cpu")
    offload = ChunkedOffloadAdamW(offload_named, config=CONFIG, device="cpu", chunk_bytes=chunk_bytes, copies=copies)
    generator = torch.Generator().manual_seed(11)
    for _ in range(steps):
        give_random_gradients(plain_named, offload_named, generator=generator)
        plain.step()
        offload.step()
    return plain, plain_named, offload, offload_named


# Chunk sizes in elements: one element (every op on the scalar path), sizes that divide nothing,
# one that ends exactly where the first parameter does, all in one chunk, and more than all.
@pytest.mark.parametrize("chunk_numel", [1, 7, 64, LARGEST, 1000, TOTAL, TOTAL + 5])
@pytest.mark.parametrize("copies", ["inline", "thread"])
def test_offloaded_adamw_is_bit_identical_to_plain_for_any_chunk_size(chunk_numel, copies):
    plain, plain_named, offload, offload_named = run_both(4 * chunk_numel, copies)
    before = mixed_parameters()
    assert not torch.equal(before[0][1], plain_named[0][1]), "the step must change the bf16 weights"
    assert_bit_identical(plain, plain_named, offload, offload_named)
    assert offload.statistics().chunks == -(-TOTAL // chunk_numel)


def test_offloaded_adamw_is_bit_identical_through_a_real_backward_of_a_transformer_block():
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 32),
        torch.nn.TransformerEncoderLayer(32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True),
        torch.nn.Linear(32, 50),
    ).to(torch.bfloat16)
    models = [model, copy.deepcopy(model)]
    plain = MixedPrecisionAdamW(models[0].named_parameters(), config=CONFIG, device="cpu")
    offload = ChunkedOffloadAdamW(models[1].named_parameters(), config=CONFIG, device="cpu", chunk_bytes=4 * 999)
    tokens = torch.randint(0, 50, (4, 12))
    for _ in range(3):
        for net in models:
            net.zero_grad(set_to_none=True)
            logits = net(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        plain.step()
        offload.step()
    assert_bit_identical(plain, list(models[0].named_parameters()), offload, list(models[1].named_parameters()))


def test_plain_reference_computes_torch_adamw():
    named = mixed_parameters()
    plain = MixedPrecisionAdamW(named, config=CONFIG, device="cpu")
    masters = [torch.nn.Parameter(param.detach().float()) for _, param in named]
    reference = torch.optim.AdamW(masters, lr=CONFIG.lr, betas=(CONFIG.beta1, CONFIG.beta2), eps=CONFIG.eps,
                                  weight_decay=CONFIG.weight_decay)
    generator = torch.Generator().manual_seed(5)
    for _ in range(5):
        give_random_gradients(named, generator=generator)
        for master, (_, param) in zip(masters, named):
            master.grad = param.grad.float()
        plain.step()
        reference.step()
    for master, (name, param) in zip(masters, named):
        # Not bit-equal: torch fuses (lerp, addcmul, addcdiv) where ours rounds op by op.
        torch.testing.assert_close(plain.state_of(name).master, master.detach().reshape(-1), rtol=1e-6, atol=1e-7)
        assert torch.equal(param, plain.state_of(name).master.to(torch.bfloat16).view(param.shape))


def test_chunk_plan_splits_and_joins_parameters_at_chunk_edges():
    chunks = plan_chunks([5, 0, 3, 8], chunk_numel=4)
    assert [(c.start, c.stop) for c in chunks] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert chunks[0].segments == (Segment(0, 0, 0, 4),)
    assert chunks[1].segments == (Segment(0, 4, 0, 1), Segment(2, 0, 1, 3))  # the empty parameter is in none
    assert chunks[3].segments == (Segment(3, 4, 0, 4),)
    assert plan_chunks([], 4) == [] and plan_chunks([0, 0], 4) == []


@pytest.mark.parametrize("chunk_numel", [1, 3, 53, 100, TOTAL, 10 * TOTAL])
def test_chunk_plan_covers_every_element_exactly_once(chunk_numel):
    numels = [torch.Size(shape).numel() for shape in SHAPES]
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for chunk in plan_chunks(numels, chunk_numel):
        assert chunk.numel == min(chunk_numel, TOTAL - chunk.start)
        assert sum(seg.length for seg in chunk.segments) == chunk.numel
        for seg in chunk.segments:
            seen[seg.param_index][seg.param_start:seg.param_start + seg.length] += 1
    assert all(bool((s == 1).all()) for s in seen)


@pytest.mark.parametrize("chunk_numel", [64, 1000])
def test_accounted_peaks_are_the_derived_byte_counts(chunk_numel):
    plain, plain_named, offload, offload_named = run_both(4 * chunk_numel, "inline", steps=1)
    _, plain_peak = measure_peak(plain.account, plain.step)
    _, offload_peak = measure_peak(offload.account, offload.step)
    n, c = TOTAL, chunk_numel
    # Plain: bf16 parameters and gradients (2 + 2 bytes an element), fp32 master, exp_avg and
    # exp_avg_sq (3 x 4), plus the step's fp32 gradient and scratch for the largest parameter.
    assert plain_peak.peak_bytes == 16 * n + 8 * LARGEST
    # Offload: the bf16 parameters and gradients, and during the step two slots of three fp32
    # state chunks (2 x 3 x 4 bytes) plus one fp32 gradient chunk and one scratch chunk (2 x 4).
    assert offload_peak.peak_bytes == 4 * n + 32 * c
    assert plain_peak.peak_bytes - offload_peak.peak_bytes == 12 * n + 8 * LARGEST - 32 * c
    # Between steps the offload holds only parameters and gradients; the plain one its state too.
    assert (plain.account.current_bytes, offload.account.current_bytes) == (16 * n, 4 * n)
    assert offload.statistics().host_bytes == 12 * n


class _UnaccountedStorages(TorchDispatchMode):
    """Records every op output whose storage is neither held by the account nor host state."""

    def __init__(self, account: DeviceMemoryAccount, host_pointers: set[int]) -> None:
        super().__init__()
        self.account, self.host_pointers, self.found = account, host_pointers, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # account.allocate's own torch.empty is held right after it returns; anything else that
        # allocates writes its result, and that write is caught here.
        if func is not torch.ops.aten.empty.memory_format:
            known = self.account.storage_pointers() | self.host_pointers
            for tensor in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.numel() and \
                        tensor.untyped_storage().data_ptr() not in known:
                    self.found.append((str(func), tuple(tensor.shape)))
        return out


def test_every_tensor_a_step_writes_is_accounted_or_host_state():
    plain, plain_named, offload, offload_named = run_both(4 * 100, "inline", steps=1)
    host = {t.untyped_storage().data_ptr() for name, _ in offload_named for t in offload.state_of(name)}
    for optimizer, pointers in ((plain, set()), (offload, host)):
        with _UnaccountedStorages(optimizer.account, pointers) as mode:
            optimizer.step()
        assert mode.found == []


def test_a_parameter_without_gradient_fails_the_step_with_its_name():
    named = mixed_parameters()
    offload = ChunkedOffloadAdamW(named, config=CONFIG, device="cpu", chunk_bytes=256)
    give_random_gradients(named, generator=torch.Generator().manual_seed(1))
    named[2][1].grad = None
    with pytest.raises(MissingGradientError) as error:
        offload.step()
    assert (error.value.parameter, error.value.step, offload.steps) == ("p2", 1, 0)


def test_parameters_the_optimizers_cannot_take_are_refused_with_their_names():
    strided = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16)[:, ::2])
    with pytest.raises(OptimizerSetupError) as error:
        MixedPrecisionAdamW([("w", strided)], config=CONFIG, device="cpu")
    assert (error.value.parameter, error.value.reason) == ("w", "not contiguous")
    with pytest.raises(OptimizerSetupError, match="optimizer device is meta"):
        ChunkedOffloadAdamW([("w", torch.nn.Parameter(torch.zeros(3)))], config=CONFIG, device="meta")
    with pytest.raises(ValueError, match="multiple of 4"):
        ChunkedOffloadAdamW([], config=CONFIG, device="cpu", chunk_bytes=6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: torch.cuda.max_memory_allocated and the copy streams exist only on a GPU")
def test_offload_lowers_cuda_peak_memory_and_stays_bit_identical():
    shapes = [(1024, 1024)] * 4 + [(1024,), (3000, 333)]  # ~5.2M parameters, one that divides no chunk
    chunk_bytes = 256 << 10
    peaks, finals = {}, {}
    for kind in ("plain", "offload"):  # one at a time, so each peak is that variant's alone
        generator = torch.Generator().manual_seed(3)
        named = [(f"p{i}", torch.nn.Parameter(torch.randn(s, generator=generator).to(torch.bfloat16).cuda()))
                 for i, s in enumerate(shapes)]
        optimizer = (MixedPrecisionAdamW(named, config=CONFIG, device="cuda") if kind == "plain" else
                     ChunkedOffloadAdamW(named, config=CONFIG, device="cuda", chunk_bytes=chunk_bytes))
        for _ in range(3):
            give_random_gradients(named, generator=generator)
            _, stats = measure_peak(optimizer.account, optimizer.step)
        assert stats.source == "cuda.max_memory_allocated"
        peaks[kind] = stats.peak_bytes
        finals[kind] = {name: [param.cpu()] + [t.cpu() for t in optimizer.state_of(name)] for name, param in named}
        del optimizer, named
        torch.cuda.empty_cache()
    for name, tensors in finals["plain"].items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, finals["offload"][name])), name
    n, largest, c = sum(torch.Size(s).numel() for s in shapes), 3000 * 333, chunk_bytes // 4
    assert peaks["offload"] < peaks["plain"]
    # The derived figures (see test_accounted_peaks_are_the_derived_byte_counts), up to the
    # allocator's rounding of each block to 512 bytes.
    assert abs(peaks["plain"] - (16 * n + 8 * largest)) < 64 << 10
    assert abs(peaks["offload"] - (4 * n + 32 * c)) < 64 << 10


@pytest.mark.parametrize("kind", ["plain", "offload"])
def test_clipping_scales_the_fp32_gradients_and_both_optimizers_stay_bit_identical(kind):
    """``clip_grad_norm`` gives the fp32 norm of the bf16 gradients and makes the next step use
    gradients scaled to ``max_norm``: the same as stepping on the scaled fp32 gradients."""
    named, reference_named = mixed_parameters(), mixed_parameters()
    build = (lambda n: MixedPrecisionAdamW(n, config=CONFIG, device="cpu")) if kind == "plain" else (
        lambda n: ChunkedOffloadAdamW(n, config=CONFIG, device="cpu", chunk_bytes=4096))
    optimizer, reference = build(named), MixedPrecisionAdamW(reference_named, config=CONFIG, device="cpu")
    give_random_gradients(named, reference_named, generator=torch.Generator().manual_seed(3))
    norm = optimizer.clip_grad_norm(1.0)
    expected = torch.sqrt(sum(p.grad.float().pow(2).sum() for _, p in named)).item()
    assert norm == pytest.approx(expected, rel=1e-6) and norm > 1.0
    optimizer.step()
    # The reference steps once on fp32 gradients scaled by hand, through a step with scale 1.
    scale = 1.0 / (expected + 1e-6)
    for name, param in reference_named:
        state = reference.state_of(name)
        grad32 = param.grad.float().reshape(-1) * scale
        adamw_update_(state.master, state.exp_avg, state.exp_avg_sq, grad32, torch.empty_like(grad32),
                      step=1, config=CONFIG)
    for name, _ in named:
        assert torch.allclose(optimizer.state_of(name).master, reference.state_of(name).master, rtol=0, atol=1e-6)
    assert optimizer.clip_grad_norm(1e9) > 0 and optimizer._grad_scale == 1.0  # no clipping: scale 1


@pytest.mark.parametrize("kind", ["plain", "offload"])
def test_state_dict_round_trip_resumes_bit_for_bit_and_refuses_other_parameters(kind):
    def build(named):
        if kind == "plain":
            return MixedPrecisionAdamW(named, config=CONFIG, device="cpu")
        return ChunkedOffloadAdamW(named, config=CONFIG, device="cpu", chunk_bytes=4096)

    generator = torch.Generator().manual_seed(5)
    first_named = mixed_parameters()
    first = build(first_named)
    give_random_gradients(first_named, generator=generator)
    first.step()
    saved = first.state_dict()
    resumed_named = mixed_parameters()  # the parameters as a fresh process would have them
    resumed = build(resumed_named)
    resumed.load_state_dict(saved)
    assert resumed.steps == 1
    grads = torch.Generator().manual_seed(9)
    give_random_gradients(first_named, resumed_named, generator=grads)
    first.step()
    resumed.step()
    assert_bit_identical(first, first_named, resumed, resumed_named)
    with pytest.raises(OptimizerSetupError):
        build(mixed_parameters()[:-2]).load_state_dict(saved)
