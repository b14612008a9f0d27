"""One rollout engine of the fleet: the engine ``rollout.name`` names in :mod:`trainer.rollout.registry` (the
native torch engine, SGLang's in-process engine, or a user's ``pkg.module:Class``).

Thin: ``generate`` takes prompt ids and sampling settings and returns the engine's
``GenerationOutput``s as they are; ``update_weights`` takes one bucket of HF-named tensors from a
weight sync (the object store's), and ``sync_recv(transport, op, ...)`` reaches this engine's receiver half of
any other transport (:mod:`trainer.sync`).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch

from trainer.orphans import fault_hold
from trainer.rollout.adapters import AdapterEngine
from trainer.rollout.engine import GenerationOutput, SamplingParams
from trainer.rollout.multi_turn import loop_kwargs, run_multi_turn
from trainer.rollout.registry import engine_class
from trainer.sync.endpoints import ReceiverEndpoints


class RolloutWorker(ReceiverEndpoints):
    def __init__(self, *, model_path: str, name: str = "native", max_batch_size: int = 256,
                 max_seq_len: int = 2048, dtype: str = "float32", num_threads: int = 1, generate_threads: int = 0,
                 engine_kwargs: dict | None = None, tokenizer_path: str | None = None, settings: dict | None = None,
                 adapters: dict | None = None):
        """``name``: the engine as ``actor_rollout_ref.rollout.name`` gives it (trainer.rollout.registry: a
        built-in name or ``pkg.module:Class``); ``settings``: verl's other engine keys, for the engines
        that read them (``RolloutEngine.from_rollout``); ``adapters``: ``{"scale": alpha / rank}`` when weight
        syncs move LoRA adapters only (``lora.merge=false``: :class:`trainer.rollout.adapters.AdapterEngine`)."""
        torch.set_num_threads(max(1, num_threads))
        self.tokenizer_path, self.tokenizer = tokenizer_path or model_path, None  # loaded for multi-turn only
        # torch threads while generating (0 = num_threads): on CPU the colocated actor ranks are idle then,
        # so the engine may use their cores too; it drops back afterwards so training is not oversubscribed
        self.generate_threads = int(generate_threads) or max(1, num_threads)
        self._threads_lock, self._in_generate, self._threads_before = threading.Lock(), 0, torch.get_num_threads()
        self.engine = engine_class(name).from_rollout(model_path, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                                      dtype=dtype, engine_kwargs=engine_kwargs, settings=settings)
        if adapters is not None:
            self.engine = AdapterEngine(self.engine, scale=adapters["scale"], dtype=dtype)

    def generate(self, prompts: list[list[int]], params: dict | list[dict]) -> list[list[GenerationOutput]]:
        """``params``: one dict for every prompt, or a list with one per prompt (a resumed partial
        rollout: each its own remaining budget and seed)."""
        fault_hold("rollout")
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
        if self.tokenizer is None:
            from transformers import AutoTokenizer  # heavy: only the multi-turn loop needs a tokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        with self._generate_threads():
            return run_multi_turn(
                self.engine, self.tokenizer, multi_turn["environment"], tasks, SamplingParams(**{**params, "n": 1}),
                n=params["n"], **loop_kwargs(multi_turn))

    def update_weights(self, bucket) -> int:
        """Load one bucket of ``(hf_name, tensor)``; returns the bytes received."""
        self.engine.update_weights(bucket)
        return sum(t.numel() * t.element_size() for _, t in bucket)

    def weights_checksum(self) -> str:
        return self.engine.weights_checksum()

    def base_checksum(self) -> str:
        """Adapter-only syncs: the checksum of the base weights the adapters are merged over."""
        return self.engine.base_checksum()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def ping(self) -> int:
        return os.getpid()
