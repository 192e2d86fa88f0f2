"""A request's grammar matcher, kept in step with its output tokens, and the engine's
llguidance tokenizer (built once, on the first constrained request: about a second)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pd_cluster.structured.spec import GrammarSpec

log = logging.getLogger(__name__)


class GrammarVocabulary:
    """The engine's vocabulary as llguidance sees it: the tokenizer, the model's vocabulary
    size (logits may be wider than the tokenizer) and every id that ends generation (the
    grammar's end may be any of them)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: frozenset[int], vocab_size: int):
        self._hf, self._eos, self.vocab_size = hf_tokenizer, sorted(eos_token_ids), vocab_size
        self._ll: Any = None
        self._grammars: dict[GrammarSpec, str] = {}

    @property
    def tokenizer(self) -> Any:
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=max(self.vocab_size, len(self._hf)),
                eos_token=self._eos or None)
        return self._ll

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh llguidance matcher for `spec` (its grammar text cached per spec)."""
        from llguidance import LLMatcher

        key = GrammarSpec(spec.kind, spec.source)
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = self._grammars[key] = spec.grammar()
        return LLMatcher(self.tokenizer, grammar, log_level=0)


@dataclass(slots=True)
class GrammarState:
    """A request's matcher and how many of its output tokens it has consumed. Lives on the
    Request (so it goes when the request goes); another engine builds its own."""

    matcher: Any
    consumed: int = 0
    failed: bool = field(default=False)

    @classmethod
    def start(cls, vocab: GrammarVocabulary, spec: GrammarSpec) -> GrammarState:
        """The matcher of a new request; ValueError if the grammar cannot be built for this
        vocabulary (the request is refused rather than run unconstrained)."""
        state = cls(vocab.matcher(spec))
        if state.matcher.is_error():
            raise ValueError(f"the {spec.kind} grammar cannot be used: "
                             f"{state.matcher.get_error()}")
        if spec.generated:
            state._consume(list(spec.generated), "its earlier attempt's tokens")
        return state

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Consume the output tokens not yet consumed (all known: none pending)."""
        self.consume(output_token_ids[self.consumed:])

    def unconsumed(self, output_token_ids: list[int], last: int | None) -> list[int]:
        """The output tokens not yet consumed, `last` in place of a pending last one."""
        new = output_token_ids[self.consumed:]
        if new and last is not None:
            new[-1] = last
        return new

    def consume(self, tokens: list[int]) -> None:
        if tokens and not self.failed:
            self._consume(tokens, "a sampled token")
        self.consumed += len(tokens)

    def consumed_one(self, ok: bool) -> None:
        """One token was consumed elsewhere (a batch's parallel consume); `ok`: accepted."""
        self.consumed += 1
        if not ok:
            self.failed = True
            log.warning("grammar matcher rejected a sampled token: %s", self.matcher.get_error())

    @property
    def constrains(self) -> bool:
        """Whether the next token is constrained: always, unless the matcher failed. Once the
        grammar has ended the mask allows only the end tokens, so the request stops."""
        return not (self.failed or self.matcher.is_error())

    def _consume(self, tokens: list[int], what: str) -> None:
        if not self.matcher.consume_tokens(tokens):
            # Only a token the mask did not allow gets here (min_tokens banning the end the
            # grammar needs, say): the request goes on unconstrained rather than failing.
            self.failed = True
            log.warning("grammar matcher rejected %s: %s", what, self.matcher.get_error())
