"""Text in and out of the engine: tokenizer wrapper, streaming detokenizer, stop strings.

The engine itself works on token ids; everything here is optional (a model directory without
tokenizer files gives `load_tokenizer(...) is None`, and requests then carry ids only).

Streaming a request's output text:

    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    stop = StopChecker(["\\n\\n"])
    for each new token:  send(stop.append(detok.add([token_id])));  if stop.stopped: finish
    at finish (no stop): send(stop.append(detok.flush()) + stop.flush())
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Any of these marks a directory that AutoTokenizer can load (fast, sentencepiece or BPE files).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# tokenizer_config.json classes that name the generic tokenizers-backed class (transformers 5
# writes the first, and reads it as the second).
_PLAIN_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# Prompt tokens decoded together with the first output token: enough context for tokenizers
# whose decoding of a token depends on its left neighbour (SentencePiece's leading space).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A thin wrapper over a Hugging Face tokenizer with the calls the engine needs."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.hf = hf_tokenizer
        # Every id that ends generation: the tokenizer's EOS plus generation_config's (which,
        # for chat models, often adds the end-of-turn token).
        self.eos_token_ids = eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with special tokens (e.g. BOS) added as the tokenizer's default."""
        return list(self.hf.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are left out unless `skip_special_tokens` is False."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        """Whether `apply_chat_template` can be used."""
        return bool(self.hf.chat_template)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of an OpenAI-style message list rendered with the model's chat template
        (with `tools`, OpenAI-style function definitions, for a template that renders them).

        Raises:
            ValueError: if the tokenizer has no chat template.
        """
        if not self.has_chat_template:
            raise ValueError(
                f"tokenizer {self.hf.name_or_path!r} has no chat template; "
                "use plain-text completions or a model with a chat template"
            )
        text = self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            tools=tools
        )
        # The template writes its own special tokens (BOS, <|im_start|>); adding them again on
        # encode would duplicate them.
        return list(self.hf.encode(text, add_special_tokens=False))


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """Load the tokenizer of a HF model directory, or return None if it has no tokenizer files."""
    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    # Deferred: transformers is slow to import and token-id-only engines never need it.
    if _plain_fast_tokenizer(model_dir):
        # What AutoTokenizer would build, without the model config and class lookup it does
        # first: 1.1 s less in each new engine or router process (bench/tokenizer_load.py at
        # commit 6987296).
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    else:
        from transformers import AutoTokenizer as tokenizer_class
    hf = tokenizer_class.from_pretrained(str(model_dir))
    return Tokenizer(hf, _eos_token_ids(hf, model_dir))


def _plain_fast_tokenizer(model_dir: Path) -> bool:
    """Whether the directory names the generic fast tokenizer (tokenizer.json, no class of
    its own), for which AutoTokenizer returns PreTrainedTokenizerFast itself."""
    config = model_dir / "tokenizer_config.json"
    if not (config.is_file() and (model_dir / "tokenizer.json").is_file()):
        return False
    return json.loads(config.read_text()).get("tokenizer_class") in _PLAIN_FAST_CLASSES


def _eos_token_ids(hf: Any, model_dir: Path) -> frozenset[int]:
    ids: set[int] = set()
    if hf.eos_token_id is not None:
        ids.add(hf.eos_token_id)
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text chunks.

    Each `add` decodes only a short window: the tokens already emitted in the previous chunk
    (context) plus the tokens not yet emitted, and returns the text the new tokens added beyond
    the context. While that text ends in U+FFFD, a multi-byte character is still incomplete
    (byte-level BPE splits emoji and CJK over several tokens), so it is held back.

    Concatenating all chunks and `flush()` gives `tokenizer.decode(ids, skip_special_tokens=True)`
    of all added ids (with `prompt_ids`, the text the ids add after the prompt).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        # window[:read] were emitted last time (context only); window[read:] are pending.
        self._window: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new token ids; return the newly completed text (possibly empty)."""
        self._window.extend(token_ids)
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        """Return text still held back (an unfinished character at the end of the output)."""
        return self._advance(hold_incomplete=False)

    def _advance(self, hold_incomplete: bool) -> str:
        context_text = self._tokenizer.decode(self._window[: self._read])
        text = self._tokenizer.decode(self._window)
        if len(text) <= len(context_text) or (hold_incomplete and text.endswith(_REPLACEMENT_CHAR)):
            return ""
        # The pending tokens become the next call's context; older ones are no longer needed.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return text[len(context_text) :]


def find_stop(text: str, stop_strings: Sequence[str], start: int = 0) -> int | None:
    """Index in `text` where the earliest stop string occurring at or after `start` begins."""
    hits = [i for s in stop_strings if s and (i := text.find(s, start)) != -1]
    return min(hits, default=None)


def partial_stop_length(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stop_strings:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopChecker:
    """Applies stop strings to a stream of text chunks.

    `append` returns the part of the output that is safe to stream: text that might be the
    start of a stop string is held back until it is known not to be one, so a client never
    sees a partial stop string. On a match the output is truncated before the stop string
    and `stopped` becomes True.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self.text = ""  # the output so far, truncated before the stop string once stopped
        self.stopped = False
        self._longest = max((len(s) for s in self.stop_strings), default=0)
        self._streamed = 0  # length of self.text already returned by append

    def append(self, new_text: str) -> str:
        """Add output text; return the newly streamable text. Call no more once `stopped`."""
        if self.stopped:
            raise RuntimeError("StopChecker.append after a stop string was found")
        # A match not seen before must end inside new_text, so it starts no earlier than this.
        start = max(0, len(self.text) - self._longest + 1)
        self.text += new_text
        stop_at = find_stop(self.text, self.stop_strings, start)
        if stop_at is not None:
            self.text = self.text[:stop_at]
            self.stopped = True
            safe = len(self.text)
        else:
            safe = len(self.text) - partial_stop_length(self.text, self.stop_strings)
        chunk = self.text[self._streamed : safe]
        self._streamed = safe
        return chunk

    def flush(self) -> str:
        """At the end of generation, return text held back as a possible stop-string start."""
        chunk = self.text[self._streamed :]
        self._streamed = len(self.text)
        return chunk
