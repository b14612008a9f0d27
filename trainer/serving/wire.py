"""The weight wire codec: named tensors as bytes for HTTP weight updates.

A weight push carries (HF name, tensor) pairs as one safetensors blob, either as the raw request body
(``Content-Type: application/octet-stream``, :data:`WEIGHTS_CONTENT_TYPE`) or base64-encoded inside
SGLang's ``/update_weights_from_tensor`` JSON shape with ``load_format == "safetensors"``. The server
(:mod:`trainer.serving.sglang_native`) decodes what the fleet client (:mod:`trainer.rollout.fleet`)
encodes; a restarted fleet server copies a live peer's weights in the same format. Only ``base64``
here; safetensors is imported when a blob is encoded or decoded.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import Any

WEIGHTS_CONTENT_TYPE = "application/octet-stream"


class ProtocolError(ValueError):
    """A request the server refuses: HTTP 400 with SGLang's ``{"error": {"message": ...}}`` body."""


def tensors_to_safetensors(named_tensors: Iterable[tuple[str, Any]]) -> bytes:
    """A safetensors blob of (HF name, tensor) pairs (contiguous CPU copies)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in named_tensors})


def safetensors_to_tensors(blob: bytes) -> list[tuple[str, Any]]:
    """The (name, tensor) pairs of a blob; :class:`ProtocolError` for one that does not decode."""
    from safetensors.torch import load

    try:
        return list(load(bytes(blob)).items())
    except Exception as e:  # noqa: BLE001 - a malformed upload is the request's problem
        raise ProtocolError(f"the body is not a valid safetensors blob: {e}") from e


def parse_update_weights_from_tensor(body: Any) -> tuple[list[bytes], str | None]:
    """SGLang's UpdateWeightsFromTensorReqInput JSON with ``load_format == "safetensors"``: the blobs
    and the weight_version."""
    if not isinstance(body, dict) or not isinstance(body.get("serialized_named_tensors"), list):
        raise ProtocolError("the body must be an object with 'serialized_named_tensors': [base64 safetensors, ...]")
    if body.get("load_format") != "safetensors":
        raise ProtocolError(
            f"load_format {body.get('load_format')!r} is not supported over HTTP: SGLang's in-process format "
            "carries CUDA IPC handles; send load_format='safetensors' with base64 safetensors blobs, or the raw blob "
            "with Content-Type: application/octet-stream")
    blobs = []
    for k, s in enumerate(body["serialized_named_tensors"]):
        if not isinstance(s, str):
            raise ProtocolError(f"serialized_named_tensors[{k}] must be a base64 string")
        try:
            blobs.append(base64.b64decode(s, validate=True))
        except ValueError as e:
            raise ProtocolError(f"serialized_named_tensors[{k}] is not valid base64: {e}") from e
    wv = body.get("weight_version")
    return blobs, (None if wv is None else str(wv))
