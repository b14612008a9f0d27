"""One rollout engine of the fleet: the engine ``rollout.name`` names in :mod:`trainer.rollout.registry` (the
native torch engine, SGLang's in-process engine, or a user's ``pkg.module:Class``).

Thin: ``generate`` takes prompt ids and sampling settings and returns the engine's
``GenerationOutput``s as they are; ``update_weights`` takes one bucket of HF-named tensors from a
weight sync (:mod:`trainer.workers.rollouts`).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch

from trainer.rollout.engine import GenerationOutput, SamplingParams
from trainer.rollout.registry import engine_class


class RolloutWorker:
    def __init__(self, *, model_path: str, name: str = "native", max_batch_size: int = 256,
                 max_seq_len: int = 2048, dtype: str = "float32", num_threads: int = 1, generate_threads: int = 0,
                 engine_kwargs: dict | None = None, tokenizer_path: str | None = None, settings: dict | None = None):
        """``name``: the engine as ``actor_rollout_ref.rollout.name`` gives it (trainer.rollout.registry: a
        built-in name or ``pkg.module:Class``); ``settings``: verl's other engine keys, for the engines
        that read them (``RolloutEngine.from_rollout``)."""
        torch.set_num_threads(max(1, num_threads))
        self.tokenizer_path, self.tokenizer = tokenizer_path or model_path, None  # loaded for multi-turn only
        # torch threads while generating (0 = num_threads): on CPU the colocated actor ranks are idle then,
        # so the engine may use their cores too; it drops back afterwards so training is not oversubscribed
        self.generate_threads = int(generate_threads) or max(1, num_threads)
        self._threads_lock, self._in_generate, self._threads_before = threading.Lock(), 0, torch.get_num_threads()
        self.engine = engine_class(name).from_rollout(model_path, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                                      dtype=dtype, engine_kwargs=engine_kwargs, settings=settings)

    def generate(self, prompts: list[list[int]], params: dict | list[dict]) -> list[list[GenerationOutput]]:
        """``params``: one dict for every prompt, or a list with one per prompt (a resumed partial
        rollout: each its own remaining budget and seed)."""
        sp = [SamplingParams(**p) for p in params] if isinstance(params, list) else SamplingParams(**params)
        with self._generate_threads():
            return self.engine.generate(prompts, sp)

    @contextmanager
    def _generate_threads(self):
        """torch's (process-wide) thread count at ``generate_threads`` while any generate call runs: the
        first call in sets it, the last one out restores it (calls overlap: streaming admission)."""
        with self._threads_lock:
            if self._in_generate == 0:
                self._threads_before = torch.get_num_threads()
                torch.set_num_threads(self.generate_threads)
            self._in_generate += 1
        try:
            yield
        finally:
            with self._threads_lock:
                self._in_generate -= 1
                if self._in_generate == 0:
                    torch.set_num_threads(self._threads_before)

    def abort(self) -> None:
        """End the running :meth:`generate` (this call runs in the actor's second thread): unfinished
        responses come back with ``finish_reason == "abort"`` and the tokens sampled so far."""
        self.engine.abort()

    def generate_multi_turn(self, tasks: list[dict], params: dict, multi_turn: dict) -> list:
        """``params["n"]`` episodes per task with the agent loop over this engine (its turns batched
        across episodes): a list of :class:`trainer.rollout.multi_turn.Trajectory`, task-major."""
        from trainer.rollout.multi_turn import loop_kwargs, run_multi_turn

        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        with self._generate_threads():
            return run_multi_turn(
                self.engine, self.tokenizer, multi_turn["environment"], tasks, SamplingParams(**{**params, "n": 1}),
                n=params["n"], **loop_kwargs(multi_turn))

    def update_weights(self, bucket) -> int:
        """Load one bucket of ``(hf_name, tensor)``; returns the bytes received."""
        self.engine.update_weights(bucket)
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def shm_layout(self) -> tuple | None:
        """This engine's weights as one flat storage (``NativeEngine.storage_layout``): what a shared-memory
        sync (trainer/workers/weight_shm.py) lays its file out by; None when the engine cannot take one."""
        layout = getattr(self.engine, "storage_layout", None)
        return layout() if layout is not None else None

    def shm_attach(self, path: str, token: bytes, layout) -> bool:
        """Map the weight-sync file and move this engine's weights into it (every engine of the node
        then holds the same pages); False when the file is not visible from here (another node or
        ``/dev/shm`` namespace) or the engine cannot hold its weights there."""
        from trainer.workers.weight_shm import SharedWeights

        if not hasattr(self.engine, "share_weights"):
            return False
        if self.engine.storage_layout()[1:] != (layout.numel, layout.entries):
            raise ValueError("this engine lays its weights out differently from the weight-sync file")
        try:
            self._shm = SharedWeights(path, token, layout)
        except FileNotFoundError:
            return False
        self.engine.share_weights(self._shm.storage)
        return True

    def take_shared_weights(self) -> int:
        """The actor ranks write the weights in place: the engine re-derives what it computes from them
        at its next pass (``weights_changed``). Returns the sync's bytes."""
        self.engine.weights_changed()
        return self._shm.layout.model_bytes

    def shm_load(self, *written: int) -> int:
        """:meth:`take_shared_weights` once every actor rank has written (``written``: the ranks'
        results, which Ray resolves first: a rank's failed check fails this call too)."""
        return self.take_shared_weights()

    def weights_checksum(self) -> str:
        return self.engine.weights_checksum()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def ping(self) -> int:
        return os.getpid()

    # ---- weight sync through a torch.distributed group (trainer/workers/weight_group.py) ---------------
    def wg_join(self, host: str, port: int, rank: int, world: int, plans: list, dtype: str, bucket_bytes: int) -> bool:
        """Join the weight group as its rank ``rank`` (blocks until every actor rank and engine has);
        ``plans``: every actor rank's blocks, which this engine will receive in buckets. False when
        this engine cannot place blocks into its weights (no ``hf_views``)."""
        from trainer.workers.weight_group import Receiver, join

        views = self.engine.hf_views() if hasattr(self.engine, "hf_views") else {}
        device = next(iter(views.values())).device if views else torch.device("cpu")
        self._wg_pg, _ = join(host, port, rank, world, device)
        if not views or not hasattr(self.engine, "weights_changed"):
            return False
        held = {str(v.dtype).removeprefix("torch.") for v in views.values()}
        if held != {dtype}:
            raise ValueError(f"the engine holds its weights in {sorted(held)}, but the sync sends {dtype}")
        self._wg = Receiver(self._wg_pg, plans, getattr(torch, dtype), bucket_bytes, device)
        return True

    def wg_recv(self, verify: bool, bucket_bytes: int) -> dict:
        """Receive every actor rank's blocks into this engine's weights, then re-derive what the engine
        computes from them; with ``verify`` the digest of every block read back from the weights."""
        self._wg.rebucket(bucket_bytes)
        res = self._wg.receive(self.engine.hf_views(), verify)
        self.engine.weights_changed()
        return res

    def wg_close(self, key: str = "") -> None:
        """Leave the weight group (an engine is in one)."""
        pg = getattr(self, "_wg_pg", None)
        self._wg = self._wg_pg = None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 (the actor ranks may be gone already)
                pass

    # ---- SGLang's distributed weight update (trainer/workers/weight_broadcast.py) ---------------------
    def bc_ranks(self) -> int:
        """How many ranks this engine brings to a broadcast group (its tensor-parallel size); 0 when the
        engine takes no broadcast (only SGLang does)."""
        return int(self.engine.tp_size) if hasattr(self.engine, "update_weights_broadcast") else 0

    def bc_join(self, host: str, port: int, rank_offset: int, world: int, group_name: str, backend: str) -> None:
        """Join the trainer's broadcast group: this engine's TP ranks become ranks ``rank_offset ..``."""
        self.engine.init_weight_sync_group(host, port, rank_offset, world, group_name=group_name, backend=backend)
        self._bc_group = group_name

    def bc_recv(self, desc: dict) -> int:
        """Receive one bucket the trainer's rank 0 broadcasts (``desc``: ``weight_broadcast.pack``'s
        description); returns its bytes."""
        self.engine.update_weights_broadcast(desc["specs"], group_name=self._bc_group, digests=desc["digests"],
                                             probes=desc["probes"])
        return desc["bytes"]

    def bc_read_back(self) -> dict:
        """``{name: max |engine - sent|}`` over the probe rows the sender kept, read back from the engine
        (None where the model class cannot be read back)."""
        return self.engine.verify_weights_on_gpu()

    def bc_close(self) -> None:
        group, self._bc_group = getattr(self, "_bc_group", None), None
        if group is not None:
            try:
                self.engine.destroy_weight_sync_group(group)
            except Exception:  # noqa: BLE001 (the engine may be gone already)
                pass
