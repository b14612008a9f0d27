"""Export megatron-core weights, from any TP/PP layout, in Hugging Face naming.

:func:`iter_hf_weights` streams ``(hf_name, full tensor)`` pairs in buckets of about
``bucket_bytes``: the API the rollout's weight sync (``trainer.workers.rollouts``) uses to feed engines. It is collective
over the model-parallel group (every TP and PP rank must iterate it), and it gathers **one
parameter at a time**: the owning pipeline stage all-gathers the parameter's TP shards, merges them
(:func:`convert.tp_merge`), splits it into HF tensors (:func:`convert.canonical_to_hf`) and
broadcasts them along the pipeline group. Every rank therefore receives every full tensor, and
peak extra memory is one bucket plus one parameter, never the whole model. Data-parallel replicas
each stream their own copy without talking to each other.

:func:`export_hf` writes a directory that ``transformers.AutoModelForCausalLM.from_pretrained``
loads: ``config.json`` (the source config, dtype updated), safetensors shards with an index, and the
tokenizer / generation files copied from the source directory. Rank 0 writes into a temporary
directory that is renamed into place when complete, so a crash never leaves a half-written export.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

import torch
import torch.distributed as dist

from trainer.fsutil import bucketed, replace_dir, tmp_dir_beside

from megatron_bridge.convert import (canonical_names, canonical_to_hf, expert_index, is_expert, local_name, tp_kind,
                                    tp_merge)
from megatron_bridge.hf_config import HFModelConfig
from megatron_bridge.lora import LoRALinear
from megatron_bridge import cpu_shims
from megatron_bridge.model import chunks, unwrap

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)


def canonical_shape(name: str, hf: HFModelConfig, padded_vocab: int) -> tuple[int, ...]:
    """Full (TP-merged) shape of a canonical megatron parameter, from the config alone."""
    H, F, hd = hf.hidden_size, hf.intermediate_size, hf.head_dim
    qkv = (hf.num_heads + 2 * hf.num_kv_heads) * hd
    if name in ("embedding.word_embeddings.weight",):
        return (padded_vocab, H)
    if name == "output_layer.weight":
        return (padded_vocab, H)
    if name.endswith("linear_qkv.weight"):
        return (qkv, H)
    if name.endswith("linear_qkv.bias"):
        return (qkv,)
    if name.endswith("q_layernorm.weight") or name.endswith("k_layernorm.weight"):
        return (hd,)
    if name.endswith("linear_proj.weight"):
        return (H, hf.num_heads * hd)
    if name.endswith("mlp.router.weight"):
        return (hf.num_experts, H)
    if name.endswith("shared_experts.gate_weight"):
        return (1, H)
    if ".mlp.experts." in name or ".mlp.shared_experts." in name:
        F = hf.moe_intermediate_size if ".mlp.experts." in name else hf.shared_expert_intermediate_size
    if name.endswith("linear_fc1.weight"):
        return (2 * F, H)
    if name.endswith("linear_fc2.weight"):
        return (H, F)
    if name.endswith("layernorm.weight"):
        return (H,)
    raise KeyError(name)


def stage_plan(m) -> list[tuple[int, int, str]]:
    """(owning PP stage, its chunk, canonical name) for every parameter of the whole model, in HF
    order. Virtual stage ``v`` (of ``pp * vpp``, in model order) is chunk ``v // pp`` of rank ``v % pp``."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    hf = m.hf_config
    layout = m.virtual_layers
    nv = len(layout)
    starts = [sum(layout[:v]) for v in range(nv)]
    plan = []
    for v in range(nv):
        layers = range(starts[v], starts[v] + layout[v])
        for n in canonical_names(hf, layers=layers, pre=v == 0, post=v == nv - 1, value_head=m.is_critic):
            plan.append((v % pp, v // pp, n))
    return plan


def _lora_linears(m) -> dict:
    """``{local weight name: LoRA linear}`` of one chunk: their weights are streamed merged (see :func:`_full_param`)."""
    return {name + ".weight": mod for name, mod in m.named_modules() if isinstance(mod, LoRALinear)}


@torch.no_grad()
def _full_param(m, params: dict, canonical: str, lora: dict | None = None) -> torch.Tensor:
    """All-gather this stage's TP shards of one parameter and merge them (owning stage only). A weight with a LoRA
    adapter (``lora``: :func:`_lora_linears`) is streamed as the function the layer computes, this rank's shard of
    ``W + (alpha/r) B A`` (a shard of each merges exactly: :func:`megatron_bridge.lora.merged_weight`), so the
    engines, the checksums and the export see one plain weight; with the adapters off it is ``W``."""
    from megatron.core import parallel_state as ps

    lname = local_name(canonical, m.layer_offset, m.uses_te, getattr(m, "expert_offset", 0))
    mod = (lora or {}).get(lname)
    p = mod.merged_weight() if mod is not None and mod.lora_enabled else params[lname].detach()
    if is_expert(canonical):  # a routed expert: sharded over the expert-tensor-parallel group
        tp, group = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group()
    else:
        tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    if tp == 1 or tp_kind(canonical, m.is_critic) == "rep":
        return p
    parts = [torch.empty_like(p) for _ in range(tp)]
    dist.all_gather(parts, p.contiguous(), group=group)
    return tp_merge(canonical, parts, m.is_critic)


@torch.no_grad()
def iter_hf_param(model) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every HF tensor, one megatron parameter at a time (collective)."""
    from megatron.core import parallel_state as ps


    cpu_shims.install()
    ms = [unwrap(c) for c in chunks(model)]
    m = ms[0]
    hf = m.hf_config
    my_stage = ps.get_pipeline_model_parallel_rank()
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_group = ps.get_pipeline_model_parallel_group()
    dtype = next(m.parameters()).dtype
    device = next(m.parameters()).device
    params = [dict(c.named_parameters()) for c in ms]
    loras = [_lora_linears(c) for c in ms]
    ep, ep_rank, ep_group = 1, 0, None
    if hf.is_moe:
        ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        ep_group = ps.get_expert_model_parallel_group()
    for stage, chunk, name in stage_plan(m):
        if name == "output_layer.weight" and hf.tie_word_embeddings and not m.is_critic:
            continue  # the tied copy on the last stage is the embedding; HF stores it once
        if m.is_critic and name.startswith("output_layer."):
            shape = (1, hf.hidden_size) if name.endswith("weight") else (1,)
        else:
            shape = canonical_shape(name, hf, m.padded_vocab_size)
        if stage == my_stage and is_expert(name) and ep > 1:
            # the expert lives on one expert-parallel rank of this stage: it merges, the others receive
            owner = expert_index(name) // m.num_local_experts
            full = _full_param(ms[chunk], params[chunk], name, loras[chunk]) if owner == ep_rank else \
                torch.empty(shape, dtype=dtype, device=device)
            full = full.contiguous()
            dist.broadcast(full, src=dist.get_global_rank(ep_group, owner), group=ep_group)
            pairs = canonical_to_hf(name, full, hf, value_head=m.is_critic)
        elif stage == my_stage:
            pairs = canonical_to_hf(name, _full_param(ms[chunk], params[chunk], name, loras[chunk]), hf,
                                    value_head=m.is_critic)
        else:
            meta = torch.empty(shape, device="meta")
            pairs = [(k, torch.empty(v.shape, dtype=dtype, device=device))
                     for k, v in canonical_to_hf(name, meta, hf, value_head=m.is_critic)]
        for k, t in pairs:
            if pp > 1:
                t = t.contiguous()
                dist.broadcast(t, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            yield k, t


def iter_hf_weights(model, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets ``[(hf_name, full tensor), ...]`` of at least ``bucket_bytes`` (the last may be smaller).

    A single tensor larger than ``bucket_bytes`` forms a bucket by itself. Collective: call on every
    rank of the model-parallel group and consume it to the end. HF names and shapes match
    ``AutoModelForCausalLM`` (tied lm_head omitted). Zero-copy where possible: a tensor that needs
    no TP merge or re-layout (TP=1, own stage) is a view of the live parameter, valid until the next
    optimizer step; clone what you keep.
    """
    yield from bucketed(iter_hf_param(model), bucket_bytes)


def _hf_config_json(hf: HFModelConfig, dtype: torch.dtype, critic: bool) -> dict:
    raw = dict(hf.raw)
    name = str(dtype).replace("torch.", "")
    raw["torch_dtype"] = name
    if "dtype" in raw:
        raw["dtype"] = name
    if critic:
        arch = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[hf.model_type]
        raw["architectures"] = [f"{arch}ForTokenClassification"]
        raw["num_labels"] = 1
        raw["id2label"], raw["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    return raw


def export_hf(model, out_dir: str, *, source_dir: str | None = None, max_shard_bytes: int = 4 << 30,
              bucket_bytes: int = 512 << 20) -> str | None:
    """Write a HF directory (rank 0; every model-parallel rank must call). Returns the path on rank 0."""
    from safetensors.torch import save_file


    m = unwrap(chunks(model)[0])
    writer = dist.get_rank() == 0
    tmp = None
    if writer:
        tmp = tmp_dir_beside(out_dir)
    try:
        shard, shard_size, shards, weight_map = {}, 0, [], {}
        dtype = next(m.parameters()).dtype

        def flush():
            nonlocal shard, shard_size
            if shard:
                fn = f"model-{len(shards) + 1:05d}.safetensors"
                save_file(shard, os.path.join(tmp, fn), metadata={"format": "pt"})
                shards.append(fn)
                weight_map.update({k: fn for k in shard})
                shard, shard_size = {}, 0

        for bucket in iter_hf_weights(model, bucket_bytes):
            if not writer:
                continue
            for k, t in bucket:
                nbytes = t.numel() * t.element_size()
                if shard and shard_size + nbytes > max_shard_bytes:
                    flush()
                shard[k] = t.detach().cpu().contiguous()
                shard_size += nbytes
        if writer:
            flush()
            n = len(shards)
            if n == 1:
                os.replace(os.path.join(tmp, shards[0]), os.path.join(tmp, "model.safetensors"))
            else:
                final = {}
                for i, fn in enumerate(shards):
                    new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                    os.replace(os.path.join(tmp, fn), os.path.join(tmp, new))
                    final[fn] = new
                total = sum(os.path.getsize(os.path.join(tmp, f)) for f in final.values())
                with open(os.path.join(tmp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
                    json.dump({"metadata": {"total_size": total},
                               "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}, f, indent=2)
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                json.dump(_hf_config_json(m.hf_config, dtype, m.is_critic), f, indent=2, sort_keys=True)
            if source_dir:
                for fn in TOKENIZER_FILES:
                    src = os.path.join(source_dir, fn)
                    if os.path.exists(src):
                        shutil.copy2(src, os.path.join(tmp, fn))
            replace_dir(tmp, out_dir)
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return out_dir if writer else None
