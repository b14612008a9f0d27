"""The SGLang rollout engine: one ``sglang.Engine`` behind :class:`~trainer.rollout.engine.RolloutEngine`.

One adapter for GPU and CPU: the DEVICE decides the engine arguments (:func:`engine_args`), nothing else.
On a machine without CUDA the engine runs SGLang's own CPU path (plain torch layers, ``torch_native``
attention, no memory saver), set up by :mod:`trainer.rollout.sglang_cpu` (the pinned install and two
small shims); that is what CI tests. On GPU the kernels are SGLang's (untested here: no GPU is lent).

Pinned: **sglang==0.5.21** (the ``sglang`` extra): the newest release whose own torch pin
(``torch==2.13.0``) agrees with Coxswain's, so ``coxswain[sglang]`` resolves (0.5.22 and 0.5.23 pin
torch 2.14.1). Every SGLang call below was read in that release's source; file references are to
``sglang/srt/...`` in the 0.5.21 wheel, with approximate line numbers. Other versions change this
API (the weight-update session below is recent, for one), so the engine warns on another version.

Everything that can be got wrong without a GPU is a pure function here, tested on CPU without
sglang (``tests/rollout/test_sglang_engine.py``): sampling-parameter dicts, the n-expansion and its
inverse, the mapping of SGLang's output dicts to :class:`GenerationOutput`, weight validation,
bucketing and flattening, and the running checksum. ``sglang`` is imported only in
:class:`SGLangEngine`'s constructor.

Sampling (:func:`sampling_params_dict`)
    temperature T > 0  -> ``temperature=T``; T == 0 -> ``temperature=1, top_k=1``: greedy. SGLang
    itself rewrites T < 1e-6 that way (sampling/sampling_params.py ~217) and treats top_k <= 1 as
    greedy (sampling/sampling_batch_info.py ~253); we send the rewritten form so the log-prob is
    the T = 1 one that :mod:`trainer.rollout.engine` defines for greedy.
    top_k None / 0     -> ``-1`` (SGLang: whole vocabulary).  top_p as is.
    Every other knob (min_p, penalties, min_new_tokens, ignore_eos) is sent at its neutral value,
    so a server-wide ``preferred_sampling_params`` cannot change the distribution unseen
    (managers/tokenizer_manager.py ~1470 merges request values over it).

n > 1 (:func:`expand_requests`)
    Expanded HERE: every (prompt i, sample j) is its own SGLang request with ``n=1`` and its own
    ``sampling_seed``. SGLang's ``n`` would copy one sampling-params dict, seed included, to all n
    samples (managers/io_struct.py ~530 and ~736), so seeded samples of one prompt would be
    identical; it also needs the same n for every prompt of a batch and renames the requests.
    The shared prompt is still computed once per batch by SGLang's radix (prefix) cache.

Seeds
    ``sampling_seed`` exists in 0.5.21 but is only read when the server runs with
    ``enable_deterministic_inference=True`` (sampling/sampling_batch_info.py ~140: otherwise the
    seed tensor is None). That mode forces ``sampling_backend="pytorch"`` and batch-invariant
    kernels (arg_groups/overrides.py ~970) and takes only the fa3 / fa4 / flashinfer / triton
    attention backends (arg_groups/choices.py), so it is slower: :class:`SGLangEngine` takes
    ``deterministic=False`` by default and then seeds do not make runs reproducible. In that mode a
    request without a seed gets seed 42, so every request here carries one (drawn at random when
    ``SamplingParams.seed`` is None, else derived from ``(seed, i, j)`` by :func:`request_seed`).
    The seeded draw is a Gumbel-max over ``murmur_hash(seed, position)`` noise
    (layers/sampler.py ``multinomial_with_seed``): reproducible across batch compositions, but a
    different stream from the native engine's, so seeded samples are not equal ACROSS engines.

Log-probs (the finding)
    With ``return_logprob=True`` the sampler returns ``log(softmax(logits / T))`` of the sampled
    token over the FULL vocabulary (layers/sampler.py ~248-280: ``logits.div_(temperatures)``,
    softmax into ``probs``, ``logprobs = torch.log(probs)``, or ``log_softmax`` of the same scaled
    logits in deterministic mode; top-k/top-p only filter sorted COPIES of ``probs`` inside the
    sampling kernels, ~324-450 and ~766). All-greedy batches take ``log_softmax(logits)`` (~197),
    the T = 1 value. That is exactly the trainer's ``log_softmax(logits / T)[y]``. The switch that
    would change it is the environment variable
    ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (default false; read at import in layers/sampler.py ~74): when
    true SGLang returns T = 1 log-probs instead. :func:`check_logprob_env` refuses to start with it
    set. No server argument is needed. Logits are float32 after the LM head (layers/
    logits_processor.py ~1158), the LM-head matmul itself runs in the model dtype.
    ``logprob_start_len`` is left at -1: output tokens only, no prompt log-probs (io_struct.py ~231).

Output and stop tokens (:func:`to_generation_output`)
    With ``skip_tokenizer_init=True`` each result is ``{"output_ids": [...], "meta_info": {...}}``
    (managers/tokenizer_manager.py ~2539, the ``BatchTokenIDOutput`` branch); ``meta_info`` holds
    ``finish_reason`` (a dict: ``{"type": "stop", "matched": id}``, ``{"type": "length", "length":
    n}`` or ``{"type": "abort", "message": ..., ...}``, managers/schedule_batch.py ~270-330) and
    ``output_token_logprobs``, a list of ``(logprob, token_id, None)`` tuples (tokenizer_manager.py
    ``detokenize_logprob_tokens`` ~2910). The matched stop token IS in ``output_ids``: the scheduler
    sends ``output_ids[:finished_len]`` with ``finished_len = matched_pos + 1`` (schedule_batch.py
    ~1802 and ``output_ids_through_stop`` ~1438), and the detokenizer's ``trim_matched_stop``
    never runs on this path (we also send ``no_stop_trim=True``). Deviation from the native engine:
    SGLang also stops on the model's EOS ids from config.json and generation_config.json
    (configs/model_config.py ``_get_hf_eos_token_id`` ~1999) even when they are not in
    ``stop_token_ids``; the trainer passes those ids (:func:`trainer.hf_io.stop_token_ids`) as stop tokens anyway,
    so the two agree.

Weights (:meth:`SGLangEngine.update_weights`)
    HF names, as SGLang's ``load_weights`` takes them (models/qwen2.py ~219: it maps q/k/v and
    gate/up into its fused parameters itself). SGLang silently skips a name it does not know, so
    names and shapes are checked here against the checkpoint's safetensors headers first
    (:func:`validate_named_tensors`). Tensors are cast to the engine dtype and flattened into one
    uint8 buffer per bucket (:func:`flatten_bucket`, the layout of SGLang's
    ``FlattenedTensorBucket``, weight_sync/tensor_bucket.py) and sent with
    ``update_weights_from_tensor(..., load_format="flattened_bucket", flush_cache=False)``: one
    ``MultiprocessingSerializer`` payload per TP rank (entrypoints/engine.py ~1656: each rank
    deserializes only its own copy, which CUDA IPC refcounting and one-shot fd sharing of CPU
    shared memory both need). In 0.5.21 every tensor/distributed update must run inside
    ``begin_weight_update()`` / ``end_weight_update()`` (managers/scheduler_components/
    weight_updater.py ~179 and ~219, else ``success=False``). The prefix cache is flushed once,
    before the next generation, not once per bucket.
    Split placement (NCCL): :meth:`SGLangEngine.init_weight_sync_group` wraps
    ``init_weights_update_group`` (engine.py ~1522) and :meth:`SGLangEngine.update_weights_broadcast`
    wraps ``update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache,
    load_format)`` (~1570): the engine ranks are ``rank_offset + tp_rank`` and receive ONE
    broadcast from group rank 0 of the buffer :func:`flatten_bucket` builds on the sender.

Weight checksum
    SGLang has no HF-named checksum (its ``check_weights`` hashes its own fused, sharded layout,
    not comparable with the trainer's). :meth:`SGLangEngine.weights_checksum` is
    :func:`~trainer.rollout.engine.checksum_named_tensors` over the weights the engine was GIVEN:
    per name, the digest of the last pushed tensor (after the cast to the engine dtype), or of the
    checkpoint tensor it loaded at start. It verifies the push stream (every name, shape, dtype and
    bit that went in) and that SGLang accepted every bucket; it does not read GPU memory.
    :meth:`SGLangEngine.verify_weights_on_gpu` does, for a few parameters, through
    ``get_weights_by_name`` (engine.py ~1649), which returns the first rows of TP rank 0's shard as
    float lists; only Llama-family model classes implement it in 0.5.21 (models/llama.py ~779;
    Qwen2 answers None, which is reported as "not supported", not as a mismatch).

Memory (:meth:`SGLangEngine.sleep` / :meth:`SGLangEngine.wake`)
    ``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)`` with tags
    ``"kv_cache"``, ``"weights"``, ``"cuda_graph"`` (constants.py), which need
    ``enable_memory_saver=True`` and an idle engine. Released weights lose their contents unless
    ``enable_weights_cpu_backup``; the engine then refuses to generate or report a checksum until
    every weight was pushed again (the trainer's sync does exactly that while the engine sleeps).
    SGLang asserts an idle scheduler on release, and a failed assertion kills the scheduler and the
    calling process; :meth:`SGLangEngine.sleep` first waits until ``flush_cache`` succeeds (idle).
    CPU form: the memory saver needs CUDA, so it is off; the same calls run, SGLang frees nothing but
    the prefix cache, and the weights survive a sleep (no re-push needed).

Abort
    ``Engine`` has no abort method in 0.5.21; ``engine.tokenizer_manager.abort_request(rid="",
    abort_all=True)`` (managers/tokenizer_manager.py ~2114) is scheduled onto the engine's event loop
    from the calling thread. Running requests end with ``{"type": "abort"}`` and the tokens so far.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import struct
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from trainer.hf_io import iter_safetensors, load_config_json, overridden_fields
from trainer.rollout import sglang_cpu
from trainer.rollout.engine import (GenerationOutput, RolloutEngine, RouteShape, SamplingParams, moe_shape, routes_of,
                                    tensor_digest)
from trainer.rollout.registry import Capabilities
from trainer.rollout.weights import (combine_digests, default_probe_names, flatten_bucket, iter_cast_buckets, probe_rows,
                                     read_checkpoint_index, readback_error, unflatten_bucket,
                                     validate_named_tensors)
from trainer.rollout.sglang_cpu import SGLANG_VERSION
INSTALL_HINT = (f"GPU: pip install 'coxswain[sglang]' (sglang=={SGLANG_VERSION}); "
                f"CPU: python -m trainer.rollout.sglang_cpu install (a venv at .venv-sglang-cpu)")

# SGLang's dtype spellings (arg_groups/fields/model.py, ``dtype``) -> torch. "auto" is refused: the checksum
# needs the dtype the weights are held in, which "auto" leaves to SGLang.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
          "float32": torch.float32, "float": torch.float32}
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # constants.py GPU_MEMORY_ALL_TYPES


# --------------------------------------------------------------------------------------------------
# Sampling parameters and the n-expansion
# --------------------------------------------------------------------------------------------------
def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"SGLang engine dtype must be bfloat16, float16 or float32, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"SGLang engine dtype must be one of {sorted(DTYPES)}, got {dtype!r} "
                         f"('auto' is not accepted: the weight checksum needs the dtype the engine holds)")
    return DTYPES[dtype]


def sglang_top_k(top_k: int | None) -> int:
    """Ours: None / 0 = no filter. SGLang: -1 = no filter (sampling_params.py ~221), k >= 1 otherwise."""
    return -1 if not top_k else int(top_k)


def request_seed(seed: int | None, prompt_index: int, sample_index: int) -> int:
    """The ``sampling_seed`` of request (prompt i, sample j): a 63-bit int, a function of
    ``(seed, i, j)`` so that samples of one prompt differ and a rerun repeats; random for None."""
    if seed is None:
        return secrets.randbits(63)
    h = hashlib.sha256(f"coxswain:{int(seed)}:{prompt_index}:{sample_index}".encode()).digest()
    return struct.unpack(">Q", h[:8])[0] >> 1  # SGLang wants [-2**63, 2**63) (sampling_params.py ~282)


def sampling_params_dict(sp: SamplingParams, sampling_seed: int) -> dict:
    """SGLang's per-request ``sampling_params`` dict for ONE sample of ``sp`` (``n`` is expanded by
    the caller). Field names from sampling/sampling_params.py (0.5.21) ``SamplingParams``."""
    if sp.greedy:
        temperature, top_k, top_p = 1.0, 1, 1.0  # what SGLang does for T < 1e-6; log-prob at T = 1
    else:
        temperature, top_k, top_p = float(sp.temperature), sglang_top_k(sp.top_k), float(sp.top_p)
    return {
        "n": 1,
        "max_new_tokens": int(sp.max_new_tokens),
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
        "ignore_eos": False,  # True would also ignore stop_token_ids (schedule_batch.py ~1784)
        "stop_token_ids": list(sp.stop_token_ids) or None,
        "no_stop_trim": True,  # keep the stop token (only the detokenizer path trims; said for clarity)
        "sampling_seed": int(sampling_seed),
    }


@dataclass
class ExpandedRequests:
    """One SGLang request per (prompt, sample): parallel lists, and ``index[r] = (i, j)``."""

    input_ids: list[list[int]]
    sampling_params: list[dict]
    rids: list[str]
    index: list[tuple[int, int]]
    num_samples: list[int]  # n of each prompt


def expand_requests(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    rid_prefix: str | None = None,
) -> ExpandedRequests:
    """Repeat prompt i ``params[i].n`` times, each copy with its own seed and request id."""
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
    prefix = rid_prefix or uuid.uuid4().hex
    out = ExpandedRequests([], [], [], [], [])
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        out.num_samples.append(sp.n)
        for j in range(sp.n):
            out.input_ids.append(ids)
            out.sampling_params.append(sampling_params_dict(sp, request_seed(sp.seed, i, j)))
            out.rids.append(f"{prefix}-{i}-{j}")
            out.index.append((i, j))
    return out


# --------------------------------------------------------------------------------------------------
# SGLang outputs -> GenerationOutput
# --------------------------------------------------------------------------------------------------
def finish_reason_of(fr: Mapping | None) -> str:
    """SGLang's ``meta_info["finish_reason"]`` dict -> "stop" | "length" | "abort"."""
    if fr is None:
        raise ValueError("SGLang returned an unfinished request (finish_reason is None)")
    kind = fr.get("type")
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"unknown SGLang finish reason {fr!r}")
    return kind


