"""The rollout group as an HTTP fleet (``actor_rollout_ref.rollout.mode=server``): disaggregated rollout.

``rollout.num_engines`` engine servers (``python -m trainer.rollout.native_server``; real SGLang servers
speak the same ``/generate`` protocol) run behind the real ``sglang-router``
(:class:`trainer.rollout.fleet.Fleet`), and the driver talks to them through the fleet's client. This
class has the calls the loop and the resharding manager make on a rollout :class:`WorkerGroup` (one
"rank": the router balances the requests over the servers), so the loop does not know which kind it
drives:

* ``generate``: every prompt of the batch goes to the router at once (``n`` samples per request);
  a server that dies mid-batch costs a retry on another server, counted in ``fleet/retries``;
* ``generate_multi_turn``: the agent loop (:mod:`trainer.rollout.multi_turn`) runs on the driver, its
  turns sent through the router by ``FleetClient.agenerate`` (``concurrency`` episodes in flight);
* weights: the resharding manager hands over the actor's whole (HF name, tensor) stream once
  (``update_weights_stream``); the client drains the servers, pushes every bucket to each of them and
  checks each server's checksum against the stream's, so a sync is verified per server;
* ``sleep``/``wake``: no-ops (the servers own their devices; there is nothing to give back).
"""

from __future__ import annotations

import asyncio
import os

import torch

from trainer.rollout.engine import SamplingParams


class FleetRollout:
    size = 1

    def __init__(self, model_path: str, *, num_servers: int, threads_per_server: int, max_batch_size: int,
                 max_seq_len: int, dtype: str, tokenizer_path: str | None, log_dir: str):
        from trainer.rollout.fleet import Fleet

        self.tokenizer_path, self.tokenizer = tokenizer_path or model_path, None
        self.dtype = dtype
        os.makedirs(log_dir, exist_ok=True)
        self.fleet = Fleet(model_path, num_servers=num_servers, threads_per_server=threads_per_server,
                           max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype,
                           log_dir=log_dir).start()
        self.client = self.fleet.client

    # the WorkerGroup calls the loop makes ------------------------------------------------------
    def call(self, method: str, args_per_rank=None, **kwargs) -> list:
        args = tuple(args_per_rank[0]) if args_per_rank else ()
        return [getattr(self, method)(*args, **kwargs)]

    async_call = call  # results are ready when it returns; ``get`` passes them through

    @staticmethod
    def get(refs: list) -> list:
        return list(refs)

    def shutdown(self) -> None:
        self.fleet.close()

    # rollout ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: dict) -> list[list[tuple[list[int], list[float], str]]]:
        outs = self.client.generate(prompts, SamplingParams(**params))
        return [[(o.token_ids, o.logprobs, o.finish_reason) for o in per_prompt] for per_prompt in outs]

    def generate_multi_turn(self, tasks: list[dict], params: dict, multi_turn: dict) -> list:
        from trainer.rollout.multi_turn import loop_kwargs, rollout_trajectories

        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return asyncio.run(rollout_trajectories(
            self.client.agenerate, self.tokenizer, multi_turn["environment"], tasks,
            SamplingParams(**{**params, "n": 1}), params["n"], **loop_kwargs(multi_turn)))

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    # weights ---------------------------------------------------------------------------------
    def update_weights_stream(self, named_tensors) -> int:
        """Push the whole stream (drained, bucketed, every server checksum-verified); the bytes sent."""
        nbytes = 0

        def counted():
            nonlocal nbytes
            for name, t in named_tensors:
                nbytes += t.numel() * t.element_size()
                yield name, t

        self.client.update_weights(counted(), dtype=getattr(torch, self.dtype))
        return nbytes

    def weights_checksum(self) -> str:
        return self.client.weights_checksum()

    def metrics(self) -> dict[str, float]:
        return self.fleet.stats.as_metrics()
