"""Test models fitted to a conversation: a model directory's weights trained in place until greedy
decoding reproduces given tokens, so mesh and Serve tests can drive a real tool-calling turn.

Knows torch, safetensors and the engine's HF loader; nothing of the mesh or Serve.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollmesh.engine.models import load_hf_model

# Every trained token wins greedy decoding by this many logits.
FIT_MARGIN = 1.0


def greedy_margin(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The smallest lead of each target's logit over the best other id (negative: one loses)."""
    with torch.no_grad():
        chosen = logits.gather(1, targets[:, None])[:, 0]
        others = logits.scatter(1, targets[:, None], float("-inf")).max(dim=-1).values
        return float((chosen - others).min())


def fit_to_samples(model_dir: Path, samples: list[tuple[list[int], list[int]]], vocab_size: int, *,
                   max_steps: int, margin: float = FIT_MARGIN) -> None:
    """Train the directory's weights until greedy decoding reproduces the tokens each sample's loss
    mask marks (``samples``: (ids, loss_mask) pairs) with ``margin``; write them back in place
    (same tensor names and dtypes). Raises AssertionError after ``max_steps`` without it."""
    model = load_hf_model(model_dir).requires_grad_(True).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = [(torch.tensor([ids]), torch.tensor(mask[1:], dtype=torch.bool)) for ids, mask in samples]
    for _ in range(max_steps):
        loss, smallest = 0.0, float("inf")
        for inputs, trained in batches:
            logits = model(inputs)[0, :-1]
            targets = inputs[0, 1:]
            smallest = min(smallest, greedy_margin(logits[trained, :vocab_size], targets[trained]))
            loss = loss + torch.nn.functional.cross_entropy(logits[trained], targets[trained])
        if smallest >= margin:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError(f"fixture: the fit did not reach a greedy margin of {margin} in {max_steps} steps")
    weights = model_dir / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        metadata, dtypes = f.metadata(), {key: f.get_tensor(key).dtype for key in f.keys()}
    state = model.state_dict()
    save_file({key: state[key].detach().to(dtype).contiguous() for key, dtype in dtypes.items()},
              str(weights), metadata=metadata)