def output_logprobs(meta_info: Mapping) -> tuple[list[float], list[int]]:
    """(log-probs, token ids) from ``meta_info["output_token_logprobs"]``: a list of
    ``(logprob, token_id, text_or_None)`` (tokenizer_manager.py ``detokenize_logprob_tokens``)."""
    entries = meta_info.get("output_token_logprobs") or []
    return [float(e[0]) for e in entries], [int(e[1]) for e in entries]


def to_generation_output(out: Mapping, routes: RouteShape | None = None) -> GenerationOutput:
    """One SGLang result dict (``{"output_ids", "meta_info"}``) -> :class:`GenerationOutput`.

    Checks what the trainer relies on: one log-prob per token, for the same token ids, and on
    "stop" the matched stop token as the last token. An aborted request may carry fewer log-probs
    than tokens (a request aborted while retracted, output_streamer.py ~585); it is cut to the
    tokens that have one. ``routes``: the request asked for its routed experts (R3), which then must
    cover every input token (the prompt's and every kept sampled token but the last).
    """
    meta = out["meta_info"]
    reason = finish_reason_of(meta.get("finish_reason"))
    ids = [int(t) for t in out.get("output_ids") or []]
    lps, lp_ids = output_logprobs(meta)
    if len(lps) != len(ids):
        if reason != "abort":
            raise ValueError(f"request {meta.get('id')}: {len(ids)} output tokens but {len(lps)} log-probs "
                             f"(finish {meta.get('finish_reason')})")
        k = min(len(ids), len(lps))
        ids, lps, lp_ids = ids[:k], lps[:k], lp_ids[:k]
    if lp_ids != ids:
        raise ValueError(f"request {meta.get('id')}: log-prob token ids differ from output_ids")
    if reason == "stop":
        matched = meta["finish_reason"].get("matched")
        if isinstance(matched, int) and (not ids or ids[-1] != matched):
            raise ValueError(f"request {meta.get('id')}: finished on stop token {matched} but the last "
                             f"output token is {ids[-1] if ids else None}")
    routed = None
    if routes is not None:
        routed = routes_of(meta, routes, rows=routes.prompt_len + len(ids) - 1, cut=reason == "abort")
    return GenerationOutput(token_ids=ids, logprobs=lps, finish_reason=reason, routed_experts=routed)


