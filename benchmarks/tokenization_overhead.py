"""Per-turn tokenization cost of a multi-turn rollout: appending a turn vs re-rendering it all.

A Qwen3 model directory is built here: the real Qwen3 chat template
(tests/data/chat_templates/qwen3.jinja, read from that path), a byte-level BPE with
``--vocab`` tokens trained on synthetic text, and Qwen's special tokens; it is loaded with
rollmesh's ``ModelDirectory``. A tool-calling conversation (one user query, then turns of about
1K tokens: the model's reasoning, a tool call and the tool's result) is grown to 8K, 32K and 128K
tokens. At each size the appended turn is a 200-token tool result plus the generation prompt:

- ours: ``ChatTrajectory.append`` (the template's text after a stand-in turn, tokenized alone);
- baseline: the whole conversation rendered with the template and tokenized again.

Each is timed ``--repeats`` times, alternating, on a fresh copy of the same trajectory, with the
garbage collector off while timing (as timeit does); medians.
Before timing, the trajectory is checked token for token against the baseline's ids (``exact``).
``ratio`` = baseline / ours at 32K.

    python benchmarks/tokenization_overhead.py [--repeats 15] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import print_result
from rollmesh.chat import ModelDirectory
from rollmesh.chat.turn_append import ChatTrajectory

TEMPLATE = Path(__file__).resolve().parent.parent / "tests" / "data" / "chat_templates" / "qwen3.jinja"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PLAIN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
SIZES = {"8k": 8 * 1024, "32k": 32 * 1024, "128k": 128 * 1024}
TURN_TOKENS = 1024
TOOL_RESULT_TOKENS = 200
TOOLS = [{"type": "function", "function": {
    "name": "run_python", "description": "Run Python code in the sandbox and return its output.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]


class TextSource:
    """Word-like text from a fixed syllable inventory, seeded: the corpus and the conversation."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        syllables = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
        self.words = ["".join(self.rng.choice(syllables) for _ in range(self.rng.randint(1, 4)))
                      for _ in range(6000)]
        self.weights = [1 / (rank + 10) for rank in range(len(self.words))]   # Zipf-like

    def sentence(self) -> str:
        words = self.rng.choices(self.words, self.weights, k=self.rng.randint(6, 18))
        return " ".join(words).capitalize() + self.rng.choice([".", ".", ",", "?", ":"])

    def code_line(self) -> str:
        name, other = self.rng.choices(self.words, self.weights, k=2)
        return self.rng.choice([f"{name} = {other}({self.rng.randint(0, 999)})",
                                f"for {name} in range({self.rng.randint(1, 64)}):",
                                f"    print({name}, {other}[{self.rng.randint(0, 9)}])",
                                f'result["{name}"] = {self.rng.random():.4f}'])

    def text_of(self, model: ModelDirectory, tokens: int, *, code: bool = False) -> str:
        """About ``tokens`` tokens of prose (or code lines)."""
        parts: list[str] = []
        count = 0
        while count < tokens:
            part = self.code_line() if code else self.sentence()
            parts.append(part)
            count += len(model.encode(part)) + 1
        return ("\n" if code else " ").join(parts)


