"""Model FLOPs utilisation (MFU): ``perf/mfu/actor``, ``perf/mfu/actor_infer``, ``perf/mfu/ref`` and
``perf/mfu/critic``, verl's names.

MFU = the model's FLOPs for the pass (counted from the architecture and the batch's sequence lengths,
:func:`model_flops`) / (the pass's wall time x the role's devices x one device's peak). The FLOPs are
the model's, not the hardware's: recomputed activations (``recompute_*``) are not counted, so turning
recompute on lowers the figure, as in PaLM's definition.

The peak: on GPU the vendor's dense (no sparsity) figure for the role's dtype from :data:`GPU_PEAK_TFLOPS`,
looked up by the device name the workers report; on CPU there is no such figure, so the driver times
a square matmul once at start-up in both operand layouts (:func:`measure_cpu_peak`) and that measured rate is the peak (logged
as the parameter ``perf/peak_tflops`` with ``perf/peak_source``). A CPU MFU therefore says how close
the pass comes to this machine's own best matmul, not to a datasheet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from trainer.hf_io import ArchConfig

# Dense peak TFLOP/s per device by (name fragment, dtype): the vendors' datasheets, without 2:4
# sparsity. "float32" is the plain FP32 (no TF32) figure. The first fragment found in the device
# name wins, so the longer names come first.
GPU_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0}),
    ("H100", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("H800", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    ("H20", {"bfloat16": 148.0, "float16": 148.0, "float32": 44.0}),
    ("B200", {"bfloat16": 2250.0, "float16": 2250.0, "float32": 80.0}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("A800", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6}),
    ("A10", {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2}),
    ("V100", {"float16": 125.0, "float32": 15.7}),
]


def matmul_params(arch: ArchConfig, *, value_head: bool = False) -> int:
    """The weights one token multiplies through (the N of 6N): per layer the q, k, v and o projections
    and the MLP (SwiGLU: gate, up, down; a MoE layer: the router, the ``experts_per_token`` routed
    experts the token visits and the shared expert with its gate), then the output layer (the LM
    head, ``hidden x vocab``, or a critic's value head, ``hidden x 1``). Not counted: the embedding
    (a lookup, no multiply), norms and biases (O(hidden) per token, under 0.1% at any real size)."""
    h, hd = arch.hidden_size, arch.head_dim
    attn = h * arch.num_heads * hd * 2 + h * arch.num_kv_heads * hd * 2  # q and o; k and v
    if arch.is_moe:
        mlp = h * arch.num_experts + arch.experts_per_token * 3 * h * arch.moe_intermediate_size
        if arch.shared_expert_intermediate_size:
            mlp += 3 * h * arch.shared_expert_intermediate_size + h  # the shared expert and its sigmoid gate
    else:
        mlp = 3 * h * arch.intermediate_size
    head = h if value_head else h * arch.vocab_size
    return arch.num_layers * (attn + mlp) + head


def model_flops(arch: ArchConfig, seqlens: Iterable[int], *, backward: bool = True, value_head: bool = False) -> float:
    """The model FLOPs of one pass over sequences of the given lengths.

    Formula (PaLM, Chowdhery et al. 2022, Appendix B; the same count as Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 5.1):
    training costs ``6 N + 12 L H Q T`` FLOPs per token, where N is the number of weights the token
    multiplies through (:func:`matmul_params`; for a MoE model the active ones), L the layers, H the
    query heads, Q the head dimension and T the sequence length. 6N: a multiply-add (2 FLOPs) per
    weight forward and twice that backward; 12 L H Q T: the attention scores (Q K^T) and the weighted
    sum (A V), 2 x 2 L H Q T forward, three times that with the backward, counted over the full
    T x T square as PaLM does (causal masking is not subtracted). Summed over a batch of
    sequences: ``6 N sum(T) + 12 L H Q sum(T^2)``. ``backward=False`` (a log-prob or value forward):
    one third of it, ``2 N sum(T) + 4 L H Q sum(T^2)``."""
    lens = [int(t) for t in seqlens]
    n = matmul_params(arch, value_head=value_head)
    attn = arch.num_layers * arch.num_heads * arch.head_dim
    fwd = 2.0 * n * sum(lens) + 4.0 * attn * sum(t * t for t in lens)
    return 3.0 * fwd if backward else fwd


def gpu_peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    """The datasheet's dense peak of ``device_name`` (``torch.cuda.get_device_name()``) for ``dtype``,
    or None for a device (or dtype) the table does not list."""
    for frag, peaks in GPU_PEAK_TFLOPS:
        if frag.lower() in device_name.lower():
            return peaks.get(dtype)
    return None


def measure_cpu_peak(dtype: torch.dtype = torch.float32, threads: Optional[int] = None, size: int = 1024,
                     repeats: int = 5) -> float:
    """This CPU's matmul rate in TFLOP/s: the best of ``repeats`` timings of one ``size`` x ``size``
    matmul in ``dtype`` (2 size^3 FLOPs each) on ``threads`` intra-op threads (None: torch's current
    setting; restored afterwards). The best, not the mean: the peak is what the machine can do, and a
    shared machine's slow runs say nothing about that. Tens of milliseconds in fp32."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _time_matmul(dtype, size, repeats)
    finally:
        torch.set_num_threads(before)


def _time_matmul(dtype: torch.dtype, size: int, repeats: int, probe: int = 256, budget_s: float = 0.3) -> float:
    """The rate of the faster operand layout: ``a @ b`` or ``a @ b.T`` (``nn.Linear``'s, the layout of every
    weight product in a model). torch's CPU kernels differ by layout: on an AVX2 machine without bf16
    instructions the bf16 ``a @ b`` ran at 0.8 GFLOP/s and ``a @ b.T`` at 7 GFLOP/s, so a peak from one layout
    alone put a model's train step at 184% MFU (gpu_check's CPU rehearsal failed on it). The layout is chosen on
    ``probe``-sized products (milliseconds) and only the faster one is timed at ``size``: timing the slow bf16
    layout at 1024 cost such a machine 15 s of every bf16 run's start-up. The faster layout is timed at half of
    ``size`` first, and at ``size`` only when that fits ``budget_s`` (8x the half-size time per product): on that
    machine (AMD EPYC, no bf16 instructions) bf16 at 1024 took 1.35 s for a rate 8% above 512's (0.0105 against
    0.0097 TFLOP/s; fp32 2% above), about a tenth of every tiny run's wall time, so there the half-size rate is
    the peak."""
    half = max(size // 2, 1)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    n = min(probe, size)

    def best_time(x, y, times):
        torch.matmul(x, y)  # warm-up: the first call allocates and picks the kernel
        best = float("inf")
        for _ in range(times):
            t0 = time.perf_counter()
            torch.matmul(x, y)
            best = min(best, time.perf_counter() - t0)
        return best

    small_a, small_b = a[:n, :n].contiguous(), b[:n, :n].contiguous()
    transposed = best_time(small_a, small_b.t(), 2) < best_time(small_a, small_b, 2)
    half_a, half_b = a[:half, :half].contiguous(), b[:half, :half].contiguous()
    t_half = best_time(half_a, half_b.t() if transposed else half_b, repeats)
    if 8 * t_half * (repeats + 1) > budget_s:
        return 2.0 * half ** 3 / t_half / 1e12
    return 2.0 * size ** 3 / best_time(a, b.t() if transposed else b, repeats) / 1e12


def mfu(flops: float, seconds: float, n_devices: int, peak_tflops: float) -> Optional[float]:
    """``flops / (seconds x n_devices x peak)``; None when the pass did not run (no time) or no peak."""
    if seconds <= 0 or not peak_tflops or n_devices < 1:
        return None
    return flops / (seconds * n_devices * peak_tflops * 1e12)


@dataclass(frozen=True)
class PassCost:
    """One timed pass of a role: its metric (``perf/mfu/<name>``), the ``timing_s/*`` key that times
    it, the model, the devices it runs on, and how many passes over the batch it makes."""

    name: str  # actor | actor_infer | ref | critic
    timing: str  # update_actor | old_log_prob | ref | update_critic
    arch: ArchConfig
    n_devices: int
    peak_tflops: float
    backward: bool = True
    epochs: int = 1  # ppo_epochs of an update
    value_head: bool = False  # the critic: a hidden x 1 head instead of the LM head


def mfu_metrics(passes: Iterable[PassCost], timings: dict, seqlens: list[int]) -> dict[str, float]:
    """``perf/mfu/<name>`` for each pass that ran this step (its ``timing_s/<timing>`` is in ``timings``)."""
    out = {}
    for p in passes:
        t = timings.get(f"timing_s/{p.timing}")
        if t is None:
            continue
        flops = p.epochs * model_flops(p.arch, seqlens, backward=p.backward, value_head=p.value_head)
        v = mfu(flops, t, p.n_devices, p.peak_tflops)
        if v is not None:
            out[f"perf/mfu/{p.name}"] = v
    return out


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# verl's precision spellings (fsdp_config) -> the names above
_PRECISION_NAMES = {"fp32": "float32", "32": "float32", "bf16": "bfloat16", "fp16": "float16", "16": "float16"}


def role_dtype(section) -> str:
    """The compute dtype of a role's config section: ``deepspeed_config.dtype`` (falling back to
    ``megatron.dtype``) under the DeepSpeed strategy; FSDP's mixed-precision ``param_dtype`` (else
    ``fsdp_config.dtype``) under fsdp / fsdp2 (the critic's and RM's fsdp_config sit under ``model``); else
    ``megatron.dtype``."""
    strategy = section.get("strategy")
    if strategy == "deepspeed" and section.deepspeed_config.dtype:
        return str(section.deepspeed_config.dtype)
    if strategy in ("fsdp", "fsdp2"):
        fc = section.get("fsdp_config") or section.model.fsdp_config
        name = str((fc.get("mixed_precision") or {}).get("param_dtype", fc.dtype))
        return _PRECISION_NAMES.get(name, name)
    return str(section.megatron.dtype)


class PeakTable:
    """One device's peak per dtype: the datasheet's on GPU, measured on CPU (once per dtype, at the
    first ask: start-up). ``params`` holds what was used, for the trackers (``perf/peak_tflops/<dtype>``,
    ``perf/peak_source``)."""

    def __init__(self, device_name: str, cpu_threads: int):
        self.device_name, self.cpu_threads = device_name, cpu_threads
        self.params: dict[str, str] = {}
        self._peaks: dict[str, Optional[float]] = {}

    def __call__(self, dtype: str) -> Optional[float]:
        if dtype not in self._peaks:
            if self.device_name == "cpu":
                peak = measure_cpu_peak(_TORCH_DTYPES[dtype], threads=self.cpu_threads)
                self.params["perf/peak_source"] = (f"measured at start-up: the best 1024x1024 matmul on "
                                                   f"{self.cpu_threads} CPU thread(s), one rank slot's share")
            else:
                peak = gpu_peak_tflops(self.device_name, dtype)
                self.params["perf/peak_source"] = f"datasheet (dense) of {self.device_name}"
            self._peaks[dtype] = peak
            if peak is not None:
                self.params[f"perf/peak_tflops/{dtype}"] = f"{peak:.6g}"
        return self._peaks[dtype]


def role_passes(cfg, cluster, plan, peaks: PeakTable) -> list[PassCost]:
    """The timed passes of the run's roles (``cluster``: trainer.workers.cluster.Cluster): the actor's
    update and old-log-prob forward, the reference forward, the critic's update. A role whose device
    has no known peak is left out (the caller says so)."""
    arf = cfg.actor_rollout_ref
    actor_arch = ArchConfig.from_pretrained(arf.model.path)
    out = []
    a_peak = peaks(role_dtype(arf.actor))
    if a_peak:
        epochs = plan.actor_update.epochs
        out += [PassCost("actor", "update_actor", actor_arch, cluster.actor.size, a_peak, epochs=epochs),
                PassCost("actor_infer", "old_log_prob", actor_arch, cluster.actor.size, a_peak, backward=False)]
    if cluster.ref is not None and (r_peak := peaks(role_dtype(arf.ref))):
        out.append(PassCost("ref", "ref", actor_arch, cluster.ref.size, r_peak, backward=False))
    if cluster.critic is not None and (c_peak := peaks(role_dtype(cfg.critic))):
        c_arch = ArchConfig.from_pretrained(cfg.critic.model.path or arf.model.path)
        out.append(PassCost("critic", "update_critic", c_arch, cluster.critic.size, c_peak,
                            epochs=plan.critic_update.epochs, value_head=True))
    return out