# Model types whose SGLang 0.5.21 class builds its own lm_head and never reads tie_word_embeddings
# (models/qwen3_moe.py, qwen2_moe.py): a tied checkpoint has no lm_head.weight, so that head stays as allocated.
IGNORES_TIED_HEAD = frozenset({"qwen3_moe", "qwen2_moe"})


def model_refusal(config: Mapping, model_path: str) -> str | None:
    """Why SGLang cannot serve this HF config faithfully, with the fix; None when it can. Found by comparing
    SGLang's log-probs with transformers': a tied Qwen3-MoE sampled from a head that was never loaded
    (log-probs off by up to 0.8, silently; every weight check passes, since the head is not a weight it takes)."""
    mt = config.get("model_type")
    if mt in IGNORES_TIED_HEAD and config.get("tie_word_embeddings"):
        return (f"{model_path}: a {mt} model with tie_word_embeddings=true, which sglang {SGLANG_VERSION} does not tie "
                f"(its {mt} class loads lm_head.weight, which a tied checkpoint lacks, and would sample from an "
                f"unloaded head): save the checkpoint untied (lm_head.weight = the embedding, tie_word_embeddings="
                f"false), or use the native engine (actor_rollout_ref.rollout.name=native)")
    return None


def group_outputs(outs: Sequence[Mapping], req: ExpandedRequests,
                  routes: RouteShape | None = None) -> list[list[GenerationOutput]]:
    """SGLang's result list (one per expanded request, in request order) -> ``out[i][j]``; ``routes``: the
    requests asked for their routed experts (R3), of that shape."""
    if len(outs) != len(req.index):
        raise ValueError(f"{len(req.index)} requests sent but {len(outs)} results returned")
    grouped: list[list[GenerationOutput | None]] = [[None] * n for n in req.num_samples]
    for o, rid, ids, (i, j) in zip(outs, req.rids, req.input_ids, req.index):
        got = o.get("meta_info", {}).get("id")
        if got is not None and got != rid:
            raise ValueError(f"result for request {got!r} where {rid!r} was expected")
        shape = None if routes is None else RouteShape(routes.layers, routes.top_k, len(ids))
        grouped[i][j] = to_generation_output(o, shape)
    return grouped  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# Engine arguments
