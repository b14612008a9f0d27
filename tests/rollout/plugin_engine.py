"""A rollout engine that lives outside the package, to prove that ``rollout.name=pkg.module:Class`` is enough:
a small sampler over ``transformers``' own model (not Coxswain's), one sequence at a time with its KV cache.

It follows :class:`trainer.rollout.engine.RolloutEngine`: log-probs are ``log_softmax(logits / T)[y]`` over the
full vocabulary (T = 1 for greedy), the stop token is kept, ``weights_checksum`` hashes the weights it holds.
It declares only what it can do: the object store as its weight transport, CPU, no partial rollout, no
routed experts, no server. Left out: top-k / top-p filters (refused) and batching across sequences.

Each call is appended to the JSON-lines file named by ``engine_kwargs.log`` (process id, what was asked,
what it returned), so a test sees that this engine, in the rollout worker's process, did the work.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM

from trainer.rollout.engine import GenerationOutput, RolloutEngine, SamplingParams, checksum_named_tensors
from trainer.rollout.registry import Capabilities


class TinyEngine(RolloutEngine):
    capabilities = Capabilities(weight_protocols=("object_store",), partial_rollout=False, routing_replay=False,
                                multi_turn=True, devices=("cpu",), server=None)

    def __init__(self, model_path: str, *, max_seq_len: int, dtype: torch.dtype, log: str | None = None):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.max_seq_len, self.log = max_seq_len, log
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        # HF names as the trainer streams them: a tied lm_head is the embedding, not sent separately
        self.weights = {n: t for n, t in self.model.state_dict().items() if not (tied and n == "lm_head.weight")}
        self._abort = threading.Event()

    @classmethod
    def from_rollout(cls, model_path, *, max_batch_size, max_seq_len, dtype, engine_kwargs=None, settings=None):
        return cls(model_path, max_seq_len=max_seq_len, dtype=getattr(torch, dtype), **(engine_kwargs or {}))

    def _record(self, **event) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), **event}) + "\n")

    @torch.no_grad()
    def _sample_one(self, prompt: Sequence[int], sp: SamplingParams, gen: torch.Generator) -> GenerationOutput:
        ids, past, out = torch.tensor([list(prompt)]), None, GenerationOutput()
        budget = min(sp.max_new_tokens, self.max_seq_len - len(prompt))
        while len(out.token_ids) < budget:
            if self._abort.is_set():
                out.finish_reason = "abort"
                return out
            step = self.model(input_ids=ids, cache=past, use_cache=True)
            logits, past = step.logits[0, -1].float(), step.cache  # [V]
            if sp.greedy:
                y = int(torch.argmax(logits))
                logp = torch.log_softmax(logits, -1)[y]
            else:
                logp_all = torch.log_softmax(logits / sp.temperature, -1)  # [V]
                y = int(torch.multinomial(logp_all.exp(), 1, generator=gen))
                logp = logp_all[y]
            out.token_ids.append(y)
            out.logprobs.append(float(logp))
            if y in sp.stop_token_ids:
                out.finish_reason = "stop"
                return out
            ids = torch.tensor([[y]])
        out.finish_reason = "length"
        return out

    def generate(self, prompt_token_ids, params):
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompt_token_ids)
        if any(sp.top_k_or_zero or sp.top_p < 1.0 for sp in per_prompt):
            raise ValueError("TinyEngine samples from the full distribution: set top_k=-1 and top_p=1")
        self._abort.clear()
        outs = []
        for i, (prompt, sp) in enumerate(zip(prompt_token_ids, per_prompt)):
            gen = torch.Generator()
            gen.manual_seed(sp.seed * 1_000_003 + i if sp.seed is not None else int.from_bytes(os.urandom(4), "little"))
            outs.append([self._sample_one(prompt, sp, gen) for _ in range(sp.n)])
        self._record(event="generate", prompts=len(prompt_token_ids), responses=sum(len(o) for o in outs),
                     tokens=sum(len(r.token_ids) for o in outs for r in o))
        return outs

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        names = []
        for name, t in named_tensors:
            if name not in self.weights:
                raise KeyError(f"TinyEngine holds no weight {name!r}")
            if tuple(t.shape) != tuple(self.weights[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the engine's is {tuple(self.weights[name].shape)}")
            self.weights[name].copy_(t)
            names.append(name)
        self._record(event="update_weights", names=len(names))
        return names

    def weights_checksum(self) -> str:
        ck = checksum_named_tensors(self.weights.items())
        self._record(event="weights_checksum", checksum=ck)
        return ck

    def abort(self) -> None:
        self._abort.set()
