"""The megatron-core strategy: one rank of a TP / PP / VPP / CP / EP model group (``*.strategy=megatron``).

Everything goes through ``megatron_bridge``: the distributed set-up and parallel layout
(``launch``), the model built from the HF config with the HF weights loaded (``model``, ``convert``),
log-probs on padded or packed (THD) rows (``logprobs``), the train step with megatron's optimizer and
LR schedule (``train``), checkpoints in megatron's distributed format (``checkpoint``), the HF-named
weight stream and its per-rank blocks (``export``, ``reshard``), R3 routing replay
(``routing_replay``) and verl's parameter / gradient / optimizer offload (``offload``).

Imported only in a worker process that runs this strategy (``trainer.strategies.load_strategy``). It never
imports megatron-core itself: megatron stays inside ``megatron_bridge``.
"""

from __future__ import annotations

import os

import torch
from omegaconf import OmegaConf

from megatron_bridge import launch
from megatron_bridge import offload as off
from megatron_bridge import routing_replay as rr
from megatron_bridge.checkpoint import load_checkpoint, save_checkpoint
from megatron_bridge.convert import load_hf_weights
from megatron_bridge.export import export_hf, iter_hf_param, iter_hf_weights
from megatron_bridge.hf_config import read_hf_config
from megatron_bridge.logprobs import compute_logprobs
from megatron_bridge.lora import (adapters_disabled, apply_lora, export_peft_adapter, is_adapter_key, iter_adapter_hf,
                                  load_adapter_state, read_peft_adapter, training_report)
from megatron_bridge.model import build_model, compile_model
from megatron_bridge.reshard import local_blocks, local_param
from megatron_bridge.train import OptimConfig, make_trainer, train_step
from trainer.fsutil import bucketed
from trainer.rewards.reward_model import check_score_head
from trainer.strategies import DTYPES, Strategy
from trainer.optimizer_overrides import passthrough as optimizer_passthrough
from trainer.transformer_overrides import passthrough
from trainer.lora import LoRASettings
from trainer.verl_compat import moe_settings, recompute_settings


ADAPTER_DIR = "lora_adapter"  # the peft adapter beside the merged HF export