# --------------------------------------------------------------------------------------------------
ADAPTER_KWARGS = frozenset({"deterministic", "release_weights_on_sleep", "bucket_bytes", "probe_names"})


def check_logprob_env(environ: Mapping[str, str]) -> None:
    """Refuse ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set true: SGLang would then return T = 1 log-probs
    (layers/sampler.py ~74, ~209), not the ``log_softmax(logits / T)`` the trainer recomputes."""
    v = environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "false").strip().lower()
    if v in ("true", "1", "yes", "y"):
        raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return log-probs before the "
                         "temperature, but rollout importance sampling compares them with the trainer's "
                         "log_softmax(logits / T). Unset it.")


def engine_args(
    *,
    model_path: str,
    tp_size: int = 1,
    mem_fraction_static: float = 0.5,
    dtype: str | torch.dtype = "bfloat16",
    seed: int = 0,
    deterministic: bool = False,
    enable_memory_saver: bool = True,
    device: str = "cuda",
    engine_kwargs: Mapping | None = None,
) -> dict:
    """Keyword arguments for ``sglang.Engine`` (= ``ServerArgs`` fields, arg_groups/fields/*.py).

    ``device="cpu"`` adds :func:`trainer.rollout.sglang_cpu.cpu_engine_args` (``torch_native`` attention, no
    CUDA graphs, no overlap scheduler, a bounded KV cache) and turns the memory saver off (it needs CUDA).

    ``engine_kwargs`` are passed through last, so they override (e.g. ``attention_backend``,
    ``max_running_requests``, ``chunked_prefill_size``, ``disable_cuda_graph``,
    ``enable_weights_cpu_backup``, ``context_length``, ``log_level``). Refused: ``dp_size != 1``
    (weight reads/updates assume one data-parallel rank; tokenizer_control_mixin.py ~565) and
    ``skip_tokenizer_init=False`` (outputs would be detokenized and stop tokens trimmed).
    """
    dt = resolve_dtype(dtype)
    args = {
        "model_path": str(model_path),
        "tp_size": int(tp_size),
        "mem_fraction_static": float(mem_fraction_static),
        "dtype": {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dt],
        "random_seed": int(seed),
        "skip_tokenizer_init": True,  # token ids in and out; no tokenizer process, no stop trimming
        "enable_memory_saver": bool(enable_memory_saver),  # needed by release/resume_memory_occupation
        "enable_deterministic_inference": bool(deterministic),  # makes sampling_seed take effect
        "log_level": "error",
    }
    if device == "cpu":
        args.update(sglang_cpu.cpu_engine_args())
    elif device != "cuda":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    extra = dict(engine_kwargs or {})
    bad = sorted(k for k in extra if k in ADAPTER_KWARGS)
    if bad:
        raise ValueError(f"{bad} are SGLangEngine arguments, not sglang.Engine ones")
    if extra.get("dp_size", 1) != 1:
        raise ValueError("dp_size must be 1 per SGLang engine (use more engines in the fleet instead)")
    if extra.get("skip_tokenizer_init", True) is not True:
        raise ValueError("skip_tokenizer_init must stay True: the engine exchanges token ids only")
    args.update(extra)
    return args


