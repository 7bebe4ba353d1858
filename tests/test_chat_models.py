"""The test model directories (tests/support/chat_models.py) are what the chat tests take them for:
real Hugging Face directories whose tokenizer loads with AutoTokenizer and whose real chat
template renders plain and tool-calling conversations, with each family's markers as single
tokens, special or not as in the real tokenizer."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import transformers

from support.chat_models import FAMILIES, TEMPLATES_DIR, build_model_dir

pytestmark = pytest.mark.unit

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL_ID = "a1b2c3d4e"  # Mistral's template refuses ids that are not 9 characters long


def tool_conversation(family: str) -> list[dict]:
    arguments: object = {"city": "Paris"}
    if FAMILIES[family].tool_arguments_are_text:
        arguments = json.dumps(arguments)
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny, 24 C"},
    ]


# The family's markers its template writes around a tool call, as the rendering must contain them.
TOOL_CALL_MARKERS = {
    "qwen2_5": ["<tool_call>", "</tool_call>", "<tool_response>"],
    "qwen3": ["<tool_call>", "</tool_call>", "<tool_response>"],
    "llama3": ['{"name": "get_weather", "parameters": {"city": "Paris"}}', "<|start_header_id|>ipython"],
    "mistral": ["[AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]", CALL_ID],
    "deepseek_v3": ["<\uff5ctool\u2581calls\u2581begin\uff5c>", "get_weather<\uff5ctool\u2581sep\uff5c>{"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "functions.get_weather:0", "<|tool_call_argument_begin|>"],
    "gpt_oss": ["to=functions.get_weather<|channel|>commentary", "<|call|>"],
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_directory_loads_as_a_fast_tokenizer_with_the_family_tokens(
    family: str, chat_model_dirs: dict[str, Path]
) -> None:
    spec = FAMILIES[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dirs[family])
    assert tokenizer.is_fast
    assert 1000 <= len(tokenizer) <= 2100
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (spec.bos, spec.eos, spec.pad)
    for marker in spec.leading_special + spec.trailing_special + spec.added_plain:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        assert len(ids) == 1, marker
        skipped = tokenizer.decode(ids, skip_special_tokens=True)
        assert skipped == ("" if marker not in spec.added_plain else marker), marker


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generation_config_lists_the_family_eos_tokens(family: str, chat_model_dirs: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dirs[family])
    config = json.loads((chat_model_dirs[family] / "generation_config.json").read_text())
    eos = config["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    assert tokenizer.convert_ids_to_tokens(eos_ids) == list(FAMILIES[family].generation_eos)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_real_template_renders_a_two_message_conversation(family: str, chat_model_dirs: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dirs[family])
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, **FAMILIES[family].template_kwargs)
    assert "What is the weather in Paris?" in text and "It is sunny." in text
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_real_template_renders_tools_and_a_tool_call(family: str, chat_model_dirs: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dirs[family])
    text = tokenizer.apply_chat_template(
        tool_conversation(family),
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
        **FAMILIES[family].template_kwargs,
    )
    assert "get_weather" in text and "sunny, 24 C" in text
    for marker in TOOL_CALL_MARKERS[family]:
        assert marker in text, marker
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_llama3_date_string_sets_the_today_date_line(chat_model_dirs: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dirs["llama3"])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, date_string="01 Dec 2026"
    )
    assert "Today Date: 01 Dec 2026\n" in text


def test_mistral_template_refuses_a_call_id_not_nine_characters(chat_model_dirs: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dirs["mistral"])
    messages = tool_conversation("mistral")
    messages[1]["tool_calls"][0]["id"] = "call_1"
    with pytest.raises(Exception, match="length 9"):
        tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)


def test_qwen3_enable_thinking_false_writes_an_empty_think_block(chat_model_dirs: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dirs["qwen3"])
    messages = [{"role": "user", "content": "hi"}]
    thinking = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    direct = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert thinking.endswith("<|im_start|>assistant\n")
    assert direct.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_bos_prepending_families_add_bos_only_with_special_tokens(chat_model_dirs: dict[str, Path]) -> None:
    for family, spec in FAMILIES.items():
        tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dirs[family])
        with_special = tokenizer.encode("hello", add_special_tokens=True)
        without = tokenizer.encode("hello", add_special_tokens=False)
        if spec.prepends_bos:
            assert with_special == [tokenizer.bos_token_id] + without, family
        else:
            assert with_special == without, family


def test_chat_template_file_layout_loads_the_same_template(tmp_path: Path) -> None:
    directory = build_model_dir("kimi_k2", tmp_path / "kimi", chat_template_file=True)
    assert "chat_template" not in json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    assert tokenizer.chat_template == FAMILIES["kimi_k2"].template_path.read_text()


def test_with_weights_writes_a_model_whose_embedding_covers_the_tokenizer(
    chat_model_dir_with_weights: Path,
) -> None:
    config = json.loads((chat_model_dir_with_weights / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model_dir_with_weights)
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] % 64 == 0 and len(tokenizer) < config["vocab_size"] < len(tokenizer) + 64
    assert (chat_model_dir_with_weights / "model.safetensors").stat().st_size > 0
    generation = json.loads((chat_model_dir_with_weights / "generation_config.json").read_text())
    assert tokenizer.convert_ids_to_tokens(generation["eos_token_id"]) == ["<|im_end|>", "<|endoftext|>"]


def test_templates_are_the_blobs_sources_md_names() -> None:
    """Each template is byte for byte the llama.cpp file SOURCES.md names (git blob id)."""
    sources = (TEMPLATES_DIR / "SOURCES.md").read_text()
    row = re.compile(r"^\| (\w+) \| \S+\.jinja \| \S+ \| [0-9a-f]{40} \| ([0-9a-f]{40}) \|", re.M)
    rows = row.findall(sources)
    assert sorted(family for family, _ in rows) == sorted(FAMILIES)
    for family, blob in rows:
        data = (TEMPLATES_DIR / f"{family}.jinja").read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, family
