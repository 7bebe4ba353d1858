"""Hugging Face model directories per chat family, built locally and fast, for the chat tests.

`build_model_dir(family, directory)` writes what a real model repository ships for its tokenizer:
tokenizer.json (a byte-level BPE trained here on a small built-in corpus, ~1.5K tokens, with the
family's marker tokens added), tokenizer_config.json (the family's real chat template from
tests/data/chat_templates/, its bos/eos/pad/unk tokens, `added_tokens_decoder`,
PreTrainedTokenizerFast) and generation_config.json (the family's eos list). With
`with_weights=True` it adds config.json and model.safetensors of a tiny random transformers model
sized to the tokenizer. Nothing is downloaded.

The token strings, which markers are special and which are plain added tokens, the bos/eos/pad
choices and the eos lists follow the real models (tests/data/chat_templates/SOURCES.md); the
numeric ids are this tokenizer's own. Special tokens come first in the vocabulary where the real
model has them first (Mistral's control tokens, DeepSeek's bos/eos), otherwise after the BPE
vocabulary as in the real ones (Qwen, Llama 3, Kimi, gpt-oss).

What the real templates need of a caller (tests/test_chat_models.py shows each):
- llama3: `date_string` for the "Today Date" line (else "26 Jul 2024"); tools go into the first
  user message; one tool call per assistant message.
- mistral: tool call ids and tool_call_id of exactly 9 characters; user/assistant alternate.
- deepseek_v3: a tool call's arguments as JSON text (`tool_arguments_are_text`); `thinking`
  opens `<think>`; this template writes no tool declarations.
- qwen3: `enable_thinking=False` writes an empty think block after the generation prompt.
- gpt_oss: "Current date:" comes from strftime_now (today); analysis goes in `thinking`.
- qwen2_5, kimi_k2: nothing beyond messages and tools.

This module knows nothing of rollmesh: it only makes test data.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
BPE_VOCAB_SIZE = 1536


@dataclass(frozen=True)
class ChatFamily:
    """What a family's tokenizer and generation config carry (strings; ids are assigned here)."""

    name: str
    leading_special: tuple[str, ...]  # special tokens at the start of the vocabulary (ids 0..)
    trailing_special: tuple[str, ...]  # special tokens after the BPE vocabulary
    added_plain: tuple[str, ...]  # added tokens that are not special: never split, decoded as text
    bos: str | None
    eos: str
    generation_eos: tuple[str, ...]  # generation_config.json's eos_token_id, in the real order
    architecture: str  # the transformers class of with_weights=True's model
    pad: str | None = None
    unk: str | None = None
    prepends_bos: bool = False  # the real tokenizer puts bos in front when encoding text
    # Template variables the real template reads that tests should pin.
    template_kwargs: dict[str, object] = field(default_factory=dict)
    # The template concatenates a tool call's "arguments" as JSON text (DeepSeek) instead of
    # writing a mapping through `tojson` (every other family here).
    tool_arguments_are_text: bool = False

    @property
    def template_path(self) -> Path:
        return TEMPLATES_DIR / f"{self.name}.jinja"


_QWEN_SPECIAL = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
_QWEN_PLAIN = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip

# U+FF5C (fullwidth bar) and U+2581 (lower one-eighth block) are part of DeepSeek's token strings.
DEEPSEEK_BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
DEEPSEEK_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"


def _deepseek(name: str) -> str:
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


