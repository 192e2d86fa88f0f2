"""What a request's output must match, as a small picklable value that travels with it."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, replace
from typing import Any

# Compact JSON: one space or none where JSON allows any run of whitespace. A small model given
# free whitespace can pad forever ("\n\n\n..."), never closing the object within max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarKind(str, enum.Enum):
    """The form of a GrammarSpec's `source`."""

    JSON_SCHEMA = "json_schema"   # source: a JSON schema, as JSON text
    JSON_OBJECT = "json_object"   # source: "" (any JSON object)
    REGEX = "regex"               # source: a regular expression (Rust regex syntax)
    CHOICE = "choice"             # source: a JSON list of strings; the output is one of them

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on a request's output text.

    `generated`: output tokens an earlier attempt of the request already produced (a request
    re-run on another decode engine carries them in its prompt): the matcher replays them
    before it constrains anything, so the output goes on where it stopped.
    """

    kind: GrammarKind
    source: str = ""
    generated: tuple[int, ...] = ()

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GrammarSpec:
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls(GrammarKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls(GrammarKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls(GrammarKind.CHOICE, json.dumps(choices))

    def continued(self, tokens: list[int]) -> GrammarSpec:
        """The spec of a re-run that already has `tokens` of output beyond `generated`."""
        return replace(self, generated=self.generated + tuple(tokens))

    def grammar(self) -> str:
        """llguidance's grammar text for this spec (not yet checked: see `check`)."""
        from llguidance import LLMatcher

        if self.kind is GrammarKind.JSON_SCHEMA:
            return LLMatcher.grammar_from_json_schema(self.source, defaults=_JSON_OPTIONS)
        if self.kind is GrammarKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.kind is GrammarKind.REGEX:
            return LLMatcher.grammar_from_regex(self.source)
        choices = json.loads(self.source)
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))

    def check(self) -> None:
        """Raise ValueError (llguidance's reason) if the grammar is not usable."""
        if self.kind is GrammarKind.CHOICE:
            choices = json.loads(self.source)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("must be a non-empty list of non-empty strings")
        from llguidance import LLMatcher

        try:
            grammar = self.grammar()
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(str(e)) from None
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(error)
