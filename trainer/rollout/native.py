"""The native rollout engine: pure torch, CPU by default, and the reference the other engines match.

Scheduling (continuous batching). Every (prompt, sample) pair is a request. Up to ``max_batch_size``
requests are active, each owning one row ("slot") of a preallocated KV cache
(:class:`~trainer.rollout.hf_model.KVCache`). The loop is

    1. retire finished requests; their slots become free;
    2. admit waiting requests into free slots: prefill their prompts (a prompt sampled n times is
       computed once and its keys/values copied to n slots) and sample each one's first token;
    3. compact: move the highest slots into holes so that the active rows are slots 0..B-1 and the
       decode step can read the cache as plain slices (one row copy per finished request, instead
       of a gather of the whole cache every step);
    4. one decode step for all B active rows, each at its own position; sample; check stops.

So one long response does not stall the batch: the rows around it are refilled as they finish.

Sampling, for a row with temperature T, top-k k and top-p p (see :func:`sample_tokens`):

    z = logits / T;   logprob(y) = log_softmax(z)[y]        (full vocabulary, what the trainer recomputes)
    draw y from softmax(z) restricted to the k largest z (k = 0: all), renormalised, then restricted to
    the smallest prefix (by descending probability) whose mass reaches p (the HF / vLLM order:
    top-k, then top-p on the renormalised top-k distribution); T = 0 is argmax with logprob at T = 1.

The draw is inverse-CDF sampling with ONE uniform number per token: y = the first token whose
cumulative (float64) probability exceeds u * total, the CDF running over token ids in id order when
no filter is on, and over the kept tokens in descending-probability order when top-k/top-p is. The uniforms of request (prompt i, sample j)
come from its own ``random.Random`` stream seeded with ``(seed, i, j)``, so a sample depends on the
seed, the prompt's position in the call and the sample index -- not on ``max_batch_size``, on
which other requests share its batch, or on scheduling order. With a per-prompt params LIST, each
prompt is its own request: its stream is keyed by ``(its params' seed, 0, j)``, whatever its position,
so ``generate(P, [.., sp, ..])[k] == generate([P[k]], sp)[0]`` and a seeded request draws the same
samples however a batcher composes the call (``request_keyed_seeds``). One params object for all
prompts keeps the positional key, so a seeded step's prompts draw distinct streams. (A per-row stream is also what makes
one uniform per token cheap: no per-row ``torch.Generator`` call, and the rest is vectorised.)
Finite-precision caveat: rows are computed in batches of varying size, so logits can differ in the
last bits between schedules; a draw can flip only when u falls within that rounding of a CDF
boundary (probability ~1e-7 per token).
"""

from __future__ import annotations

import functools
import os
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from trainer.rollout.engine import GenerationOutput, RolloutEngine, SamplingParams, checksum_named_tensors
from trainer.rollout.hf_model import CausalLM, KVCache, decode_step
from trainer.rollout.registry import Capabilities