def split_engine_kwargs(kw: Mapping | None) -> tuple[dict, dict]:
    """``rollout.engine_kwargs`` -> (SGLangEngine arguments, ``sglang.Engine`` arguments)."""
    kw = dict(kw or {})
    return {k: v for k, v in kw.items() if k in ADAPTER_KWARGS}, {k: v for k, v in kw.items() if k not in ADAPTER_KWARGS}


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------
def _check(result, what: str) -> None:
    """SGLang's control calls return ``(success, message)`` (managers/communicator.py ``merge_results`` ~106)."""
    ok, msg = (result if isinstance(result, tuple) else (getattr(result, "success", True), getattr(result, "message", "")))
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {msg}")


class SGLangEngine(RolloutEngine):
    """A ``sglang.Engine`` (one TP group, ``dp_size=1``) as a :class:`RolloutEngine`.

    ``model_path``: HF checkpoint dir with safetensors. ``dtype``: bfloat16 | float16 | float32.
    ``deterministic``: SGLang's ``enable_deterministic_inference``; needed for seeds to reproduce.
    ``release_weights_on_sleep``: :meth:`sleep` also frees the weights (contents lost unless
    ``engine_kwargs={"enable_weights_cpu_backup": True}``), not only KV cache and CUDA graphs.
    ``bucket_bytes``: largest flat buffer sent at once (after the dtype cast).
    ``probe_names``: parameters :meth:`verify_weights_on_gpu` reads back (default: a few).
    ``engine_kwargs``: passed to ``sglang.Engine`` (see :func:`engine_args`).
    ``device``: "cuda" | "cpu"; default: "cuda" when torch sees a GPU, else "cpu" (SGLang's CPU path,
    :mod:`trainer.rollout.sglang_cpu`). It decides the engine arguments only.
    """

    # weights by SGLang's broadcast (trainer/sync/broadcast.py) or buckets through the object store; routed
    # experts (R3) with enable_return_routed_experts; no partial rollout or adapters yet; serves as real
    # sglang.launch_server processes
    capabilities = Capabilities(weight_protocols=("broadcast", "object_store"), partial_rollout=False,
                                routing_replay=True, multi_turn=True, devices=("cpu", "cuda"),
                                server="trainer.rollout.fleet:SGLangServers")

    @classmethod
    def from_rollout(cls, model_path: str, *, max_batch_size: int, max_seq_len: int, dtype: str,
                     engine_kwargs: dict | None = None, settings: dict | None = None) -> "SGLangEngine":
        """:meth:`from_config` with verl's rollout keys (``settings``); SGLang derives the context length
        from the model, so ``max_seq_len`` is not passed; nor is ``settings["device"]``: SGLang takes the
        machine's device (CUDA where present, else its CPU path: :meth:`from_config`'s engine arguments)."""
        settings = {k: v for k, v in (settings or {}).items() if k != "device"}
        return cls.from_config(model_path=model_path, dtype=dtype, max_num_seqs=max_batch_size,
                               engine_kwargs=engine_kwargs, **settings)

    @classmethod
    def unavailable(cls, *, server: bool) -> str | None:
        if server:  # a fleet of SGLang servers: the servers need sglang, this trainer only speaks HTTP to them
            if sglang_cpu.server_python() is None:
                return ("actor_rollout_ref.rollout.name=sglang with rollout.mode=server launches sglang.launch_server, "
                        "but no interpreter here has sglang: pip install 'coxswain[sglang]' (GPU), or "
                        f"{sglang_cpu.INSTALL_COMMAND} (CPU; COXSWAIN_SGLANG_PYTHON names another interpreter)")
            return None
        why = None if torch.cuda.is_available() else sglang_cpu.missing_reason()  # SGLang's CPU path where installed
        if why:
            return ("actor_rollout_ref.rollout.name=sglang needs CUDA GPUs with pip install 'coxswain[sglang]', or on "
                    f"CPU the SGLang CPU install, absent here ({why}); or use the native engine (rollout.name=native)")
        return None

    def __init__(
        self,
        model_path: str,
        *,
        tp_size: int = 1,
        mem_fraction_static: float = 0.5,
        dtype: str | torch.dtype = "bfloat16",
        seed: int = 0,
        deterministic: bool = False,
        release_weights_on_sleep: bool = True,
        bucket_bytes: int = 512 << 20,
        probe_names: Sequence[str] | None = None,
        engine_kwargs: Mapping | None = None,
        device: str | None = None,
    ):
        check_logprob_env(os.environ)
        device = str(device or (engine_kwargs or {}).get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
        args = engine_args(model_path=model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                           dtype=dtype, seed=seed, deterministic=deterministic, device=device,
                           engine_kwargs=engine_kwargs)
        self.device = device
        self.model_path = str(model_path)
        self.dtype = resolve_dtype(dtype)
        self.tp_size = int(args["tp_size"])
        self.bucket_bytes = int(bucket_bytes)
        why = model_refusal(load_config_json(self.model_path), self.model_path)
        if why:
            raise ValueError(why)
        self.specs, self.skip = read_checkpoint_index(self.model_path)
        # R3: the shape of the routes SGLang returns (None: dense model, or the capture is off)
        hf_cfg = {**load_config_json(self.model_path), **json.loads(args.get("json_model_override_args") or "{}")}
        self.routes = moe_shape(hf_cfg) if args.get("enable_return_routed_experts") else None
        self.probe_names = list(probe_names) if probe_names is not None else default_probe_names(self.specs)
        self.sleep_tags = MEMORY_TAGS if release_weights_on_sleep else ("kv_cache", "cuda_graph")
        # Released weights keep their contents only with the memory saver off (nothing is released)
        # or with its CPU backup on.
        self._weights_survive_sleep = not args["enable_memory_saver"] or bool(args.get("enable_weights_cpu_backup"))
        self._digests: dict[str, bytes | None] = {}  # name -> digest of what the engine was given last
        self._probes: dict[str, torch.Tensor] = {}  # probe name -> first rows as last pushed (float32)
        self._broadcast: set[str] = set()  # names last written by broadcast: no probe rows kept
        self._released: set[str] = set()
        self._repushed: set[str] | None = None  # names pushed since the weights were released and lost
        self._needs_flush = False
        # Abort bookkeeping (see :meth:`abort`): the running generate call's number, and whether an abort
        # was asked for it.
        self._gen_lock = threading.Lock()
        self._gen_epoch = 0
        self._generating = False
        self._abort_epoch = -1
        if device == "cpu":
            sglang_cpu.activate()  # env + the sgl_kernel stand-in on PYTHONPATH, before sglang is imported
        try:
            import sglang  # the optional heavy dependency (the sglang extra, or the CPU venv)
        except ImportError as e:
            raise ImportError(f"the SGLang rollout engine needs sglang: {INSTALL_HINT}") from e
        version = getattr(sglang, "__version__", "?")
        if version != SGLANG_VERSION:
            warnings.warn(f"sglang {version} is installed; this engine was written against sglang=={SGLANG_VERSION} "
                          f"and its weight-update and memory API changes between releases", stacklevel=2)
        self.engine = sglang.Engine(**args)

    @classmethod
    def from_config(
        cls,
        *,
        model_path: str,
        tensor_model_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        enforce_eager: bool = False,
        engine_kwargs: Mapping | None = None,
        hf_overrides: Mapping | None = None,
        enable_rollout_routing_replay: bool = False,
    ) -> "SGLangEngine":
        """Build from plain values named as in ``actor_rollout_ref.rollout`` (verl's names).

        ``engine_kwargs`` keys that are this class's arguments (``deterministic``,
        ``release_weights_on_sleep``, ``bucket_bytes``, ``probe_names``) go to it; the rest to
        ``sglang.Engine`` and override the mapped values.
        """
        own, server = split_engine_kwargs(engine_kwargs)
        mapped = {}
        if max_num_seqs:
            mapped["max_running_requests"] = int(max_num_seqs)
        if not enable_chunked_prefill:
            mapped["chunked_prefill_size"] = -1  # SGLang: -1 disables chunked prefill
        elif max_num_batched_tokens:
            mapped["chunked_prefill_size"] = int(max_num_batched_tokens)
        if enforce_eager:
            mapped["disable_cuda_graph"] = True
        if enable_rollout_routing_replay:  # R3: SGLang captures each token's experts (a host buffer, KV-pool sized)
            mapped["enable_return_routed_experts"] = True
        if hf_overrides:  # verl's model.override_config, as the other readers apply it (trainer.hf_io.apply_overrides)
            mapped["json_model_override_args"] = json.dumps(overridden_fields(load_config_json(model_path), hf_overrides))
        mapped.update(server)
        return cls(model_path, tp_size=tensor_model_parallel_size, mem_fraction_static=gpu_memory_utilization,
                   dtype=dtype, seed=seed, engine_kwargs=mapped, **own)

    # ---- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[GenerationOutput]]:
        req = expand_requests(prompt_token_ids, params)
        if not req.index:
            return [[] for _ in req.num_samples]
        plist = [params] if isinstance(params, SamplingParams) else list(params)
        routed = any(p.return_routed_experts for p in plist)
        if routed and self.routes is None:
            raise ValueError("return_routed_experts asks for MoE routing, but this engine does not capture it: "
                             + ("the model has no MoE layers" if moe_shape(load_config_json(self.model_path)) is None
                                else "start it with enable_rollout_routing_replay=True (engine_kwargs "
                                     "enable_return_routed_experts)"))
        with self._gen_lock:
            self._gen_epoch += 1
            self._generating = True
        try:
            self.wake()  # like the native engine, generating wakes a sleeping engine
            if self._needs_flush:
                self.flush_cache()
            # the routing flag goes only when asked: the call without it is the one every SGLang release takes
            extra = {"return_routed_experts": True} if routed else {}
            outs = self.engine.generate(input_ids=req.input_ids, sampling_params=req.sampling_params,
                                        return_logprob=True, rid=req.rids, **extra)
        finally:
            with self._gen_lock:
                self._generating = False
        return group_outputs(outs, req, self.routes if routed else None)

    def abort(self) -> None:
        """End the running :meth:`generate` (called from another thread): every request of the engine
        is aborted and comes back with ``finish_reason == "abort"`` (with the tokens sampled so far). A
        no-op when none runs.

        One ``abort_request(abort_all=True)`` can be lost: sent while the call is still waking or
        flushing the engine, or before the batch's requests reached the scheduler, it aborts nothing and
        the batch then runs to its length limit. So the abort is re-sent every 50 ms on the engine's
        event loop (whose thread owns the ZMQ socket) until that same generate call returns; the call's
        number keeps a late tick from aborting the next call."""
        with self._gen_lock:
            if not self._generating or self._abort_epoch == self._gen_epoch:
                return
            self._abort_epoch = epoch = self._gen_epoch
        loop = self.engine.loop
        tm = self.engine.tokenizer_manager

        def tick():
            with self._gen_lock:
                live = self._generating and self._gen_epoch == epoch
            if live:
                tm.abort_request("", True)
                loop.call_later(0.05, tick)

        # Queued callbacks and timers survive between run_until_complete calls, so a tick sent while the
        # loop is idle runs as soon as the call enters the loop.
        loop.call_soon_threadsafe(tick)

    def flush_cache(self) -> None:
        self._wait_idle()  # SGLang flushes only an idle scheduler (and then answers success)
        self._needs_flush = False

    def _wait_idle(self, timeout_s: float = 60.0) -> None:
        """Flush the prefix cache, retrying until the scheduler is idle (it refuses, with success=False,
        while a batch is still being finished)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.engine.flush_cache()
            ok = result[0] if isinstance(result, tuple) else getattr(result, "success", True)
            if ok:
                return
            if time.monotonic() > deadline:
                _check(result, f"flush_cache (scheduler not idle after {timeout_s:.0f} s)")
            time.sleep(0.02)

    # ---- memory ------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release the KV cache, CUDA graphs and (by default) the weights until :meth:`wake`."""
        tags = [t for t in self.sleep_tags if t not in self._released]
        if not tags:
            return
        # SGLang ASSERTS an idle scheduler here (weight_updater.py ~320; a failed assertion kills the
        # scheduler and, with it, this process). Right after generate() returns the scheduler can still be
        # finishing its last batch, so wait until it is idle: flush_cache succeeds only then (scheduler.py ~5189).
        self._wait_idle()
        self.engine.release_memory_occupation(tags=tags)
        self._released.update(tags)
        if "weights" in tags and not self._weights_survive_sleep:
            self._repushed = set()

    def _resume(self, tags: Iterable[str]) -> None:
        tags = [t for t in MEMORY_TAGS if t in set(tags) and t in self._released]
        if tags:
            self.engine.resume_memory_occupation(tags=tags)
            self._released.difference_update(tags)

    def _check_weights_valid(self, what: str) -> None:
        if self._repushed is not None:
            missing = len(self.specs) - len(self._repushed)
            raise RuntimeError(f"cannot {what}: sleep() released the engine's weights without a CPU backup and "
                               f"{missing} of {len(self.specs)} weights have not been pushed since; push all "
                               f"weights (update_weights) first, or pass engine_kwargs "
                               f"{{'enable_weights_cpu_backup': True}} / release_weights_on_sleep=False")

    def wake(self) -> None:
        """Take back what :meth:`sleep` released (the weights first, as SGLang's RL users do)."""
        if not self._released:
            return
        self._check_weights_valid("wake the engine")
        self._resume(self._released)

    # ---- weights -----------------------------------------------------------------------------
    def _mark_pushed(self, names: Iterable[str]) -> None:
        self._needs_flush = True  # the prefix cache holds keys/values of the old weights
        if self._repushed is not None:
            self._repushed.update(names)
            if self._repushed >= set(self.specs):
                self._repushed = None

    def _push_flat(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        from sglang.srt.utils import MultiprocessingSerializer  # optional heavy dependency (sglang)
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        flat, metas = flatten_bucket(bucket, self.dtype)
        if flat.is_cuda:
            # The sender side of SGLang's CUDA-IPC device mapping (weight_sync/utils.py ~42). Only for CUDA
            # tensors: it replaces torch's tensor reductions, and CPU tensors then no longer pickle.
            monkey_patch_torch_reductions()
        payload = {"flattened_tensor": flat,
                   "metadata": [FlattenedTensorMetadata(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype,
                                                        start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel)
                                for m in metas]}
        # One payload per TP rank; each rank deserializes only its own (engine.py ~1656).
        per_rank = [MultiprocessingSerializer.serialize(payload) for _ in range(self.tp_size)]
        _check(self.engine.update_weights_from_tensor(per_rank, load_format="flattened_bucket", flush_cache=False),
               "update_weights_from_tensor")
        return unflatten_bucket(flat, metas)

    @contextlib.contextmanager
    def _weight_session(self):
        """0.5.21 accepts tensor/distributed updates only inside begin/end_weight_update."""
        _check(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            yield
        except BaseException:
            self.engine.end_weight_update()  # close the session; the push error is the one to report
            raise
        _check(self.engine.end_weight_update(), "end_weight_update")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Push HF-named tensors (any order, any subset) into the engine; returns the names written.

        Works while asleep: released weights are resumed first (the KV cache stays released).
        """
        items = validate_named_tensors(named_tensors, self.specs, self.skip)
        if not items:
            return []
        self._resume(["weights"])
        probe = set(self.probe_names)
        with self._weight_session():
            for bucket in iter_cast_buckets(items, self.dtype, self.bucket_bytes):
                sent = self._push_flat(bucket)
                for name, t in sent:  # t: the cast tensor exactly as sent
                    self._digests[name] = tensor_digest(name, t)
                    self._broadcast.discard(name)
                    if name in probe:
                        self._probes[name] = t[:4].to("cpu", torch.float32)
                self._mark_pushed(n for n, _ in sent)
        return [n for n, _ in items]

    def init_weight_sync_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                               group_name: str = "coxswain_weights", backend: str = "nccl") -> None:
        """Join the trainer's weight-broadcast group (split placement): this engine's TP ranks become
        ranks ``rank_offset .. rank_offset + tp_size - 1`` of ``world_size``; the sender is rank 0."""
        _check(self.engine.init_weights_update_group(master_address=master_address, master_port=master_port,
                                                     rank_offset=rank_offset, world_size=world_size,
                                                     group_name=group_name, backend=backend),
               "init_weights_update_group")

    def destroy_weight_sync_group(self, group_name: str = "coxswain_weights") -> None:
        """Leave the weight-broadcast group (``destroy_weights_update_group``, engine.py ~1544)."""
        _check(self.engine.destroy_weights_update_group(group_name=group_name), "destroy_weights_update_group")

    def update_weights_broadcast(self, specs: Sequence[tuple[str, Sequence[int]]], group_name: str = "coxswain_weights",
                                 digests: Mapping[str, bytes] | None = None,
                                 probes: Mapping[str, torch.Tensor] | None = None) -> list[str]:
        """Receive one bucket broadcast by group rank 0 (blocks until it arrives).

        ``specs``: ``(name, shape)`` in buffer order; the sender broadcasts
        ``flatten_bucket(tensors, engine dtype)[0]`` over the group, concurrently with this call.
        ``digests``: the sender's ``tensor_digest(name, cast tensor)`` per name; this engine never sees
        the bytes, so without them :meth:`weights_checksum` refuses to answer for these names.
        ``probes``: the sender's first rows of some tensors as sent (``probe_rows``, float32): for those,
        :meth:`verify_weights_on_gpu` reads the engine's copy back and compares.
        """
        names = [n for n, _ in specs]
        # Shapes checked on meta tensors (no memory); skipped names (tied lm_head) are errors here,
        # since the sender's buffer layout must match the names exactly.
        validate_named_tensors([(n, torch.empty(tuple(s), dtype=self.dtype, device="meta")) for n, s in specs], self.specs)
        self._resume(["weights"])
        dt = str(self.dtype).removeprefix("torch.")
        with self._weight_session():
            _check(self.engine.update_weights_from_distributed(
                names=names, dtypes=[dt] * len(names), shapes=[list(s) for _, s in specs], group_name=group_name,
                flush_cache=False, load_format="flattened_bucket"), "update_weights_from_distributed")
        for n in names:
            self._digests[n] = (digests or {}).get(n)
            probe = (probes or {}).get(n)
            if probe is not None and n in self.probe_names:  # the sender's rows as sent: read back and compared
                self._probes[n] = probe
                self._broadcast.discard(n)
            else:
                self._probes.pop(n, None)
                self._broadcast.add(n)
        self._mark_pushed(names)
        return names

    def weights_checksum(self) -> str:
        """:func:`~trainer.rollout.engine.checksum_named_tensors` (engine dtype, HF names, tied
        lm_head left out) over what the engine was given: the last push per name, else the checkpoint."""
        self._check_weights_valid("report a weight checksum")
        unverified = sorted(n for n, d in self._digests.items() if d is None)
        if unverified:
            raise RuntimeError(f"{len(unverified)} weights (e.g. {unverified[0]!r}) were broadcast without digests; "
                               f"their contents cannot be vouched for")
        missing = [n for n in self.specs if n not in self._digests]
        for name, t in iter_safetensors(self.model_path, missing):
            self._digests[name] = tensor_digest(name, t, self.dtype)
        return combine_digests({n: self._digests[n] for n in self.specs})  # type: ignore[misc]

    def verify_weights_on_gpu(self, rows: int = 4) -> dict[str, float | None]:
        """Read the probe parameters back from the GPU: ``{name: max |engine - expected|}`` (0.0 when
        exact), ``None`` where the model class has no ``get_weights_by_name`` (e.g. Qwen2 in 0.5.21)."""
        self._check_weights_valid("read weights back")
        if "weights" in self._released:
            raise RuntimeError("the weights are released (sleep); wake() or push them first")
        rows = min(rows, 4)  # probes keep 4 rows
        result: dict[str, float | None] = {}
        for name in self.probe_names:
            if name in self._broadcast:
                continue  # never seen here; its digest vouches for it instead
            want = self._probes.get(name)
            if want is None:
                (_, t), = iter_safetensors(self.model_path, [name])
                want = probe_rows(t, 4, self.dtype)
            want = want[:rows]
            got = self.engine.get_weights_by_name(name, truncate_size=rows)
            if got is None:
                result[name] = None
                continue
            result[name] = readback_error(torch.tensor(got, dtype=torch.float32), want)
        return result

    def shutdown(self) -> None:
        self.engine.shutdown()
