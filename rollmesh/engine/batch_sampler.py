"""How a batch's logits become tokens: each constrained row masked by its grammar, the sampler,
each asking row's top logprobs kept, and each grammar advanced by the token its row drew.

Knows torch, the sampler (``sampling``), the grammar machinery (``guided_decoding``) and the
sequences it samples for (``decode_state``); not the model, the KV pool or the batch's order of
business (``decode`` runs the forward pass and decides when a sequence starts, stops or leaves).

Top logprobs (``GenerateOptions.top_logprobs``): the sampler returns each asking row's most
likely ids from the distribution it samples from (after a grammar's mask); a batch computes them
only when some row asks. Grammars (``GenerateOptions.grammar``): a constrained sequence's row of
the logits is masked before sampling, from its first token to its end-of-turn id; the count of
constrained sequences (``constrained_active``) lets a step whose batch holds no grammar skip
grammar work altogether.
"""

from __future__ import annotations

import torch

from rollmesh.engine.decode_state import ActiveSequence
from rollmesh.engine.guided_decoding import GuidedDecoder, accept
from rollmesh.engine.sampling import sample_tokens


class BatchSampler:
    """Samples one token per row for the decode engine, with the grammars of its sequences."""

    def __init__(self, guided: GuidedDecoder, *, vocab_size: int, generator: torch.Generator,
                 device: torch.device) -> None:
        self.guided = guided
        self.vocab_size = vocab_size  # ids past it (padded embedding rows) are never sampled
        self.generator = generator
        self._device = device
        self.constrained_active = 0  # sequences holding a matcher

    def start_grammar(self, sequence: ActiveSequence) -> None:
        """Give ``sequence`` a matcher for its grammar (compiled, and cached, at validation)."""
        sequence.matcher = self.guided.matcher(sequence.options.grammar,
                                               request_id=sequence.request_id)
        self.constrained_active += 1

    def sample(
        self, batch: list[ActiveSequence], logits: torch.Tensor, *, masked: bool
    ) -> tuple[list[int], list[float], list[bool] | None]:
        """(each row's token, its logprob, per row: was it constrained, or None when not
        ``masked``) from ``logits`` [B, V]; keeps each asking row's top logprobs."""
        constrained = None
        if masked:
            logits = logits.float()  # the mask goes into the very tensor sample_tokens normalises
            constrained = self.guided.mask(logits, [s.matcher for s in batch])
        temperature = torch.tensor([s.temperature for s in batch], device=self._device)
        top_p = torch.tensor([s.top_p for s in batch], device=self._device)
        top_n = max(s.options.top_logprobs for s in batch)
        chosen, logprobs, *top = sample_tokens(logits, temperature, top_p, self.generator,
                                               vocab_size=self.vocab_size, top_n=top_n)
        if top:
            _keep_top(batch, *top[0])
        return chosen.tolist(), logprobs.tolist(), constrained

    def advance_grammar(self, sequence: ActiveSequence, token: int, constrained: bool) -> None:
        if sequence.matcher is None:
            return
        sequence.constrained.append(constrained)
        if not accept(sequence.matcher, token):
            # Cannot happen for a masked row; should it, the rest of the turn goes unconstrained
            # (its flags say so, see end_grammar) rather than failing the whole batch's step.
            self._drop_grammar(sequence)

    def end_grammar(self, sequence: ActiveSequence) -> None:
        """``sequence`` leaves the batch: its matcher goes, its flags cover every token."""
        self._drop_grammar(sequence)
        if sequence.options.grammar is not None:  # one flag per token, also after a dropped grammar
            sequence.constrained += [False] * (len(sequence.token_ids) - len(sequence.constrained))

    def _drop_grammar(self, sequence: ActiveSequence) -> None:
        if sequence.matcher is not None:
            sequence.matcher = None
            self.constrained_active -= 1


def _keep_top(batch: list[ActiveSequence], ids: torch.Tensor, values: torch.Tensor) -> None:
    """Each asking row's first ``options.top_logprobs`` alternatives (the batch computed as many
    as its hungriest row asked for)."""
    for sequence, row_ids, row_values in zip(batch, ids.tolist(), values.tolist()):
        if sequence.top is not None:
            n = sequence.options.top_logprobs
            sequence.top.append(list(zip(row_ids[:n], row_values[:n])))
