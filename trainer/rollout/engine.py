"""The rollout engine interface: what every engine (native torch, SGLang, a user's) promises the trainer.

An engine class declares what it can do (``capabilities``, :class:`trainer.rollout.registry.Capabilities`),
is built from the rollout config by :meth:`RolloutEngine.from_rollout`, and says at run time what this machine
lacks to run it (:meth:`RolloutEngine.unavailable`); ``rollout.name`` finds it in the registry.

An engine turns prompts (token ids) into sampled responses and returns, for each sampled token, the
log-probability the sampler gave it. Rollout importance sampling corrects the trainer's recomputed
log-probs against these, so their definition must match the trainer's exactly:

    logprob_t = log_softmax(logits_t / T)[y_t]            over the FULL vocabulary

where ``logits_t`` are the model's raw next-token logits at step t, ``T`` the sampling temperature and
``y_t`` the sampled token. Decisions, stated once here:

* Temperature is applied before the log-softmax (the sampler's distribution, as in SGLang's
  ``return_logprob``; vLLM's default returns the raw ``T = 1`` log-probs instead).
* top-k / top-p truncation is NOT reflected in the returned log-probs. They only restrict which tokens
  can be drawn; the log-prob is still taken over the full vocabulary, because that is what the trainer
  recomputes (``log_softmax(logits / T)``). A truncated-and-renormalised log-prob would be larger than
  the trainer's by log(kept mass) and show up as a spurious mismatch.
* Greedy decoding (``temperature == 0``) returns ``log_softmax(logits)[y_t]``, i.e. ``T`` taken as 1,
  since ``logits / 0`` has no distribution.
* The stop token that ended a response IS part of ``token_ids`` (and gets a log-prob): the trainer
  must see exactly the sequence that was sampled, or the end-of-sequence decision is never trained.

Weight sync is checked with :func:`checksum_named_tensors`, a pure function that both sides compute:
the engine over the weights it holds (:meth:`RolloutEngine.weights_checksum`), the trainer over the
HF-named stream it sends; a mismatch (or a failed push) is a :class:`WeightSyncError`, whoever checks.

Routed experts (R3 routing replay) travel between processes in SGLang's form (sgl-project/sglang PR #12162,
``meta_info["routed_experts"]``): the base64 of int32 ``[tokens, layers, top_k]`` in native byte order, one row
per input token (every prompt token, every sampled token but the last); :func:`encode_routes` /
:func:`decode_routes` are that form, used by the SGLang adapter, the HTTP fleet client and the native server.
"""

from __future__ import annotations

import abc
import base64
import ctypes
import xxhash
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from trainer.rollout.registry import Capabilities

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the responses of one prompt.

    ``top_k`` of 0 or None and ``top_p`` of 1.0 switch those filters off. ``temperature == 0`` is greedy
    (argmax; ties go to the lowest token id, like ``torch.argmax``). ``seed`` makes sampling
    reproducible; see the engine for how it is turned into per-request random streams.
    """

    n: int = 1  # responses per prompt
    temperature: float = 1.0  # logits are divided by this before softmax; 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest top set whose probability reaches top_p
    top_k: int | None = None  # keep the k most likely tokens; 0 / None = no filter
    max_new_tokens: int = 128  # response length cap (finish_reason "length")
    stop_token_ids: tuple[int, ...] = ()  # sampling one of these ends the response (finish_reason "stop")
    seed: int | None = None  # None = nondeterministic
    # MoE routing replay (R3): return each input token's top-k experts per MoE layer with the output
    return_routed_experts: bool = False

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 or None, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # Accept any iterable of ints (a list from JSON, a set) but store a hashable tuple.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_k_or_zero(self) -> int:
        return self.top_k or 0


@dataclass
class GenerationOutput:
    """One sampled response.

    ``token_ids[i]`` was sampled with log-probability ``logprobs[i]`` (definition in the module
    docstring), so ``len(token_ids) == len(logprobs)`` always. On ``finish_reason == "stop"`` the last
    token is the stop token.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    # with ``SamplingParams.return_routed_experts`` (MoE): ``[len(prompt) + len(token_ids) - 1, R, k]``
    # int16, the experts each INPUT token (every prompt token, every sampled token but the last) was
    # routed to in each of the R MoE layers, as the engine computed them while sampling
    routed_experts: "torch.Tensor | None" = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


