"""The DeepSpeed ZeRO strategy: actor, reference or critic on a Hugging Face model (``*.strategy=deepspeed``).

Any ``AutoModelForCausalLM`` trains with no conversion code: the model is the HF model, sharded by ZeRO
over the group's data-parallel ranks (stage 1: optimizer states; 2: + gradients; 3: + parameters;
Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv:1910.02054). The group is pure data parallel (``dp_size`` = world size).

* ``compute`` / ``train_step``: the HF forward on padded rows (``attention_mask`` and position ids
  restarting at each row's first real token), with the same per-token definitions as the megatron
  path (``megatron_bridge.logprobs``): ``x = logits / T`` (temperature first), ``logp(y) = x_y -
  logsumexp(x)``, ``H = logsumexp(x) - sum softmax(x) x``, ``sum pi^2 = sum exp(2 (x - logsumexp(x)))``
  (with ``actor.calculate_sum_pi_squared``) over the full vocabulary, each aligned with
  the token it scores (the first token and pads get 0). A critic is
  ``AutoModelForTokenClassification`` with one label (HF name ``score``, as the megatron critic
  exports it), initialised as the megatron critic's head when the checkpoint has none.
* One optimizer step per mini-batch: every micro-batch's loss is already normalised by the WHOLE
  mini-batch (``LossAgg``: global token / sequence counts, times the DP size that DeepSpeed's gradient
  averaging divides by), so gradients accumulate unscaled (the accumulation boundary is set by hand,
  since dynamic micro-batching gives each mini-batch its own count), then DeepSpeed reduces, clips
  (``gradient_clipping``) and steps. The optimizer is torch's AdamW with megatron's grouping (no
  weight decay on biases and 1-D parameters) and megatron's own LR schedule object
  (``OptimizerParamScheduler``: warmup, constant / cosine / linear), so both strategies follow the
  same schedule and the parity test can compare them step for step.
* Weights: ``hf_params`` yields the HF-named parameters; under ZeRO-3 each one is gathered
  (``GatheredParameters``, collective) and copied, so the extra memory of a sync is one bucket. ZeRO
  partitions flat buffers, not HF blocks, so there are no ``reshard_blocks``: syncs gather.
* Checkpoints: DeepSpeed's own format (``engine.save_checkpoint``, every rank its partition) plus the
  LR schedule as client state, inside the driver's atomic checkpoint directory; HF export gathers and
  writes safetensors with the source's config and tokenizer files.

* LoRA (``actor_rollout_ref.model.lora.*``, the actor): peft adapters on the HF projections
  (:mod:`trainer.strategies.hf_lora`), added before DeepSpeed wraps the model, so ZeRO and AdamW hold only the
  adapters; the reference policy is the actor with its adapters off; a sync moves the adapters (``merge=false``)
  or merged weights; checkpoints leave the frozen base out (``exclude_frozen_parameters``); the export writes the
  merged model and a peft adapter directory.

Device: CPU (gloo; ``DS_ACCELERATOR=cpu``) or CUDA (nccl). Offload of parameters / optimizer states
to CPU (ZeRO-Offload) is passed to DeepSpeed on CUDA and refused on CPU, where nothing would move.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_bridge.train import OptimConfig, make_scheduler
from trainer.lora import LoRASettings
from trainer.strategies import DTYPES, Strategy
from trainer.strategies.hf_lora import ADAPTER_DIR, PeftLoRA, is_adapter_name
from trainer.strategies.hf_model import align, load_hf_model, next_token_outputs, param_groups, write_hf_dir


def ds_config(*, zero_stage: int, dtype: str, clip_grad: float, offload_params: bool = False,
              offload_optimizer: bool = False) -> dict:
    """The DeepSpeed config of a role (micro-batching and accumulation are driven by the worker)."""
    zero: dict = {"stage": int(zero_stage)}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "gradient_clipping": float(clip_grad or 0.0),
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _import_deepspeed(use_cuda: bool):
    """DeepSpeed, imported here and not at the top: it picks its accelerator from ``DS_ACCELERATOR`` at
    import time, so the variable must be set first (and it is a heavy import)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if use_cuda else "cpu")
    import deepspeed  # heavy optional dependency, configured by the environment above
    import deepspeed.ops

    if not use_cuda:
        # DeepSpeed's CPU backend would JIT-compile its shared-memory all-reduce kernel (C++, tens of
        # seconds, a compiler needed) at start-up; training reduces through gloo and never uses it
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


