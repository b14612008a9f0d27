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
``serialize_flat(flat, metas)`` (the push itself: :class:`~trainer.rollout.fleet_client.FleetClient` with
``weight_protocol="sglang"``: ``/begin_weight_update``, per bucket ``/update_weights_from_tensor`` with
``{"serialized_named_tensors": [payload], "load_format": "flattened_bucket", "flush_cache": false}``,
``/end_weight_update``, ``/flush_cache``)
    The payload is what SGLang's ``MultiprocessingSerializer`` would write, without sglang: torch's
    ``ForkingPickler`` of ``{"flattened_tensor": uint8 buffer, "metadata": [...]}``, each metadata entry a
    ``types.SimpleNamespace`` with the fields of SGLang's ``FlattenedTensorMetadata`` (its loader reads them
    by attribute and rebuilds its own class, weight_updater.py ``_update_weights_from_flattened_bucket``;
    both types are on its ``SafeUnpickler`` allow-list). The buffer travels as a named shared-memory
    segment (torch's "file_system" sharing strategy): the server is no child of the trainer, so the default
    fd passing would fail multiprocessing's authkey check and kill SGLang's scheduler. Sender and server
    therefore share a host, and the sender keeps the buffer alive until the server has answered.
``push_from_disk(url, model_dir)`` (any host that sees the directory)
    ``POST /update_weights_from_disk {"model_path": dir}``: the server reloads a safetensors checkpoint.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import types
import urllib.request
from collections.abc import Sequence

import torch

from trainer.rollout.weights import FlatMeta


class SGLangServerError(RuntimeError):
    pass


def _post(url: str, path: str, body: dict | None, timeout: float = 300.0, key: str | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, data=data, method="POST", headers=headers)
    for attempt in range(3):  # a connection closed before any answer is retried: the admin calls are idempotent
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
            break
        except urllib.error.HTTPError as e:
            raise SGLangServerError(f"{url}{path}: HTTP {e.code}: {e.read()[:500]!r}") from e
        except (http.client.RemoteDisconnected, ConnectionResetError):
            # seen once with two SGLang fleets up on a loaded 2-core machine (cause not pinned down; see
            # trainer/rollout/fleet_client.py FleetClient._admin)
            if attempt == 2:
                raise
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


def server_command(python: str, model: str, *, host: str, port: int, device: str = "cpu", dtype: str = "float32",
                   admin_key: str | None = None, max_total_tokens: int = 4096, extra: Sequence[str] = ()) -> list[str]:
    """``python -m sglang.launch_server`` for one fleet server (module docstring). No ``--context-length``:
    SGLang derives it from the model, and refuses a longer one; ``extra`` carries any other flag."""
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
    return cmd + [str(a) for a in extra]


def push_from_disk(urls: Sequence[str], model_dir: str, key: str | None = None) -> None:
    """Each server reloads the safetensors checkpoint in ``model_dir`` (any host that sees the directory)."""
    for u in urls:
        _post(u, "/update_weights_from_disk", {"model_path": str(model_dir), "flush_cache": True}, key=key)
