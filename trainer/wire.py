"""The weight wire codec: named tensors as bytes for HTTP weight updates.

A weight push carries (HF name, tensor) pairs as one safetensors blob, either as the raw request body
(``Content-Type: application/octet-stream``, :data:`WEIGHTS_CONTENT_TYPE`) or base64-encoded inside
SGLang's ``/update_weights_from_tensor`` JSON shape with ``load_format == "safetensors"``. The server
(:mod:`trainer.serving.sglang_native`) decodes what the fleet client (:mod:`trainer.rollout.fleet`)
encodes; a restarted fleet server copies a live peer's weights in the same format. Only ``base64``
here; safetensors is imported when a blob is encoded or decoded.

The server also takes SGLang's own same-host form, ``load_format == "flattened_bucket"`` (what a fleet
client sends real SGLang servers, :func:`trainer.rollout.sglang_http.serialize_flat`): a pickle of
``{"flattened_tensor": uint8 buffer in named shared memory, "metadata": [SimpleNamespace(name, shape,
dtype, start_idx, end_idx, numel)]}``. :func:`flattened_bucket_to_tensors` reads it with an unpickler that
admits only the globals such a payload names (torch's shared-memory storage rebuilders, ``torch.Tensor``,
``torch.Size``, torch dtypes, ``types.SimpleNamespace``), as SGLang's own ``SafeUnpickler`` does with a
wider list, checks every offset against the buffer, and returns copies (the sender's segment can go).
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


_FLAT_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("types", "SimpleNamespace"),
}


def flattened_bucket_to_tensors(payload: bytes) -> list[tuple[str, Any]]:
    """The (name, tensor) pairs of one SGLang ``flattened_bucket`` payload (module docstring)."""
    import io
    import math
    import pickle

    import torch

    class _Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in _FLAT_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            raise ProtocolError(f"flattened_bucket payload names {module}.{name}, which a weight bucket never holds")

    import torch.multiprocessing  # noqa: F401 - torch's storage rebuilders for the shared-memory buffer

    try:
        obj = _Restricted(io.BytesIO(payload)).load()
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - a payload that does not decode is the request's problem
        raise ProtocolError(f"flattened_bucket payload does not decode: {type(e).__name__}: {e}") from e
    flat = obj.get("flattened_tensor") if isinstance(obj, dict) else None
    metas = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1 or not isinstance(metas, list):
        raise ProtocolError("flattened_bucket payload must be {'flattened_tensor': 1-D uint8 tensor, 'metadata': [...]}")
    out = []
    for m in metas:
        try:
            name, shape, dtype, a, b = str(m.name), tuple(int(x) for x in m.shape), m.dtype, int(m.start_idx), int(m.end_idx)
        except (AttributeError, TypeError, ValueError) as e:
            raise ProtocolError(f"flattened_bucket metadata entry {m!r} lacks name/shape/dtype/start_idx/end_idx") from e
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"{name}: dtype {dtype!r} is not a torch dtype")
        if not (0 <= a <= b <= flat.numel()) or b - a != math.prod(shape) * dtype.itemsize:
            raise ProtocolError(f"{name}: bytes [{a}, {b}) do not hold shape {shape} of {dtype} inside a "
                                f"{flat.numel()}-byte buffer")
        out.append((name, flat[a:b].view(dtype).reshape(shape).clone()))
    return out


def parse_update_weights_from_tensor(body: Any) -> tuple[list[bytes], str | None]:
    """SGLang's UpdateWeightsFromTensorReqInput JSON with ``load_format == "safetensors"``: the blobs
    and the weight_version."""
    if not isinstance(body, dict) or not isinstance(body.get("serialized_named_tensors"), list):
        raise ProtocolError("the body must be an object with 'serialized_named_tensors': [base64 safetensors, ...]")
    if body.get("load_format") not in ("safetensors", "flattened_bucket"):
        raise ProtocolError(
            f"load_format {body.get('load_format')!r} is not supported over HTTP: send load_format='safetensors' with "
            "base64 safetensors blobs, 'flattened_bucket' (SGLang's same-host form, a CPU buffer in shared memory), or "
            "the raw blob with Content-Type: application/octet-stream")
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