class MegatronStrategy(Strategy):
    packs = True

    @classmethod
    def from_section(cls, section, *, optim, checkpointing, routing_replay, compile) -> dict:
        """The role's ``megatron`` section: TP / PP / VPP / CP / EP, the layer split, precision, offload, and
        the recompute and MoE settings of its ``override_transformer_config``."""
        m = section.megatron
        return dict(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                    vpp=m.virtual_pipeline_model_parallel_size or 1, cp=m.context_parallel_size,
                    ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size, moe=moe_settings(m),
                    # every other TransformerConfig field as given (GPU kernel switches off without a GPU)
                    transformer=passthrough(OmegaConf.to_container(m.override_transformer_config, resolve=True),
                                            cuda=torch.cuda.is_available()),
                    pp_layers=list(m.pipeline_layer_split) if m.pipeline_layer_split else None,
                    # nothing to recompute without a backward
                    recompute=recompute_settings(checkpointing, m) if optim is not None else None,
                    params_dtype=m.dtype, compile=bool(m.use_torch_compile or compile), seed=m.seed,
                    # override_optimizer_config as OptimizerConfig keywords (host offload turned off without a GPU)
                    optim=None if optim is None else dict(optim, overrides=optimizer_passthrough(
                        optim.get("overrides") or {}, cuda=torch.cuda.is_available())),
                    sequence_parallel=bool(m.sequence_parallel), routing_replay=routing_replay,
                    offload=dict(params=bool(m.param_offload), grads=bool(m.grad_offload),
                                 optimizer=bool(m.optimizer_offload)))

    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str, master_port: int,
                 model_path: str, tp: int = 1, pp: int = 1, vpp: int = 1, cp: int = 1, ep: int = 1,
                 etp: int | None = None, moe: dict | None = None, pp_layers=None, params_dtype: str = "float32",
                 compile: bool = False, optim: dict | None = None, seed: int = 1, recompute: dict | None = None,
                 sequence_parallel: bool = False, routing_replay: bool = False, offload: dict | None = None,
                 hf_overrides: dict | None = None, transformer: dict | None = None, lora: dict | None = None):
        launch.init_distributed(rank, world_size, master_addr, master_port, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp,
                                seed=seed)
        self.mesh = launch.parallel_layout()
        self.hf = read_hf_config(model_path, hf_overrides)  # verl's model.override_config over config.json
        if role == "reward":  # a reward model's head is its training: never a fresh init (trainer.rewards.reward_model)
            check_score_head(model_path, self.hf.hidden_size)
        # LoRA (trainer.lora.LoRASettings as a dict): adapters on the local spec's linears, so never Transformer
        # Engine's fused ones (megatron_bridge.lora refuses them)
        self.lora = LoRASettings(**lora) if lora else None
        self.model = build_model(self.hf, pp_layers=pp_layers, params_dtype=DTYPES[params_dtype],
                                 value_head=role in ("critic", "reward"),
                                 recompute={**(recompute or {}), **(moe or {}), **(transformer or {})} or None,
                                 sequence_parallel=sequence_parallel, use_te=False if self.lora else None)
        load_hf_weights(self.model, model_path)
        # R3 routing replay: every forward routes each token to the experts the rollout engine used
        self.routing_replay = routing_replay
        if routing_replay:
            if not self.hf.is_moe:
                raise ValueError(f"{role}: router_replay.mode=R3 replays mixture-of-experts routing, but {model_path} "
                                 f"is a dense model; remove the router_replay line")
            rr.install(self.model)
        if self.lora is not None:
            self._apply_lora(seed)
        # after apply_lora: the base weights are frozen, so megatron's DDP buffers and optimizer hold the adapters only
        self.trainer = make_trainer(self.model, OptimConfig(**optim)) if optim is not None else None
        self._setup_offload(offload or {})
        if compile:
            compile_model(self.model)

    def module(self):
        return self.trainer.model if self.trainer is not None else self.model

    # ------------------------------------------------------------------ LoRA (megatron_bridge.lora)
    def _apply_lora(self, seed: int) -> None:
        """Adapters on the loaded base weights (initialised from ``seed``, the same at every layout), or the
        peft adapter of ``adapter_path`` over them."""
        s = self.lora
        apply_lora(self.model, **s.apply_kwargs(), seed=seed, dtype=DTYPES[s.dtype] if s.dtype else None)
        if s.adapter_path:
            # strict: every adapter this rank holds must be in the file (a peft adapter on fewer modules than
            # target_modules names is refused, not half-loaded)
            load_adapter_state(self.model, read_peft_adapter(s.adapter_path, self.hf))

    def reference_policy(self):
        """The actor with its adapters off is the reference policy (verl's LoRA reference): the base weights,
        bit for bit."""
        if self.lora is None:
            return super().reference_policy()
        return adapters_disabled(self.module())

    # ------------------------------------------------------------------ offload (megatron_bridge.offload)
    def _setup_offload(self, offload: dict) -> None:
        """verl's ``param_offload`` / ``grad_offload`` / ``optimizer_offload``: each named part lives in
        host memory except while a method that needs it runs (``trainer.workers.train_worker.resident``)."""
        bad = set(offload) - {"params", "grads", "optimizer"}
        if bad:
            raise ValueError(f"offload: unknown parts {sorted(bad)}")
        t = self.trainer
        self._offloaders = {}
        if offload.get("optimizer") and t is not None:  # first: it tells its own tensors from the model's
            self._offloaders["optimizer"] = off.StorageOffload(off.optimizer_state(t.optimizer, t.model), name="optimizer")
        if offload.get("grads") and t is not None:
            self._offloaders["grads"] = off.StorageOffload(off.grad_buffers(t.model), keep=False, name="grads")
        if offload.get("params"):
            self._offloaders["params"] = off.StorageOffload(off.model_params(self.module()), name="params")
        self.offloaded_bytes = {}
        self.offload_state()

    def load_state(self, parts) -> None:
        for name in ("params", "grads", "optimizer"):  # the reverse of offload_state's order
            o = self._offloaders.get(name)
            if o is not None and name in parts:
                o.load()

    def offload_state(self) -> None:
        for name, o in self._offloaders.items():
            n = o.offload()
            if n:
                self.offloaded_bytes[name] = n

    def offload_status(self) -> dict:
        """Per offloaded part: whether it is in host memory now, the bytes it freed the last time, and the
        bytes its storages hold in place right now (0 while offloaded)."""
        return {"offloaded": {k: o.offloaded for k, o in self._offloaders.items()}, "bytes": dict(self.offloaded_bytes),
                "resident": {k: off.resident_bytes(o.tensors()) for k, o in self._offloaders.items()}}

    # ------------------------------------------------------------------ micro-batches, forward, step
    @property
    def min_micro_batches(self) -> int:
        # the interleaved schedule (virtual pipeline stages) needs a micro-batch per pipeline stage
        return self.mesh["pp_size"] if self.mesh.get("vpp_size", 1) > 1 else 1

    def loss_group(self):
        # the data-parallel peers of this rank's stage: tensor-parallel peers hold the same rows, context-parallel
        # peers gather their tokens back into whole rows before the loss (megatron_bridge.logprobs.head_outputs),
        # and only the last pipeline stage runs the loss (its DP group is made of last-stage ranks)
        return launch.data_parallel_group() if self.mesh["dp_size"] > 1 else None

    def compute(self, mbs: list[dict], *, temperature: float, with_entropy: bool,
                with_sum_pi_squared: bool = False) -> list[dict]:
        """Forward-only per-token outputs of each micro-batch on its own grid (``megatron_bridge.logprobs``)."""
        return compute_logprobs(self.module(), mbs, temperature=temperature, with_entropy=with_entropy,
                                with_sum_pi_squared=with_sum_pi_squared)

    def train_step(self, mbs: list[dict], loss_fn, **kw) -> dict:
        """One optimizer step over the micro-batches: ``loss``, ``grad_norm``, ``lr``, ``skipped`` (with LoRA also
        ``lora/*``: what this rank trained, :func:`megatron_bridge.lora.training_report`)."""
        out = train_step(self.trainer, mbs, loss_fn, **kw)
        if self.lora is not None:
            out.update({f"lora/{k}": v for k, v in training_report(self.module(), self.trainer.optimizer).items()})
        return out

    # ------------------------------------------------------------------ weights
    @property
    def adapter_sync(self) -> bool:
        """A weight sync moves the LoRA adapters only (``lora.merge=false``), not merged weights."""
        return self.lora is not None and not self.lora.merge

    def hf_buckets(self, bucket_bytes: int):
        """HF-named weight buckets, collective over the model group (every rank sees full tensors); with
        adapter-only sync the adapters in peft's layout (:func:`megatron_bridge.lora.iter_adapter_hf`)."""
        if self.adapter_sync:
            return bucketed(iter_adapter_hf(self.module()), bucket_bytes)
        return iter_hf_weights(self.module(), bucket_bytes)

    def hf_params(self):
        """``(hf_name, full tensor)`` one at a time, collective (the adapters, with adapter-only sync)."""
        if self.adapter_sync:
            return iter_adapter_hf(self.module())
        return iter_hf_param(self.module())

    def base_params(self):
        """``(hf_name, full tensor)`` of the base weights (the adapters off), collective: what an adapter-only
        sync's engines merge over (their one-time check)."""
        with adapters_disabled(self.module()):
            yield from iter_hf_param(self.module())

    def reshard_blocks(self) -> list | None:
        # a block is a strided copy out of a live parameter, planned once; a LoRA weight is sent merged, a tensor
        # computed at each sync, so LoRA syncs by the gathered stream (hf_buckets: the hybrid copy, object store,
        # SGLang's broadcast), which merges each weight as it goes
        return None if self.lora is not None else local_blocks(self.module())

    def local_param(self, ref: str) -> torch.Tensor:
        return local_param(self.module(), ref)

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_keep(self):
        """What a checkpoint holds of the model: with LoRA the adapters only (the frozen base is
        ``model.path``'s, loaded at start: a LoRA checkpoint is the adapters and their optimizer state)."""
        return is_adapter_key if self.lora is not None else None

    def save(self, ckpt_dir: str, extra: dict | None = None) -> str:
        t = self.trainer
        return save_checkpoint(ckpt_dir, self.module(), t.optimizer if t else None, t.scheduler if t else None, extra=extra,
                               keep=self._ckpt_keep())

    def load(self, ckpt_dir: str, contents=("model", "optimizer", "extra")) -> dict:
        """``contents``: verl's load_contents (the model always; the optimizer and the LR scheduler
        ('extra') only when named, otherwise they keep their fresh state)."""
        t = self.trainer
        out = load_checkpoint(ckpt_dir, self.module(), t.optimizer if t and "optimizer" in contents else None,
                              t.scheduler if t and "extra" in contents else None, keep=self._ckpt_keep())
        if self._offloaders:
            off.own_storages(self.module(), t.optimizer if t else None)  # loaded tensors may sit in a mapped file
        return out

    def export_hf(self, out_dir: str, source_dir: str | None = None) -> str:
        """The HF model (with LoRA: merged weights), and with LoRA also the peft adapter directory
        ``<out_dir>/lora_adapter`` that ``PeftModel.from_pretrained(<base model>, ...)`` loads."""
        export_hf(self.module(), out_dir, source_dir=source_dir)
        if self.lora is not None:
            export_peft_adapter(self.module(), os.path.join(out_dir, ADAPTER_DIR), rank=self.lora.rank,
                                alpha=self.lora.alpha, dropout=self.lora.dropout,
                                base_model_name_or_path=os.path.abspath(source_dir) if source_dir else None)
        return out_dir
