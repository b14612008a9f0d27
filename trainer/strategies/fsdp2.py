"""The FSDP2 strategy: actor, reference, critic or reward model on a Hugging Face model, sharded by PyTorch's
``fully_shard`` (``*.strategy=fsdp2``; verl's ``fsdp`` spelling runs here too), with Ulysses sequence
parallelism.

Fully sharded data parallelism (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel", arXiv:2304.11277; FSDP2 is its per-parameter DTensor rewrite): every parameter is split along
dim 0 over the mesh; a decoder layer's full weights exist only while it runs (all-gather before forward
and backward, reduce-scatter of the gradients after). Each decoder layer (the model's ``_no_split_modules``
or ``fsdp_config.wrap_policy.transformer_layer_cls_to_wrap``) is one FSDP unit, the untied embedding
another, the root the rest, as verl's ``apply_fsdp2`` does.

verl's ``fsdp_config`` keys and meanings:

* ``fsdp_size``: -1 (or >= the world) shards over all ranks; otherwise a 2-D mesh ``(world / fsdp_size,
  fsdp_size)``: sharded within groups of ``fsdp_size``, replicated across them (hybrid sharding, HSDP).
* ``model_dtype`` (fp32): the parameters' (and optimizer's) dtype; ``mixed_precision`` (``param_dtype``,
  ``reduce_dtype``) or else ``dtype`` (bfloat16): the compute dtype of forward and backward and the
  dtype gradients are reduced in (FSDP2's ``MixedPrecisionPolicy``; fp32 reductions by default).
* ``reshard_after_forward``; ``offload_policy`` (FSDP2's ``CPUOffloadPolicy``: shards live in host
  memory and the optimizer steps there; always on for a forward-only reference, as verl does);
  ``param_offload`` / ``optimizer_offload`` (the sharded parameters / Adam states moved to host memory
  between calls, as verl's ``offload_fsdp_model_to_cpu``). On a CPU device everything already lives in
  host memory: these move nothing and say so in ``offload_status``.
* ``ulysses_sequence_parallel_size`` (the role's, as in verl): :mod:`trainer.strategies.ulysses`. The
  data-parallel size is ``world / P``; parameters are still sharded over the whole world, as in verl.
* ``entropy_checkpointing`` (the entropy recomputed from the logits in backward), ``entropy_from_logits_with_chunking``
  (the entropy over chunks of positions), ``full_determinism`` (torch's deterministic algorithms).
* ``use_remove_padding``: a micro-batch is one packed row of its real tokens; padded rows otherwise. Both
  run the same masked attention (:func:`trainer.strategies.ulysses.attention`), so packing changes no
  number.

The forward and loss definitions are :mod:`trainer.strategies.hf_model`'s. One optimizer step per
mini-batch: the worker's loss is already normalised over the whole mini-batch times the DP size
(``LossAgg``), and FSDP averages the reduced gradients over the world, so micro-batch gradients simply
accumulate. The optimizer is torch's AdamW with megatron's grouping (no weight decay on biases and 1-D
parameters, where verl's FSDP actor decays every parameter: the one deviation, kept so that every
strategy here takes the same step) and megatron's LR schedule object, so FSDP2, DeepSpeed and Megatron
follow the same schedule. The global gradient norm is clipped (``optim.clip_grad``); a non-finite norm
skips the step, as verl does.

LoRA (``actor_rollout_ref.model.lora.*``, the actor): peft adapters on the HF projections
(:mod:`trainer.strategies.hf_lora`), added to the whole loaded model before ``fully_shard``, so the optimizer holds
only the adapters; the reference policy is the actor with its adapters off; syncs move the adapters or merged weights
(no reshard blocks); checkpoints hold the adapters' shards and their Adam state; the export adds a peft adapter.

Weights: ``hf_params`` all-gathers one parameter at a time (``DTensor.full_tensor``), so a weight sync or
an export holds one full tensor (or one bucket) beyond the shards, never the whole model. On one node with a
CPU actor, ``reshard_blocks`` lets each rank write its own dim-0 shard (a row block of each HF tensor) straight
into the engines' shared weights, with no gather (``trainer.sync.shared_memory``).

Checkpoints follow verl's FSDP layout inside the driver's atomic step directory: per rank
``model_world_size_{W}_rank_{r}.pt`` (its shards), ``optim_world_size_{W}_rank_{r}.pt`` (its Adam states)
and ``extra_state_world_size_{W}_rank_{r}.pt`` (the LR schedule), read back with ``weights_only``; the
world size must match to resume (re-sharding a checkpoint is not built). HF export gathers and writes
safetensors with the source's config and tokenizer files.

Building never holds the whole model on a rank: the model is made with its parameters on the meta device,
sharded, allocated, and each rank reads only its own rows of each checkpoint tensor (safetensors slices).
Where a model's parameters do not map 1:1 by name and shape onto the checkpoint (a conversion transformers
applies at load), every rank loads it whole through transformers instead, then shards it.

Left out: FSDP1's size-based wrapping (``wrap_policy.min_num_params``, refused).
"""

