"""One rank of a megatron-core model group: actor, reference or critic.

Thin by design: each method unpacks the batch shard it was sent, calls ``megatron_bridge`` (model,
log-probs, train step, checkpoints, weight stream) and ``trainer.algos`` (losses), and returns
numpy arrays or a metrics dict. It runs as a Ray actor (one per rank) or, for debugging, as a plain
object in the driver (``trainer.debug.in_process=true``), so ``breakpoint()`` works in every method.

Batch shards arrive as ``RolloutBatch.to_numpy_dict()`` (numpy crosses Ray without pickling tensors).
Per-token outputs come back for the response part only: ``[b, T]`` with ``T`` the response width.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np
import torch

from trainer.batch import RolloutBatch


class MegatronWorker:
    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str, master_port: int,
                 model_path: str, tp: int = 1, pp: int = 1, pp_layers=None, params_dtype: str = "float32",
                 optim: dict | None = None, seed: int = 1, num_threads: int = 1):
        from megatron_bridge import launch
        from megatron_bridge.convert import load_hf_weights
        from megatron_bridge.hf_config import read_hf_config
        from megatron_bridge.model import build_model

        torch.set_num_threads(max(1, num_threads))
        self.role, self.rank = role, rank
        launch.init_distributed(rank, world_size, master_addr, master_port, tp=tp, pp=pp, seed=seed)
        self.mesh = launch.parallel_layout()
        self.hf = read_hf_config(model_path)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[params_dtype]
        self.model = build_model(self.hf, pp_layers=pp_layers, params_dtype=dtype, value_head=(role == "critic"))
        load_hf_weights(self.model, model_path)
        self.trainer = None
        if optim is not None:
            from megatron_bridge.train import OptimConfig, make_trainer

            self.trainer = make_trainer(self.model, OptimConfig(**optim))

    # ------------------------------------------------------------------ layout
    def layout(self) -> dict:
        return {"rank": self.rank, **self.mesh}

    def _module(self):
        return self.trainer.model if self.trainer is not None else self.model

    @staticmethod
    def _micro_batches(batch: RolloutBatch, micro_bs: int, fields: tuple[str, ...]) -> list[dict]:
        out = []
        for s in range(0, batch.batch_size[0], micro_bs):
            mb = batch[s:s + micro_bs]
            d = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask}
            for f in fields:
                v = getattr(mb, f)
                if v is not None:
                    d[f] = v
            out.append(d)
        return out

    # ------------------------------------------------------------------ forward passes
    def compute_log_prob(self, batch_np: dict, *, temperature: float, micro_batch_size: int,
                         with_entropy: bool = False) -> dict[str, np.ndarray]:
        """Per-token log-probs (and entropy) of the response tokens under the current weights."""
        from megatron_bridge.logprobs import compute_logprobs

        batch = RolloutBatch.from_numpy_dict(batch_np)
        P = batch.prompts.shape[1]
        mbs = self._micro_batches(batch, micro_batch_size, ())
        with torch.no_grad():
            outs = compute_logprobs(self._module(), mbs, temperature=temperature, with_entropy=with_entropy)
        res = {"log_probs": torch.cat([o["logprobs"][:, P:] for o in outs]).float().numpy()}
        if with_entropy:
            res["entropy"] = torch.cat([o["entropy"][:, P:] for o in outs]).float().numpy()
        return res

    def compute_values(self, batch_np: dict, *, micro_batch_size: int) -> dict[str, np.ndarray]:
        from megatron_bridge.logprobs import compute_logprobs

        batch = RolloutBatch.from_numpy_dict(batch_np)
        P = batch.prompts.shape[1]
        with torch.no_grad():
            outs = compute_logprobs(self._module(), self._micro_batches(batch, micro_batch_size, ()))
        return {"values": torch.cat([o["values"][:, P:] for o in outs]).float().numpy()}

    # ------------------------------------------------------------------ updates
    def update_actor(self, mini_batches: list[dict], *, loss: dict, temperature: float,
                     micro_batch_size: int) -> list[dict]:
        """One optimizer step per mini-batch shard. ``loss`` holds the policy-loss settings and, per
        mini-batch, the GLOBAL token / sequence counts (``global_counts[i]``) so that micro-batch and
        data-parallel splits give the full-batch gradient (see ``trainer.algos.losses.agg_loss``)."""
        from megatron_bridge.train import train_step

        from trainer.algos.kl import kl_penalty
        from trainer.algos.losses import agg_loss, get_policy_loss_fn

        policy_loss = get_policy_loss_fn(loss["loss_mode"])
        dp = self.mesh["dp_size"]
        mode = loss["loss_agg_mode"]
        fields = ("response_mask", "old_log_probs", "advantages", "rollout_is_weights", "ref_log_probs")
        out = []
        for i, mb_np in enumerate(mini_batches):
            batch = RolloutBatch.from_numpy_dict(mb_np)
            P = batch.prompts.shape[1]
            n_tok, n_seq = loss["global_counts"][i]
            agg = dict(global_num_tokens=n_tok, global_num_seqs=n_seq, dp_size=dp, norm_constant=loss.get("norm_constant"))

            def loss_fn(outs: dict, mb: dict):
                logp = outs["logprobs"][:, P:]  # [b, T]
                mask = mb["response_mask"]
                pg, metrics = policy_loss(
                    old_log_prob=mb["old_log_probs"], log_prob=logp, advantages=mb["advantages"], response_mask=mask,
                    loss_agg_mode=mode, rollout_is_weights=mb.get("rollout_is_weights"),
                    clip_ratio=loss["clip_ratio"], clip_ratio_low=loss["clip_ratio_low"],
                    clip_ratio_high=loss["clip_ratio_high"], clip_ratio_c=loss["clip_ratio_c"],
                    **loss.get("policy_kwargs", {}), **agg)
                total = pg
                metrics = {f"actor/{k}": v for k, v in metrics.items()}
                metrics["actor/pg_loss"] = pg.detach()
                if "entropy" in outs:
                    ent = agg_loss(outs["entropy"][:, P:], mask, mode, **agg)
                    total = total - loss["entropy_coeff"] * ent
                    metrics["actor/entropy"] = ent.detach()
                if loss["use_kl_loss"]:
                    kl = kl_penalty(logp, mb["ref_log_probs"], loss["kl_loss_type"])
                    kl_l = agg_loss(kl, mask, mode, **agg)
                    total = total + loss["kl_loss_coef"] * kl_l
                    metrics["actor/kl_loss"] = kl_l.detach()
                return total, metrics

            # entropy only enters the graph when it is trained on (the logged entropy comes from the
            # old-log-prob pass); at real vocab sizes it is a large [tokens, V] computation to keep
            m = train_step(self.trainer, self._micro_batches(batch, micro_batch_size, fields), loss_fn,
                           temperature=temperature, with_entropy=bool(loss["entropy_coeff"]))
            out.append({("actor/" + k if "/" not in k else k): float(v) for k, v in m.items()})
        return out

    def update_critic(self, mini_batches: list[dict], *, loss: dict, micro_batch_size: int) -> list[dict]:
        from megatron_bridge.train import train_step

        from trainer.algos.losses import value_loss

        dp = self.mesh["dp_size"]
        out = []
        for i, mb_np in enumerate(mini_batches):
            batch = RolloutBatch.from_numpy_dict(mb_np)
            P = batch.prompts.shape[1]
            n_tok, n_seq = loss["global_counts"][i]

            def loss_fn(outs: dict, mb: dict):
                vl, metrics = value_loss(outs["values"][:, P:], mb["values"], mb["returns"], mb["response_mask"],
                                         cliprange_value=loss["cliprange_value"], loss_agg_mode=loss["loss_agg_mode"],
                                         global_num_tokens=n_tok, global_num_seqs=n_seq, dp_size=dp)
                metrics = {f"critic/{k}": v for k, v in metrics.items()}
                metrics["critic/vf_loss"] = vl.detach()
                return vl, metrics

            m = train_step(self.trainer, self._micro_batches(batch, micro_batch_size, ("response_mask", "values", "returns")),
                           loss_fn)
            out.append({("critic/" + k if "/" not in k else k): float(v) for k, v in m.items()})
        return out

    # ------------------------------------------------------------------ weights, checkpoints
    def weight_buckets(self, bucket_bytes: int) -> Iterator[Any]:
        """Collective generator over HF-named weight buckets. Every rank must drain it; only global
        rank 0 yields the tensors (others yield None, so nothing is shipped twice)."""
        from megatron_bridge.export import iter_hf_weights

        for bucket in iter_hf_weights(self._module(), bucket_bytes):
            yield [(n, t.detach().cpu().clone()) for n, t in bucket] if self.rank == 0 else None

    def weights_checksum(self, dtype: str | None = None) -> str | None:
        from megatron_bridge.export import iter_hf_param

        from trainer.rollout.engine import checksum_named_tensors

        dt = getattr(torch, dtype) if dtype else None
        pairs = ((n, t.detach().cpu()) for n, t in iter_hf_param(self._module()))
        if self.rank == 0:
            return checksum_named_tensors(pairs, dtype=dt)
        for _ in pairs:  # collective: still take part in every gather
            pass
        return None

    def save(self, ckpt_dir: str, extra: dict | None = None) -> str:
        from megatron_bridge.checkpoint import save_checkpoint

        t = self.trainer
        return save_checkpoint(ckpt_dir, self._module(), t.optimizer if t else None, t.scheduler if t else None, extra=extra)

    def load(self, ckpt_dir: str) -> dict:
        from megatron_bridge.checkpoint import load_checkpoint

        t = self.trainer
        return load_checkpoint(ckpt_dir, self._module(), t.optimizer if t else None, t.scheduler if t else None)

    def export_hf(self, out_dir: str, source_dir: str | None = None) -> str:
        from megatron_bridge.export import export_hf

        export_hf(self._module(), out_dir, source_dir=source_dir)
        return out_dir

    def rng_state(self) -> dict:
        from trainer.checkpoint import capture_rng

        return capture_rng()

    def set_rng_state(self, state: dict) -> None:
        from trainer.checkpoint import restore_rng

        restore_rng(state)

    def ping(self) -> int:
        return os.getpid()
