"""Train step on megatron-core: micro-batches through ``get_forward_backward_func``, DDP, optimizer.

The bridge knows nothing about RL. The caller passes ``loss_fn(outputs, micro_batch) -> (loss,
metrics)``; ``outputs`` holds per-token ``logprobs`` (+ ``entropy``) for a policy, or ``values`` for a
critic, aligned with ``micro_batch["input_ids"]`` as described in :mod:`megatron_bridge.logprobs`.

Loss convention (read this before writing ``loss_fn``): the gradient taken is that of

    L = mean over data-parallel ranks of ( sum over this rank's micro-batches of loss_fn(...)[0] )

i.e. micro-batch losses are **summed**, not averaged: ``loss_fn`` owns the normalisation (for a
token-mean over the whole mini-batch, divide each micro-batch's token sum by the mini-batch's
total token count). megatron's schedule divides every micro-batch loss by the number of
micro-batches; the step multiplies it back. The data-parallel mean is megatron DDP's gradient
average.

Gradient clipping is done here, not by megatron's ``clip_grad`` (whose CPU path needs a hack): the
squared L2 norm is summed over this rank's gradient shards, skipping tensor-parallel duplicates and
the tied output copy, then all-reduced over the optimizer's grad-stats group (tensor x pipeline
parallel ranks; the whole world under the distributed optimizer, whose shards are disjoint across
data-parallel ranks). All gradients are scaled by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_``.

Optimizers are megatron's: ``adam`` (torch AdamW semantics: decoupled weight decay) and ``sgd``.
LR schedule: megatron's ``OptimizerParamScheduler`` with linear warmup from 0 to ``lr`` over
``lr_warmup_steps``, then ``constant``, ``cosine`` or ``linear`` decay to ``min_lr`` at
``lr_decay_steps``. The distributed optimizer needs reduce-scatter, which gloo lacks, so on CPU it
falls back to the plain optimizer with a warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megatron_bridge.logprobs import batch_to, head_outputs, model_device, model_inputs, run_model, schedule_args
from megatron_bridge.model import chunks
from megatron_bridge import cpu_shims

LossFn = Callable[[dict, dict], "tuple[torch.Tensor, dict]"]


@dataclass
class OptimConfig:
    optimizer: str = "adam"  # "adam" (AdamW) or "sgd"
    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # floor of cosine / linear decay
    weight_decay: float = 0.0  # decoupled weight decay
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    clip_grad: float = 1.0  # max global L2 norm; 0 disables clipping (the norm is still reported)
    lr_schedule: str = "constant"  # "constant" | "cosine" | "linear"
    lr_warmup_steps: int = 0  # linear warmup from lr_warmup_init to lr
    lr_warmup_init: float = 0.0  # learning rate at step 0 of the warmup
    lr_decay_steps: int | None = None  # step at which decay reaches min_lr (default: warmup + 1)
    use_distributed_optimizer: bool = False  # shard optimizer state over data parallel (GPU/nccl)
    overrides: dict = field(default_factory=dict)  # further megatron-core OptimizerConfig fields, as given


@dataclass
class Trainer:
    """What a train step needs, bundled: DDP-wrapped model chunk, optimizer, LR scheduler."""

    model: object  # megatron DistributedDataParallel around a BridgeGPTModel (a list of them: one per virtual stage)
    optimizer: object
    scheduler: object
    optim: OptimConfig
    step: int = 0


def _dist_optimizer_ok(requested: bool) -> bool:
    if requested and dist.get_backend() == "gloo":
        warnings.warn("distributed optimizer needs reduce-scatter, which gloo lacks: using the plain optimizer")
        return False
    return requested


def make_trainer(model, optim: OptimConfig) -> Trainer:
    """Wrap a freshly built (and loaded) model (one chunk, or the chunk list of virtual pipeline
    stages) in megatron DDP and build optimizer + schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer



    cpu_shims.install()
    cs = chunks(model)
    cfg = cs[0].config  # one TransformerConfig shared by the chunks
    use_dist = _dist_optimizer_ok(optim.use_distributed_optimizer)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_dist,
        bucket_size=None)
    # megatron's convention: only the first chunk's buffers are bucketed
    ddps = [DistributedDataParallel(cfg, ddp_cfg, c, disable_bucketing=i > 0) for i, c in enumerate(cs)]
    ocfg = OptimizerConfig(
        optimizer=optim.optimizer, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        sgd_momentum=optim.sgd_momentum, clip_grad=0.0,  # clipping is ours (see module docstring)
        bf16=cfg.bf16, fp16=cfg.fp16, params_dtype=cfg.params_dtype, use_distributed_optimizer=use_dist,
        **optim.overrides)
    with cpu_shims.cuda_type_names():  # bf16/fp16 on CPU: megatron's type check wants CUDA names
        opt = get_megatron_optimizer(ocfg, ddps)
    _use_fused_adam(opt)
    cfg.no_sync_func = ddps[0].no_sync if len(ddps) == 1 else [d.no_sync for d in ddps]
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.grad_scale_func = opt.scale_loss
    sched = make_scheduler(opt, optim)
    return Trainer(ddps[0] if not isinstance(model, (list, tuple)) else ddps, opt, sched, optim)


def _use_fused_adam(optimizer) -> None:
    """Switch megatron's fallback ``torch.optim.AdamW`` (built when TE / apex are absent, as on CPU)
    to torch's fused multi-tensor kernel: the same update rule in one kernel per step instead of
    ~10 ops per parameter (timing: ``benchmarks/bench_e2e.py``, History). Other optimizers (TE / apex
    FusedAdam, SGD) stay."""
    for o in optimizers(optimizer):
        inner = getattr(o, "optimizer", None)
        if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        # contiguous only: the fused kernel pairs a strided parameter's elements with the wrong gradients (seen
        # with torch 2.13 on CPU; megatron_bridge.lora's factors are contiguous copies for this reason)
        if params and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() and p.is_contiguous()
                          for p in params):
            inner.defaults.update(fused=True, foreach=False)
            for g in inner.param_groups:
                g.update(fused=True, foreach=False)


