"""Byte-level tokenizer: ids 0-255 are bytes, then a few special tokens.

Knows nothing but Python. Byte-level means no text is ever re-tokenized differently: the exact ids
the model produced are what the trainer sees, and any UTF-8 string round-trips.
"""

from __future__ import annotations

from typing import Iterable

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
SPECIAL_TOKENS = {"<bos>": BOS_ID, "<eos>": EOS_ID, "<pad>": PAD_ID}
MIN_VOCAB_SIZE = 259


class ByteTokenizer:
    """UTF-8 bytes as token ids; special ids decode to nothing in text."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID

    def __init__(self, vocab_size: int = 260) -> None:
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size {vocab_size} < {MIN_VOCAB_SIZE} (256 bytes + specials)")
        self.vocab_size = vocab_size

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def is_valid(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size


class ByteDetokenizer:
    """What the decode engine needs to stop a model whose end-of-sequence id is its own (an HF
    checkpoint's ``eos_token_id``): that id, and the byte decoding stop strings are matched in."""

    def __init__(self, eos_id: int) -> None:
        self.eos_id = eos_id

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