FAMILIES: dict[str, ChatFamily] = {
    "qwen2_5": ChatFamily(
        name="qwen2_5",
        leading_special=(),
        trailing_special=_QWEN_SPECIAL,
        added_plain=_QWEN_PLAIN,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        architecture="Qwen2ForCausalLM",
    ),
    "qwen3": ChatFamily(
        name="qwen3",
        leading_special=(),
        trailing_special=_QWEN_SPECIAL,
        added_plain=_QWEN_PLAIN + ("<tool_response>", "</tool_response>", "<think>", "</think>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        architecture="Qwen2ForCausalLM",
    ),
    "llama3": ChatFamily(
        name="llama3",
        leading_special=(),
        trailing_special=(
            "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
            "<|python_tag|>",
        ),  # fmt: skip
        added_plain=(),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        architecture="LlamaForCausalLM",
        prepends_bos=True,
        # Without it the template writes its own default, "26 Jul 2024"; pinned so tests say so.
        template_kwargs={"date_string": "26 Jul 2024"},
    ),
    "mistral": ChatFamily(
        name="mistral",
        leading_special=(
            "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]",
        ),  # fmt: skip
        trailing_special=(),
        added_plain=(),
        bos="<s>",
        eos="</s>",
        unk="<unk>",
        generation_eos=("</s>",),
        architecture="LlamaForCausalLM",
        prepends_bos=True,
    ),
    "deepseek_v3": ChatFamily(
        name="deepseek_v3",
        leading_special=(DEEPSEEK_BOS, DEEPSEEK_EOS, _deepseek("\u2581pad\u2581")),
        trailing_special=(),
        added_plain=(
            "<think>", "</think>", _deepseek("User"), _deepseek("Assistant"),
            _deepseek("tool calls begin"), _deepseek("tool calls end"),
            _deepseek("tool call begin"), _deepseek("tool call end"),
            _deepseek("tool outputs begin"), _deepseek("tool outputs end"),
            _deepseek("tool output begin"), _deepseek("tool output end"), _deepseek("tool sep"),
        ),  # fmt: skip
        bos=DEEPSEEK_BOS,
        eos=DEEPSEEK_EOS,
        generation_eos=(DEEPSEEK_EOS,),
        architecture="LlamaForCausalLM",
        prepends_bos=True,
        tool_arguments_are_text=True,
    ),
    "kimi_k2": ChatFamily(
        name="kimi_k2",
        leading_special=(),
        trailing_special=(
            "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
            "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>",
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_middle|>", "[UNK]", "[PAD]",
        ),  # fmt: skip
        added_plain=(),
        bos="[BOS]",
        eos="<|im_end|>",
        pad="[PAD]",
        unk="[UNK]",
        generation_eos=("<|im_end|>",),
        architecture="LlamaForCausalLM",
    ),
    "gpt_oss": ChatFamily(
        name="gpt_oss",
        leading_special=(),
        trailing_special=(
            "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
            "<|start|>", "<|end|>", "<|message|>", "<|call|>",
        ),  # fmt: skip
        added_plain=(),
        bos="<|startoftext|>",
        eos="<|return|>",
        pad="<|endoftext|>",
        generation_eos=("<|return|>", "<|endoftext|>", "<|call|>"),
        architecture="LlamaForCausalLM",
        # The template writes "Current date:" from strftime_now; tests compare around that line.
        template_kwargs={"reasoning_effort": "medium"},
    ),
}

# Text the BPE is trained on: chat prose, JSON tool calls and results, code. Small on purpose:
# training takes milliseconds, and any byte still encodes (the byte alphabet is seeded).
_CORPUS = """\
You are a helpful assistant. The user asks a question and the assistant answers it.
What is the weather like in Paris today? It is sunny and warm, about 24 degrees.
Please call the tool to look up the weather, then tell me what it says.
I will search the files for the function and read the result before answering.
The answer is 42. Let me think step by step about the problem first.
Thanks! Could you also check the time in Tokyo and in New York?
The model reads the prompt, writes a reply, and stops at the end of its turn.
Here is a summary of the results: three tests passed and one failed.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search_files", "arguments": {"query": "def main", "path": "src/"}}
{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
 "required": ["city"]}}}
{"content": "sunny, 24 C", "call_id": "call_0001", "tool_call_id": "abc123XYZ"}
[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi! How can I help?"}]
def get_weather(city: str, unit: str = "celsius") -> dict:
    \"\"\"Return the weather for a city.\"\"\"
    result = {"city": city, "temperature": 24, "unit": unit}
    return result

for index, value in enumerate(values):
    if value is None:
        continue
    print(f"{index}: {value}")

class Agent:
    def __init__(self, tools: list[str]) -> None:
        self.tools = tools

    async def run(self, prompt: str) -> str:
        return await self.model.generate(prompt, max_tokens=128, temperature=0.7)
import json, os, sys; x = [1, 2, 3]; y = {"a": 1, "b": [true, false, null]}
0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 2025 3.14 -1 1e-5
Today Date: 26 Jul 2024. Cutting Knowledge Date: December 2023. Reasoning: medium.
# Tools\n\nYou may call one or more functions to assist with the user query.
"""


@functools.lru_cache(maxsize=None)
def _trained_bpe_json(leading_special: tuple[str, ...]) -> str:
    """The trained byte-level BPE (as tokenizer.json text), leading specials at ids 0.. ."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in leading_special],
        show_progress=False,
    )
    # The templates' own prose and Jinja add variety, and keep their boilerplate compact.
    templates = [path.read_text(encoding="utf-8") for path in sorted(TEMPLATES_DIR.glob("*.jinja"))]
    lines = _CORPUS.splitlines() + [line for text in templates for line in text.splitlines()]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer.to_str()


def _tokenizer_for(family: ChatFamily):
    from tokenizers import AddedToken, Tokenizer, processors

    tokenizer = Tokenizer.from_str(_trained_bpe_json(family.leading_special))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in family.trailing_special]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in family.added_plain]
    )
    if family.prepends_bos:
        assert family.bos is not None
        bos_id = tokenizer.token_to_id(family.bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A $B", special_tokens=[(family.bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _added_tokens_decoder(tokenizer, family: ChatFamily) -> dict[str, dict[str, object]]:
    entries = {}
    for content in family.leading_special + family.trailing_special + family.added_plain:
        entries[str(tokenizer.token_to_id(content))] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content not in family.added_plain,
        }
    return dict(sorted(entries.items(), key=lambda item: int(item[0])))


def build_model_dir(
    family: str,
    directory: Path,
    *,
    with_weights: bool = False,
    chat_template_file: bool = False,
    embedding_rows: int | None = None,
) -> Path:
    """Write `family`'s model directory into `directory` (created) and return it.

    chat_template_file: put the template in chat_template.jinja, as newer repositories ship it,
    instead of tokenizer_config.json's "chat_template".
    embedding_rows: with_weights's vocab_size; default the tokenizer's length, or for the Qwen
    families that length rounded up to a multiple of 64, since real Qwen pads its embedding
    past the tokenizer (152064 rows for 151665 tokens).
    """
    spec = FAMILIES[family]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer_for(spec)
    token_count = tokenizer.get_vocab_size(with_added_tokens=True)
    if embedding_rows is None:
        embedding_rows = -(-token_count // 64) * 64 if family.startswith("qwen") else token_count

    if with_weights:
        # Before the tokenizer files: save_pretrained writes a generation_config.json of its own.
        _save_random_model(spec, tokenizer, directory, embedding_rows)

    tokenizer.save(str(directory / "tokenizer.json"))
    template = spec.template_path.read_text(encoding="utf-8")
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": _added_tokens_decoder(tokenizer, spec),
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "unk_token": spec.unk,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template_file:
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config["chat_template"] = template
    _write_json(directory / "tokenizer_config.json", config)
    _write_json(directory / "generation_config.json", generation_config(spec, tokenizer))
    return directory


def generation_config(spec: ChatFamily, tokenizer) -> dict[str, object]:
    eos_ids = [tokenizer.token_to_id(t) for t in spec.generation_eos]
    config: dict[str, object] = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    if spec.bos is not None:
        config["bos_token_id"] = tokenizer.token_to_id(spec.bos)
    if spec.pad is not None:
        config["pad_token_id"] = tokenizer.token_to_id(spec.pad)
    return config


def _save_random_model(spec: ChatFamily, tokenizer, directory: Path, embedding_rows: int) -> None:
    import torch
    import transformers

    config_class = {
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "LlamaForCausalLM": transformers.LlamaConfig,
    }[spec.architecture]
    eos_ids = [tokenizer.token_to_id(t) for t in spec.generation_eos]
    config = config_class(
        vocab_size=embedding_rows,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(spec.bos) if spec.bos else None,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=tokenizer.token_to_id(spec.pad) if spec.pad else None,
    )
    torch.manual_seed(0)
    model = getattr(transformers, spec.architecture)(config)
    model.save_pretrained(directory)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
