"""Weight pushes into REAL SGLang servers (``python -m sglang.launch_server``) through SGLang's own endpoints.

:class:`~trainer.rollout.fleet.FleetClient` generates through any SGLang-native ``/generate`` (real SGLang
or Coxswain's native server), but pushes weights with Coxswain's own endpoints. This is the weight side
for real SGLang 0.5.21 servers, same bookkeeping as the in-process adapter
(:class:`~trainer.rollout.sglang_engine.SGLangEngine`):

``push_tensors(url, named_tensors)`` (same host: SGLang's tensor route)
    ``POST /begin_weight_update``; per bucket ``POST /update_weights_from_tensor`` with
    ``{"serialized_named_tensors": [base64 MultiprocessingSerializer payload per TP rank],
    "load_format": "flattened_bucket", "flush_cache": false}`` (the HTTP form of the engine call, io_struct.py
    ``UpdateWeightsFromTensorReqInput``; the tensor travels as a named shared-memory segment, torch's
    "file_system" sharing strategy, so sender and server share a host; the sender keeps the buffer alive
    until the server answered); ``POST /end_weight_update``;
    ``POST /flush_cache``.
``push_from_disk(url, model_dir)`` (any host that sees the directory)
    ``POST /update_weights_from_disk {"model_path": dir}``: the server reloads a safetensors checkpoint.

Verification, where SGLang can report it: SGLang has no HF-named checksum, so the checksum is
:func:`~trainer.rollout.engine.checksum_named_tensors` of the stream that every server ACCEPTED (each bucket
answered ``success``), and :func:`read_back` compares the first rows of a few parameters through
``/get_weights_by_name`` (Llama-family models implement it in 0.5.21; others answer null -> None).
"""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Iterable, Sequence

import torch

from trainer.rollout.engine import checksum_named_tensors
from trainer.rollout.sglang_engine import flatten_bucket, iter_cast_buckets, probe_rows


class SGLangServerError(RuntimeError):
    pass


def _post(url: str, path: str, body: dict | None, timeout: float = 300.0) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise SGLangServerError(f"{url}{path}: HTTP {e.code}: {e.read()[:500]!r}") from e
    try:
        out = json.loads(raw) if raw else {}
    except json.JSONDecodeError:  # /flush_cache answers plain text
        out = {"text": raw.decode(errors="replace")}
    if isinstance(out, dict) and out.get("success") is False:
        raise SGLangServerError(f"{url}{path} failed: {out.get('message')}")
    return out


def serialize_bucket(bucket: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """(the flat buffer, which must outlive the request; the base64 payload SGLang's HTTP route takes)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    flat, metas = flatten_bucket(bucket, dtype)
    payload = {"flattened_tensor": flat,
               "metadata": [FlattenedTensorMetadata(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype,
                                                    start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
                            for m in metas]}
    # The server is no child of this process, so the default fd-passing strategy fails its authkey check
    # (multiprocessing's resource_sharer) and SGLang's scheduler dies; "file_system" shares the buffer by
    # shared-memory NAME, which any process on the host can open.
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        raw = MultiprocessingSerializer.serialize(payload)
    finally:
        tmp.set_sharing_strategy(old)
    return flat, base64.b64encode(raw).decode()


def push_tensors(urls: Sequence[str], named_tensors: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype,
                 bucket_bytes: int = 64 << 20, tp_size: int = 1) -> str:
    """Push HF-named tensors into every server (same host); returns the checksum of what they accepted
    (cast to ``dtype``)."""
    urls = list(urls)
    for u in urls:
        _post(u, "/begin_weight_update", {})
    sent: list[tuple[str, torch.Tensor]] = []
    try:
        for bucket in iter_cast_buckets(named_tensors, dtype, bucket_bytes):
            for u in urls:
                # Serialized per server: a shared-memory handle is opened once by its receiver.
                flat, payload = serialize_bucket(bucket, dtype)
                _post(u, "/update_weights_from_tensor", {"serialized_named_tensors": [payload] * tp_size,
                                                         "load_format": "flattened_bucket", "flush_cache": False})
                del flat
            sent.extend((n, t.detach().to("cpu", dtype)) for n, t in bucket)
    finally:
        for u in urls:
            _post(u, "/end_weight_update", {})
    for u in urls:
        _post(u, "/flush_cache", None)
    return checksum_named_tensors(sent, dtype=dtype)


def push_from_disk(urls: Sequence[str], model_dir: str) -> None:
    for u in urls:
        _post(u, "/update_weights_from_disk", {"model_path": str(model_dir), "flush_cache": True})


def read_back(url: str, expected: dict[str, torch.Tensor], dtype: torch.dtype, rows: int = 2) -> dict[str, float | None]:
    """``{name: max |server - expected|}`` over the first ``rows`` rows (None where the model class cannot
    report, e.g. Qwen2 in 0.5.21)."""
    out: dict[str, float | None] = {}
    for name, t in expected.items():
        got = _post(url, "/get_weights_by_name", {"name": name, "truncate_size": rows})
        if got is None:
            out[name] = None
            continue
        want = probe_rows(t, rows, dtype)
        got_t = torch.tensor(got, dtype=torch.float32)
        out[name] = float((got_t - want).abs().max()) if got_t.shape == want.shape else float("inf")
    return out
