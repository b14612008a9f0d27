"""Hugging Face checkpoint I/O shared by the trainer (megatron bridge) and the rollout engines.

One reader per thing a local HF model directory holds, so that a checkpoint the engine loads is one
the trainer loads, and the two stop on the same tokens:

* ``config.json`` -> :class:`ArchConfig` (:func:`read_config`): a Llama / Qwen2 / Qwen3 decoder,

      h   = x + o_proj(Attn(rope(norm_q(q_proj(n1(x)))), rope(norm_k(k_proj(n1(x)))), v_proj(n1(x))))
      out = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))          (pre-norm RMSNorm, SwiGLU)

  with any GQA ratio, Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm, Llama's
  ``attention_bias`` / ``mlp_bias``; and their mixture-of-experts twins ``qwen3_moe`` / ``qwen2_moe``,
  whose MLP is a router over ``E`` SwiGLU experts (Shazeer et al. 2017, "Outrageously Large Neural
  Networks", arXiv:1701.06538; Qwen3 / Qwen2-MoE technical reports):

      p   = softmax(W_router n2(h))                                        (fp32, over the E experts)
      S   = top-k(p);  w_e = p_e, renormalised to sum 1 over S when norm_topk_prob
      out = h + sum_{e in S} w_e SwiGLU_e(n2(h)) [+ sigmoid(g . n2(h)) SwiGLU_shared(n2(h))  (qwen2_moe)]

  every layer MoE (``mlp_only_layers`` empty, ``decoder_sparse_step`` 1, as the released models). Field names of transformers v4 (``rope_theta`` +
  ``rope_scaling``) and v5 (``rope_parameters``, also per layer type) are both read.
* ``*.safetensors`` (:class:`SafetensorsDir`, :func:`iter_safetensors`): one ``model.safetensors``,
  several files, or shards listed by ``model.safetensors.index.json`` (the index is authoritative).
  Nothing else is read: ``pytorch_model*.bin`` is refused with the command that converts it.
* stop tokens (:func:`stop_token_ids`): the union of the tokenizer's EOS, ``generation_config.json``'s
  and ``config.json``'s ``eos_token_id``.

RoPE (:func:`rope_inv_freq`). Rotary position embedding (Su et al. 2021, "RoFormer: Enhanced
Transformer with Rotary Position Embedding", arXiv:2104.09864) rotates the pair of q/k channels
``(i, i + d/2)`` (HF's "rotate_half" layout) of the token at position ``p`` by the angle
``p * inv_freq_i``, ``i = 0 .. d/2 - 1``, ``d = head_dim``, with

    default:  inv_freq_i = theta ** (-2i / d)
    linear:   inv_freq_i = theta ** (-2i / d) / factor
              (position interpolation: Chen et al. 2023, "Extending Context Window of Large Language
              Models via Positional Interpolation", arXiv:2306.15595)
    llama3:   per wavelength w_i = 2 pi / inv_i, L = original_max_position_embeddings:
              w_i > L / low_freq_factor  -> inv_i / factor             (long wavelengths interpolated)
              w_i < L / high_freq_factor -> inv_i                      (short ones kept)
              otherwise                  -> (1 - s) inv_i / factor + s inv_i,
                                            s = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)
              (the frequency-dependent interpolation released with Llama 3.1, Grattafiori et al. 2024,
              "The Llama 3 Herd of Models", arXiv:2407.21783; an instance of the "NTK-by-parts" idea of
              Peng et al. 2023, "YaRN", arXiv:2309.00071, without YaRN's attention temperature)

computed in float32 in the order ``transformers`` (``modeling_rope_utils``) uses, so the tables are
bit-identical to the HF models'. None of these types scales the attention logits.

Refused (:class:`UnsupportedConfig`, naming the field, the value and what to do), because neither
the engine nor the bridge computes them: a ``model_type`` other than llama / qwen2 / qwen3; an
activation other than silu; sliding-window attention (``use_sliding_window`` or a ``layer_types``
entry other than ``full_attention``); RoPE types other than the three above (dynamic / yarn /
longrope change the attention scale or depend on the sequence length) or with missing parameters;
``partial_rotary_factor != 1``; quantized checkpoints (``quantization_config``); head counts that do
not divide. A consumer may refuse more on top (the bridge: biases megatron cannot place, see
:func:`megatron_bridge.hf_config.read_hf_config`).

A leaf module: stdlib, torch and safetensors only (transformers is never needed), so both the
megatron bridge and the engines import it.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_REQUIRED = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
INDEX_FILE = "model.safetensors.index.json"


class UnsupportedConfig(NotImplementedError, ValueError):
    """A ``config.json`` asks for something this code does not compute. Both a ``ValueError`` (a bad
    input) and a ``NotImplementedError`` (a missing feature), so either ``except`` catches it."""


def _refuse(msg: str) -> UnsupportedConfig:
    return UnsupportedConfig(f"config.json: {msg}")


# --------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------
def load_config_json(src: str | os.PathLike) -> dict:
    """The raw ``config.json`` dict of a model directory (or of a path to the file itself)."""
    path = os.path.join(src, "config.json") if os.path.isdir(src) else os.fspath(src)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: a Hugging Face model directory needs a config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# verl's ``*.model.override_config``: the config.json fields a run may override. Each is read by this
# module, so the megatron bridge, the native engine and the perf counter see the same value; the
# DeepSpeed strategy and SGLang get the same dict (transformers' and SGLang's own readers). Fields that
# size a weight (hidden_size, num_hidden_layers, vocab_size, ...) would not fit the checkpoint, and
# fields nothing here reads would change nothing: both are refused.
OVERRIDABLE_FIELDS = {
    "max_position_embeddings": "the context length the RoPE tables (and llama3 scaling's original length) are built for",
    "rope_theta": "the RoPE base",
    "rope_scaling": "RoPE scaling: a dict with rope_type (default | linear | llama3) and its parameters",
    "attention_dropout": "dropout on the attention probabilities while training (the DeepSpeed strategy's transformers model)",
    "rms_norm_eps": "the RMSNorm epsilon",
}


# Dropout probabilities of other architectures (GPT-2 / Phi names) that verl's DAPO recipe sets to 0 "to be
# sure": the Llama / Qwen2 / Qwen3 decoders built here have no such dropout, so 0 is exactly what runs and is
# accepted (and written nowhere); any other value would ask for a dropout that does not exist, and is refused.
ZERO_ONLY_FIELDS = {"embd_pdrop": "embedding dropout", "resid_pdrop": "residual dropout"}


def override_fields(override) -> dict:
    """The HF fields of a verl ``override_config`` dict: its top-level fields and those of its
    ``model_config`` sub-dict (verl's megatron workers read that one), which win on a clash.
    ``moe_config.freeze_moe_router`` is not a field (see :func:`override_errors`), nor is a zero
    :data:`ZERO_ONLY_FIELDS` probability."""
    ov = {k: v for k, v in dict(override or {}).items() if k not in ("model_config", "moe_config")}
    ov.update(dict((override or {}).get("model_config") or {}))
    return {k: v for k, v in ov.items() if k not in ZERO_ONLY_FIELDS}


def override_errors(override, key: str) -> list[str]:
    """What is wrong with a verl ``override_config`` dict at ``key``: unknown fields (with the closest
    names), a value of the wrong type, ``moe_config.freeze_moe_router=true`` (not built)."""
    errs = []
    moe = dict((override or {}).get("moe_config") or {})
    if moe.pop("freeze_moe_router", False):
        errs.append(f"{key}.moe_config.freeze_moe_router=true: freezing the MoE router is not built; remove the line.")
    if moe:
        errs.append(f"{key}.moe_config: {sorted(moe)} unknown; verl's moe_config has freeze_moe_router only.")
    top = {k: v for k, v in dict(override or {}).items() if k not in ("model_config", "moe_config")}
    fields = [(f"{key}.{k}", k, v) for k, v in top.items()]
    fields += [(f"{key}.model_config.{k}", k, v) for k, v in dict((override or {}).get("model_config") or {}).items()]
    for at, name, val in fields:
        if name in ZERO_ONLY_FIELDS:
            if isinstance(val, bool) or not isinstance(val, (int, float)) or val != 0:
                errs.append(f"{at}={val!r}: the Llama / Qwen2 / Qwen3 decoders have no {ZERO_ONLY_FIELDS[name]}; only 0 "
                            f"(what runs) is accepted: remove the line or set it to 0.")
            continue
        if name not in OVERRIDABLE_FIELDS:
            near = difflib.get_close_matches(name, list(OVERRIDABLE_FIELDS), n=3, cutoff=0.6)
            errs.append(f"{at}: not a field that can be overridden"
                        + (f" (closest: {', '.join(near)})" if near else "")
                        + f"; the fields are {', '.join(OVERRIDABLE_FIELDS)} (a field that sizes a weight would not fit "
                        f"the checkpoint).")
        elif name == "rope_scaling" and val is not None and not isinstance(val, dict):
            errs.append(f"{at}={val!r}: a dict, e.g. {{rope_type: linear, factor: 2.0}}, or null.")
        elif name != "rope_scaling" and (isinstance(val, bool) or not isinstance(val, (int, float))):
            errs.append(f"{at}={val!r}: a number.")
        elif name in ("max_position_embeddings", "rope_theta", "rms_norm_eps") and val <= 0:
            errs.append(f"{at}={val}: must be > 0.")
        elif name == "attention_dropout" and not 0 <= val < 1:
            errs.append(f"{at}={val}: a probability in [0, 1).")
    return errs


def apply_overrides(d: dict, override) -> dict:
    """``config.json``'s dict with the override's fields set over it (a new dict). A RoPE override is
    written in both spellings, v4's ``rope_theta`` / ``rope_scaling`` and v5's ``rope_parameters``
    (which wins where both are read), so every reader sees it: a new ``rope_scaling`` replaces the
    checkpoint's scaling and keeps its base; a new ``rope_theta`` keeps its scaling."""
    ov = override_fields(override)
    if not ov:
        return d
    out = {**d, **ov}
    if "rope_theta" in ov or "rope_scaling" in ov:
        old = dict(d.get("rope_parameters") or {})
        old = dict(old["full_attention"]) if isinstance(old.get("full_attention"), dict) else old
        theta = ov.get("rope_theta", old.get("rope_theta", d.get("rope_theta", 10000.0)))
        if "rope_scaling" in ov:
            scaling = dict(ov["rope_scaling"] or {})
        else:
            scaling = {k: v for k, v in {**dict(d.get("rope_scaling") or {}), **old}.items() if k != "rope_theta"}
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        out.update(rope_theta=theta, rope_scaling=scaling, rope_parameters={**scaling, "rope_theta": theta})
    return out


def overridden_fields(d: dict, override) -> dict:
    """The config.json fields an override changes, as :func:`apply_overrides` writes them: what an
    engine that reads the checkpoint's config itself is given (SGLang's ``json_model_override_args``)."""
    out = apply_overrides(d, override)
    return {k: v for k, v in out.items() if k not in d or d[k] != v}


@dataclass(frozen=True)
class ArchConfig:
    """The architecture of a HF Llama / Qwen2 / Qwen3 decoder, normalised across families and
    transformers versions. Build it with :func:`read_config` (or :meth:`from_hf_dict`)."""

    model_type: str  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2: always; Llama/Qwen3: attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., params}; no rope_theta in it
    max_position_embeddings: int = 2048
    eos_token_id: tuple[int, ...] = ()  # config.json's; see stop_token_ids for the full stop set
    torch_dtype: torch.dtype | None = None  # the checkpoint's declared dtype (None: not given / "auto")
    num_experts: int = 0  # mixture of experts: routed experts per layer (0: a dense MLP)
    experts_per_token: int = 0  # top-k experts each token is sent to
    moe_intermediate_size: int = 0  # each routed expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum 1
    shared_expert_intermediate_size: int = 0  # qwen2_moe: the always-on shared expert's width (0: none)
    attention_dropout: float = 0.0  # dropout on the attention probabilities in training
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # config.json as read

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ArchConfig":
        return read_config(d)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, overrides=None) -> "ArchConfig":
        return read_config(path, overrides)