class DeepSpeedStrategy(Strategy):
    @classmethod
    def from_section(cls, section, *, optim, checkpointing, routing_replay, compile) -> dict:
        """The role's ``deepspeed_config`` section (its precision falls back to ``megatron.dtype``, the role's
        precision key before DeepSpeed existed here). R3 routing replay is refused with DeepSpeed at load time;
        ``trainer.compile`` does not apply (the HF model runs eagerly)."""
        ds = section.deepspeed_config
        return dict(zero_stage=ds.zero_stage, params_dtype=ds.dtype or section.megatron.dtype, optim=optim,
                    seed=ds.seed, gradient_checkpointing=bool(checkpointing and optim is not None),
                    offload_params=bool(ds.param_offload), offload_optimizer=bool(ds.optimizer_offload))

    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str, master_port: int,
                 model_path: str, zero_stage: int = 2, params_dtype: str = "float32", optim: dict | None = None,
                 seed: int = 1, gradient_checkpointing: bool = False, offload_params: bool = False,
                 offload_optimizer: bool = False, hf_overrides: dict | None = None, lora: dict | None = None):
        use_cuda = torch.cuda.is_available()
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        self._ds = deepspeed = _import_deepspeed(use_cuda)
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", auto_mpi_discovery=False,
                                       verbose=False)
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"deepspeed_config.zero_stage={zero_stage}: use 0, 1, 2 or 3")
        torch.manual_seed(seed)
        self.role, self.rank = role, rank
        self.mesh = {"dp_rank": rank, "dp_size": world_size, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
                     "vpp_size": 1, "cp_rank": 0, "cp_size": 1, "ep_rank": 0, "ep_size": 1}
        self.zero_stage = int(zero_stage)
        self.is_critic = role in ("critic", "reward")  # a reward model reads its score through the value path
        self.hf_overrides = hf_overrides
        self.model = load_hf_model(role, model_path, DTYPES[params_dtype], hf_overrides)
        if gradient_checkpointing and optim is not None:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # LoRA (trainer.lora.LoRASettings as a dict) through peft, at the megatron actor's init for the same seed;
        # before DeepSpeed wraps the model, so ZeRO and the optimizer see the frozen base and the adapters
        self.lora = PeftLoRA(LoRASettings(**lora), model_path, hf_overrides) if lora else None
        if self.lora is not None:
            self.model = self.lora.apply(self.model, seed=seed)
        cfg = ds_config(zero_stage=zero_stage, dtype=params_dtype, clip_grad=(optim or {}).get("clip_grad", 0.0),
                        offload_params=offload_params, offload_optimizer=offload_optimizer)
        if optim is None:  # reference: forward only (ZeRO-3 still partitions the parameters)
            self.ds_engine = deepspeed.initialize(model=self.model, config=cfg)[0] if self.zero_stage == 3 else None
            self.scheduler = None
            return
        self.optim = OptimConfig(**optim)
        if self.optim.optimizer != "adam":
            raise ValueError(f"strategy=deepspeed: optim.optimizer={self.optim.optimizer!r}; DeepSpeed trains with AdamW here")
        groups = param_groups(self.model, self.optim.weight_decay)  # the trainable parameters (LoRA: the adapters)
        self._optimizer_params = sum(p.numel() for g in groups for p in g["params"])
        opt = torch.optim.AdamW(groups, lr=self.optim.lr,
                                betas=(self.optim.adam_beta1, self.optim.adam_beta2), eps=self.optim.adam_eps)
        self.ds_engine, self.ds_optimizer, _, _ = deepspeed.initialize(model=self.model, optimizer=opt, config=cfg)
        # megatron's schedule object drives the learning rate of every group (the same numbers as the megatron path)
        self.scheduler = make_scheduler(self.ds_optimizer, self.optim)

    # ------------------------------------------------------------------ model
    def module(self):
        return self.ds_engine.module if self.ds_engine is not None else self.model

    def _device(self) -> torch.device:
        return self.ds_engine.device if self.ds_engine is not None else next(self.model.parameters()).device

    def _outputs(self, mb: dict, *, temperature: float, with_entropy: bool, entropy_grad: bool = True,
                 with_sum_pi_squared: bool = False) -> dict:
        dev = self._device()
        ids, am = mb["input_ids"].to(dev), mb["attention_mask"].long().to(dev)
        pos = (am.cumsum(-1) - 1).clamp_min(0)
        valid = am.bool().clone()
        first = am.argmax(-1)  # each row's first real token: nothing scores it
        valid[torch.arange(ids.shape[0]), first] = False
        # through the engine, not its module: its forward also advances ZeRO-3's micro-step counter, without
        # which every micro-batch's gradient would overwrite the previous one instead of adding to it
        model = self.ds_engine if self.ds_engine is not None else self.model
        out = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False)
        nxt = torch.zeros_like(ids)
        nxt[:, :-1] = ids[:, 1:]
        res = next_token_outputs(out.logits, nxt, critic=self.is_critic, temperature=temperature,
                                 with_entropy=with_entropy, entropy_grad=entropy_grad,
                                 with_sum_pi_squared=with_sum_pi_squared)
        return {k: align(v, valid) for k, v in res.items()}

    def compute(self, mbs, *, temperature, with_entropy, with_sum_pi_squared=False):
        m = self.module()
        was = m.training
        m.eval()
        try:
            with torch.no_grad():
                return [{k: v.float().cpu() for k, v in self._outputs(
                    mb, temperature=temperature, with_entropy=with_entropy,
                    with_sum_pi_squared=with_sum_pi_squared).items()} for mb in mbs]
        finally:
            m.train(was)

    def train_step(self, mbs, loss_fn, *, temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = True) -> dict:
        eng = self.ds_engine
        eng.train()
        total = 0.0
        for i, mb in enumerate(mbs):
            eng.set_gradient_accumulation_boundary(i == len(mbs) - 1)
            outs = self._outputs(mb, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
            dev = self._device()  # the loss reads the micro-batch's fields beside the outputs, on their device
            loss, _ = loss_fn(outs, {k: v.to(dev) if torch.is_tensor(v) else v for k, v in mb.items()})
            eng.backward(loss)
            total += float(loss.detach())
        lr = float(self.ds_optimizer.param_groups[0]["lr"])
        eng.step()
        gn = eng.get_global_grad_norm()
        gn = float(gn) if gn is not None else float("nan")
        skipped = 0.0
        if not (gn == gn and gn != float("inf")):  # a non-finite norm: DeepSpeed skipped the step (or must)
            skipped = 1.0
        self.scheduler.step(increment=1)
        out = {"loss": total, "grad_norm": gn, "lr": lr, "skipped": skipped}
        if self.lora is not None:
            out.update({f"lora/{k}": v for k, v in PeftLoRA.report(self.module(), self._optimizer_params).items()})
        return out

    def reference_policy(self):
        """With LoRA the actor with its adapters off is the reference policy (verl's LoRA reference): the base
        weights, bit for bit."""
        if self.lora is None:
            return super().reference_policy()
        return PeftLoRA.reference(self.module())

    # ------------------------------------------------------------------ weights
    @contextmanager
    def _gathered(self, params):
        if self.zero_stage == 3 and self.ds_engine is not None:
            with self._ds.zero.GatheredParameters(list(params), modifier_rank=None):
                yield
        else:
            yield

    def _read(self, params) -> list[torch.Tensor]:
        """Whole copies of ``params`` (ZeRO-3 gathers them: collective)."""
        with self._gathered(params):
            return [p.detach().clone() for p in params]

    @property
    def adapter_sync(self) -> bool:
        """A weight sync moves the LoRA adapters only (``lora.merge=false``), not merged weights."""
        return self.lora is not None and not self.lora.s.merge

    def _tied(self) -> tuple:
        tied = bool(getattr(self.module().config, "tie_word_embeddings", False))
        return ("lm_head.weight",) if tied else ()

    def hf_params(self):
        """HF names and full tensors; ZeRO-3 gathers one parameter at a time (collective: every rank). With LoRA:
        the adapters in peft's layout (``lora.merge=false``) or the merged weights ``W + (alpha / r) B A``."""
        m = self.module()
        if self.lora is not None:
            if self.adapter_sync:
                yield from self.lora.adapters(m, self._read)
            else:
                yield from self.lora.weights(m, self._read, merged=True, skip=self._tied())
            return
        tied = bool(getattr(m.config, "tie_word_embeddings", False))
        for name, p in m.named_parameters():
            if tied and name == "lm_head.weight":
                continue
            with self._gathered([p]):
                t = p.detach().clone() if self.zero_stage == 3 else p.detach()
            yield name, t

    def base_params(self):
        """``(hf_name, full tensor)`` of the base weights (the adapters off), collective: what an adapter-only
        sync's engines merge over (their one-time check)."""
        yield from self.lora.weights(self.module(), self._read, merged=False, skip=self._tied())

    # ------------------------------------------------------------------ checkpoints
    def save(self, ckpt_dir: str, extra: dict | None = None) -> str:
        """DeepSpeed's own checkpoint; with LoRA without the frozen base (``model.path``'s, loaded at start): the
        adapters and their optimizer state."""
        if self.ds_engine is None or self.scheduler is None:
            return ckpt_dir
        os.makedirs(ckpt_dir, exist_ok=True)
        self.ds_engine.save_checkpoint(ckpt_dir, tag="deepspeed", client_state={"scheduler": self.scheduler.state_dict()},
                                       save_latest=False, exclude_frozen_parameters=self.lora is not None)
        return ckpt_dir

    def load(self, ckpt_dir: str, contents=("model", "optimizer", "extra")) -> dict:
        if self.ds_engine is None or self.scheduler is None:
            return {}
        if not os.path.isdir(os.path.join(ckpt_dir, "deepspeed")):
            raise FileNotFoundError(f"{ckpt_dir} holds no DeepSpeed checkpoint (expected {ckpt_dir}/deepspeed): it "
                                    f"was saved by another strategy; resume with the strategy that saved it")
        # a LoRA checkpoint holds no base weights (they stay as loaded from model.path): not strict, so the
        # adapters are checked to be there first
        if self.lora is not None:
            self._check_adapters_in(ckpt_dir)
        _, client = self.ds_engine.load_checkpoint(ckpt_dir, tag="deepspeed",
                                                   load_optimizer_states="optimizer" in contents,
                                                   load_lr_scheduler_states=False,
                                                   load_module_strict=self.lora is None)
        if "extra" in contents and client and "scheduler" in client:
            self.scheduler.load_state_dict(client["scheduler"])
        return client or {}

    def _check_adapters_in(self, ckpt_dir: str) -> None:
        """Every adapter of the model is in the checkpoint's module state (a non-strict load would leave a missing
        one at its init without a word)."""
        path = os.path.join(ckpt_dir, "deepspeed", "mp_rank_00_model_states.pt")
        saved = set(torch.load(path, map_location="cpu", weights_only=True)["module"])  # tensors, no code
        lacking = [n for n, _ in self.module().named_parameters() if is_adapter_name(n) and n not in saved]
        if lacking:
            raise KeyError(f"{ckpt_dir}: the LoRA checkpoint has no {lacking[:3]} ({len(lacking)} adapters): it was "
                           f"saved with other lora.target_modules; resume with the settings that saved it")

    def export_hf(self, out_dir: str, source_dir: str | None = None) -> str | None:
        """Write a HF directory (rank 0 writes; every rank takes part in the ZeRO-3 gathers). With LoRA: the merged
        weights, and the peft adapter directory ``<out_dir>/lora_adapter`` that
        ``PeftModel.from_pretrained(<base model>, ...)`` loads."""
        writer = self.rank == 0
        m = self.module()
        merged = (self.lora.weights(m, self._read, merged=True, skip=self._tied()) if self.lora is not None
                  else self.hf_params())
        state = {}
        for n, t in merged:  # collective under ZeRO-3; only the writer keeps the tensors
            if writer:
                state[n] = t.cpu().contiguous()
        adapters = {n: t.cpu().contiguous() for n, t in self.lora.adapters(m, self._read)} if self.lora else {}
        if writer:
            config = m.get_base_model().config if self.lora is not None else m.config
            write_hf_dir(state, config, out_dir, source_dir)
            if self.lora is not None:
                self.lora.write_adapter_dir(os.path.join(out_dir, ADAPTER_DIR), adapters, source_dir)
        if dist.is_initialized():
            dist.barrier()
        return out_dir if writer else None
