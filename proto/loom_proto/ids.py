"""Identifiers that travel inside NATS subjects.

A subject token must never contain ``.``, ``*``, ``>`` or whitespace, or a tenant could publish
into another tenant's subject space. Every id that becomes a subject token matches
:data:`ID_PATTERN`; the pattern is also part of every Struct field typed :data:`Id`, so decoding
rejects a bad id before any handler sees it.
"""

import re
from typing import Annotated

from msgspec import Meta

# ``(?![\s\S])`` is "end of input" in both Python and JSON Schema (ECMA) regexes; ``$`` would
# also match before a trailing newline, and msgspec checks patterns with ``re.search``.
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}(?![\s\S])"
_ID_RE = re.compile(ID_PATTERN)

Id = Annotated[str, Meta(pattern=ID_PATTERN, description="[A-Za-z0-9_-]{1,64}; safe as a subject token")]


ID_RULE = "1-64 characters of letters, digits, '_' or '-'"
"""What :data:`ID_PATTERN` allows, in words (error messages never show the expression)."""

GPU_MODEL_PATTERN = r"^[A-Za-z0-9_.+-]{1,32}(?![\s\S])"
GPU_MODEL_RULE = "a GPU model name of 1-32 letters, digits, '_', '.', '+' or '-'"
STAGE_NAME_PATTERN = r"^[A-Za-z0-9_]{1,24}(?![\s\S])"
STAGE_NAME_RULE = "a stage name of 1-24 letters, digits or '_'"

_RULES = {
    ID_PATTERN: f"an id of {ID_RULE}",
    GPU_MODEL_PATTERN: GPU_MODEL_RULE,
    STAGE_NAME_PATTERN: STAGE_NAME_RULE,
}
"""Each pattern a wire struct uses, in words."""

_PATTERN_TEXT = re.compile(r"Expected `str` matching regex '((?:[^'\\]|\\.)*)'")


def plain_words(message: str) -> str:
    """A validation message with each pattern's regular expression replaced by its rule in words
    (a pattern not listed is said as "text of the allowed form", never as the expression)."""

    def words(match: re.Match[str]) -> str:
        # msgspec shows the pattern as a Python literal would (backslashes doubled).
        pattern = match.group(1).replace("\\\\", "\\")
        return f"Expected {_RULES.get(pattern, 'text of the allowed form')}"

    return _PATTERN_TEXT.sub(words, message)


class InvalidIdError(ValueError):
    """An identifier that cannot be used as a subject token."""


def validate_id(value: str, what: str = "id") -> str:
    """Return ``value`` unchanged if it is a valid identifier, else raise :class:`InvalidIdError`."""
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise InvalidIdError(f"invalid {what} {value!r}: must be {ID_RULE}")
    return value