from __future__ import annotations

import contextlib
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megatron_bridge.reshard import Block
from megatron_bridge.train import OptimConfig, make_scheduler
from trainer.hf_io import SafetensorsDir
from trainer.rewards.reward_model import check_score_head
from trainer.lora import LoRASettings
from trainer.strategies import DTYPES, Strategy
from trainer.strategies.hf_lora import ADAPTER_DIR, PeftLoRA, is_adapter_name
from trainer.strategies.hf_model import (align, critic_head_init, load_hf_model, model_class, next_token_outputs,
                                         param_groups, role_config, write_hf_dir)
from trainer.strategies.ulysses import ATTN_NAME, SeqContext, attention_mask, gather_seq, set_seq_context

# verl's precision spellings (PrecisionType) -> torch dtypes
PRECISIONS = {"fp32": torch.float32, "float32": torch.float32, "32": torch.float32,
              "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
              "fp16": torch.float16, "float16": torch.float16, "16": torch.float16, **DTYPES}


def precision(name, key: str) -> torch.dtype:
    try:
        return PRECISIONS[str(name)]
    except KeyError:
        raise ValueError(f"{key}={name!r}: use fp32, bf16 or fp16 (or float32, bfloat16, float16)") from None


@contextlib.contextmanager
def params_on_meta():
    """Parameters registered inside are moved to the meta device as they are created (no memory kept), while
    buffers stay real: a model's non-persistent buffers (RoPE's ``inv_freq``) are computed at construction and
    are in no checkpoint, so they must survive the empty re-allocation that follows."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def shard_rows(p, mesh) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of ``p``'s dim 0 that this rank's FSDP2 shard holds: ``torch.chunk``'s split, chunks
    of ``ceil(N / S)`` rows over the ``S`` ranks of the mesh's last (shard) dimension; the last may be short or
    empty."""
    S, r = mesh.size(mesh.ndim - 1), mesh.get_coordinate()[mesh.ndim - 1]
    N = p.shape[0]
    c = -(-N // S)
    lo = min(r * c, N)
    return lo, min(lo + c, N)


def _ckpt_name(kind: str, world: int, rank: int) -> str:
    return f"{kind}_world_size_{world}_rank_{rank}.pt"


class FSDP2Strategy(Strategy):
    @classmethod
    def from_section(cls, section, *, optim, checkpointing, routing_replay, compile) -> dict:
        """verl's keys: the role's ``fsdp_config`` (the critic's and the reward model's under ``model``), its
        ``ulysses_sequence_parallel_size``; whether micro-batches are packed is the plan's (verl's
        ``use_remove_padding``). R3 routing replay is refused at load time for this strategy; ``trainer.compile``
        does not apply (the HF model runs eagerly)."""
        fc = section.get("fsdp_config") or section.model.fsdp_config
        mp = fc.get("mixed_precision") or {}
        wrap = fc.get("wrap_policy") or {}
        return dict(
            optim=optim, model_dtype=fc.model_dtype, param_dtype=mp.get("param_dtype", fc.dtype),
            reduce_dtype=mp.get("reduce_dtype", "fp32"), fsdp_size=int(fc.fsdp_size),
            sp=int(section.get("ulysses_sequence_parallel_size", 1) or 1),
            reshard_after_forward=bool(fc.reshard_after_forward),
            offload_policy=bool(fc.offload_policy or fc.forward_only), param_offload=bool(fc.param_offload),
            optimizer_offload=bool(fc.optimizer_offload), forward_prefetch=bool(fc.forward_prefetch),
            gradient_checkpointing=bool(checkpointing and optim is not None), seed=int(fc.seed),
            wrap_classes=wrap.get("transformer_layer_cls_to_wrap"), entropy_checkpointing=bool(fc.entropy_checkpointing),
            entropy_chunking=bool(fc.entropy_from_logits_with_chunking), full_determinism=bool(fc.full_determinism))

    def __init__(self, *, role: str, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str,
                 optim: dict | None = None, model_dtype: str = "fp32", param_dtype: str = "bfloat16",
                 reduce_dtype: str = "fp32", fsdp_size: int = -1, sp: int = 1, reshard_after_forward: bool = True,
                 offload_policy: bool = False, param_offload: bool = False, optimizer_offload: bool = False,
                 forward_prefetch: bool = False, gradient_checkpointing: bool = False, packed: bool = True,
                 seed: int = 42, wrap_classes=None, entropy_checkpointing: bool = False, entropy_chunking: bool = False,
                 full_determinism: bool = False, hf_overrides: dict | None = None, lora: dict | None = None):
        use_cuda = torch.cuda.is_available()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=rank, world_size=world_size, timeout=timedelta(minutes=30))
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        if sp < 1 or world_size % sp:
            raise ValueError(f"ulysses_sequence_parallel_size={sp} must divide the role's {world_size} ranks")
        torch.manual_seed(seed)
        if full_determinism:  # verl's enable_full_determinism: deterministic kernels only (cuBLAS needs its workspace set)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.entropy_opts = dict(checkpoint=bool(entropy_checkpointing), chunked=bool(entropy_chunking))
        self.role, self.rank, self.world = role, rank, world_size
        self.is_critic = role in ("critic", "reward")  # a reward model reads its score through the value path
        self.packs = bool(packed)
        # Ulysses groups: consecutive ranks (verl's (dp, sp) mesh, sp inner); every rank creates every group
        self.sp, self.sp_group = sp, None
        for d in range(world_size // sp):
            g = dist.new_group(list(range(d * sp, (d + 1) * sp))) if sp > 1 else None
            if d == rank // sp:
                self.sp_group = g
        self.mesh = {"dp_rank": rank // sp, "dp_size": world_size // sp, "tp_rank": 0, "tp_size": 1, "pp_rank": 0,
                     "pp_size": 1, "vpp_size": 1, "cp_rank": rank % sp, "cp_size": sp, "ep_rank": 0, "ep_size": 1}

        dev_type = self.device.type
        if fsdp_size < 0 or fsdp_size >= world_size:
            self.fsdp_mesh = init_device_mesh(dev_type, (world_size,), mesh_dim_names=("fsdp",))
        else:
            if world_size % fsdp_size:
                raise ValueError(f"fsdp_config.fsdp_size={fsdp_size} must divide the role's {world_size} ranks")
            self.fsdp_mesh = init_device_mesh(dev_type, (world_size // fsdp_size, fsdp_size),
                                              mesh_dim_names=("ddp", "fsdp"))

        dtype = precision(model_dtype, "fsdp_config.model_dtype")
        # LoRA (trainer.lora.LoRASettings as a dict) through peft, at the megatron actor's init for the same seed;
        # the model is then loaded whole (peft adds its adapters to a loaded model) and wrapped before sharding
        self.lora = PeftLoRA(LoRASettings(**lora), model_path, hf_overrides) if lora else None
        model, sources = self._empty_model(role, model_path, dtype, hf_overrides) if self.lora is None else (None, None)
        self.read_rows = sources is not None  # each rank read only its own rows of the checkpoint
        if sources is None:  # names or shapes that do not map 1:1 onto the checkpoint: transformers loads it whole
            model = load_hf_model(role, model_path, dtype, hf_overrides, attn_implementation=ATTN_NAME).to(self.device)
        if sp > 1 and model.config.num_attention_heads % sp:
            raise ValueError(f"ulysses_sequence_parallel_size={sp} must divide the model's "
                             f"{model.config.num_attention_heads} attention heads")
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora is not None:
            model = self.lora.apply(model, seed=seed)
        # a forward-only reference keeps its shards in host memory (verl's choice for the reference)
        self.host_shards = bool(offload_policy or optim is None) and use_cuda
        kw = dict(mesh=self.fsdp_mesh, reshard_after_forward=bool(reshard_after_forward),
                  mp_policy=MixedPrecisionPolicy(param_dtype=precision(param_dtype, "fsdp_config.mixed_precision.param_dtype"),
                                                 reduce_dtype=precision(reduce_dtype, "fsdp_config.mixed_precision.reduce_dtype"),
                                                 cast_forward_inputs=True),
                  offload_policy=CPUOffloadPolicy(pin_memory=True) if self.host_shards else None)
        names = wrap_classes or getattr(model, "_no_split_modules", None) or []
        names = [names] if isinstance(names, str) else list(names)
        units = [m for m in model.modules() if type(m).__name__ in names
                 or (isinstance(m, torch.nn.Embedding) and not model.config.tie_word_embeddings)]
        if not any(type(m).__name__ in names for m in units):
            raise ValueError(f"FSDP wrap: no module of class {names} in {type(model).__name__}; set "
                             f"fsdp_config.wrap_policy.transformer_layer_cls_to_wrap to its decoder layer's class")
        for m in units:
            fully_shard(m, **kw)
        fully_shard(model, **kw)
        if sources is not None:  # allocate this rank's shards, then fill them from the checkpoint's rows
            buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
            model.to_empty(device=torch.device("cpu") if self.host_shards else self.device)
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(buffers[n])
            self._load_rows(model, SafetensorsDir(model_path), sources)
        if forward_prefetch:  # each unit also starts the next unit's all-gather (verl's forward_prefetch)
            for a, b in zip(units, units[1:]):
                a.set_modules_to_forward_prefetch([b])
        self.model = model

        # offload between calls (verl's param_offload / optimizer_offload): moves only on an accelerator
        self.param_offload = bool(param_offload) and use_cuda and not self.host_shards
        self.optimizer_offload = bool(optimizer_offload) and use_cuda and not self.host_shards
        self.offloaded_bytes: dict[str, int] = {}
        self._resident = {"params": True, "optimizer": True}
        self.optimizer = self.scheduler = None
        if optim is not None:
            self._make_optimizer(model, optim)
        self.offload_state()

    def _make_optimizer(self, model, optim: dict) -> None:
        self.optim = OptimConfig(**optim)
        if self.optim.optimizer != "adam":
            raise ValueError(f"strategy=fsdp2: optim.optimizer={self.optim.optimizer!r}; FSDP trains with AdamW here")
        groups = param_groups(model, self.optim.weight_decay)  # the trainable parameters (LoRA: the adapters)
        self._optimizer_params = sum(p.numel() for g in groups for p in g["params"])
        self.optimizer = torch.optim.AdamW(groups, lr=self.optim.lr, betas=(self.optim.adam_beta1, self.optim.adam_beta2),
                                           eps=self.optim.adam_eps)
        self.scheduler = make_scheduler(self.optimizer, self.optim)

    # ------------------------------------------------------------------ building: every rank reads its own rows
    def _empty_model(self, role: str, path: str, dtype: torch.dtype, overrides):
        """The role's model with its parameters on the meta device, and where each parameter comes from in the
        checkpoint (its key, or None for a critic's / reward model's head the checkpoint lacks); ``(None, None)``
        when the parameters do not map 1:1 by name and shape onto the checkpoint's tensors (a conversion
        transformers applies at load): then the caller loads it whole."""
        cfg = role_config(role, path, overrides)
        if role == "reward":  # its trained head or nothing (trainer.rewards.reward_model)
            check_score_head(path, cfg.hidden_size)
        with params_on_meta():
            model = model_class(role).from_config(cfg, dtype=dtype, attn_implementation=ATTN_NAME)
        ckpt = SafetensorsDir(path)
        prefix = getattr(model, "base_model_prefix", "") + "."
        sources = {}
        for name, p in model.named_parameters():
            key = name if name in ckpt else name[len(prefix):] if name.startswith(prefix) and name[len(prefix):] in ckpt else None
            if key is None and self.is_critic and name.startswith("score."):
                sources[name] = None  # initialised as load_hf_model initialises it
                continue
            if key is None or tuple(ckpt.spec(key)[0]) != tuple(p.shape):
                return None, None
            sources[name] = key
        return model, sources

    def _load_rows(self, model, ckpt: SafetensorsDir, sources: dict) -> None:
        """Fill each parameter's local shard with its rows of the checkpoint tensor (``safetensors`` slices: no
        rank reads more than its shards), cast to the parameter's dtype."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                local = p.to_local()
                lo, hi = shard_rows(p, self.fsdp_mesh)
                if local.shape[0] != hi - lo:
                    raise RuntimeError(f"{name}: FSDP2 holds {local.shape[0]} rows here, the row plan {hi - lo}")
                if hi == lo:
                    continue
                key = sources[name]
                if key is not None:
                    rows = ckpt.get_rows(key, lo, hi)
                elif name == "score.weight" and self.role == "critic":
                    rows = critic_head_init(p.shape[1], torch.float32)[lo:hi]
                else:  # a head bias the checkpoint lacks: 0
                    rows = torch.zeros((hi - lo, *p.shape[1:]))
                local.copy_(rows.to(local.dtype))

    # ------------------------------------------------------------------ forward
    def _rows(self, mb: dict):
        """A micro-batch as full rows on this device: ``ids``, ``pos`` (position ids), ``seg`` (sequence id per
        position, 0 on pads) and ``valid`` (positions that score a token: not a sequence's first, not a pad)."""
        dev = self.device
        if "cu_seqlens" in mb:  # one packed row of sequences
            ids = mb["input_ids"].to(dev)  # [1, N]
            cu = mb["cu_seqlens"].long().tolist()
            lens = torch.tensor([b - a for a, b in zip(cu, cu[1:])], device=dev)
            seg = torch.repeat_interleave(torch.arange(1, len(lens) + 1, device=dev), lens)[None]  # [1, N]
            starts = torch.repeat_interleave(torch.tensor(cu[:-1], device=dev), lens)
            pos = (torch.arange(ids.shape[1], device=dev) - starts)[None]
            valid = pos > 0
        else:
            ids, am = mb["input_ids"].to(dev), mb["attention_mask"].long().to(dev)  # [b, S]
            seg = am
            pos = (am.cumsum(-1) - 1).clamp_min(0)
            valid = am.bool() & (pos > 0)
        return ids, pos, seg, valid

    def _outputs(self, mb: dict, *, temperature: float, with_entropy: bool, entropy_grad: bool = True,
                 with_sum_pi_squared: bool = False) -> dict:
        ids, pos, seg, valid = self._rows(mb)
        S, P = ids.shape[1], self.sp
        pad = (-S) % P  # the row splits evenly over the Ulysses group
        if pad:
            ids, pos, seg = (torch.nn.functional.pad(t, (0, pad)) for t in (ids, pos, seg))
        nxt = torch.zeros_like(ids)
        nxt[:, :-1] = ids[:, 1:]
        n = ids.shape[1] // P
        lo = (self.rank % P) * n
        set_seq_context(SeqContext(mask=attention_mask(seg), group=self.sp_group, size=P))
        out = self.model(input_ids=ids[:, lo:lo + n], position_ids=pos[:, lo:lo + n], use_cache=False)
        res = next_token_outputs(out.logits, nxt[:, lo:lo + n], critic=self.is_critic, temperature=temperature,
                                 with_entropy=with_entropy, entropy_grad=entropy_grad,
                                 with_sum_pi_squared=with_sum_pi_squared, **self.entropy_opts)
        return {k: align(gather_seq(v, self.sp_group, P)[:, :S], valid) for k, v in res.items()}

    def compute(self, mbs, *, temperature, with_entropy, with_sum_pi_squared=False):
        was = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return [{k: v.float().cpu() for k, v in self._outputs(
                    mb, temperature=temperature, with_entropy=with_entropy,
                    with_sum_pi_squared=with_sum_pi_squared).items()} for mb in mbs]
        finally:
            self.model.train(was)

    def train_step(self, mbs, loss_fn, *, temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = True) -> dict:
        self.model.train()
        total = 0.0
        for mb in mbs:
            outs = self._outputs(mb, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
            loss, _ = loss_fn(outs, {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in mb.items()})
            loss.backward()
            total += float(loss.detach())
        lr = float(self.optimizer.param_groups[0]["lr"])
        params = [p for p in self.model.parameters() if p.grad is not None]
        gn = torch.nn.utils.get_total_norm([p.grad for p in params])
        gn = float(gn.full_tensor() if isinstance(gn, DTensor) else gn)
        skipped = 0.0
        if math.isfinite(gn):
            clip = float(self.optim.clip_grad or 0.0)
            if clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, clip, torch.tensor(gn))
            self.optimizer.step()
        else:  # verl skips the update when the norm is not finite
            skipped = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step(increment=1)
        out = {"loss": total, "grad_norm": gn, "lr": lr, "skipped": skipped}
        if self.lora is not None:
            out.update({f"lora/{k}": v for k, v in PeftLoRA.report(self.model, self._optimizer_params).items()})
        return out

    def reference_policy(self):
        """With LoRA the actor with its adapters off is the reference policy (verl's LoRA reference)."""
        if self.lora is None:
            return super().reference_policy()
        return PeftLoRA.reference(self.model)

    # ------------------------------------------------------------------ weights
    def _read(self, params) -> list[torch.Tensor]:
        """Whole tensors of ``params`` (all-gathered: collective)."""
        return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().to(self.device) for p in params]

    def _tied(self) -> tuple:
        return ("lm_head.weight",) if getattr(self.model.config, "tie_word_embeddings", False) else ()

    @property
    def adapter_sync(self) -> bool:
        """A weight sync moves the LoRA adapters only (``lora.merge=false``), not merged weights."""
        return self.lora is not None and not self.lora.s.merge

    def base_params(self):
        """The base weights (the adapters off) by HF name, collective: the engines' one-time base check."""
        yield from self.lora.weights(self.model, self._read, merged=False, skip=self._tied())

    def hf_params(self):
        """HF names and full tensors, all-gathered one parameter at a time (collective: every rank). With LoRA:
        the adapters in peft's layout (``lora.merge=false``) or the merged weights ``W + (alpha / r) B A``."""
        if self.lora is not None:
            if self.adapter_sync:
                yield from self.lora.adapters(self.model, self._read)
            else:
                yield from self.lora.weights(self.model, self._read, merged=True, skip=self._tied())
            return
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        for name, p in self.model.named_parameters():
            if tied and name == "lm_head.weight":
                continue
            t = p.full_tensor() if isinstance(p, DTensor) else p
            yield name, t.detach().to(self.device)

    def reshard_blocks(self) -> list | None:
        """This rank's rows of each HF tensor: FSDP2 shards dim 0 in ``torch.chunk``'s way (chunks of ``ceil(N / S)``
        rows over the ``S`` ranks of the shard dimension; the last ones may be short or empty), and a shard is a
        contiguous row block of the HF tensor, written by the shard-group's replica 0 only (hybrid sharding keeps
        identical copies on the other replicas)."""
        if self.lora is not None:  # a LoRA sync streams adapters or merged weights, computed at each sync
            return None
        coords = self.fsdp_mesh.get_coordinate()
        if coords is None or any(c != 0 for c in coords[:-1]):
            return []
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        blocks = []
        for name, p in self.model.named_parameters():
            if tied and name == "lm_head.weight":
                continue
            if not isinstance(p, DTensor):
                return None
            local = p.to_local()
            if p.device.type != "cpu" or not local.is_contiguous():
                return None
            lo, hi = shard_rows(p, self.fsdp_mesh)
            if local.shape[0] != hi - lo:  # not the chunking this plan assumes: let the transports gather
                return None
            if hi > lo:
                cols = p.numel() // p.shape[0]
                blocks.append(Block(hf_name=name, hf_shape=tuple(p.shape), rows=(lo, hi), cols=(0, cols), param=name,
                                    offset=0, row_stride=cols))
        return blocks

    def local_param(self, ref: str) -> torch.Tensor:
        p = dict(self.model.named_parameters())[ref]
        return p.to_local() if isinstance(p, DTensor) else p

    # ------------------------------------------------------------------ checkpoints (verl's FSDP layout)
    def _files(self, ckpt_dir: str) -> dict:
        return {k: os.path.join(ckpt_dir, _ckpt_name(k, self.world, self.rank)) for k in ("model", "optim", "extra_state")}

    def save(self, ckpt_dir: str, extra: dict | None = None) -> str:
        os.makedirs(ckpt_dir, exist_ok=True)
        f = self._files(ckpt_dir)
        # with LoRA the adapters only: the frozen base is model.path's, loaded at start
        torch.save({n: p.to_local().detach().cpu().clone() for n, p in self.model.named_parameters()
                    if self.lora is None or is_adapter_name(n)}, f["model"])
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            sd["state"] = {i: {k: (v.to_local() if isinstance(v, DTensor) else v).detach().cpu().clone()
                               for k, v in st.items()} for i, st in sd["state"].items()}
            torch.save(sd, f["optim"])
            torch.save({"scheduler": self.scheduler.state_dict()}, f["extra_state"])
        return ckpt_dir

    def load(self, ckpt_dir: str, contents=("model", "optimizer", "extra")) -> dict:
        f = self._files(ckpt_dir)
        if not os.path.exists(f["model"]):
            found = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("model_world_size_")) if os.path.isdir(ckpt_dir) else []
            raise FileNotFoundError(
                f"{ckpt_dir} holds no FSDP shard for rank {self.rank} of {self.world} ({os.path.basename(f['model'])}); "
                + (f"it holds {found[:3]}: resume with the world size that saved it" if found else
                   "it was saved by another strategy: resume with the strategy that saved it"))
        state = torch.load(f["model"], map_location="cpu", weights_only=True)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if self.lora is not None and not is_adapter_name(n):
                    continue  # the frozen base, as loaded from model.path
                local = p.to_local() if isinstance(p, DTensor) else p
                if n not in state or state[n].shape != local.shape:
                    raise ValueError(f"{f['model']}: parameter {n} is missing or has another shape; the checkpoint "
                                     f"is of another model or sharding")
                local.copy_(state[n])
        if self.optimizer is None:
            return {}
        if "optimizer" in contents:
            sd = torch.load(f["optim"], map_location="cpu", weights_only=True)
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            for i, st in sd["state"].items():
                p = params[int(i)]
                for k, v in list(st.items()):
                    if isinstance(p, DTensor) and v.dim() > 0:  # Adam moments: this rank's shard, back as a DTensor
                        st[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape,
                                                   stride=p.stride(), run_check=False)
            self.optimizer.load_state_dict(sd)
        if "extra" in contents:
            self.scheduler.load_state_dict(torch.load(f["extra_state"], map_location="cpu", weights_only=True)["scheduler"])
        return {}

    def export_hf(self, out_dir: str, source_dir: str | None = None) -> str | None:
        """A HF directory written by rank 0 (every rank takes part in the gathers)."""
        writer = self.rank == 0
        state = {}
        weights = (self.lora.weights(self.model, self._read, merged=True, skip=self._tied()) if self.lora is not None
                   else self.hf_params())
        for n, t in weights:
            if writer:
                state[n] = t.cpu().contiguous()
        adapters = dict(self.lora.adapters(self.model, self._read)) if self.lora is not None else {}
        if writer:
            write_hf_dir(state, self.model.config, out_dir, source_dir)
            if self.lora is not None:
                self.lora.write_adapter_dir(os.path.join(out_dir, ADAPTER_DIR), adapters, source_dir)
        dist.barrier()
        return out_dir if writer else None

    # ------------------------------------------------------------------ offload between calls
    def _optim_tensors(self):
        if self.optimizer is None:
            return []
        return [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]

    def _move(self, part: str, device) -> int:
        moved = 0
        if part == "params":
            for p in self.model.parameters():
                moved += p.numel() * p.element_size()
            self.model.to(device)
        else:
            for st in (self.optimizer.state.values() if self.optimizer is not None else []):
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        st[k] = v.to(device)
                        moved += v.numel() * v.element_size()
        return moved

    def load_state(self, parts) -> None:
        for part, on in (("params", self.param_offload), ("optimizer", self.optimizer_offload)):
            if on and part in parts and not self._resident[part]:
                self._move(part, self.device)
                self._resident[part] = True

    def offload_state(self) -> None:
        for part, on in (("params", self.param_offload), ("optimizer", self.optimizer_offload)):
            if on and self._resident[part]:
                n = self._move(part, "cpu")
                if n:
                    self.offloaded_bytes[part] = n
                self._resident[part] = False

    def offload_status(self) -> dict:
        """Per part that offloads (``param_offload`` / ``optimizer_offload``, on an accelerator): whether it is in
        host memory now, the bytes it moved the last time, and the bytes it holds on the accelerator right now
        (0 while offloaded). On a CPU device no part offloads: everything is host memory already."""
        on = {"params": self.param_offload, "optimizer": self.optimizer_offload}
        tensors = {"params": list(self.model.parameters()), "optimizer": self._optim_tensors()}
        return {"offloaded": {k: not self._resident[k] for k, v in on.items() if v},
                "bytes": dict(self.offloaded_bytes),
                "resident": {k: sum(t.numel() * t.element_size() for t in tensors[k] if t.device.type != "cpu")
                             for k, v in on.items() if v}}