# --------------------------------------------------------------------------------------------------
# Sampling: pure functions over tensors
# --------------------------------------------------------------------------------------------------
def filter_probs_sorted(sorted_logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities over descending-sorted (temperature-scaled) logits ``[R, M]`` after top-k then
    top-p; unnormalised after top-p (zeros for dropped tokens).

    top-k keeps ranks < k; top-p keeps a token when the mass of strictly more likely tokens (of the
    top-k-renormalised distribution) is < p, so the first token is always kept.
    """
    M = sorted_logits.shape[-1]
    if 0 < top_k < M:
        sorted_logits = sorted_logits.masked_fill(torch.arange(M, device=sorted_logits.device) >= top_k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)  # [R, M] renormalised over the top-k
    if top_p < 1.0:
        before = probs.cumsum(-1) - probs  # [R, M] mass of the strictly better-ranked tokens
        probs = probs.masked_fill(before >= top_p, 0.0)
    return probs


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first entry whose cumulative (float64) mass exceeds ``u * total``, per row.

    probs ``[R, M]`` nonnegative (need not sum to 1), uniforms ``[R]`` in [0, 1). A zero-probability
    entry is never returned: its cumulative mass equals its predecessor's. The clamp to the first
    index reaching the total guards ``u * total`` rounding up to the total.
    """
    cdf = probs.double().cumsum(-1)  # [R, M]
    total = cdf[:, -1:].contiguous()  # [R, 1]
    target = uniforms.to(cdf.dtype)[:, None] * total  # [R, 1]
    idx = torch.searchsorted(cdf, target, right=True)  # [R, 1] first cdf > target
    last = torch.searchsorted(cdf, total, right=False)  # [R, 1] first cdf == total
    return torch.minimum(idx, last).squeeze(1)  # [R]


@functools.lru_cache(maxsize=64)
def _block_size(V: int) -> int:
    # Largest divisor of V in [64, 1024] so that [R, V] views as [R, V / bs, bs] without a copy.
    for bs in range(1024, 63, -1):
        if V % bs == 0:
            return bs
    return 0


def blocked_max_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x.amax(-1)``, ``x.argmax(-1)``) for ``[R, V]``, argmax = first index of the max.

    Same result as torch.argmax, 5-10x faster on CPU, where argmax over a long row is not vectorised
    but amax is: find the first block holding the row max, then argmax inside that block.
    """
    R, V = x.shape
    bs = _block_size(V)
    if not bs or V // bs < 2:
        m, i = x.max(-1)
        return m, i
    v = x.view(R, V // bs, bs)  # [R, nb, bs]
    bmax = v.amax(-1)  # [R, nb]
    m, b = bmax.max(-1)  # [R] row max and the first block holding it
    rows = torch.arange(R, device=x.device)
    return m, b * bs + v[rows, b].argmax(-1)  # [R]


def blocked_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """:func:`inverse_cdf` over ``[R, V]`` without a float64 cumsum of the whole row.

    Two levels: block sums -> first block whose cumulative mass exceeds ``u * total`` -> inverse CDF
    inside that block with the remaining mass. The same draw as :func:`inverse_cdf` except within
    float rounding of a boundary.
    """
    R, V = weights.shape
    bs = _block_size(V)
    if not bs or V // bs < 2:
        return inverse_cdf(weights, uniforms)
    w = weights.view(R, V // bs, bs)  # [R, nb, bs]
    bsum = w.sum(-1).double()  # [R, nb]
    cdf = bsum.cumsum(-1)  # [R, nb]
    total = cdf[:, -1:].contiguous()  # [R, 1]
    target = uniforms.to(cdf.dtype)[:, None] * total  # [R, 1]
    b = torch.minimum(torch.searchsorted(cdf, target, right=True), torch.searchsorted(cdf, total, right=False)).squeeze(1)  # [R]
    before = torch.cat([torch.zeros_like(cdf[:, :1]), cdf[:, :-1]], dim=1).gather(1, b[:, None]).squeeze(1)  # [R] mass before block b
    rows = torch.arange(R, device=weights.device)
    j = inverse_cdf_remaining(w[rows, b], uniforms.to(cdf.dtype) * total.squeeze(1) - before)  # [R]
    return b * bs + j


def inverse_cdf_remaining(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    # First index whose cumulative mass exceeds ``mass`` (absolute, not a fraction), clamped to the
    # first index that reaches the row total (so never a zero-mass entry).
    cdf = probs.double().cumsum(-1)  # [R, M]
    idx = torch.searchsorted(cdf, mass[:, None].to(cdf.dtype), right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(idx, last).squeeze(1)


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits [R, V]`` (fp32); returns (tokens ``[R]``, logprobs ``[R]``).

    ``logprobs = log_softmax(logits / T)[token]`` over the full vocabulary (T = 1 when greedy), see the
    module docstring; ``uniforms [R]`` in [0, 1) drive the draw (ignored when greedy).
    The log-softmax is never materialised: logprob = z[y] - max(z) - log(sum(exp(z - max(z)))).
    """
    R, V = logits.shape
    greedy = temperature == 0
    z = logits if greedy or temperature == 1.0 else logits / temperature  # [R, V]
    if greedy:
        m, tokens = blocked_max_argmax(z)  # [R], [R]
        m = m[:, None]  # [R, 1]
    else:
        m = z.amax(-1, keepdim=True)  # [R, 1]
    e = torch.sub(z, m).exp_()  # [R, V] unnormalised softmax(z)
    log_total = e.sum(-1).double().log()  # [R]
    if greedy:
        pass
    elif (top_k == 0 or top_k >= V) and top_p >= 1.0:
        tokens = blocked_inverse_cdf(e, uniforms)  # [R]
    else:
        if 0 < top_k < V:
            vals, idx = torch.topk(z, top_k, dim=-1)  # [R, k] sorted descending
        else:
            vals, idx = torch.sort(z, dim=-1, descending=True)  # [R, V]
        probs = filter_probs_sorted(vals, top_k=top_k, top_p=top_p)
        tokens = idx.gather(1, inverse_cdf(probs, uniforms)[:, None]).squeeze(1)  # [R]
    z_tok = z.gather(1, tokens[:, None]).squeeze(1)  # [R]
    logprobs = (z_tok - m.squeeze(1)).double() - log_total  # [R]
    return tokens, logprobs.float()


