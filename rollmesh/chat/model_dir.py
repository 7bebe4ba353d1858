"""A Hugging Face model directory as chat needs it: its fast tokenizer, its own chat template,
the ids that end an assistant turn, and which token ids exist.

Knows transformers' tokenizer API and the files of a model directory (tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json, config.json); nothing of
engines, Ray or NATS. Rendering goes through the tokenizer's own ``apply_chat_template``, never a
hand-written copy of a template. Nothing is downloaded: the directory must be complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollmesh.chat.errors import ModelDirectoryError, TemplateRenderError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Files from which transformers can build a fast tokenizer without remote code.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")

# Tokens that end an assistant turn in the families rollmesh knows, taken when the vocabulary has
# them, because generation_config.json does not always list them all: Llama 3 ends a turn with
# <|eot_id|>, or <|eom_id|> after a built-in tool call; ChatML models (Qwen, Kimi) with
# <|im_end|>; gpt-oss with <|return|>, or <|call|> after a tool call (its <|end|> only ends one
# message of a turn, so it is not here).
KNOWN_END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|return|>", "<|call|>")

# apply_chat_template's own arguments: passing one as a template variable would be ambiguous.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "chat_template"}
)


@dataclass(frozen=True, eq=False)
class ModelDirectory:
    """A loaded model directory; build it with ``ModelDirectory.load(path)``."""

    path: Path
    tokenizer: PreTrainedTokenizerBase  # fast (Rust-backed)
    chat_template: str
    end_of_turn_ids: frozenset[int]
    # config.json's vocab_size: the embedding's rows, which may exceed the tokenizer (Qwen pads
    # 151665 tokens to 152064 rows); None when the directory has no config.json.
    embedding_rows: int | None

    @classmethod
    def load(cls, path: Path | str) -> ModelDirectory:
        path = Path(path)
        if not path.is_dir():
            raise ModelDirectoryError(path, "not a directory")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ModelDirectoryError(path, f"no tokenizer files (none of {', '.join(TOKENIZER_FILES)})")
        # The JSON files first: transformers reads them too, and would say less about what is wrong.
        embedding_rows = _embedding_rows(path)
        generation_eos_ids = _generation_eos_ids(path)
        tokenizer = _load_fast_tokenizer(path)
        chat_template = _default_template(tokenizer.chat_template)
        if not chat_template:
            raise ModelDirectoryError(
                path, "no chat template (neither tokenizer_config.json's chat_template nor chat_template.jinja)"
            )
        vocab_ids = frozenset(tokenizer.get_vocab().values())
        end_ids = generation_eos_ids | _tokenizer_end_ids(tokenizer)
        unknown = sorted(end_ids - vocab_ids)
        if unknown:
            raise ModelDirectoryError(
                path, f"end-of-turn ids {unknown} are not in the tokenizer's vocabulary ({len(tokenizer)} tokens)"
            )
        return cls(
            path=path,
            tokenizer=tokenizer,
            chat_template=chat_template,
            end_of_turn_ids=frozenset(end_ids),
            embedding_rows=embedding_rows,
        )

    @property
    def vocab_size(self) -> int:
        """How many tokens the tokenizer has, added tokens included: ids are below this."""
        return len(self.tokenizer)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as the model's own template writes it (text, special tokens spelled).

        template_kwargs are the template's extra variables, e.g. Qwen 3's ``enable_thinking``,
        Llama 3's ``date_string``, gpt-oss's ``reasoning_effort``.
        """
        extra = dict(template_kwargs or {})
        clashing = sorted(_RESERVED_TEMPLATE_KWARGS & extra.keys())
        if clashing:
            raise TemplateRenderError(f"template_kwargs may not set {', '.join(clashing)}: pass them as arguments")
        import jinja2

        try:
            text = self.tokenizer.apply_chat_template(
                [dict(message) for message in messages],
                tools=[dict(tool) for tool in tools] if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **extra,
            )
        except jinja2.TemplateError as exc:
            # Templates call raise_exception(msg), which transformers turns into a plain
            # TemplateError; its subclasses (syntax, undefined) are failures of another kind.
            said = str(exc) if type(exc) is jinja2.TemplateError else ""
            raise TemplateRenderError(f"chat template failed: {exc}", template_message=said) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateRenderError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise TemplateRenderError(f"apply_chat_template returned {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of text as it stands: no bos or eos added (a rendered template has its own)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def valid_token_mask(self, embedding_rows: int | None = None) -> tuple[bool, ...]:
        """One flag per embedding row: True where the tokenizer has that id, so an engine can
        mask the logits of rows past the tokenizer (padding) before sampling.

        embedding_rows defaults to config.json's vocab_size. Fewer rows than the tokenizer has
        tokens is refused: the tokenizer could then produce ids the model cannot embed.
        """
        rows = self.embedding_rows if embedding_rows is None else embedding_rows
        if rows is None:
            raise ModelDirectoryError(self.path, "no config.json vocab_size: pass embedding_rows")
        vocab_ids = self.tokenizer.get_vocab().values()
        if rows < max(vocab_ids) + 1:
            raise ModelDirectoryError(
                self.path, f"the embedding has {rows} rows but the tokenizer has ids up to {max(vocab_ids)}"
            )
        mask = [False] * rows
        for token_id in vocab_ids:
            mask[token_id] = True
        return tuple(mask)


def _load_fast_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises OSError, ValueError, json and tokenizers errors
        raise ModelDirectoryError(path, f"the tokenizer did not load: {type(exc).__name__}: {exc}") from exc
    if not tokenizer.is_fast:
        raise ModelDirectoryError(path, f"the tokenizer is {type(tokenizer).__name__}, not a fast tokenizer")
    return tokenizer


def _default_template(template: str | dict[str, str] | None) -> str:
    """A directory may name several templates ({"default": ..., "tool_use": ...})."""
    if isinstance(template, dict):
        return template.get("default") or next(iter(template.values()), "")
    return template or ""


def _read_json_object(path: Path, name: str) -> dict[str, Any] | None:
    file = path / name
    if not file.exists():
        return None
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirectoryError(path, f"{name} is unreadable: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelDirectoryError(path, f"{name} is not a JSON object")
    return value


def _generation_eos_ids(path: Path) -> set[int]:
    config = _read_json_object(path, "generation_config.json")
    if config is None:
        return set()
    eos = config.get("eos_token_id")
    if eos is None:
        return set()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelDirectoryError(
            path, f"generation_config.json's eos_token_id is {eos!r}: want a token id or a list of them"
        )
    return set(ids)


def _tokenizer_end_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[token] for token in KNOWN_END_OF_TURN_TOKENS if token in vocab)
    return ids


def _embedding_rows(path: Path) -> int | None:
    config = _read_json_object(path, "config.json")
    if config is None:
        return None
    # Multimodal configs keep the language model's vocab_size in text_config.
    rows = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    if rows is None:
        return None
    if not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0:
        raise ModelDirectoryError(path, f"config.json's vocab_size is {rows!r}: want a positive integer")
    return rows
