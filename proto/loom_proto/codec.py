"""Strict JSON encoding and decoding of wire Structs.

Decoders are cached per type. Before parsing, a payload is refused when it is over
:data:`MAX_PAYLOAD_BYTES` or nested deeper than :data:`MAX_DEPTH` arrays / objects (msgspec and
the standard library recurse per level and raise ``RecursionError`` somewhere past a thousand
levels; a contract of Loom's is a few levels deep). After parsing, a payload whose objects repeat a
key is refused (msgspec keeps the last value silently). Every refusal is a :class:`DecodeError`:
the message can never be decoded, so it is not worth a retry.

Cost: the depth check counts brackets (C speed) and scans further only when there are more than
:data:`MAX_DEPTH` of them. The duplicate-key check is free for a payload written by
:func:`encode` (the common case: re-encoding the decoded value gives the same bytes back, and an
encoder never repeats a key); any other payload is decoded once more untyped and its ``:`` are
counted against the re-encoding's (a repeated key loses an entry), and only when those differ
(``:`` inside strings, ``\\u`` escapes, or a real repeat) does the exact, slower check run.
``loom bench codec`` measures it.
"""

import array
import itertools
import json
import re
from typing import Any, TypeVar

import msgspec

from loom_proto.ids import plain_words

MAX_PAYLOAD_BYTES = 256 * 1024
MAX_DEPTH = 32
"""The deepest nesting of arrays and objects a payload may have (Loom's contracts use under 8)."""

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}
_untyped = msgspec.json.Decoder()

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"\\')
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # opening +1, closing -1 (as signed bytes)


class DecodeError(ValueError):
    """A payload that is not a valid instance of the expected contract; never worth a retry."""


def encode(message: msgspec.Struct) -> bytes:
    """Encode a Struct as compact JSON."""
    return _encoder.encode(message)


def decode(payload: bytes, type_: type[T]) -> T:
    """Decode ``payload`` strictly as ``type_``: unknown fields, wrong types, bad ids, payloads too
    large or too deeply nested, and objects with a repeated key all raise :class:`DecodeError`."""
    check_payload(payload)
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = msgspec.json.Decoder(type_)
        _decoders[type_] = decoder
    try:
        value = decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(plain_words(str(exc))) from exc
    except RecursionError as exc:  # unreachable past check_payload; kept so it can never escape
        raise DecodeError(f"payload nested too deeply: {exc}") from exc
    if _encoder.encode(value) != payload:
        check_unique_keys(payload)
    return value  # type: ignore[no-any-return]  # Decoder[Any] built for type_


def check_payload(payload: bytes) -> None:
    """Refuse, before any parsing, a payload over the size limit or nested over :data:`MAX_DEPTH`."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise DecodeError(f"payload of {len(payload)} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit")
    if payload.count(b"[") + payload.count(b"{") <= MAX_DEPTH:
        return  # fewer brackets than the limit: no need to look where they are
    depth = nesting_depth(payload)
    if depth > MAX_DEPTH:
        raise DecodeError(f"payload nested {depth} levels deep; at most {MAX_DEPTH} are accepted")


def nesting_depth(payload: bytes) -> int:
    """The deepest nesting of arrays and objects in ``payload``: brackets inside strings do not
    count, an unclosed one stays open to the end. C-speed passes only (a few ms for 256 KiB)."""
    structure = payload.translate(None, _NOT_STRUCTURE)
    # A string whose content holds no bracket, quote or backslash is left as two adjacent quotes:
    # dropping them changes nothing about what is inside a string and what is not.
    structure = structure.replace(b'""', b"")
    if b'"' in structure or b"\\" in structure:
        # Some string holds a bracket or an escape: take strings out of the payload itself.
        # (With no backslash at all, no quote is escaped: every other piece is outside a string.)
        payload = _STRING.sub(b"", payload) if b"\\" in payload else b"".join(payload.split(b'"')[::2])
        structure = payload.translate(None, _NOT_STRUCTURE)
    steps = array.array("b", structure.translate(_STEPS, b'"\\'))
    return max(itertools.accumulate(steps), default=0)


def check_unique_keys(payload: bytes) -> None:
    """Raise :class:`DecodeError` when an object in ``payload`` (valid JSON, nesting checked)
    repeats a key."""
    if b"\\u" not in payload:
        # Outside strings a ':' follows a key and nothing else; a repeated key is one entry less
        # once decoded, so the re-encoding has fewer ':' (strings keep theirs: neither side
        # escapes ':' when no \\u escape is present).
        try:
            again = _encoder.encode(_untyped.decode(payload))
        except (msgspec.DecodeError, RecursionError):
            again = b""
        if again and again.count(b":") == payload.count(b":"):
            return
    try:
        json.loads(payload, object_pairs_hook=_refuse_repeats)
    except _RepeatedKeyError as exc:
        raise DecodeError(plain_words(str(exc))) from exc
    except (ValueError, RecursionError) as exc:  # not JSON the stdlib reads: msgspec did, so let it be
        del exc


class _RepeatedKeyError(ValueError):
    pass


def _refuse_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKeyError(f"key {key!r} appears more than once in one JSON object")
            seen.add(key)
    return out
