"""One rollout engine of the fleet: the native torch engine (CPU default), or SGLang's in-process engine on GPUs.

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


class RolloutWorker:
    def __init__(self, *, model_path: str, name: str = "native", max_batch_size: int = 256,
                 max_seq_len: int = 2048, dtype: str = "float32", num_threads: int = 1, generate_threads: int = 0,
                 engine_kwargs: dict | None = None, tokenizer_path: str | None = None, sglang: dict | None = None):
        torch.set_num_threads(max(1, num_threads))
        self.tokenizer_path, self.tokenizer = tokenizer_path or model_path, None  # loaded for multi-turn only
        # torch threads while generating (0 = num_threads): on CPU the colocated actor ranks are idle then,
        # so the engine may use their cores too; it drops back afterwards so training is not oversubscribed
        self.generate_threads = int(generate_threads) or max(1, num_threads)
        self._threads_lock, self._in_generate, self._threads_before = threading.Lock(), 0, torch.get_num_threads()
        if name == "sglang":  # GPU: an in-process sglang.Engine (trainer/rollout/sglang_engine.py)
            from trainer.rollout.sglang_engine import SGLangEngine

            self.engine = SGLangEngine.from_config(model_path=model_path, dtype=dtype, max_num_seqs=max_batch_size,
                                                   engine_kwargs=engine_kwargs, **(sglang or {}))
        elif name == "native":
            from trainer.rollout.native import NativeEngine

            self.engine = NativeEngine(model_path, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                       dtype=getattr(torch, dtype), **(engine_kwargs or {}))
        else:
            raise ValueError(f"unknown rollout engine '{name}'; actor_rollout_ref.rollout.name is native or sglang")

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

    def shm_attach(self, path: str, token: bytes, layout) -> bool:
        """Map the weight-sync buffer (trainer/workers/weight_shm.py); False when this engine cannot
        take a shared-memory sync (not the native engine, or the buffer is not visible from here)."""
        from trainer.workers.weight_shm import SharedSlots

        if not hasattr(self.engine, "hf_views"):
            return False
        try:
            self._shm = SharedSlots(path, token, layout)
        except FileNotFoundError:
            return False
        missing = sorted(set(layout.entries) - set(self.engine.hf_views()))
        if missing:
            raise ValueError(f"the actor's weights have tensors this engine lacks, e.g. {missing[:3]}")
        return True

    def load_shared_bucket(self, bucket: int, digest: bool) -> tuple[int, str | None]:
        """Load ``bucket`` from the mapped buffer into the engine; with ``digest``, check every block of
        it against the writers' digests in the buffer's table. Returns (bytes loaded, the first
        mismatch as an error message or None)."""
        from trainer.workers.weight_shm import check_bucket

        tensors = [(n, self._shm.tensor(n)) for n in self._shm.layout.bucket(bucket)]
        self.engine.update_weights(tensors)
        error = check_bucket(self._shm, bucket, self.engine.hf_views()) if digest else None
        return sum(t.numel() * t.element_size() for _, t in tensors), error

    def shm_load(self, bucket: int, digest: bool, *written: int) -> int:
        """:meth:`load_shared_bucket` once every actor rank has written it (``written``: the ranks'
        results, which Ray resolves first); a mismatch raises ``WeightSyncError``."""
        from trainer.rollout.engine import WeightSyncError

        nbytes, error = self.load_shared_bucket(bucket, digest)
        if error:
            raise WeightSyncError(error)
        return nbytes

    def weights_checksum(self) -> str:
        return self.engine.weights_checksum()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def ping(self) -> int:
        return os.getpid()
