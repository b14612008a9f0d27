"""One rank of a megatron-core model group: actor, reference or critic.

Thin by design: each method unpacks the batch shard it was sent, calls ``megatron_bridge`` (model,
log-probs, train step, checkpoints, weight stream) and ``trainer.algos`` (losses), and returns
numpy arrays or a metrics dict. It runs as a Ray actor (one per rank) or, for debugging, as a plain
object in the driver (``trainer.debug.in_process=true``), so ``breakpoint()`` works in every method.

Batch shards arrive as ``RolloutBatch.to_numpy_dict()`` (numpy crosses Ray without pickling tensors).
Per-token outputs come back for the response part only: ``[b, T]`` with ``T`` the response width.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any, Iterator

import numpy as np
import torch

from trainer.batch import RolloutBatch


def combine_digests(digests: dict[str, bytes]) -> str:
    """``trainer.rollout.engine.checksum_named_tensors`` from per-tensor ``tensor_digest``s: sha256
    over the digests in sorted name order (tests check the two agree)."""
    total = hashlib.sha256()
    for name in sorted(digests):
        total.update(digests[name])
    return total.hexdigest()


class MegatronWorker:
    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str, master_port: int,
                 model_path: str, tp: int = 1, pp: int = 1, pp_layers=None, params_dtype: str = "float32",
                 compile: bool = False, optim: dict | None = None, seed: int = 1, num_threads: int = 1):
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
        if compile:
            from megatron_bridge.model import compile_model

            compile_model(self.model)

    # ------------------------------------------------------------------ layout
    def layout(self) -> dict:
        return {"rank": self.rank, **self.mesh}

    def _module(self):
        return self.trainer.model if self.trainer is not None else self.model

    @staticmethod
    def _trimmed(batch_np: dict) -> tuple[RolloutBatch, int]:
        """The shard without its all-padding columns (``RolloutBatch.trim_padding``) and the full
        response width ``T`` that per-token results are padded back to."""
        batch = RolloutBatch.from_numpy_dict(batch_np)
        T = batch.response_width
        return batch.trim_padding()[0], T

    @staticmethod
    def _full_width(x: torch.Tensor, T: int) -> np.ndarray:
        """``[b, T']`` per-token results back to ``[b, T]`` (zeros on the trimmed padding columns)."""
        x = x.float()
        if x.shape[1] < T:
            x = torch.nn.functional.pad(x, (0, T - x.shape[1]))
        return x.numpy()

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

        batch, T = self._trimmed(batch_np)
        P = batch.prompts.shape[1]
        mbs = self._micro_batches(batch, micro_batch_size, ())
        with torch.no_grad():
            outs = compute_logprobs(self._module(), mbs, temperature=temperature, with_entropy=with_entropy)
        res = {"log_probs": self._full_width(torch.cat([o["logprobs"][:, P:] for o in outs]), T)}
        if with_entropy:
            res["entropy"] = self._full_width(torch.cat([o["entropy"][:, P:] for o in outs]), T)
        return res

    def compute_values(self, batch_np: dict, *, micro_batch_size: int) -> dict[str, np.ndarray]:
        from megatron_bridge.logprobs import compute_logprobs

        batch, T = self._trimmed(batch_np)
        P = batch.prompts.shape[1]
        with torch.no_grad():
            outs = compute_logprobs(self._module(), self._micro_batches(batch, micro_batch_size, ()))
        return {"values": self._full_width(torch.cat([o["values"][:, P:] for o in outs]), T)}

    # ------------------------------------------------------------------ updates
    def update_actor(self, mini_batches: list[dict], *, loss: dict, temperature: float,
                     micro_batch_size: int) -> dict:
        """One optimizer step per mini-batch shard. ``loss`` holds the policy-loss settings and, per
        mini-batch, the GLOBAL token / sequence counts (``global_counts[i]``) so that micro-batch and
        data-parallel splits give the full-batch gradient (see ``trainer.algos.losses.agg_loss``).

        On-policy (``loss["on_policy"]``: one mini-batch, one epoch) the shard carries no old
        log-probs: the update's own forward runs at the start-of-step weights, so the old log-probs
        ARE its log-probs, taken detached (ratio exactly 1), and the separate old-log-prob forward is
        skipped. Rollout-IS weights (``loss["rollout_is"]``: the keyword arguments of
        ``compute_rollout_is_weights``) are then computed here per micro-batch from those; every
        weight is a per-token or per-row function, so this equals the driver-side computation.
        The detached log-probs and entropies come back as ``outputs`` ([b, T] per shard sample) for
        the driver's metrics. Returns ``{"metrics": [one dict per mini-batch], "outputs": ... or None}``."""
        from megatron_bridge.train import train_step

        from trainer.algos.kl import kl_penalty
        from trainer.algos.losses import agg_loss, get_policy_loss_fn
        from trainer.algos.rollout_is import compute_rollout_is_weights

        policy_loss = get_policy_loss_fn(loss["loss_mode"])
        dp = self.mesh["dp_size"]
        mode = loss["loss_agg_mode"]
        on_policy, is_kw = bool(loss.get("on_policy")), loss.get("rollout_is")
        if on_policy and len(mini_batches) != 1:
            raise ValueError(f"on_policy=True needs exactly one mini-batch (got {len(mini_batches)}): with several, "
                             f"later mini-batches run at updated weights and need the start-of-step old log-probs")
        fields = ("response_mask", "old_log_probs", "advantages", "rollout_is_weights", "ref_log_probs",
                  "rollout_log_probs")
        out, captured = [], []
        for i, mb_np in enumerate(mini_batches):
            batch, T = self._trimmed(mb_np)
            P = batch.prompts.shape[1]
            n_tok, n_seq = loss["global_counts"][i]
            agg = dict(global_num_tokens=n_tok, global_num_seqs=n_seq, dp_size=dp, norm_constant=loss.get("norm_constant"))

            def loss_fn(outs: dict, mb: dict):
                logp = outs["logprobs"][:, P:]  # [b, T]
                mask = mb["response_mask"]
                old, is_w = mb.get("old_log_probs"), mb.get("rollout_is_weights")
                if on_policy:
                    old = logp.detach()  # [b, T'] the start-of-step policy, exactly
                    ent = outs["entropy"][:, P:].detach() if "entropy" in outs else None
                    captured.append((old, ent, T))
                    if is_kw is not None and is_kw.get("rollout_is", True) and bool(mask.any()):
                        is_w = compute_rollout_is_weights(old, mb["rollout_log_probs"], mask, **is_kw)[0]
                pg, metrics = policy_loss(
                    old_log_prob=old, log_prob=logp, advantages=mb["advantages"], response_mask=mask,
                    loss_agg_mode=mode, rollout_is_weights=is_w,
                    clip_ratio=loss["clip_ratio"], clip_ratio_low=loss["clip_ratio_low"],
                    clip_ratio_high=loss["clip_ratio_high"], clip_ratio_c=loss["clip_ratio_c"],
                    **loss.get("policy_kwargs", {}), **agg)
                total = pg
                metrics = {f"actor/{k}": v for k, v in metrics.items()}
                metrics["actor/pg_loss"] = pg.detach()
                if "entropy" in outs and loss["entropy_coeff"]:
                    ent = agg_loss(outs["entropy"][:, P:], mask, mode, **agg)
                    total = total - loss["entropy_coeff"] * ent
                    metrics["actor/entropy"] = ent.detach()
                if loss["use_kl_loss"]:
                    kl = kl_penalty(logp, mb["ref_log_probs"], loss["kl_loss_type"])
                    kl_l = agg_loss(kl, mask, mode, **agg)
                    total = total + loss["kl_loss_coef"] * kl_l
                    metrics["actor/kl_loss"] = kl_l.detach()
                return total, metrics

            # entropy enters the graph only when it is trained on; on-policy it is still computed, detached,
            # for the logged rollout entropy (the skipped old-log-prob pass used to provide it)
            m = train_step(self.trainer, self._micro_batches(batch, micro_batch_size, fields), loss_fn,
                           temperature=temperature, with_entropy=bool(loss["entropy_coeff"]) or on_policy,
                           entropy_grad=bool(loss["entropy_coeff"]))
            out.append({("actor/" + k if "/" not in k else k): float(v) for k, v in m.items()})
        outputs = None
        if captured:  # the last pipeline stage (the one that ran loss_fn)
            outputs = {"log_probs": np.concatenate([self._full_width(c[0], c[2]) for c in captured])}
            if captured[0][1] is not None:
                outputs["entropy"] = np.concatenate([self._full_width(c[1], c[2]) for c in captured])
        return {"metrics": out, "outputs": outputs}

    def update_critic(self, mini_batches: list[dict], *, loss: dict, micro_batch_size: int) -> list[dict]:
        from megatron_bridge.train import train_step

        from trainer.algos.losses import value_loss

        dp = self.mesh["dp_size"]
        out = []
        for i, mb_np in enumerate(mini_batches):
            batch, _ = self._trimmed(mb_np)
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
    def weight_buckets(self, bucket_bytes: int, digest_dtype: str | None = None) -> Iterator[Any]:
        """Collective generator over HF-named weight buckets. Every rank must drain it; only global
        rank 0 yields the tensors (others yield None, so nothing is shipped twice).

        No copy is made here: Ray serialises a yielded bucket into its object store before the
        generator resumes (views of live parameters are fine: no optimizer step runs during a sync).
        With ``digest_dtype`` (``"none"`` = as is) rank 0 then hashes the bucket it just handed
        over, while the engines load it, and ``stream_checksum`` returns the checksum of everything
        streamed: verification without a second gather pass over the model."""
        from megatron_bridge.export import iter_hf_weights

        from trainer.rollout.engine import tensor_digest

        hashing = digest_dtype is not None and self.rank == 0
        dt = getattr(torch, digest_dtype) if hashing and digest_dtype != "none" else None
        self._stream_digests, self._stream_done = {}, threading.Event()
        try:
            for bucket in iter_hf_weights(self._module(), bucket_bytes):
                if self.rank != 0:
                    yield None
                    continue
                pairs = [(n, t.detach().cpu()) for n, t in bucket]
                yield pairs
                if hashing:
                    for n, t in pairs:
                        if n in self._stream_digests:
                            raise ValueError(f"tensor {n!r} appears twice in the weight stream")
                        self._stream_digests[n] = tensor_digest(n, t, dt)
        finally:
            self._stream_done.set()

    def stream_checksum(self, timeout: float = 600.0) -> str | None:
        """Checksum of the last ``weight_buckets`` stream (rank 0; others None), equal to
        ``checksum_named_tensors`` of the same tensors. Waits for the stream's last digest."""
        if self.rank != 0:
            return None
        done = getattr(self, "_stream_done", None)
        if done is None or not done.wait(timeout):
            raise RuntimeError("stream_checksum: no finished weight_buckets stream with digests")
        return combine_digests(self._stream_digests)

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
