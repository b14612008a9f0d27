"""The typed batch that flows through a training step, and length-balanced partitioning.

``RolloutBatch`` is a ``tensordict.TensorClass``: a dataclass whose fields share the leading batch
dimension ``B``. tensordict gives indexing, ``torch.cat``, ``to(device)`` and pickling; this module
adds what a step needs on top:

* a schema (``FIELD_SPECS``): every field's symbolic shape and dtype class, checked on construction,
  on assignment (``batch.old_log_probs = x``) and whenever tensordict rebuilds an instance
  (indexing, ``cat``, ``to``, unpickling). A mismatch raises ``ValueError`` naming the field, the
  shape it has, the shape it should have and the field the size was taken from;
* data-parallel splitting (``dp_split``), concatenation with a clear error when parts hold different
  fields (``RolloutBatch.cat``), row selection by a LongTensor (``batch[idx]``, used by the DAPO
  group filter);
* per-sample non-tensor data (data source, ground truth, uid, ...) in the ``meta`` field: a
  ``TensorDict`` with batch size ``[B]`` whose entries are ``NonTensorStack``s (one Python object per
  sample), so they follow every split, cat and index like the tensors do;
* a numpy form (``to_numpy_dict`` / ``from_numpy_dict``) for moving a batch through Ray: Ray's
  object store hands numpy arrays over with zero-copy pickle-5 buffers, while torch tensors are
  pickled through a byte copy.

Shapes. ``P`` is the padded prompt width, ``T`` the padded response width, ``L = P + T``.
Prompts are LEFT-padded and responses RIGHT-padded, so ``input_ids = cat(prompts, responses)`` has
its valid tokens contiguous. ``attention_mask`` marks every real token (prompt, sampled and, in
multi-turn, environment/tool tokens); ``response_mask`` is the LOSS mask over the response part: 1 on
tokens the policy sampled, 0 on padding and on tool/environment tokens. So the compute cost of a
sample is ``attention_mask.sum()`` (``num_tokens``), not ``response_mask.sum()``.

Length-balanced partitioning. Data-parallel ranks wait for the slowest one, so the summed tokens
per rank should be even. Two heuristics for multiway number partitioning (minimise the largest
part sum), each with an optional equal-cardinality constraint (every rank gets ``n/k`` samples):

* ``karmarkar_karp``: the largest differencing method (Karmarkar & Karp 1982, "The differencing
  method of set partitioning"), generalised to ``k`` parts as in Korf 1998 ("A complete anytime
  algorithm for number partitioning", Sec. 7.3). Each state is a k-tuple of subsets sorted by sum;
  the two states with the largest spread (max sum - min sum) are merged by pairing the heaviest
  subset of one with the lightest of the other, until one state is left. For equal sizes the
  items, sorted, are cut into runs of ``k`` and each run starts as one state with one item per
  subset, so every merge keeps all subsets of a state the same size (the balanced LDM of
  Michiels et al. 2003). Known worst-case ratios to the optimum max-sum: ``4/3 - 1/(3k)`` for the
  free version (Michiels, Korst, Aarts, van Leeuwen 2007) and ``2 - 1/k`` for the balanced one
  with ``k`` given (Michiels et al. 2003).
* ``greedy_lpt``: longest processing time first (Graham 1969): items in decreasing order, each to
  the currently lightest part (among the parts not yet full, for equal sizes). Ratio
  ``4/3 - 1/(3k)`` for the free version.

``partition_imbalance`` reports max/min/mean part sums and the imbalance ratio max/mean (1.0 is
perfect balance). ``RolloutBatch.balanced_split`` partitions a batch by ``num_tokens``;
``restore_order`` puts per-rank results back into the original sample order.

No deviation from the cited methods, except tie-breaking (deterministic: by insertion order).
"""

from __future__ import annotations

import heapq
from typing import Callable, Optional, Sequence

import numpy as np
import torch

import trainer.lazy_dynamo  # noqa: F401  (first: tensordict without torch._dynamo, see its docstring)
from tensordict import NonTensorData, NonTensorStack, TensorClass, TensorDict
from trainer.algos.utils import load_fn

# --------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------

# dtype classes a field may hold. Ids and indices must be int64 (they index embeddings and
# tensors); masks may be bool or any integer type; float fields any floating type (float32 by
# convention, bf16/fp64 allowed).
INT64 = "int64"
MASK = "bool or integer"
FLOAT = "floating point"
INDEX = "integer"