# --------------------------------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------------------------------
def _compiled_decode_step(cfg, gemm_template: bool, options: dict | None):
    """``torch.compile`` of :func:`decode_step` for one engine, on a code object of its own.

    Dynamo keeps compiled graphs, and counts them against its recompile limit (8), per code object
    of the compiled frame. A ``functools.partial`` is compiled through dynamo's one shared wrapper
    frame, so every engine of a process shared that budget: CI hit ``FailOnRecompileLimitHit`` once
    the rollout tests had built enough compiled engines (a server hosting several engines would
    too). A fresh code object per engine (the copy torch itself makes for nested calls) gives each
    engine its own.
    """
    def step(weights, k_cache, v_cache, tokens, positions, cos_table, sin_table):
        return decode_step(cfg, weights, k_cache, v_cache, tokens, positions, cos_table, sin_table,
                           gemm_template=gemm_template)

    step.__code__ = step.__code__.replace(co_varnames=step.__code__.co_varnames)
    return torch.compile(step, dynamic=False, fullgraph=True, options=options)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(eq=False)
class _Request:
    prompt_idx: int
    sample_idx: int
    prompt: list[int]
    params: SamplingParams
    rng: random.Random
    stop: frozenset
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    slot: int = -1
    routes: list | None = None  # routing replay: [n, R, k] chunks of its input tokens' experts

    @property
    def cached(self) -> int:
        # Positions held in the cache: the prompt and every sampled token but the last (the next input).
        return len(self.prompt) + len(self.tokens) - 1