class RolloutEngine(abc.ABC):
    """What the controller and the rollout loops may call on any engine."""

    # True when ``generate`` with a per-prompt params LIST draws each prompt's samples from a stream
    # keyed by that prompt's own ``seed`` alone (not by its position in the call), so a seeded request
    # gives the same samples whatever it is batched with. The async batcher and the multi-turn loop
    # rely on it to batch seeded requests together; an engine without it gets one seeded item per call.
    request_keyed_seeds: bool = False
    # what this engine can do (trainer.rollout.registry): the checks, the cluster and the fleet ask this
    capabilities: Capabilities = Capabilities()

    @classmethod
    def from_rollout(cls, model_path: str, *, max_batch_size: int, max_seq_len: int, dtype: str,
                     engine_kwargs: dict | None = None, settings: dict | None = None) -> "RolloutEngine":
        """One engine as ``actor_rollout_ref.rollout`` describes it (what the rollout worker calls):
        ``dtype`` a torch dtype's name, ``engine_kwargs`` the user's ``rollout.engine_kwargs``,
        ``settings`` verl's other engine keys (tensor_model_parallel_size, gpu_memory_utilization, seed,
        max_num_batched_tokens, enable_chunked_prefill, enforce_eager; enable_rollout_routing_replay when R3 is
        on) for the engines that read them.
        By default ``cls(model_path, max_batch_size=, max_seq_len=, dtype=torch.<dtype>, **engine_kwargs)``."""
        return cls(model_path, max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=getattr(torch, dtype),
                   **(engine_kwargs or {}))

    @classmethod
    def unavailable(cls, *, server: bool) -> str | None:
        """Why this machine cannot run the engine (in a worker, or with ``server`` as the fleet's HTTP
        servers), with the fix; None when it can. Asked at run time, not at config load."""
        return None

    @abc.abstractmethod
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[GenerationOutput]]:
        """Sample ``params.n`` responses for every prompt.

        ``params`` is one :class:`SamplingParams` for all prompts, or one per prompt (see
        ``request_keyed_seeds`` for what a seed means then). Returns ``out[i][j]``: response ``j`` of
        prompt ``i``.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy (name, tensor) pairs in HF naming into the engine; returns the names written.

        The stream may come in buckets and in any order; a partial stream updates only those names.
        An unknown name or a wrong shape is an error (a silent skip would make a sync look done).
        """

    @abc.abstractmethod
    def weights_checksum(self) -> str:
        """:func:`checksum_named_tensors` over the weights the engine holds, in HF naming."""

    def sleep(self) -> None:
        """Release what memory the engine can (KV cache, ...) until :meth:`wake`."""

    def wake(self) -> None:
        """Take back what :meth:`sleep` released."""

    @abc.abstractmethod
    def abort(self) -> None:
        """End in-flight generation: unfinished responses come back with ``finish_reason == "abort"``."""


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # Raw bytes of a contiguous CPU tensor, for any dtype, read in place through its address: a numpy
    # view (t.numpy()) would do the same but mark the storage non-resizable for good, and offload
    # (megatron_bridge.offload) frees a parameter's memory by resizing its storage (the caller keeps
    # ``t`` alive while the view is read).
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def new_hasher():
    """The weight-sync hash: XXH3-128 (Collet, xxHash; non-cryptographic, ~30 GB/s per core here against
    sha256's ~2 GB/s). A sync check guards against corruption and bugs (a missed bucket, a wrong cast, a
    stale tensor), not against an adversary who controls the bytes; 128 bits make an accidental match
    ~2^-128. Checkpoints keep sha256 (trainer/checkpoint.py): their manifest is a tamper check."""
    return xxhash.xxh3_128()


