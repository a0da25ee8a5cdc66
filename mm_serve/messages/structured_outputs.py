"""Structured outputs: a request's constraint on the text it may generate.

The engine enforces a constraint with xgrammar (Dong et al. 2024, "XGrammar: Flexible and
Efficient Structured Generation Engine for Large Language Models"): the constraint is compiled
into a grammar over the tokenizer's vocabulary, a matcher follows the request's output tokens,
and before each sampling step it gives a bitmask of the tokens that keep the output valid; the
sampler sets every other token's logit to -inf (``worker/sampler.apply_token_bitmask``).

This module holds what both processes share: the parameters, and ``check_grammar``, which the
front end calls so that a constraint that does not compile is the request's error (a 400), not
the engine's.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint, as vLLM's ``StructuredOutputsParams`` names them.

    - ``json``: a JSON schema (its JSON text); the output is an instance of it.
    - ``regex``: the output matches the regular expression.
    - ``choice``: the output is one of these strings.
    - ``grammar``: the output is a sentence of this EBNF (GBNF) grammar, rule ``root``.
    - ``json_object``: the output is a JSON object (OpenAI's ``response_format`` ``json_object``).

    JSON outputs have no whitespace between tokens beyond ``", "`` and ``": "``
    (``any_whitespace=False``), so a model cannot pad them with spaces up to ``max_tokens``.

    Raises:
        ValueError: not exactly one constraint is set, or ``choice`` is empty.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        kinds = [self.json, self.regex, self.choice, self.grammar]
        if sum(kind is not None for kind in kinds) + self.json_object != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar and "
                "json_object."
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must list at least one string.")

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, text)``: what the grammar compiler takes, and the compiled-grammar cache key.
        ``kind`` is "json" (``json_object`` is the schema of any object), "regex" or "grammar"
        (a choice becomes an EBNF grammar)."""
        if self.json_object:
            return "json", '{"type": "object"}'
        if self.json is not None:
            return "json", self.json
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            # JSON string literals are EBNF string literals (the same escapes).
            return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in self.choice)
        return "grammar", self.grammar


def check_grammar(params: StructuredOutputsParams) -> None:
    """Compile ``params`` without a vocabulary (fast), to find errors before the engine does.

    Raises:
        ValueError: the schema, regex or grammar does not compile; the compiler's message.
    """
    _check_key(params.key)


# How a JSON schema compiles, in the front end's check and the engine's compiler alike: no
# free whitespace between tokens, and no properties the schema does not name.
JSON_SCHEMA_OPTIONS = {"any_whitespace": False, "strict_mode": True}


# xgrammar writes a string with minLength or maxLength as characters of this class, which lets
# control characters (a raw tab) through: JSON forbids them unescaped, so json.loads would
# refuse the output. They are taken out of the class (escapes stay out, as xgrammar has it).
_LENGTH_BOUND_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\]"


def json_schema_grammar(schema: str) -> Any:
    """The ``xgrammar.Grammar`` of a JSON schema (text) under ``JSON_SCHEMA_OPTIONS``, whose
    every string is valid JSON (no unescaped control character).

    Raises:
        RuntimeError: xgrammar's, for a schema it cannot convert.
    """
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(schema, **JSON_SCHEMA_OPTIONS)
    ebnf = str(grammar)
    if _LENGTH_BOUND_CHARACTER not in ebnf:
        return grammar
    return xgrammar.Grammar.from_ebnf(ebnf.replace(_LENGTH_BOUND_CHARACTER, _JSON_STRING_CHARACTER))


@functools.lru_cache(maxsize=256)
def _check_key(key: tuple[str, str]) -> None:
    import xgrammar

    kind, text = key
    try:
        if kind == "json":
            json_schema_grammar(text)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(text)
        elif kind == "grammar":
            xgrammar.Grammar.from_ebnf(text)
    except RuntimeError as e:
        raise ValueError(f"Invalid {kind}: {compiler_message(e)}") from None


def compiler_message(error: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    text = str(error).strip()
    return re.sub(r"^\[[\d:]+\] [^ ]+:\d+: ", "", text).strip()
