"""REAL SGLang servers (``python -m sglang.launch_server``) over HTTP: their command line, and weight pushes
through SGLang's own endpoints. Nothing here imports sglang: the trainer drives a fleet of SGLang servers
(:class:`~trainer.rollout.fleet.Fleet` with ``backend="sglang"``) from an environment without it, the
servers running in the interpreter that has it (:func:`trainer.rollout.sglang_cpu.server_python`).

``server_command(python, model, host=, port=, device=, dtype=, admin_key=, ...)``
    The launch command. On CPU it adds :func:`~trainer.rollout.sglang_cpu.cpu_engine_args` as flags (the
    caller also applies :func:`~trainer.rollout.sglang_cpu.activate` to the server's environment).
    ``--admin-api-key``: SGLang 0.5.21 then requires that key on its admin endpoints (weights, cache,
    abort: ``AuthLevel.ADMIN_OPTIONAL``) while ``/generate`` stays open to the router (no ``--api-key``),
    the same split as Coxswain's native servers (``--open-generation``). SGLang reads the key from its
    command line only, so it is visible in the host's process list (the native server reads it from its
    environment).
``push_tensors(url, named_tensors)`` (same host: SGLang's tensor route)
    ``POST /begin_weight_update``; per bucket ``POST /update_weights_from_tensor`` with
    ``{"serialized_named_tensors": [base64 payload per TP rank], "load_format": "flattened_bucket",
    "flush_cache": false}`` (the HTTP form of the engine call, io_struct.py
    ``UpdateWeightsFromTensorReqInput``); ``POST /end_weight_update``; ``POST /flush_cache``.
    The payload (:func:`serialize_flat`) is what SGLang's ``MultiprocessingSerializer`` would write,
    without sglang: torch's ``ForkingPickler`` of ``{"flattened_tensor": uint8 buffer, "metadata": [...]}``,
    each metadata entry a ``types.SimpleNamespace`` with the fields of SGLang's ``FlattenedTensorMetadata``
    (its loader reads them by attribute and rebuilds its own class, weight_updater.py
    ``_update_weights_from_flattened_bucket``; both types are on its ``SafeUnpickler`` allow-list). The
    buffer travels as a named shared-memory segment (torch's "file_system" sharing strategy): the server is
    no child of the trainer, so the default fd passing would fail multiprocessing's authkey check and kill
    SGLang's scheduler. Sender and server therefore share a host, and the sender keeps the buffer alive
    until the server has answered.
``push_from_disk(url, model_dir)`` (any host that sees the directory)
    ``POST /update_weights_from_disk {"model_path": dir}``: the server reloads a safetensors checkpoint.

Verification, where SGLang can report it: SGLang has no HF-named checksum, so the checksum is
:func:`~trainer.rollout.engine.checksum_named_tensors` of the stream that every server ACCEPTED (each bucket
answered ``success``), and :func:`read_back` compares the first rows of a few parameters through
``/get_weights_by_name`` (Llama-family models implement it in 0.5.21; others answer null -> None).
"""

from __future__ import annotations

import base64
import io
import json
import types
import urllib.request
from collections.abc import Iterable, Sequence

import torch

from trainer.rollout.engine import checksum_named_tensors
from trainer.rollout.sglang_engine import FlatMeta, flatten_bucket, iter_cast_buckets, probe_rows


class SGLangServerError(RuntimeError):
    pass


def _post(url: str, path: str, body: dict | None, timeout: float = 300.0, key: str | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, data=data, method="POST", headers=headers)
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


def serialize_flat(flat: torch.Tensor, metas: Sequence[FlatMeta]) -> str:
    """The base64 payload SGLang's HTTP tensor route takes for one flattened bucket (module docstring).
    ``flat`` must stay alive until the server has answered."""
    import torch.multiprocessing as tmp  # registers torch's tensor/storage reductions with ForkingPickler
    from multiprocessing.reduction import ForkingPickler

    payload = {"flattened_tensor": flat,
               "metadata": [types.SimpleNamespace(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype,
                                                  start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
                            for m in metas]}
    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(payload)
    finally:
        tmp.set_sharing_strategy(old)
    return base64.b64encode(buf.getvalue()).decode()


def serialize_bucket(bucket: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """(the flat buffer, which must outlive the request; the base64 payload SGLang's HTTP route takes)."""
    flat, metas = flatten_bucket(bucket, dtype, device="cpu")
    return flat, serialize_flat(flat, metas)


def server_command(python: str, model: str, *, host: str, port: int, device: str = "cpu", dtype: str = "float32",
                   admin_key: str | None = None, context_length: int | None = None, max_total_tokens: int = 4096,
                   seed: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    """``python -m sglang.launch_server`` for one fleet server (module docstring)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", host, "--port", str(port),
           "--dtype", dtype, "--skip-tokenizer-init", "--skip-server-warmup", "--log-level", "warning"]
    if device == "cpu":
        from trainer.rollout.sglang_cpu import cpu_engine_args

        for k, v in cpu_engine_args(max_total_tokens).items():
            if k == "enable_memory_saver":
                continue  # off by default
            flag = "--" + k.replace("_", "-")
            cmd += [flag] if v is True else [flag, str(v)]
    if admin_key:
        cmd += ["--admin-api-key", admin_key]
    if context_length:
        cmd += ["--context-length", str(int(context_length))]
    if seed is not None:
        cmd += ["--random-seed", str(int(seed))]
    return cmd + [str(a) for a in extra]


def push_tensors(urls: Sequence[str], named_tensors: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype,
                 bucket_bytes: int = 64 << 20, tp_size: int = 1, key: str | None = None) -> str:
    """Push HF-named tensors into every server (same host); returns the checksum of what they accepted
    (cast to ``dtype``)."""
    urls = list(urls)
    for u in urls:
        _post(u, "/begin_weight_update", {}, key=key)
    sent: list[tuple[str, torch.Tensor]] = []
    try:
        for bucket in iter_cast_buckets(named_tensors, dtype, bucket_bytes):
            for u in urls:
                # Serialized per server: a shared-memory handle is opened once by its receiver.
                flat, payload = serialize_bucket(bucket, dtype)
                _post(u, "/update_weights_from_tensor", {"serialized_named_tensors": [payload] * tp_size,
                                                         "load_format": "flattened_bucket", "flush_cache": False},
                      key=key)
                del flat
            sent.extend((n, t.detach().to("cpu", dtype)) for n, t in bucket)
    finally:
        for u in urls:
            _post(u, "/end_weight_update", {}, key=key)
    for u in urls:
        _post(u, "/flush_cache", None, key=key)
    return checksum_named_tensors(sent, dtype=dtype)


def push_from_disk(urls: Sequence[str], model_dir: str, key: str | None = None) -> None:
    for u in urls:
        _post(u, "/update_weights_from_disk", {"model_path": str(model_dir), "flush_cache": True}, key=key)


def read_back(url: str, expected: dict[str, torch.Tensor], dtype: torch.dtype, rows: int = 2,
              key: str | None = None) -> dict[str, float | None]:
    """``{name: max |server - expected|}`` over the first ``rows`` rows (None where the model class cannot
    report, e.g. Qwen2 in 0.5.21)."""
    out: dict[str, float | None] = {}
    for name, t in expected.items():
        got = _post(url, "/get_weights_by_name", {"name": name, "truncate_size": rows}, key=key)
        if got is None:
            out[name] = None
            continue
        want = probe_rows(t, rows, dtype)
        got_t = torch.tensor(got, dtype=torch.float32)
        out[name] = float((got_t - want).abs().max()) if got_t.shape == want.shape else float("inf")
    return out