def build_model(directory: Path, vocab: int) -> ModelDirectory:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    source = TextSource(seed=1)
    corpus = [source.sentence() for _ in range(40_000)] + [source.code_line() for _ in range(10_000)]
    corpus += ['{"name": "run_python", "arguments": {"code": "print(1)"}}'] * 50
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False, "chat_template": TEMPLATE.read_text(encoding="utf-8")}))
    ids = [tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return ModelDirectory.load(directory)


def grow(model: ModelDirectory, source: TextSource, tokens: int) -> ChatTrajectory:
    """A tool-calling rollout of about ``tokens`` tokens, each turn generated as Qwen3 writes it,
    ending after a generated tool call (so the next thing to append is its result)."""
    messages = [{"role": "system", "content": "You are a careful data analyst with a Python sandbox."},
                {"role": "user", "content": source.text_of(model, 120)}]
    trajectory = ChatTrajectory(model, messages, tools=TOOLS, family="qwen3")
    while True:
        reasoning = source.text_of(model, TURN_TOKENS - TOOL_RESULT_TOKENS - 160)
        code = source.text_of(model, 120, code=True)
        arguments = json.dumps({"code": code}, ensure_ascii=False)
        text = (f"<think>\n{reasoning}\n</think>\n\n"
                f'<tool_call>\n{{"name": "run_python", "arguments": {arguments}}}\n</tool_call><|im_end|>')
        ids = model.encode(text)
        call = {"id": f"call_{len(messages)}", "type": "function",
                "function": {"name": "run_python", "arguments": arguments}}
        trajectory.add_generated(ids, [-0.1] * len(ids), {"role": "assistant", "content": "",
                                                          "reasoning_content": reasoning, "tool_calls": [call]})
        if len(trajectory.sample.ids) + TURN_TOKENS > tokens:
            return trajectory
        trajectory.append([tool_result(model, source, call["id"])])


def tool_result(model: ModelDirectory, source: TextSource, call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": source.text_of(model, TOOL_RESULT_TOKENS, code=True)}


def rerender(model: ModelDirectory, trajectory: ChatTrajectory, result: dict) -> list[int]:
    """The baseline: the whole conversation rendered and tokenized again."""
    text = model.render([*trajectory.messages, result], tools=TOOLS, add_generation_prompt=True)
    return model.encode(text)


def timed_without_gc(call) -> float:
    """Seconds ``call`` takes with the garbage collector off, as timeit measures: otherwise a
    collection may traverse the fresh copy's lists (128K entries) inside the timed call."""
    gc.disable()
    try:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    finally:
        gc.enable()


def measure(model: ModelDirectory, trajectory: ChatTrajectory, result: dict, repeats: int) -> dict:
    check = trajectory.fork()
    appended = check.append([result])
    exact = check.prompt_ids() == rerender(model, trajectory, result)
    ours, baseline = [], []
    for _ in range(repeats):
        fresh = trajectory.fork()
        for column in (fresh.sample.ids, fresh.sample.loss_mask, fresh.sample.logprobs):
            # A copy's lists have no spare capacity, a grown trajectory's do: without this the
            # first extend would copy the whole history, which a real append does not.
            column.append(0)
            column.pop()
        ours.append(timed_without_gc(lambda: fresh.append([result])))
        baseline.append(timed_without_gc(lambda: rerender(model, trajectory, result)))
    return {"context_tokens": len(check.prompt_ids()), "appended_tokens": len(appended), "exact": exact,
            "append_ms": statistics.median(ours) * 1e3, "rerender_ms": statistics.median(baseline) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-tok-") as tmp:
        start = time.perf_counter()
        model = build_model(Path(tmp), args.vocab)
        print(f"tokenizer: {model.vocab_size} tokens, trained in {time.perf_counter() - start:.1f} s", flush=True)
        source = TextSource(seed=2)
        figures = {}
        for name, tokens in SIZES.items():
            trajectory = grow(model, source, tokens)
            result = tool_result(model, source, "call_next")
            figures[name] = measure(model, trajectory, result, args.repeats)
            f = figures[name]
            print(f"{name}: {f['context_tokens']} tokens after appending {f['appended_tokens']}: "
                  f"append {f['append_ms']:.3f} ms, re-render {f['rerender_ms']:.2f} ms, exact {f['exact']}",
                  flush=True)
    at_32k = figures["32k"]
    extra = {}
    for name, f in figures.items():
        extra[f"append_ms_{name}"] = round(f["append_ms"], 3)
        extra[f"rerender_ms_{name}"] = round(f["rerender_ms"], 3)
        extra[f"context_tokens_{name}"] = f["context_tokens"]
    print_result("tokenization_overhead", at_32k["append_ms"], at_32k["rerender_ms"], "ms per appended turn at 32K",
                 at_32k["rerender_ms"] / at_32k["append_ms"], **extra,
                 exact=all(f["exact"] for f in figures.values()), vocab=model.vocab_size,
                 appended_tokens=at_32k["appended_tokens"])


if __name__ == "__main__":
    main()