_CHUNK_BYTES = 512 << 10  # what hashing streams through at a time: it stays in a core's L2 cache


def _hash_rows(h, t: torch.Tensor) -> None:
    """Feed the row-major bytes of CPU tensor ``t`` to ``h``, in place where it can: all at once when
    ``t`` is contiguous; a 2-D view with contiguous rows (a column block of a matrix) row by row when
    rows are long (>= 8 KiB; the hash streams, so this equals hashing its contiguous copy, without the
    copy), else through a contiguous copy of at most ``_CHUNK_BYTES`` at a time (cheaper than a
    Python call per short row, and it stays in cache)."""
    if t.numel() == 0:
        return
    if t.is_contiguous():
        h.update(_tensor_bytes(t))
        return
    if t.dim() != 2 or t.stride(1) != 1:
        t = t.contiguous()  # kept alive by the name while its bytes are read
        h.update(_tensor_bytes(t))
        return
    es, rows = t.element_size(), t.shape[0]
    row, step = t.shape[1] * es, t.stride(0) * es
    if row >= 8192:
        span = memoryview((ctypes.c_ubyte * ((rows - 1) * step + row)).from_address(t.data_ptr())).cast("B")
        for off in range(0, rows * step, step):
            h.update(span[off:off + row])
        return
    k = max(1, _CHUNK_BYTES // row)
    for r in range(0, rows, k):
        c = t[r:r + k].contiguous()
        h.update(_tensor_bytes(c))


def tensor_digest(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> bytes:
    """XXH3-128 of (name, dtype, shape, raw bytes) of one tensor, after an optional cast to ``dtype``."""
    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)  # round-to-nearest-even, the same rounding as copy_ into an engine buffer
    t = t.to("cpu")
    h = new_hasher()
    h.update(name.encode())
    h.update(b"\0" + str(t.dtype).encode() + b"\0" + repr(tuple(t.shape)).encode() + b"\0")
    _hash_rows(h, t)
    return h.digest()


def encode_routes(routes: torch.Tensor) -> str:
    """int ``[tokens, layers, top_k]`` -> SGLang's wire form (base64 of int32, native byte order)."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routes(text: str, layers: int, top_k: int, rows: int | None = None) -> torch.Tensor:
    """SGLang's wire form -> int16 ``[rows, layers, top_k]`` (the batch's ``routed_experts`` dtype).

    ``rows``, when given, is what the caller expects (prompt + sampled tokens - 1); a reply with another row
    count, or whose length is not a whole number of ``layers x top_k`` rows, is a ``ValueError`` naming both:
    a silent reshape would replay one token's experts on another."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"routed_experts is not base64 ({e})") from None
    per_row = 4 * layers * top_k
    if len(raw) % per_row or (rows is not None and len(raw) // per_row != rows):
        raise ValueError(f"routed_experts holds {len(raw)} bytes = {len(raw) / per_row:g} rows of {layers} layers x "
                         f"top-{top_k} int32, but {rows} input tokens were routed (prompt + sampled - 1)")
    if not raw:
        return torch.empty((0, layers, top_k), dtype=torch.int16)
    t = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(len(raw) // per_row, layers, top_k)
    return t.to(torch.int16)


@dataclass(frozen=True)
class RouteShape:
    """What one request's routed experts must look like: the model's MoE layers and top-k, its prompt length."""

    layers: int
    top_k: int
    prompt_len: int = 0


def routes_of(meta: Mapping, shape: RouteShape, rows: int, cut: bool = False) -> torch.Tensor:
    """``meta_info["routed_experts"]`` -> int16 ``[rows, layers, top_k]``; ``cut`` (an aborted request): the
    reply may route more tokens than were kept, and is cut to ``rows``."""
    text = meta.get("routed_experts")
    if not isinstance(text, str):
        raise ValueError(f"request {meta.get('id')}: routed experts were asked for, but the reply has none (the "
                         f"engine or server must run with enable_return_routed_experts)")
    t = decode_routes(text, shape.layers, shape.top_k, None if cut else rows)
    if len(t) < rows:
        raise ValueError(f"request {meta.get('id')}: routed experts for {len(t)} input tokens, {rows} expected")
    return t[:rows]


def moe_shape(config: Mapping) -> RouteShape | None:
    """The routed-experts shape of an HF config: every layer is a MoE layer (trainer.hf_io refuses mixed
    dense/MoE stacks), ``num_experts_per_tok`` experts each; None for a dense model."""
    k = config.get("num_experts_per_tok")
    n = config.get("num_experts", config.get("num_local_experts"))
    if not k or not n:
        return None
    return RouteShape(layers=int(config["num_hidden_layers"]), top_k=int(k))


def extend_routes(before: torch.Tensor | None, after: torch.Tensor | None) -> torch.Tensor | None:
    """The routes of a sequence generated in segments: a response resumed after an abort (partial rollout) or
    the next turn of an episode (multi-turn). The later request's prompt is the whole sequence so far, so the
    engine routes those tokens again (possibly with newer weights, and for the tokens after the last fed one
    for the first time). Every token keeps the experts it was routed to when it was first fed while sampling:
    the earlier segment's rows, then the later one's rows beyond them (the last sampled token of the earlier
    segment, any tool tokens, and the new segment's input tokens).

    ``None`` on either side: that segment has no routes. A later segment without routes (a resumed request
    aborted again before the engine gave it a slot: nothing fed, nothing sampled) keeps the earlier routes;
    dropping them would let the next resume re-route the whole prefix under newer weights."""
    if after is None:
        return before
    if before is None:
        return after
    return torch.cat([before, after[len(before):]])


class WeightSyncError(RuntimeError):
    """A weight sync failed: a push did not arrive, or an engine's (or a rank's) weights differ from the
    source's after it (:func:`checksum_named_tensors` disagrees)."""


def checksum_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None = None,
    ignore: Container[str] = (),
) -> str:
    """Exact, order-independent fingerprint of a set of named tensors (hex XXH3-128, :func:`new_hasher`).

    Each tensor is hashed on its own: ``d_name = H(name, dtype, shape, bytes)``; the result is
    ``H(d_a || d_b || ...)`` over the names in sorted order. So it does not depend on the order
    or bucketing of the stream, but any changed bit, shape, dtype or name changes it. Cost: one pass
    over the bytes (XXH3 runs at ~30 GB/s per core; about 7 ms for a 50M-parameter fp32 model, where
    sha256 took 0.1-0.2 s), plus a device-to-host copy for GPU tensors, one tensor at a time.

    ``dtype``: cast every tensor to this dtype first. The trainer passes the engine's dtype, so a bf16
    engine and an fp32 trainer agree exactly when the sync (which casts the same way) is right.
    ``ignore``: names to leave out, e.g. ``{"lm_head.weight"}`` for a tied-embedding model, where
    engines hold no separate lm_head tensor.
    """
    digests: dict[str, bytes] = {}
    for name, t in named_tensors:
        if name in ignore:
            continue
        if name in digests:
            raise ValueError(f"tensor {name!r} appears twice in the stream")
        digests[name] = tensor_digest(name, t, dtype)
    total = new_hasher()
    for name in sorted(digests):
        total.update(digests[name])
    return total.hexdigest()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a (name, tensor) stream into lists of at most ``bucket_bytes`` (a lone larger tensor
    forms its own bucket). Order is kept. ``dtype``: measure sizes as after a cast to it (what is sent)."""
    itemsize = None if dtype is None else torch.empty((), dtype=dtype).element_size()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * (itemsize or t.element_size())
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
