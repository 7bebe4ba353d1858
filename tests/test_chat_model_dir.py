"""ModelDirectory on the test model directories of every chat family (tests/support/chat_models.py):
rendering through the model's own template, encode/decode, end-of-turn ids, valid token ids,
and a typed error for every directory or conversation it cannot use."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from support.chat_models import FAMILIES, build_model_dir
from rollmesh.chat import KNOWN_END_OF_TURN_TOKENS, ModelDirectory, ModelDirectoryError, TemplateRenderError

pytestmark = pytest.mark.unit

CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "It is sunny."},
]

# Each family's end-of-turn tokens: generation_config.json's eos list, the tokenizer's eos, and
# the known end tokens its vocabulary has.
EXPECTED_END_OF_TURN = {
    "qwen2_5": {"<|im_end|>", "<|endoftext|>"},
    "qwen3": {"<|im_end|>", "<|endoftext|>"},
    "llama3": {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"},
    "mistral": {"</s>"},
    "deepseek_v3": {"<\uff5cend\u2581of\u2581sentence\uff5c>"},
    "kimi_k2": {"<|im_end|>"},
    "gpt_oss": {"<|return|>", "<|call|>", "<|endoftext|>"},
}


@pytest.fixture(scope="module")
def model_dirs(chat_model_dirs: dict[str, Path]) -> dict[str, ModelDirectory]:
    return {family: ModelDirectory.load(path) for family, path in chat_model_dirs.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_render_is_the_tokenizers_own_apply_chat_template(
    family: str, model_dirs: dict[str, ModelDirectory]
) -> None:
    model = model_dirs[family]
    kwargs = FAMILIES[family].template_kwargs
    text = model.render(CONVERSATION[:1], add_generation_prompt=True, template_kwargs=kwargs)
    expected = model.tokenizer.apply_chat_template(
        CONVERSATION[:1], tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert text == expected
    assert "What is the weather in Paris?" in text
    assert model.chat_template == FAMILIES[family].template_path.read_text()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_encode_adds_no_bos_and_decode_gives_the_text_back(
    family: str, model_dirs: dict[str, ModelDirectory]
) -> None:
    model = model_dirs[family]
    text = model.render(CONVERSATION, add_generation_prompt=False, template_kwargs=FAMILIES[family].template_kwargs)
    ids = model.encode(text)
    bos_count = text.count(model.tokenizer.bos_token) if model.tokenizer.bos_token else 0
    assert ids.count(model.tokenizer.bos_token_id) == bos_count  # the template's own bos, no second one
    assert model.decode(ids) == text


def test_decode_can_skip_special_tokens_but_keeps_plain_added_ones(model_dirs: dict[str, ModelDirectory]) -> None:
    model = model_dirs["qwen3"]
    ids = model.encode("<|im_start|>assistant\n<think>ok</think><|im_end|>")
    assert model.decode(ids, skip_special_tokens=True) == "assistant\n<think>ok</think>"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_end_of_turn_ids_are_the_familys_end_tokens(family: str, model_dirs: dict[str, ModelDirectory]) -> None:
    model = model_dirs[family]
    tokens = set(model.tokenizer.convert_ids_to_tokens(sorted(model.end_of_turn_ids)))
    assert tokens == EXPECTED_END_OF_TURN[family]


def test_end_of_turn_ids_take_a_single_int_eos_and_known_tokens_missing_from_it(tmp_path: Path) -> None:
    directory = build_model_dir("llama3", tmp_path / "llama3")
    eot = ModelDirectory.load(directory).tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eot}))
    model = ModelDirectory.load(directory)
    tokens = set(model.tokenizer.convert_ids_to_tokens(sorted(model.end_of_turn_ids)))
    # <|eot_id|> is the tokenizer's eos; <|eom_id|> is known to end a Llama 3 turn.
    assert tokens == {"<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"}
    assert {"<|eot_id|>", "<|eom_id|>"} <= set(KNOWN_END_OF_TURN_TOKENS)


def test_end_of_turn_ids_without_generation_config_come_from_the_tokenizer(tmp_path: Path) -> None:
    directory = build_model_dir("mistral", tmp_path / "mistral")
    (directory / "generation_config.json").unlink()
    model = ModelDirectory.load(directory)
    assert model.end_of_turn_ids == {model.tokenizer.eos_token_id}


def test_render_passes_tools_and_template_kwargs(model_dirs: dict[str, ModelDirectory]) -> None:
    model = model_dirs["qwen3"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = model.render(
        CONVERSATION[:1], tools=tools, add_generation_prompt=True, template_kwargs={"enable_thinking": False}
    )
    assert '"name": "get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_render_wraps_the_templates_own_exception_with_its_message(model_dirs: dict[str, ModelDirectory]) -> None:
    model = model_dirs["mistral"]
    with pytest.raises(TemplateRenderError) as caught:
        model.render([{"role": "assistant", "content": "first"}], add_generation_prompt=False)
    assert caught.value.template_message == (
        "After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."
    )
    assert caught.value.template_message in caught.value.reason


def test_render_wraps_a_failure_the_template_did_not_raise_itself(model_dirs: dict[str, ModelDirectory]) -> None:
    model = model_dirs["qwen2_5"]  # concatenates message.content: a missing content cannot render
    with pytest.raises(TemplateRenderError) as caught:
        model.render([{"role": "user"}], add_generation_prompt=True)
    assert caught.value.template_message == ""
    assert "content" in caught.value.reason


def test_render_refuses_template_kwargs_that_are_its_own_arguments(model_dirs: dict[str, ModelDirectory]) -> None:
    with pytest.raises(TemplateRenderError, match="tools"):
        model_dirs["qwen3"].render(CONVERSATION, add_generation_prompt=False, template_kwargs={"tools": []})


def test_vocab_size_and_mask_cover_rows_past_the_tokenizer(chat_model_dir_with_weights: Path) -> None:
    model = ModelDirectory.load(chat_model_dir_with_weights)
    assert model.vocab_size == len(model.tokenizer)
    assert model.embedding_rows is not None and model.embedding_rows > model.vocab_size
    mask = model.valid_token_mask()
    assert len(mask) == model.embedding_rows
    assert all(mask[: model.vocab_size]) and not any(mask[model.vocab_size :])


def test_valid_token_mask_needs_rows_without_config_json(model_dirs: dict[str, ModelDirectory]) -> None:
    model = model_dirs["llama3"]
    assert model.embedding_rows is None
    with pytest.raises(ModelDirectoryError, match="embedding_rows"):
        model.valid_token_mask()
    assert model.valid_token_mask(model.vocab_size) == (True,) * model.vocab_size


def test_valid_token_mask_refuses_fewer_rows_than_tokens(model_dirs: dict[str, ModelDirectory]) -> None:
    model = model_dirs["llama3"]
    with pytest.raises(ModelDirectoryError, match="rows"):
        model.valid_token_mask(model.vocab_size - 1)


def test_chat_template_jinja_file_is_loaded(tmp_path: Path) -> None:
    directory = build_model_dir("gpt_oss", tmp_path / "gpt_oss", chat_template_file=True)
    assert ModelDirectory.load(directory).chat_template == FAMILIES["gpt_oss"].template_path.read_text()


# --- every directory it cannot use is a ModelDirectoryError naming the path and the reason ---


def test_a_path_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelDirectoryError) as caught:
        ModelDirectory.load(tmp_path / "missing")
    assert caught.value.path == tmp_path / "missing" and caught.value.reason == "not a directory"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelDirectoryError, match="not a directory"):
        ModelDirectory.load(tmp_path / "file")


def test_a_directory_without_tokenizer_files_is_refused(tmp_path: Path) -> None:
    directory = build_model_dir("qwen2_5", tmp_path / "q")
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ModelDirectoryError) as caught:
        ModelDirectory.load(directory)
    assert caught.value.path == directory and "no tokenizer files" in caught.value.reason


def test_a_tokenizer_that_does_not_load_is_refused(tmp_path: Path) -> None:
    directory = build_model_dir("qwen2_5", tmp_path / "q")
    (directory / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelDirectoryError, match="the tokenizer did not load"):
        ModelDirectory.load(directory)


def test_a_directory_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    directory = build_model_dir("qwen2_5", tmp_path / "q")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirectoryError) as caught:
        ModelDirectory.load(directory)
    assert "no chat template" in caught.value.reason


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{broken", "generation_config.json is unreadable"),
        ("[1, 2]", "generation_config.json is not a JSON object"),
        ('{"eos_token_id": "</s>"}', "eos_token_id is '</s>'"),
        ('{"eos_token_id": [2, true]}', "eos_token_id is [2, True]"),
        ('{"eos_token_id": 99999}', "end-of-turn ids [99999] are not in the tokenizer's vocabulary"),
    ],
)
def test_an_unreadable_generation_config_is_refused(tmp_path: Path, content: str, reason: str) -> None:
    directory = build_model_dir("mistral", tmp_path / "m")
    (directory / "generation_config.json").write_text(content)
    with pytest.raises(ModelDirectoryError) as caught:
        ModelDirectory.load(directory)
    assert reason in caught.value.reason and caught.value.path == directory


def test_an_unreadable_config_json_is_refused(tmp_path: Path, chat_model_dir_with_weights: Path) -> None:
    directory = tmp_path / "q"
    shutil.copytree(chat_model_dir_with_weights, directory)
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] = "many"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirectoryError, match="config.json's vocab_size is 'many'"):
        ModelDirectory.load(directory)