class NativeEngine(RolloutEngine):
    """In-process torch engine with a preallocated KV cache and continuous batching.

    ``model``: an HF checkpoint dir (Llama / Qwen2 / Qwen3) or a :class:`CausalLM`.
    ``max_seq_len`` bounds prompt + response (a response reaching it ends with "length").
    ``num_threads``: if given, ``torch.set_num_threads`` (process-wide); the default leaves torch's
    choice (one thread per physical core), which suits a dedicated rollout process.
    ``prefill_tokens``: padded-token budget of one prefill forward (bounds activation memory).
    ``prepack``: keep oneDNN-prepacked copies of bf16/fp16 matmul weights (bit-identical outputs,
    2-3x faster decode matmuls on CPUs with AMX/AVX512-BF16; doubles weight memory). fp32 ignores it.
    ``kv_dtype``: KV-cache dtype (a dtype or its name); default the model's. (A compiled bf16 decode
    once kept an fp32 cache for torch's CPU flash kernel; its attention is now two matmuls and a
    softmax, :func:`~trainer.rollout.hf_model.decode_attention`, faster on a bf16 cache: bench_e2e
    generate, one core, interleaved in one process, median 0.358 s against 0.408 s.)
    ``compile_decode``: run decode steps through ``torch.compile`` of
    :func:`~trainer.rollout.hf_model.decode_step` (static shapes: the batch is padded to a power-of-two
    bucket, attention spans the full ``max_seq_len`` cache, masked). The first step of each bucket
    compiles (seconds); later steps skip the per-op dispatch of ~30 kernels per layer. Same logits
    as the eager step to float rounding. Uses plain (unpacked) weights.
    ``compile_options``: inductor options for that compile, e.g. ``{"cpp_wrapper": True}``: the
    step's kernel launches run from generated C++ instead of Python (bench_e2e decode, one core:
    generate 7% faster, paired over 10 calls, identical samples) at the price of a longer first
    compile per bucket (about 20 s instead of 5-10 s with an empty inductor cache).
    ``decode_gemm``: the compiled step's matmul kernels. ``"aten"`` (default): torch's (oneDNN / MKL
    calls, each with its own setup). ``"cpp"``: inductor's C++ GEMM template (AMX / AVX-512
    micro-kernels generated for each shape, chosen by ``max_autotune``), which needs every matmul as a
    bmm with a contiguous first operand: linears as ``(W x^T)^T`` and keys cached transposed
    (``KVCache(keys_transposed=True)``). bench_e2e decode step, bf16, one core, interleaved in one
    process: 1.9-2.7 ms against 2.7-4.3 ms (30-38% less). Costs a longer first compile (~40 s per
    bucket with an empty inductor cache). Needs ``compile_decode``.
    """

    request_keyed_seeds = True  # a per-prompt params list keys prompt i by its own seed, not by i
    # its weights can live in one flat storage (storage_layout / share_weights), take blocks into its own
    # views (hf_views), or be copied in the actor's process (hybrid); abort keeps the sampled tokens; MoE
    # routing is recorded; it serves as trainer.rollout.native_server; a second call joins a running loop; its
    # weights by HF name (hf_views) let trainer.rollout.adapters merge LoRA adapters into them
    capabilities = Capabilities(weight_protocols=("shared_memory", "dist_group", "hybrid", "object_store"),
                                partial_rollout=True, routing_replay=True, multi_turn=True, devices=("cpu", "cuda"),
                                lora_adapters=True,
                                server="trainer.rollout.fleet:NativeServers", compiled_decode=True,
                                concurrent_generate=True)

    @classmethod
    def from_rollout(cls, model_path: str, *, max_batch_size: int, max_seq_len: int, dtype: str,
                     engine_kwargs: dict | None = None, settings: dict | None = None) -> "NativeEngine":
        """The base class's, plus ``settings["hf_overrides"]`` (verl's ``model.override_config``) and
        ``settings["device"]`` (``trainer.device``: the engine runs where the trainer does, unless
        ``rollout.engine_kwargs.device`` says otherwise)."""
        settings, kwargs = settings or {}, dict(engine_kwargs or {})
        kwargs.setdefault("device", settings.get("device", "cpu"))
        return cls(model_path, max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=getattr(torch, dtype),
                   hf_overrides=settings.get("hf_overrides"), **kwargs)

    def __init__(
        self,
        model: str | CausalLM,
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        num_threads: int | None = None,
        prefill_tokens: int = 8192,
        prepack: bool = True,
        kv_dtype: torch.dtype | str | None = None,
        compile_decode: bool = False,
        compile_options: dict | None = None,
        decode_gemm: str = "aten",
        hf_overrides: dict | None = None,
    ):
        if num_threads:
            torch.set_num_threads(num_threads)
        if isinstance(model, CausalLM):
            self.model = model
        else:
            self.model = CausalLM.from_pretrained(model, dtype=dtype, device=device, max_len=max_seq_len,
                                                  overrides=hf_overrides)
        self.model.ensure_rope(max_seq_len)
        # bf16/fp16 CPU weights only; a no-op for fp32. The compiled step reads the plain weights.
        self.model.set_prepack(prepack and not compile_decode)
        self._decode_fn = None
        self._recording = False  # routing replay: this generate call records every MoE layer's top-k
        if decode_gemm not in ("aten", "cpp"):
            raise ValueError(f"decode_gemm={decode_gemm!r}: expected 'aten' or 'cpp'")
        if (compile_options or decode_gemm != "aten") and not compile_decode:
            what = "compile_options" if compile_options else "decode_gemm='cpp'"
            raise ValueError(f"{what} applies to a compiled decode: set compile_decode=true too "
                             "(actor_rollout_ref.rollout.engine_kwargs.compile_decode=true)")
        self.decode_gemm = decode_gemm
        if compile_decode and self.model.cfg.is_moe:
            raise ValueError(f"compile_decode does not support mixture-of-experts models ({self.model.cfg.model_type}: "
                             "the experts each token visits are data-dependent); leave "
                             "actor_rollout_ref.rollout.engine_kwargs.compile_decode off")
        if compile_decode:
            options = {}
            if decode_gemm == "cpp":
                # ATEN too: shapes the template cannot take (it declines some) keep torch's kernel;
                # elsewhere autotuning times both once per shape (cached on disk by inductor)
                options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
            options.update(compile_options or {})  # the caller's options win
            self._decode_fn = _compiled_decode_step(self.model.cfg, decode_gemm == "cpp", options or None)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.prefill_tokens = prefill_tokens
        if isinstance(kv_dtype, str):
            kv_dtype = getattr(torch, kv_dtype)
        if kv_dtype is None:
            kv_dtype = self.model.dtype
        self.kv_dtype = kv_dtype
        self.device = self.model.device
        self.cache: KVCache | None = None
        self._abort = threading.Event()
        self.stats: dict = {}
        # streaming admission: while a call runs its loop, other threads' calls join its queue (see generate)
        self._sched = threading.Condition()
        self._queue: deque | None = None  # the running loop's waiting requests; None when no loop runs
        self._loop_key: tuple = ()  # (cache length, recording) of the running loop: what a joiner must fit

    @property
    def config(self):
        return self.model.cfg

    # ---- memory ------------------------------------------------------------------------------
    def _ensure_cache(self, rows: int | None = None, length: int | None = None) -> KVCache:
        """A cache of at least ``rows`` slots x ``length`` positions (default: the engine's limits).

        Sized to the call, not to ``max_batch_size x max_seq_len``: a colocated engine frees its
        cache for every training phase, and zero-filling the full-size one again each step cost
        ~60 ms of page faults per engine (bench_e2e: 256 slots x 80 positions x 6 layers, 31 MB)
        where the step needed 32 slots. A cache that is already big enough is reused."""
        rows = self.max_batch_size if rows is None else min(rows, self.max_batch_size)
        length = self.max_seq_len if length is None else min(length, self.max_seq_len)
        if self._decode_fn is not None:  # static shapes: power-of-two slots, the full length
            rows, length = min(_pow2_at_least(rows), self.max_batch_size), self.max_seq_len
        c = self.cache
        if c is not None and c.max_batch >= rows and c.max_len >= length:
            return c
        if c is not None:  # grow, never shrink, until the next sleep
            rows, length = max(rows, c.max_batch), max(length, c.max_len)
        self.cache = None  # free the old one before allocating
        self.cache = KVCache(self.model.cfg, rows, length, self.kv_dtype, self.device,
                             keys_transposed=self.decode_gemm == "cpp")
        return self.cache

    def sleep(self) -> None:
        """Free the KV cache (weights stay, so ``update_weights`` works while asleep)."""
        self.cache = None

    def wake(self) -> None:
        """Nothing to allocate: ``generate`` sizes the cache to its requests (see ``_ensure_cache``)."""

    def reserve(self) -> KVCache:
        """Allocate the full ``max_batch_size x max_seq_len`` cache now (a server calls this at start,
        so an out-of-memory shows then, not at the first request); later calls reuse it."""
        return self._ensure_cache()

    # ---- weights -----------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        # The cache holds keys/values of the old weights only for finished work; nothing to flush
        # because every generate() call prefills its prompts afresh.
        return self.model.load_hf_tensors(named_tensors)

    def weights_checksum(self) -> str:
        return checksum_named_tensors(self.model.hf_tensors())

    def hf_views(self) -> dict[str, torch.Tensor]:
        """HF name -> view of the weight this engine holds (a weight sync's check reads them)."""
        return dict(self.model.hf_tensors())

    def storage_layout(self) -> tuple[str, int, dict]:
        """(dtype, elements, HF name -> (element offset, shape, stride)) of this engine's weights in one
        flat storage (:meth:`share_weights`)."""
        n, views = self.model.storage_layout()
        return str(self.model.dtype).removeprefix("torch."), n, views

    def share_weights(self, storage: torch.Tensor) -> None:
        """Hold the weights in ``storage`` from now on (a shared-memory weight sync maps it in every
        engine of the node and the actor ranks write into it: trainer/sync/shared_memory.py)."""
        self.model.move_weights(storage)

    def weights_changed(self) -> None:
        """The weights were written in place: re-derive what the model computes from them."""
        self.model.weights_changed()

    def abort(self) -> None:
        """Make the running :meth:`generate` (called from another thread) return at its next step."""
        self._abort.set()

    # ---- generation --------------------------------------------------------------------------
    def _make_requests(self, prompts, params) -> list[_Request]:
        per_prompt = not isinstance(params, SamplingParams)
        plist = list(params) if per_prompt else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        V = self.model.cfg.vocab_size
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; max_seq_len {self.max_seq_len} leaves no room to generate")
            if min(p) < 0 or max(p) >= V:
                raise ValueError(f"prompt {i} has token ids outside [0, {V})")
            seed = sp.seed if sp.seed is not None else secrets.randbits(62)
            stop = frozenset(sp.stop_token_ids)
            key = 0 if per_prompt else i  # per-prompt params: position-independent (module docstring)
            for j in range(sp.n):
                reqs.append(_Request(i, j, p, sp, random.Random(f"coxswain:{seed}:{key}:{j}"), stop))
        return reqs

    def _sample(self, logits: torch.Tensor, reqs: list[_Request]) -> None:
        """Sample each row's next token, append it with its log-prob, and mark finished requests."""
        # Group rows by sampling params (one group in the usual one-params call).
        groups: dict[tuple, list[int]] = {}
        for r_i, r in enumerate(reqs):
            sp = r.params
            groups.setdefault((sp.temperature, sp.top_k_or_zero, sp.top_p), []).append(r_i)
        toks = [0] * len(reqs)
        lps = [0.0] * len(reqs)
        for (temp, top_k, top_p), rows in groups.items():
            sub = logits if len(rows) == len(reqs) else logits[torch.tensor(rows, device=logits.device)]
            u = torch.tensor([reqs[r].rng.random() for r in rows], dtype=torch.float64, device=logits.device)
            t, lp = sample_tokens(sub, u, temperature=temp, top_k=top_k, top_p=top_p)
            for r, tt, ll in zip(rows, t.tolist(), lp.tolist()):
                toks[r], lps[r] = tt, ll
        for r, t, lp in zip(reqs, toks, lps):
            r.tokens.append(t)
            r.logprobs.append(lp)
            if t in r.stop:
                r.finish = "stop"  # the stop token stays in r.tokens
            elif len(r.tokens) >= r.params.max_new_tokens or len(r.prompt) + len(r.tokens) >= self.max_seq_len:
                r.finish = "length"

    def _prefill(self, cache: KVCache, admitted: list[_Request]) -> None:
        # One forward per distinct prompt; chunks bounded by the padded-token budget.
        by_prompt: dict[int, list[_Request]] = {}
        for r in admitted:
            by_prompt.setdefault(r.prompt_idx, []).append(r)
        groups = sorted(by_prompt.values(), key=lambda g: len(g[0].prompt))
        dev = self.device
        start = 0
        while start < len(groups):
            end = start + 1
            while end < len(groups) and (end + 1 - start) * len(groups[end][0].prompt) <= self.prefill_tokens:
                end += 1
            chunk = groups[start:end]
            start = end
            T = len(chunk[-1][0].prompt)  # sorted by length: the last is the longest
            tokens = torch.zeros(len(chunk), T, dtype=torch.long)
            for g_i, g in enumerate(chunk):
                tokens[g_i, : len(g[0].prompt)] = torch.tensor(g[0].prompt)
            lengths = torch.tensor([len(g[0].prompt) for g in chunk])
            reqs = [r for g in chunk for r in g]
            rows = torch.tensor([g_i for g_i, g in enumerate(chunk) for _ in g])
            slots = torch.tensor([r.slot for r in reqs])
            logits = self.model.prefill(cache, tokens.to(dev), lengths.to(dev), slots.to(dev), rows.to(dev))  # [n_u, V]
            if self._recording:
                routes = self._routes()  # [n_u, T, R, k]
                for g_i, g in enumerate(chunk):
                    for r in g:
                        r.routes = [routes[g_i, : len(r.prompt)]]
            self.stats["prefill_forwards"] += 1
            self.stats["prefill_tokens"] += int(lengths.sum())
            self._sample(logits.index_select(0, rows.to(dev)), reqs)

    def _routes(self) -> torch.Tensor:
        """The last forward's top-k experts of every MoE layer, ``[..., R, k]`` int16 on the host."""
        return torch.stack([m.routes for m in self.model.moe_layers()], dim=-2).to("cpu", torch.int16)

    def _compiled_decode(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Pad the batch to its bucket (the next power of two, at most the cache's slots): one graph per
        # bucket. Padding rows sit in free slots at position 0 (see decode_step).
        B = tokens.shape[0]
        bucket = min(_pow2_at_least(B), cache.max_batch)
        if bucket > B:
            pad = torch.zeros(bucket - B, dtype=tokens.dtype, device=tokens.device)
            tokens, positions = torch.cat([tokens, pad]), torch.cat([positions, pad])
        self.stats.setdefault("decode_buckets", set()).add(bucket)
        m = self.model
        return self._decode_fn(m.decode_weights(), cache.k, cache.v, tokens, positions, m.cos, m.sin)[:B]

    @torch.inference_mode()
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    ) -> list[list[GenerationOutput]]:
        """Streaming admission: a call made from another thread while a call runs joins the running
        loop: its requests queue behind the loop's and take slots as rows finish, so the rows of a
        batch's long tail are refilled with new work instead of decoding at a shrinking batch. (It
        waits for the loop to end instead when its prompt + budget exceeds the running cache's length
        or its routing-record flag differs.) Each request's stream is its own (module docstring), so
        a call's samples do not depend on whether it joined."""
        reqs = self._make_requests(prompt_token_ids, params)
        recording = any(r.params.return_routed_experts for r in reqs)
        if recording and not self.model.moe_layers():
            raise ValueError("return_routed_experts asks for MoE routing, but this model has no MoE layers")
        length = max((len(r.prompt) + r.params.max_new_tokens for r in reqs), default=1)
        with self._sched:
            while self._queue is not None:
                run_length, run_recording = self._loop_key
                if length <= run_length and recording == run_recording:
                    self._queue.extend(reqs)
                    self._sched.notify_all()
                    while any(r.finish is None for r in reqs):
                        self._sched.wait()
                    if any(r.finish == "error" for r in reqs):
                        raise RuntimeError("the engine loop this call joined failed (the other call raised the error)")
                    return self._outputs(len(prompt_token_ids), reqs)
                self._sched.wait()  # a loop this call cannot join: wait for it to end
            self._queue = deque(reqs)
            self._loop_key = (length, recording)  # widened to the cache's length once it is allocated
        self._abort.clear()
        served: list[_Request] = []
        try:
            cache = self._ensure_cache(rows=len(reqs), length=length)
            with self._sched:
                self._loop_key = (cache.max_len, recording)
            self._run_loop(cache, recording, served)
        except BaseException:
            with self._sched:  # joined calls must not wait forever on a loop that died
                for r in [*served, *self._queue]:
                    if r.finish is None:
                        r.finish = "error"
            raise
        finally:
            with self._sched:
                for r in self._queue:  # aborted before a slot: nothing sampled
                    r.finish = r.finish or "abort"
                self._queue = None
                self._sched.notify_all()
        return self._outputs(len(prompt_token_ids), reqs)

    @staticmethod
    def _outputs(n_prompts: int, reqs: list[_Request]) -> list[list[GenerationOutput]]:
        out: list[list[GenerationOutput]] = [[] for _ in range(n_prompts)]
        for r in reqs:  # reqs are in (prompt, sample) order
            routed = torch.cat(r.routes)[: len(r.prompt) + len(r.tokens) - 1] \
                if r.params.return_routed_experts and r.routes else None
            out[r.prompt_idx].append(GenerationOutput(r.tokens, r.logprobs, r.finish, routed))
        return out

    def _run_loop(self, cache: KVCache, recording: bool, served: list) -> None:
        """The continuous-batching loop (module docstring) over ``self._queue``, which other calls may
        extend while it runs; returns when it and the active rows are empty, or at an abort. Every
        request it admits is appended to ``served``."""
        t0 = time.perf_counter()
        self._recording = recording
        self.model.record_routing(recording)
        self.stats = dict(decode_steps=0, prefill_forwards=0, prefill_tokens=0, max_active=0, row_moves=0)
        # fault injection for tests (a slow engine): sleep this long before every decode step
        delay = float(os.environ.get("COXSWAIN_FAULT_DECODE_DELAY_S") or 0.0)
        waiting = self._queue
        slots = min(self.max_batch_size, cache.max_batch)
        active: list[_Request] = []  # sorted by slot
        while True:
            finished = [r for r in active if r.finish is not None]
            active = [r for r in active if r.finish is None]
            if finished:
                with self._sched:
                    self._sched.notify_all()  # joined calls check whether all their requests are done
            if self._abort.is_set():
                break
            # Admit waiting requests into the lowest free slots.
            with self._sched:
                admitted = []
                if waiting and len(active) < slots:
                    used = {r.slot for r in active}
                    for s in range(slots):
                        if not waiting:
                            break
                        if s not in used:
                            r = waiting.popleft()
                            r.slot = s
                            admitted.append(r)
                if not active and not admitted and not waiting:
                    break  # under the lock: no call can join a loop that is about to end
            if admitted:
                served += admitted
                self._prefill(cache, admitted)
                active = sorted([r for r in active + admitted if r.finish is None], key=lambda r: r.slot)
                if waiting and len(active) < slots:
                    continue  # some finished at their first token: refill before decoding
            if not active:
                continue
            # Compact: rows must be slots 0..B-1.
            B = len(active)
            holes = iter(sorted({*range(B)} - {r.slot for r in active}))
            for r in active:
                if r.slot >= B:
                    dst = next(holes)
                    cache.move_row(r.slot, dst, r.cached)
                    r.slot = dst
                    self.stats["row_moves"] += 1
            active.sort(key=lambda r: r.slot)
            self.stats["max_active"] = max(self.stats["max_active"], B)
            # Decode one token for every active row.
            if delay:
                time.sleep(delay)
            tokens = torch.tensor([r.tokens[-1] for r in active], device=self.device)
            pos_list = [r.cached for r in active]
            positions = torch.tensor(pos_list, device=self.device)
            if self._decode_fn is not None:
                logits = self._compiled_decode(cache, tokens, positions)
            else:
                logits = self.model.decode(cache, tokens, positions, max_position=max(pos_list), min_position=min(pos_list))  # [B, V]
            self.stats["decode_steps"] += 1
            if self._recording:
                routes = self._routes()  # [B, R, k]: the experts of each row's input token
                for i, r in enumerate(active):
                    r.routes.append(routes[i:i + 1])
            self._sample(logits, active)

        for r in active:
            if r.finish is None:
                r.finish = "abort"
        self._abort.clear()
        self.model.record_routing(False)
        self.stats["generated_tokens"] = sum(len(r.tokens) for r in served)
        self.stats["seconds"] = time.perf_counter() - t0
