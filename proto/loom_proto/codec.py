"""Strict JSON encoding and decoding of wire Structs.

Decoders are cached per type; a payload over :data:`MAX_PAYLOAD_BYTES` is refused before parsing.
"""

from typing import Any, TypeVar

import msgspec

MAX_PAYLOAD_BYTES = 256 * 1024

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


class DecodeError(ValueError):
    """A payload that is not a valid instance of the expected contract; never worth a retry."""


def encode(message: msgspec.Struct) -> bytes:
    """Encode a Struct as compact JSON."""
    return _encoder.encode(message)


def decode(payload: bytes, type_: type[T]) -> T:
    """Decode ``payload`` strictly as ``type_`` (unknown fields, wrong types and bad ids all fail)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise DecodeError(f"payload of {len(payload)} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit")
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = msgspec.json.Decoder(type_)
        _decoders[type_] = decoder
    try:
        return decoder.decode(payload)  # type: ignore[no-any-return]  # Decoder[Any] built for type_
    except msgspec.DecodeError as exc:
        raise DecodeError(str(exc)) from exc