def _int_field(d: dict, key: str) -> int:
    v = d.get(key)
    if v is None:
        raise _refuse(f"'{key}' is missing; a Llama / Qwen2 / Qwen3 config.json written by transformers has it")
    return int(v)


def _rope(d: dict, max_pos: int) -> tuple[float, dict]:
    """(theta, scaling dict with rope_type) from v4 ``rope_theta`` + ``rope_scaling`` and/or v5
    ``rope_parameters`` (flat, or per layer type: its ``full_attention`` entry); v5 wins on a clash."""
    rp = dict(d.get("rope_parameters") or {})
    if isinstance(rp.get("full_attention"), dict):
        rp = dict(rp["full_attention"])
    scaling = {**dict(d.get("rope_scaling") or {}), **rp}
    theta = scaling.pop("rope_theta", None)
    theta = float(d.get("rope_theta") or 10000.0) if theta is None else float(theta)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _refuse(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES}); it changes the "
                      f"attention scale or depends on the sequence length. Use a checkpoint without that rope scaling")
    prf = scaling.pop("partial_rotary_factor", d.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0:
        raise _refuse(f"partial_rotary_factor={prf} is not supported (only full rotary, 1.0)")
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", max_pos)
    lacking = [k for k in _ROPE_REQUIRED[rope_type] if scaling.get(k) is None]
    if lacking:
        raise _refuse(f"rope type {rope_type!r} needs {lacking} in rope_scaling / rope_parameters")
    scaling["rope_type"] = rope_type
    return theta, scaling


def read_config(src: str | os.PathLike | dict, overrides=None) -> ArchConfig:
    """Parse a ``config.json`` (a model directory, the file's path, or the loaded dict), with verl's
    ``override_config`` dict ``overrides`` set over it (:func:`apply_overrides`).

    Raises :class:`UnsupportedConfig` for what neither the engine nor the bridge computes (see the
    module docstring); each message names the field, its value and the fix.
    """
    d = apply_overrides(dict(src) if isinstance(src, dict) else load_config_json(src), overrides)
    mt = d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise _refuse(f"model_type {mt!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}. Use a Llama / Qwen2 / "
                      f"Qwen3 checkpoint")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if d.get("use_sliding_window", False):
        raise _refuse("sliding-window attention (use_sliding_window=true) is not supported; every layer must attend "
                      "to the full context")
    other = sorted({t for t in (d.get("layer_types") or []) if t != "full_attention"})
    if other:
        raise _refuse(f"layer_types {other} are not supported (sliding-window attention); only 'full_attention'")
    if d.get("quantization_config"):
        method = (d["quantization_config"] or {}).get("quant_method", "?")
        raise _refuse(f"quantization_config (quant_method {method!r}): quantized checkpoints are not supported; "
                      f"use the unquantized (bf16 / fp32) checkpoint")
    heads = _int_field(d, "num_attention_heads")
    hidden = _int_field(d, "hidden_size")
    kv = int(d.get("num_key_value_heads") or heads)
    if heads % kv:
        raise _refuse(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    head_dim = int(d.get("head_dim") or hidden // heads)
    max_pos = int(d.get("max_position_embeddings") or 2048)
    theta, scaling = _rope(d, max_pos)
    attn_bias = bool(d.get("attention_bias", False))
    eos = d.get("eos_token_id")
    eos = () if eos is None else tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    dt = d.get("torch_dtype") or d.get("dtype")
    moe = _moe_fields(d, mt)
    return ArchConfig(
        model_type=mt,
        vocab_size=_int_field(d, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int_field(d, "intermediate_size"),
        num_layers=_int_field(d, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=True if mt in ("qwen2", "qwen2_moe") else attn_bias,  # Qwen2: q/k/v biases always, none on o_proj
        o_bias=False if mt in ("qwen2", "qwen2_moe") else attn_bias,
        mlp_bias=bool(d.get("mlp_bias", False)) if mt == "llama" else False,  # Qwen MLPs have no bias
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        **moe,
        attention_dropout=float(d.get("attention_dropout") or 0.0),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        eos_token_id=eos,
        torch_dtype=_DTYPES.get(dt) if isinstance(dt, str) else None,
        raw=d,
    )


def _moe_fields(d: dict, mt: str) -> dict:
    """The mixture-of-experts fields of a ``qwen3_moe`` / ``qwen2_moe`` config (``{}`` for dense ones)."""
    if not mt.endswith("_moe"):
        return {}
    n_layers = _int_field(d, "num_hidden_layers")
    dense = sorted(set(int(i) for i in (d.get("mlp_only_layers") or [])))
    step = int(d.get("decoder_sparse_step") or 1)
    mixed = dense + [i for i in range(n_layers) if (i + 1) % step and i not in dense]
    if mixed:
        raise _refuse(f"{mt} with dense MLP layers {sorted(mixed)} (mlp_only_layers={dense}, decoder_sparse_step={step}) "
                      f"is not supported: every layer must be a mixture-of-experts layer, as in the released models")
    if d.get("num_experts") is None and d.get("num_local_experts") is not None:
        d = {**d, "num_experts": d["num_local_experts"]}  # transformers v5's name for it
    out = dict(num_experts=_int_field(d, "num_experts"), experts_per_token=_int_field(d, "num_experts_per_tok"),
               moe_intermediate_size=_int_field(d, "moe_intermediate_size"),
               norm_topk_prob=bool(d.get("norm_topk_prob", False)))
    if not 0 < out["experts_per_token"] <= out["num_experts"]:
        raise _refuse(f"num_experts_per_tok={out['experts_per_token']} must be in 1..num_experts={out['num_experts']}")
    if mt == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(d.get("shared_expert_intermediate_size") or 0)
    return out


# --------------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------------
def rope_inv_freq(cfg: ArchConfig) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim // 2]`` (float32) of ``cfg`` (its ``head_dim``,
    ``rope_theta`` and ``rope_scaling``), bit-identical to ``transformers``; formulas in the module
    docstring."""
    p, d = cfg.rope_scaling, cfg.head_dim
    kind = p.get("rope_type", "default")
    inv = 1.0 / (float(cfg.rope_theta) ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(p["factor"])
    if kind == "llama3":
        factor = p["factor"]
        lo, hi = p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)  # long wavelengths interpolated
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, blended, scaled)
    raise _refuse(f"rope type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


# --------------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------------
class SafetensorsDir:
    """The tensors of a HF checkpoint directory: ``model.safetensors``, several ``*.safetensors``, or
    the shards a ``model.safetensors.index.json`` lists (then its ``weight_map`` is authoritative).

    Random access (:meth:`get`, :meth:`spec` from the file header only) keeps one handle per file
    open; :meth:`iter` opens one file at a time.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"{self.path} is not a directory (expected a Hugging Face checkpoint directory)")
        self.where: dict[str, str] = {}  # tensor name -> file name (relative to path)
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                self.where = {k: v for k, v in json.load(f)["weight_map"].items()}
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not files:
                bins = sorted(f for f in os.listdir(self.path) if f.endswith(".bin") or f.endswith(".pt"))
                hint = (f" It holds {bins[:3]}: re-save it as safetensors, e.g. AutoModelForCausalLM."
                        f"from_pretrained(dir).save_pretrained(dir)." if bins else "")
                raise FileNotFoundError(f"no *.safetensors in {self.path}: weights are read from safetensors "
                                        f"only.{hint}")
            from safetensors import safe_open

            for fn in files:
                with safe_open(os.path.join(self.path, fn), framework="pt") as fh:
                    for k in fh.keys():
                        self.where[k] = fn
        self._handles: dict[str, Any] = {}

    @property
    def files(self) -> list[str]:
        return sorted(set(self.where.values()))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def __len__(self) -> int:
        return len(self.where)

    def keys(self):
        return self.where.keys()

    def file_of(self, name: str) -> str:
        return self.where[name]

    def _handle(self, fn: str):
        h = self._handles.get(fn)
        if h is None:
            from safetensors import safe_open

            h = self._handles[fn] = safe_open(os.path.join(self.path, fn), framework="pt")
        return h

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.where[name]).get_tensor(name)

    def get_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of one tensor (dim 0), read without the rest of it."""
        return self._handle(self.where[name]).get_slice(name)[lo:hi]

    def spec(self, name: str) -> tuple[tuple[int, ...], str]:
        """``(shape, safetensors dtype string such as "BF16")`` of one tensor, from its file header."""
        sl = self._handle(self.where[name]).get_slice(name)
        return tuple(int(n) for n in sl.get_shape()), sl.get_dtype()

    def iter(self, names: Collection[str] | Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)``, file by file (one open at a time), in each file's order. ``names``: a
        collection of names (each must exist: KeyError here, before anything is read) or a predicate
        on the name; None: every tensor."""
        if names is None or callable(names):
            return self._iter(names)
        wanted = set(names)
        unknown = sorted(wanted - self.where.keys())
        if unknown:
            raise KeyError(f"{self.path} has no tensor {unknown[0]!r} ({len(unknown)} of the requested names missing)")
        return self._iter(wanted.__contains__)

    def _iter(self, keep: Callable[[str], bool] | None) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for fn in self.files:
            with safe_open(os.path.join(self.path, fn), framework="pt") as fh:
                for name in fh.keys():
                    if self.where.get(name) == fn and (keep is None or keep(name)):
                        yield name, fh.get_tensor(name)


def iter_safetensors(path: str | os.PathLike,
                     names: Collection[str] | Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a checkpoint directory (see :class:`SafetensorsDir`), optionally only
    ``names`` (a collection, or a predicate on the name). Raises FileNotFoundError right away when the
    directory holds no safetensors."""
    return SafetensorsDir(path).iter(names)


# --------------------------------------------------------------------------------------------------
# stop tokens
# --------------------------------------------------------------------------------------------------
def _eos_field(path: str) -> list[int]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        try:
            eos = json.load(f).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]


def stop_token_ids(model_dir: str | os.PathLike, tokenizer=None) -> list[int]:
    """The ids that end a response, sorted: the union of ``tokenizer.eos_token_id`` (when a tokenizer
    is given), ``generation_config.json``'s ``eos_token_id`` (an int or a list) and ``config.json``'s.
    Chat models often name their end-of-turn token in one place and the document end in another.
    The trainer's sampler and every server use this one rule (SGLang itself also stops on the
    config.json and generation_config.json ids, see :mod:`trainer.rollout.sglang_engine`)."""
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is not None:
        ids.add(int(eos))
    for fname in ("generation_config.json", "config.json"):
        ids.update(_eos_field(os.path.join(model_dir, fname)))
    return sorted(ids)