def make_scheduler(opt, optim: OptimConfig):
    """megatron's OptimizerParamScheduler: warmup 0 -> lr, then constant / cosine / linear to min_lr."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warm = optim.lr_warmup_steps
    decay = optim.lr_decay_steps if optim.lr_decay_steps is not None else warm + 1
    decay = max(decay, warm + 1)
    style = {"constant": "constant", "cosine": "cosine", "linear": "linear"}[optim.lr_schedule]
    return OptimizerParamScheduler(
        opt, init_lr=optim.lr_warmup_init if warm else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=warm, lr_decay_steps=decay, lr_decay_style=style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay, wd_incr_style="constant")


def optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@torch.no_grad()
def clip_grad_norm(optimizer, max_norm: float) -> float:
    """Global L2 grad norm over all model-parallel shards; scale grads down to ``max_norm``. Each
    optimizer of a chain (dense parameters; mixture-of-experts expert parameters) sums its squares
    over its own grad-stats group (its shards are disjoint there), and the totals add up."""
    opts = [o for o in optimizers(optimizer) if not getattr(o, "is_stub_optimizer", False)]
    total = 0.0
    params = []
    for o in opts:
        sq = torch.zeros((), dtype=torch.float32)
        for g in o.get_main_grads_for_grad_norm():  # skips TP duplicates and the tied output copy
            sq += g.detach().float().pow(2).sum().cpu()
        ps_ = o.get_parameters()
        params += ps_
        group = o.get_grad_stats_parallel_group()
        if group is None:
            from megatron.core import parallel_state as ps

            group = ps.get_model_parallel_group()
        sq = sq.to(ps_[0].device if ps_ else torch.device("cpu"))
        dist.all_reduce(sq, group=group)
        total += float(sq)
    norm = total ** 0.5
    if max_norm > 0 and norm > max_norm:
        coeff = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coeff)
    return norm


def _last_stage_broadcast_object(obj):
    """Send a picklable object from the last pipeline stage to every stage (same TP/DP coordinates)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    buf = [obj]
    dist.broadcast_object_list(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return buf[0]


def _reduce_metrics(per_mb: list[dict]) -> dict:
    out = {}
    if not per_mb:
        return out
    for k in per_mb[0]:
        vals = [float(d[k]) for d in per_mb]
        out[k] = sum(vals) if k == "loss" else sum(vals) / len(vals)
    return out


def forward_backward(model, micro_batches: list[dict], loss_fn: LossFn, *, temperature: float = 1.0,
                     with_entropy: bool = False, entropy_grad: bool = True, forward_only: bool = False) -> dict:
    """Run the schedule over micro-batches; returns the metrics dict (on every pipeline stage).
    ``entropy_grad=False``: the ``entropy`` output is computed without autograd (a metric only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func


    cpu_shims.install()  # this thread may not be the one that built the model (threaded Ray actors)
    n = len(micro_batches)
    device = model_device(model)
    inputs = [(batch_to(mb, device), model_inputs(mb).to(device)) for mb in micro_batches]

    def step(data_iterator, mdl):
        mb, inp = next(data_iterator)
        out = run_model(mdl, inp)

        def loss_func(output):
            outs = head_outputs(mdl, output, inp, temperature=temperature, with_entropy=with_entropy,
                                entropy_grad=entropy_grad)
            loss, metrics = loss_fn(outs, mb)
            reported = {"loss": loss.detach().float()}
            reported.update({k: torch.as_tensor(v).detach().float() for k, v in (metrics or {}).items()})
            # megatron divides by n; undo it so micro-batch losses add up (module docstring)
            return loss * n, reported

        return out, loss_func

    S = max(i.input_ids.shape[1] for _, i in inputs)
    B = max(i.input_ids.shape[0] for _, i in inputs)
    res = get_forward_backward_func()(
        forward_step_func=step, **schedule_args(model, inputs, [i for _, i in inputs], seq_length=S, micro_batch_size=B),
        num_microbatches=n, forward_only=forward_only)
    return _last_stage_broadcast_object(_reduce_metrics(res or []))


def train_step(trainer: Trainer, micro_batches: list[dict], loss_fn: LossFn, *, temperature: float = 1.0,
               with_entropy: bool = False, entropy_grad: bool = True) -> dict:
    """One optimizer step over ``micro_batches``; returns ``loss``, metric means, ``grad_norm``, ``lr``."""


    cpu_shims.install()
    ddp, opt = trainer.model, trainer.optimizer
    for d in chunks(ddp):
        d.train()
        d.zero_grad_buffer()
    opt.zero_grad()
    metrics = forward_backward(ddp, micro_batches, loss_fn, temperature=temperature, with_entropy=with_entropy,
                               entropy_grad=entropy_grad)
    found_inf = opt.prepare_grads()
    if found_inf:
        metrics.update(grad_norm=float("nan"), skipped=1.0, lr=_lr(opt))
        return metrics
    gnorm = clip_grad_norm(opt, trainer.optim.clip_grad)
    ok = opt.step_with_ready_grads()
    lr = _lr(opt)
    trainer.scheduler.step(increment=1)
    trainer.step += 1
    metrics.update(grad_norm=gnorm, lr=lr, skipped=0.0 if ok else 1.0)
    return metrics


def _lr(opt) -> float:
    return float(opt.param_groups[0]["lr"])