# field -> (symbolic shape, dtype class). "L" is P + T.
FIELD_SPECS: dict[str, tuple[tuple[str, ...], str]] = {
    "prompts": (("B", "P"), INT64),
    "responses": (("B", "T"), INT64),
    "attention_mask": (("B", "L"), MASK),
    "response_mask": (("B", "T"), MASK),
    "input_ids": (("B", "L"), INT64),
    "position_ids": (("B", "L"), INT64),
    "rollout_log_probs": (("B", "T"), FLOAT),
    "routed_experts": (("B", "L", "R", "K"), INDEX),
    "old_log_probs": (("B", "T"), FLOAT),
    "ref_log_probs": (("B", "T"), FLOAT),
    "sum_pi_squared": (("B", "T"), FLOAT),
    "values": (("B", "T"), FLOAT),
    "token_level_scores": (("B", "T"), FLOAT),
    "token_level_rewards": (("B", "T"), FLOAT),
    "advantages": (("B", "T"), FLOAT),
    "returns": (("B", "T"), FLOAT),
    "rollout_is_weights": (("B", "T"), FLOAT),
    "step_ids": (("B", "T"), INT64),
    "group_ids": (("B",), INT64),
    "acc": (("B",), FLOAT),
    "scores": (("B",), FLOAT),
}


def _dtype_ok(dtype: torch.dtype, kind: str) -> bool:
    if kind == INT64:
        return dtype == torch.int64
    if kind == MASK:
        return dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)
    if kind == INDEX:
        return dtype != torch.bool and not (dtype.is_floating_point or dtype.is_complex)
    return dtype.is_floating_point


def _fmt_dims(dims: tuple[str, ...]) -> str:
    return "[" + ", ".join("P+T" if d == "L" else d for d in dims) + "]"


