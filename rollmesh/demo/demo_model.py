"""The demo's model, built as an ordinary Hugging Face model directory.

Knows the ``tokenizers`` library, transformers' Llama config and model classes and safetensors;
nothing of Ray, NATS or the mesh. ``build_demo_model(directory)`` writes what a model repository on
the Hub ships, so the demo runs exactly the path a user's Qwen model runs:

- ``tokenizer.json``: a byte-level BPE trained here on the demo's own text: its chat boilerplate
  and the atoms of its task's formulas (an element with its count: "Na", "N2"). Letters and the
  digits after them stay one piece, so a formula is the same ids in the question and in the tool
  call, and its tokens are distinct (module constants say why each choice helps a tiny model).
- ``tokenizer_config.json``: ChatML special tokens (``<|im_start|>``, ``<|im_end|>``,
  ``<|endoftext|>``) and Qwen's plain added tokens ``<tool_call>``/``</tool_call>`` and
  ``<tool_response>``/``</tool_response>``, with the chat template of ``chat_template.jinja`` in
  this package (ChatML, Hermes tool calls as Qwen writes them, the tools stated in one line).
- ``generation_config.json``: ``<|im_end|>`` and ``<|endoftext|>`` end a turn, as in Qwen.
- ``config.json`` and ``model.safetensors``: a 2-layer Llama decoder (tied embeddings) with random
  weights from a seed, 0.58M parameters: it trains in minutes on two CPU cores. Llama rather
  than Qwen2 because transformers loads a "qwen2" directory's tokenizer as its Qwen2Tokenizer,
  which replaces tokenizer.json's pre-tokenizer with Qwen's own (digits split from letters); a
  "llama" directory's tokenizer is tokenizer.json as written.

Building takes well under a second (plus importing transformers) and is deterministic: the same
seed gives the same files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

# ChatML's special tokens (never split, skipped when decoding for humans) and Qwen's plain added
# tokens (never split, but text: a tool call's tags survive decoding).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PLAIN_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")

# How text is cut before BPE merges: a run starting with a capital letter (a formula, "K2NaN2", or
# "Tools") is one piece, a digit is one piece (numbers are copied digit by digit), and every other
# run of text is one piece. So a formula is the same ids in the question and in a tool call, and
# the template's boilerplate ("molar mass of ", a call's '{"name": "calc", "arguments": {}}')
# merges into a token or two: short sequences train and sample faster.
SPLIT_PATTERN = r"\p{Lu}[\p{L}\p{N}]*|\p{N}|[^\p{Lu}\p{N}]+"

# The demo's text between special tokens, besides formulas and numbers (module docstring).
_BOILERPLATE = (
    "system\n", ": calc(formula)", "\n", "user\nmolar mass of ", "?", "assistant\n",
    '\n{"name": "calc", "arguments": {}}\n', '\n{"name": "calc", "arguments": {"formula": "', '"}}\n',
    "user", ".",
    "error: ", "unknown element ", "invalid formula ", "tool call not run",
)  # fmt: skip
_ELEMENTS = ("H", "He", "Li", "Be", "B", "C", "N", "O", "F", "Ne", "Na", "Mg", "Al", "Si", "P", "S",
             "Cl", "Ar", "K", "Ca", "Fe", "Cu", "Zn", "Br", "I")  # fmt: skip
# An element with its count is one token ("Na", "N2"): the atoms of a formula are distinct, so its
# tokens are too, and copying a formula never has to tell two equal tokens apart.
_ATOMS = tuple(f"{element}{count}" for element in _ELEMENTS for count in ("", "2", "3", "4"))
BPE_VOCAB_SIZE = 512


@dataclass(frozen=True)
class DemoModelShape:
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 256


def build_demo_model(directory: Path | str, *, seed: int = 0, shape: DemoModelShape = DemoModelShape()) -> Path:
    """Write the demo model directory (module docstring) and return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS}
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": shape.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(ids[token]): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": token in SPECIAL_TOKENS}
            for token in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS
        },
        "chat_template": TEMPLATE_PATH.read_text(encoding="utf-8"),
    })
    end_ids = [ids[token] for token in END_OF_TURN_TOKENS]
    _write_json(directory / "generation_config.json",
                {"eos_token_id": end_ids, "pad_token_id": ids["<|endoftext|>"]})
    _save_random_weights(directory, shape, vocab_size=tokenizer.get_vocab_size(), seed=seed,
                         eos_id=ids["<|im_end|>"], pad_id=ids["<|endoftext|>"])
    return directory


def _train_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([*_BOILERPLATE * 64, "Tools", *_ATOMS * 16], trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    return tokenizer


def _save_random_weights(directory: Path, shape: DemoModelShape, *, vocab_size: int, seed: int,
                         eos_id: int, pad_id: int) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = transformers.LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(rng_state)
    # Written directly rather than by save_pretrained, which would also write its own
    # generation_config.json (one eos id) over ours. A tied head is left out, as the Hub does.
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict()
    saved["architectures"] = ["LlamaForCausalLM"]
    saved["torch_dtype"] = saved["dtype"] = "float32"  # the demo trains in float32
    _write_json(directory / "config.json", saved)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