class RolloutBatch(TensorClass["shadow"]):  # "shadow": the field `values` hides TensorDict.values()
    """One step's samples. ``batch_size == [B]``; see the module docstring for P, T, L and masks.

    Required fields come first; every other field is ``None`` until the phase that fills it runs.
    """

    # ---- required: written by the rollout ----
    prompts: torch.Tensor  # [B, P] int64, prompt token ids, LEFT-padded
    responses: torch.Tensor  # [B, T] int64, response token ids, RIGHT-padded
    attention_mask: torch.Tensor  # [B, P+T] bool/int, 1 on every real token (prompt, sampled, tool)
    response_mask: torch.Tensor  # [B, T] bool/int, loss mask: 1 on sampled tokens, 0 on pad and tool/env tokens
    # ---- model inputs ----
    input_ids: Optional[torch.Tensor] = None  # [B, P+T] int64, cat(prompts, responses)
    position_ids: Optional[torch.Tensor] = None  # [B, P+T] int64, cumsum(attention_mask) - 1, clamped at 0
    # ---- log-probs ----
    rollout_log_probs: Optional[torch.Tensor] = None  # [B, T] float32, the sampler's log-probs of the responses
    routed_experts: Optional[torch.Tensor] = None  # [B, P+T, R, K] int16, R3 routing replay: each input token's K experts in each of the R MoE layers, as the engine routed it; -1 where it did not (pads, each response's last token)
    old_log_probs: Optional[torch.Tensor] = None  # [B, T] float32, trainer's log-probs at the start of the step
    ref_log_probs: Optional[torch.Tensor] = None  # [B, T] float32, reference model's log-probs
    sum_pi_squared: Optional[torch.Tensor] = None  # [B, T] float32, sum_v pi(v)^2 of the start-of-step policy at each response position (actor.calculate_sum_pi_squared)
    # ---- critic / rewards / advantages ----
    values: Optional[torch.Tensor] = None  # [B, T] float32, critic values V(s_t)
    token_level_scores: Optional[torch.Tensor] = None  # [B, T] float32, reward-function scores (usually on the last token)
    token_level_rewards: Optional[torch.Tensor] = None  # [B, T] float32, scores after KL-in-reward / shaping
    advantages: Optional[torch.Tensor] = None  # [B, T] float32
    returns: Optional[torch.Tensor] = None  # [B, T] float32
    rollout_is_weights: Optional[torch.Tensor] = None  # [B, T] float32, detached rollout-IS weights
    # ---- indices ----
    step_ids: Optional[torch.Tensor] = None  # [B, T] int64, assistant-turn index of each token (multi-turn, ADCA), -1 elsewhere
    group_ids: Optional[torch.Tensor] = None  # [B] int64, prompt/group index: responses to one prompt share it
    # ---- per-sample scalars ----
    acc: Optional[torch.Tensor] = None  # [B] float32, task accuracy (0/1 for verifiable rewards)
    scores: Optional[torch.Tensor] = None  # [B] float32, sequence score (sum of token_level_scores)
    # ---- non-tensor, per sample ----
    meta: Optional[TensorDict] = None  # TensorDict, batch [B]: NonTensorStack per key (data_source, ground_truth, uid, ...)

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        self.validate()

    def set(self, key, value, *args, **kwargs):
        # Every field assignment (constructor and `batch.x = v`) lands here: check the one field
        # against the sizes the other fields fix. tensordict itself checks the leading dim B.
        if isinstance(key, str) and value is not None:
            if key in FIELD_SPECS:
                self._check_field(key, value, self._sizes(exclude=key))
            elif key == "meta":
                _check_meta(value)
        return super().set(key, value, *args, **kwargs)

    def _sizes(self, exclude: str | None = None) -> dict[str, tuple[int, str]]:
        """Sizes of P, T, L fixed by the present fields: symbol -> (size, field it came from)."""
        sizes: dict[str, tuple[int, str]] = {}
        for name, (dims, _) in FIELD_SPECS.items():
            if name == exclude:
                continue
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != len(dims):
                continue
            for i, d in enumerate(dims):
                if d != "B" and d not in sizes:
                    sizes[d] = (int(t.shape[i]), name)
        return sizes

    @staticmethod
    def _check_field(name: str, value, sizes: dict[str, tuple[int, str]]) -> None:
        dims, kind = FIELD_SPECS[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"RolloutBatch.{name} must be a torch.Tensor {_fmt_dims(dims)}, got {type(value).__name__}")
        if value.dim() != len(dims):
            raise ValueError(
                f"RolloutBatch.{name} must have shape {_fmt_dims(dims)} ({len(dims)} dims), "
                f"got shape {list(value.shape)}"
            )
        if not _dtype_ok(value.dtype, kind):
            raise ValueError(f"RolloutBatch.{name} must be {kind}, got {value.dtype}")
        # derived sizes: L = P + T, and either of P, T from the other two
        sz = {k: v for k, v in sizes.items()}
        if "L" not in sz and "P" in sz and "T" in sz:
            sz["L"] = (sz["P"][0] + sz["T"][0], f"{sz['P'][1]} + {sz['T'][1]}")
        if "P" not in sz and "L" in sz and "T" in sz:
            sz["P"] = (sz["L"][0] - sz["T"][0], f"{sz['L'][1]} - {sz['T'][1]}")
        if "T" not in sz and "L" in sz and "P" in sz:
            sz["T"] = (sz["L"][0] - sz["P"][0], f"{sz['L'][1]} - {sz['P'][1]}")
        for i, d in enumerate(dims):
            if d == "B" or d not in sz:
                continue
            want, src = sz[d]
            if int(value.shape[i]) != want:
                sym = "P+T" if d == "L" else d
                raise ValueError(
                    f"RolloutBatch.{name} must have shape {_fmt_dims(dims)}, got {list(value.shape)}: "
                    f"dim {i} is {value.shape[i]} but {sym}={want} (from '{src}')"
                )

    def validate(self) -> "RolloutBatch":
        """Check every present field against ``FIELD_SPECS`` and P + T == L. Returns self."""
        for name in FIELD_SPECS:
            t = getattr(self, name)
            if t is not None:
                self._check_field(name, t, self._sizes(exclude=name))
        m = self.meta
        if m is not None:
            _check_meta(m)
        return self

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tokens(
        cls,
        prompts: torch.Tensor,  # [B, P] int64, left-padded
        responses: torch.Tensor,  # [B, T] int64, right-padded
        prompt_mask: torch.Tensor,  # [B, P] 1 on real prompt tokens
        response_attention_mask: torch.Tensor,  # [B, T] 1 on real response tokens (sampled and tool)
        response_mask: torch.Tensor | None = None,  # [B, T] loss mask; default: response_attention_mask
        meta: dict[str, Sequence] | None = None,
        **fields,
    ) -> "RolloutBatch":
        """Build a batch and its model inputs (``input_ids``, ``attention_mask`` as bool,
        ``position_ids``) from left-padded prompts and right-padded responses."""
        attention_mask = torch.cat([prompt_mask.bool(), response_attention_mask.bool()], dim=1)  # [B, L]
        # position of each real token counted from the first one; left pads get 0
        position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp_min(0)  # [B, L]
        if response_mask is None:
            response_mask = response_attention_mask.bool()
        b = prompts.shape[0]
        return cls(
            prompts=prompts,
            responses=responses,
            attention_mask=attention_mask,
            response_mask=response_mask,
            input_ids=torch.cat([prompts, responses], dim=1),
            position_ids=position_ids,
            meta=make_meta(meta, b) if meta is not None else None,
            batch_size=[b],
            **fields,
        )

    # ------------------------------------------------------------------ sizes
    @property
    def num_samples(self) -> int:
        return int(self.batch_size[0])

    @property
    def prompt_width(self) -> int:
        """P, the padded prompt width."""
        return int(self.prompts.shape[1])

    @property
    def response_width(self) -> int:
        """T, the padded response width."""
        return int(self.responses.shape[1])

    @property
    def prompt_length(self) -> torch.Tensor:
        """[B] int64: real prompt tokens per sample."""
        return self.attention_mask[:, : self.prompt_width].sum(dim=1, dtype=torch.int64)

    @property
    def response_length(self) -> torch.Tensor:
        """[B] int64: real (non-pad) response tokens per sample, tool/env tokens included.
        Taken from ``attention_mask``, not from the loss mask ``response_mask``."""
        return self.attention_mask[:, self.prompt_width :].sum(dim=1, dtype=torch.int64)

    @property
    def num_loss_tokens(self) -> torch.Tensor:
        """[B] int64: tokens that carry loss (sampled tokens), ``response_mask.sum(-1)``."""
        return self.response_mask.sum(dim=1, dtype=torch.int64)

    @property
    def num_tokens(self) -> torch.Tensor:
        """[B] int64: prompt + response real tokens, the per-sample compute cost for balancing."""
        return self.attention_mask.sum(dim=1, dtype=torch.int64)

    def trim_padding(self) -> tuple["RolloutBatch", int, int]:
        """The batch without the prompt columns that are padding in EVERY row (from the left) and the
        response columns that are padding in every row (from the right): ``(batch, lead, tail)``,
        ``P' = P - lead``, ``T' = T - tail`` (at least one response column is kept).

        Prompts are padded to ``data.max_prompt_length`` and responses to the response budget, so a
        batch of short prompts or early stops carries columns no row uses; every model pass over
        them is wasted compute (quadratic in attention). No real token moves relative to another
        and position ids are per token, so outputs over the kept columns are unchanged; per-token
        results of the trimmed batch map back with ``[:, :T']`` of the full ``[B, T]``."""
        P, T = self.prompt_width, self.response_width
        real = self.attention_mask.bool().any(0)  # [L] some row has a real token in this column
        lead = P if not bool(real[:P].any()) else int(real[:P].int().argmax())
        resp = real[P:]
        keep = max(1, int(resp.nonzero().max()) + 1) if bool(resp.any()) else 1
        tail = T - keep
        if lead == 0 and tail == 0:
            return self, 0, 0
        cols = {"P": slice(lead, P), "T": slice(0, keep), "L": slice(lead, P + keep)}
        fields = {}
        for name, (dims, _) in FIELD_SPECS.items():
            t = getattr(self, name)
            if t is not None:
                fields[name] = t[:, cols[dims[1]]] if len(dims) >= 2 else t
        return type(self)(**fields, meta=self.meta, batch_size=self.batch_size), lead, tail

    def widen(self, P: int, T: int) -> "RolloutBatch":
        """The batch padded to prompt width ``P >= prompt_width`` (on the left) and response width
        ``T >= response_width`` (on the right): the inverse of ``trim_padding``. Pads are 0 (ids,
        masks, floats), -1 for ``step_ids`` (no turn) and ``routed_experts`` (not routed). ``cat`` widens its parts to their widest."""
        p0, t0 = self.prompt_width, self.response_width
        if P < p0 or T < t0:
            raise ValueError(f"widen: ({P}, {T}) is narrower than the batch's ({p0}, {t0})")
        if (P, T) == (p0, t0):
            return self
        left, right = P - p0, T - t0
        fields = {}
        for name, (dims, _) in FIELD_SPECS.items():
            t = getattr(self, name)
            if t is None or len(dims) == 1:
                fields[name] = t
                continue
            fill = -1 if name in ("step_ids", "routed_experts") else 0
            pad = {"P": (left, 0), "T": (0, right), "L": (left, right)}[dims[1]]
            pad = (0, 0) * (len(dims) - 2) + pad  # F.pad lists the last dim first: dim 1 after the trailing ones
            fields[name] = torch.nn.functional.pad(t, pad, value=fill) if t.dtype != torch.bool else \
                torch.nn.functional.pad(t.to(torch.uint8), pad, value=fill).bool()
        return type(self)(**fields, meta=self.meta, batch_size=self.batch_size)

    def present_fields(self) -> list[str]:
        """Names of the fields that are set (not None), in declaration order."""
        return [n for n in (*FIELD_SPECS, "meta") if getattr(self, n) is not None]

    # ------------------------------------------------------------------ non-tensor data
    def get_meta(self, key: str) -> list:
        """The per-sample Python objects stored under ``meta[key]``, as a list of length B."""
        if self.meta is None or key not in self.meta.keys():
            have = [] if self.meta is None else sorted(self.meta.keys())
            raise KeyError(f"RolloutBatch.meta has no key '{key}'; keys: {have}")
        return _meta_values(self.meta, key)

    def set_meta(self, key: str, values: Sequence) -> None:
        """Store one Python object per sample under ``meta[key]`` (creates ``meta`` if needed)."""
        if len(values) != self.num_samples:
            raise ValueError(f"meta['{key}'] needs {self.num_samples} values (one per sample), got {len(values)}")
        if self.meta is None:
            self.meta = make_meta({key: values}, self.num_samples)
        else:
            self.meta.set(key, _stack(values))

    # ------------------------------------------------------------------ split / cat
    def dp_split(self, k: int, allow_uneven: bool = False) -> list["RolloutBatch"]:
        """Contiguous split into exactly ``k`` data-parallel chunks.

        Equal chunks of B/k samples; ``B % k != 0`` is an error unless ``allow_uneven``, in which
        case the first ``B % k`` chunks get one sample more. (Named ``dp_split`` because tensordict's
        own ``split(n)`` takes a chunk SIZE, like ``torch.split``.)
        """
        b = self.num_samples
        if k < 1:
            raise ValueError(f"dp_split: k must be >= 1, got {k}")
        if b % k != 0 and not allow_uneven:
            raise ValueError(
                f"dp_split: batch of {b} samples does not divide into {k} equal chunks "
                f"({b} % {k} = {b % k}); pick a batch size that is a multiple of {k} or pass allow_uneven=True"
            )
        q, r = divmod(b, k)
        sizes = [q + 1 if i < r else q for i in range(k)]
        out, start = [], 0
        for s in sizes:
            out.append(self[start : start + s])
            start += s
        return out

    @classmethod
    def cat(cls, batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Concatenate along B, each part widened to the widest (``widen``). All parts must hold the
        same fields (and the same meta keys)."""
        batches = list(batches)
        if not batches:
            raise ValueError("RolloutBatch.cat: need at least one batch")
        present = [set(b.present_fields()) for b in batches]
        union = set().union(*present)
        if any(p != union for p in present):
            bad = {i: sorted(union - p) for i, p in enumerate(present) if p != union}
            raise ValueError(
                f"RolloutBatch.cat: every part must hold the same fields; missing (part index -> fields): {bad}"
            )
        if "meta" in union:
            keys = [set(b.meta.keys()) for b in batches]
            allk = set().union(*keys)
            if any(k_ != allk for k_ in keys):
                bad = {i: sorted(allk - k_) for i, k_ in enumerate(keys) if k_ != allk}
                raise ValueError(f"RolloutBatch.cat: meta keys differ; missing (part index -> keys): {bad}")
        P = max(b.prompt_width for b in batches)
        T = max(b.response_width for b in batches)
        return torch.cat([b.widen(P, T) for b in batches], dim=0)

    # ------------------------------------------------------------------ balanced partitioning
    def balanced_split(
        self,
        k: int,
        method: str | Callable = "kk",
        equal_size: bool = True,
        workloads: Sequence[int] | torch.Tensor | None = None,
    ) -> tuple[list["RolloutBatch"], list[list[int]], dict[str, float]]:
        """Split into ``k`` parts with even summed ``num_tokens`` (or the given per-sample workloads).

        ``method``: ``"kk"`` (Karmarkar-Karp), ``"lpt"`` (greedy LPT), or ``"pkg.module:function"``
        with the signature of ``karmarkar_karp``. Returns ``(parts, index_lists, metrics)``:
        ``parts[i] == self[index_lists[i]]``; ``restore_order(parts, index_lists)`` gives ``self``
        back. Metrics: ``partition_imbalance`` of the result, plus ``naive_imbalance_ratio`` of the
        plain contiguous split, for comparison.
        """
        fn = load_fn(method, PARTITIONERS, "partition method")
        w = self.num_tokens if workloads is None else workloads
        seqlens = [int(x) for x in (w.tolist() if isinstance(w, torch.Tensor) else w)]
        if len(seqlens) != self.num_samples:
            raise ValueError(f"balanced_split: {len(seqlens)} workloads for {self.num_samples} samples")
        index_lists = fn(seqlens, k, equal_size)
        parts = [self[torch.tensor(ix, dtype=torch.long)] for ix in index_lists]
        metrics = partition_imbalance(seqlens, index_lists)
        metrics["naive_imbalance_ratio"] = partition_imbalance(seqlens, _contiguous(len(seqlens), k))["imbalance_ratio"]
        return parts, index_lists, metrics

    # ------------------------------------------------------------------ numpy form (Ray transport)
    def to_numpy_dict(self) -> dict:
        """A plain dict of numpy arrays (zero-copy views of CPU tensors) and Python lists.

        Layout: ``{"batch_size": B, "fields": {name: ndarray}, "meta": {key: list},
        "meta_tensors": {key: ndarray}, "torch_dtypes": {name: str}}``. numpy has no bfloat16, so a
        bf16 tensor travels as its int16 bit pattern and ``torch_dtypes`` records it.
        """
        out: dict = {"batch_size": self.num_samples, "fields": {}, "meta": {}, "meta_tensors": {}, "torch_dtypes": {}}
        for name in FIELD_SPECS:
            t = getattr(self, name)
            if t is None:
                continue
            out["fields"][name] = _to_numpy(t, name, out["torch_dtypes"])
        if self.meta is not None:
            for key in self.meta.keys():
                v = self.meta.get(key)
                if isinstance(v, torch.Tensor):
                    out["meta_tensors"][key] = _to_numpy(v, f"meta.{key}", out["torch_dtypes"])
                else:
                    out["meta"][key] = _meta_values(self.meta, key)
        return out

    @classmethod
    def from_numpy_dict(cls, d: dict, device=None, copy: bool | None = None) -> "RolloutBatch":
        """Inverse of ``to_numpy_dict``. ``copy=None`` copies only read-only arrays (Ray's zero-copy
        arrays are read-only, and a tensor over them must not be written); ``True``/``False`` force."""
        b = int(d["batch_size"])
        dt = d.get("torch_dtypes", {})
        fields = {n: _from_numpy(a, dt.get(n), copy) for n, a in d["fields"].items()}
        meta = None
        if d.get("meta") or d.get("meta_tensors"):
            meta = make_meta(d.get("meta", {}), b)
            for key, a in d.get("meta_tensors", {}).items():
                meta.set(key, _from_numpy(a, dt.get(f"meta.{key}"), copy))
        batch = cls(**fields, meta=meta, batch_size=[b])
        return batch if device is None else batch.to(device)


# --------------------------------------------------------------------------------------------------
# helpers: non-tensor data and numpy
# --------------------------------------------------------------------------------------------------


def _stack(values: Sequence) -> NonTensorStack:
    # Each value is wrapped in NonTensorData explicitly: a bare list of lists would otherwise be
    # turned into a nested stack or a tensor, and the objects would not come back as given.
    return NonTensorStack(*[NonTensorData(v) for v in values])


def make_meta(values: dict[str, Sequence], batch_size: int) -> TensorDict:
    """Build a ``meta`` TensorDict (batch ``[B]``) from ``{key: one Python object per sample}``."""
    td = TensorDict({}, batch_size=[batch_size])
    for key, vals in values.items():
        if len(vals) != batch_size:
            raise ValueError(f"meta['{key}'] has {len(vals)} values for a batch of {batch_size}")
        td.set(key, _stack(list(vals)) if batch_size > 0 else NonTensorStack.from_list([]))
    return td


def _meta_values(meta: TensorDict, key: str) -> list:
    v = meta[key]
    return list(v.tolist() if hasattr(v, "tolist") else v)


def _check_meta(m) -> None:
    if not isinstance(m, TensorDict):
        raise TypeError(f"RolloutBatch.meta must be a TensorDict with batch [B] (use make_meta), got {type(m).__name__}")


def _to_numpy(t: torch.Tensor, name: str, dtypes: dict) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        dtypes[name] = "bfloat16"
        t = t.view(torch.int16)
    return t.numpy()


def _from_numpy(a: np.ndarray, torch_dtype: str | None, copy: bool | None) -> torch.Tensor:
    if copy or (copy is None and not a.flags.writeable):
        a = np.array(a, copy=True)
    t = torch.from_numpy(a)
    if torch_dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t


# --------------------------------------------------------------------------------------------------
# partitioning (pure functions over Python ints)
# --------------------------------------------------------------------------------------------------


def _check_k(n: int, k: int, equal_size: bool, who: str) -> None:
    if k < 1:
        raise ValueError(f"{who}: k must be >= 1, got {k}")
    if equal_size and n % k != 0:
        raise ValueError(
            f"{who}: equal_size needs the number of items ({n}) to be a multiple of k ({k}); "
            f"{n} % {k} = {n % k}"
        )


def _kk_merge(x: list, y: list, k: int) -> list:
    """Merge two states (lists of ``(sum, members)`` sorted heaviest first, at most ``k`` entries;
    missing entries are empty subsets): subset ``i`` of ``x`` joins subset ``k-1-i`` of ``y``."""
    a, b = len(x), len(y)
    lo = k - b  # the first i whose partner y[k-1-i] exists
    out = list(x[: min(a, lo)])  # x's heaviest subsets meet empty subsets of y
    for i in range(lo, k):
        yj = y[k - 1 - i]
        out.append((x[i][0] + yj[0], x[i][1] + yj[1]) if i < a else yj)
    out.sort(key=lambda p: -p[0])  # stable: ties keep their order
    return out


def karmarkar_karp(seqlens: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """Largest differencing method into ``k`` parts; returns ``k`` lists of item indices (each sorted).

    With ``equal_size`` every part gets exactly ``len(seqlens) / k`` items.
    """
    n = len(seqlens)
    _check_k(n, k, equal_size, "karmarkar_karp")
    order = sorted(range(n), key=lambda i: (-seqlens[i], i))  # heaviest first, ties by index
    # A state is a list of at most k (sum, members) subsets, heaviest first; the subsets not listed
    # are empty (sum 0), which keeps the free version O(n log n) instead of O(n k).
    if equal_size:
        seeds = [order[j : j + k] for j in range(0, n, k)]  # each run of k: one item per subset
    else:
        seeds = [[i] for i in order]  # one item, k-1 empty subsets
    heap: list = []
    for tie, run in enumerate(seeds):
        state = [(seqlens[i], [i]) for i in run]
        spread = state[0][0] - (state[-1][0] if len(state) == k else 0)
        heap.append((-spread, tie, state))
    heapq.heapify(heap)
    tie = len(seeds)
    while len(heap) > 1:
        _, _, x = heapq.heappop(heap)  # largest spread
        _, _, y = heapq.heappop(heap)  # second largest
        state = _kk_merge(x, y, k)
        spread = state[0][0] - (state[-1][0] if len(state) == k else 0)
        heapq.heappush(heap, (-spread, tie, state))
        tie += 1
    subsets = [sorted(m) for _, m in heap[0][2]] if heap else []
    return subsets + [[] for _ in range(k - len(subsets))]


def greedy_lpt(seqlens: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """Longest processing time first into ``k`` parts; returns ``k`` lists of item indices (sorted).

    With ``equal_size`` a part that holds ``len(seqlens) / k`` items takes no more.
    """
    n = len(seqlens)
    _check_k(n, k, equal_size, "greedy_lpt")
    cap = n // k if equal_size else n
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, p) for p in range(k)]  # (load, part); ties go to the lower part index
    for i in sorted(range(n), key=lambda i: (-seqlens[i], i)):
        load, p = heapq.heappop(heap)
        parts[p].append(i)
        if len(parts[p]) < cap:
            heapq.heappush(heap, (load + seqlens[i], p))
    return [sorted(p) for p in parts]


PARTITIONERS: dict[str, Callable] = {"kk": karmarkar_karp, "lpt": greedy_lpt}


def partition_imbalance(seqlens: Sequence[int], partitions: Sequence[Sequence[int]]) -> dict[str, float]:
    """Token sums of the parts: ``max_tokens``, ``min_tokens``, ``mean_tokens`` (total / k) and
    ``imbalance_ratio`` = max / mean (1.0 when perfectly even; 1.0 when everything is empty)."""
    sums = [sum(seqlens[i] for i in part) for part in partitions]
    if not sums:
        raise ValueError("partition_imbalance: no partitions")
    mean = sum(sums) / len(sums)
    mx = max(sums)
    return {
        "max_tokens": float(mx),
        "min_tokens": float(min(sums)),
        "mean_tokens": float(mean),
        "imbalance_ratio": float(mx / mean) if mean > 0 else 1.0,
    }


def micro_batch_groups(tokens: Sequence[int], *, size: int, max_tokens: Optional[int] = None,
                       budget_key: str = "ppo_max_token_len_per_gpu", min_groups: int = 1) -> list[list[int]]:
    """Row groups of one rank's micro-batches: contiguous runs of ``size`` rows, or (``max_tokens``,
    verl's ``use_dynamic_bsz``) the fewest groups, length-balanced by Karmarkar-Karp, whose token sums
    all fit the budget: ``k = ceil(sum / max_tokens)`` groups, one more while the largest overflows.
    The loss is normalised over the whole mini-batch either way, so the gradient does not depend on
    the grouping. A row longer than the budget cannot fit any group and is an error naming the key.
    ``min_groups``: at least this many groups while there are rows for them (the interleaved
    pipeline schedule needs one micro-batch per pipeline stage)."""
    n = len(tokens)
    if max_tokens is None:
        groups = [list(range(s, min(n, s + size))) for s in range(0, n, size)]
        return groups if len(groups) >= min(min_groups, n) else _contiguous(n, min(min_groups, n))
    longest = max(tokens, default=0)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens does not fit the micro-batch token budget {budget_key}="
                         f"{max_tokens}: raise it to at least the longest prompt + response")
    k = max(1, min_groups, -(-sum(tokens) // max_tokens))
    while True:
        groups = [sorted(g) for g in karmarkar_karp(list(tokens), min(k, n), equal_size=False) if g]
        if max(sum(tokens[i] for i in g) for g in groups) <= max_tokens or k >= n:
            return sorted(groups)
        k += 1


def _contiguous(n: int, k: int) -> list[list[int]]:
    q, r = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        s = q + 1 if i < r else q
        out.append(list(range(start, start + s)))
        start += s
    return out


def inverse_permutation(index_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """[B] int64 ``inv`` such that ``cat(parts)[inv]`` is in the original order, where
    ``parts[i]`` holds the rows ``index_lists[i]``. The lists must cover 0..B-1 exactly once."""
    perm = torch.tensor([i for ix in index_lists for i in ix], dtype=torch.long)  # [B] row j of cat -> original index
    n = perm.numel()
    if not torch.equal(torch.sort(perm).values, torch.arange(n)):
        raise ValueError(f"index lists are not a permutation of 0..{n - 1}")
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)
    return inv


def restore_order(parts: Sequence, index_lists: Sequence[Sequence[int]]):
    """Put per-rank results back into the original sample order.

    ``parts`` are RolloutBatches or tensors with the rows ``index_lists[i]`` of the original, as
    returned by ``balanced_split`` (each possibly transformed by a worker, same row count).
    """
    parts = list(parts)
    for i, (p, ix) in enumerate(zip(parts, index_lists)):
        if len(p) != len(ix):
            raise ValueError(f"restore_order: part {i} has {len(p)} rows but its index list has {len(ix)}")
    inv = inverse_permutation(index_lists)
    if all(isinstance(p, RolloutBatch) for p in parts):
        return RolloutBatch.cat(parts)[inv]
    return torch.cat(parts, dim=0)[inv]


# ------------------------------------------------------------------ packed rows (use_remove_padding)
def pack_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """A padded batch ``[b, S]`` as one packed row: ``{"input_ids": [1, N], "cu_seqlens": [b+1],
    "pack_index": [N]}`` with ``N`` its real tokens and ``pack_index`` their flat positions in the
    ``[b, S]`` grid (rows in order, each row's real tokens in order). Rows must be contiguous (left,
    right or both sides padded), as every batch of the trainer is."""
    real = attention_mask.bool()  # [b, S]
    lens = real.sum(1)  # [b]
    idx = real.reshape(-1).nonzero().squeeze(1)  # [N]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    return {"input_ids": input_ids.reshape(-1)[idx][None], "cu_seqlens": cu, "pack_index": idx}


def unpack_padded(x: torch.Tensor, pack_index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of ``pack_padded`` for a per-token output ``[1, N]``: ``[b, S]`` with zeros on the pad
    positions (differentiable: gradients flow back to the packed tokens)."""
    flat = x.new_zeros(shape[0] * shape[1]).index_copy(0, pack_index.to(x.device), x.reshape(-1))
    return flat.view(shape)
