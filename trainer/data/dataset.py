"""Prompt datasets in verl's row format, and a resumable shuffled sampler.

A row (parquet, jsonl or a json list) looks like::

    {"data_source": "openai/gsm8k",                               # selects the scorer
     "prompt": [{"role": "user", "content": "..."}],             # chat messages (prompt_key)
     "reward_model": {"style": "rule", "ground_truth": "72"},    # what the scorer compares with
     "extra_info": {"split": "train", "index": 0, ...}}          # optional, passed to the scorer

:class:`RLDataset` reads the files, checks every row, renders the prompt with the tokenizer's chat
template (``add_generation_prompt=True``) and tokenises it once, up front.

* **Bad rows** (a missing key, a wrong type, an empty prompt, a line that is not JSON) are reported
  with the file and the row number (1-based; "line" for jsonl). ``on_bad_row="error"`` raises
  :class:`BadRowError` naming file, row, fault and fix; ``"skip"`` drops the row, counts it in
  ``stats["bad_rows"]`` and logs one summary.
* **No chat template** (a base model's tokenizer): the plain fallback renders a single user message
  as its content verbatim (so ``"12+34="`` stays ``"12+34="``), and several messages as
  ``"role: content"`` lines followed by ``"assistant: "``. No special tokens are added.
* **Overlong prompts** (more than ``max_prompt_length`` tokens): dropped and counted when
  ``filter_overlong_prompts``; otherwise ``truncation`` decides: ``error`` (raise, naming the row),
  ``left`` (keep the last tokens) or ``right`` (keep the first).

:class:`PromptSampler` draws batches of indices from a seeded permutation per epoch (Python's
``random.Random(f"{seed}:{epoch}")``, whose stream is stable across platforms and versions). Its
``state_dict()`` is ``{epoch, offset, seed, ...}``; loading it continues with exactly the batches an
uninterrupted run would have drawn. A batch never straddles two epochs: the tail of an epoch that is
shorter than the batch is dropped (as verl's ``drop_last``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import stat
from typing import Any, Iterable, Sequence

import numpy
import torch

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
_FORMAT_FIX = (
    "each row needs prompt=[{'role': 'user', 'content': '...'}], data_source='...', "
    "reward_model={'ground_truth': ...} and optionally extra_info={...} (verl's format); "
    "raw GSM8K / MATH files can be converted with `python -m trainer.data.convert`"
)


class BadRowError(ValueError):
    """A dataset row that cannot be used; the message names the file, the row, the fault and the fix."""


class _Fault(Exception):
    def __init__(self, fault: str, fix: str = _FORMAT_FIX):
        super().__init__(fault)
        self.fault, self.fix = fault, fix


# ----------------------------------------------------------------------------------------------
# reading and checking rows
# ----------------------------------------------------------------------------------------------
def iter_raw_rows(path: str) -> Iterable[tuple[str, Any]]:
    """Yield ``(where, row)`` for each row of a parquet / jsonl / json file; ``row`` is a ``_Fault``
    for a jsonl line that is not JSON. ``where`` is ``"row N"`` or ``"line N"`` (1-based)."""
    if os.path.isdir(path):
        raise BadRowError(f"dataset path {path!r} is a directory (data.train_files / data.val_files): give the "
                          f".parquet / .jsonl / .json files in it, as a list for several")
    try:
        mode = os.stat(path).st_mode  # stat, not open: opening a FIFO blocks until a writer comes
    except FileNotFoundError:
        raise FileNotFoundError(f"dataset file {path!r} does not exist (data.train_files / data.val_files)") from None
    if not stat.S_ISREG(mode):
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise BadRowError(f"dataset path {path!r} is {kind}, not a data file (data.train_files / data.val_files): "
                          f"give a .parquet / .jsonl / .json file")
    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for a damaged file
            raise BadRowError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e)[:200]}); "
                              f"re-export it (e.g. pandas.DataFrame.to_parquet) or convert it to .jsonl") from None
        for n, row in enumerate(rows, 1):
            yield f"row {n}", row
    elif lower.endswith(".jsonl"):
        # bytes, decoded line by line: a text-mode reader decodes ahead in chunks, so its error would come
        # with the line number of wherever the reading had got to, not of the offending byte
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadRowError(f"{path}: not UTF-8 text at line {n}, byte {e.start + 1} of the line ({e.reason}); "
                                      f"re-encode the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    yield f"line {n}", json.loads(line)
                except json.JSONDecodeError as e:
                    yield f"line {n}", _Fault(f"not valid JSON ({e.msg} at column {e.colno})", "fix or remove the line")
                except RecursionError:
                    yield f"line {n}", _Fault("JSON nested too deeply to read", "flatten or remove the line")
    elif lower.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise BadRowError(f"{path}: not a readable JSON file ({type(e).__name__}: {str(e)[:200]}); "
                              f"fix it, or write one JSON object per line as .jsonl") from None
        if not isinstance(data, list):
            raise BadRowError(f"{path}: a .json dataset must be a list of rows, got {type(data).__name__}")
        for n, row in enumerate(data, 1):
            yield f"row {n}", row
    else:
        raise BadRowError(f"dataset file {path!r}: unsupported format; use .parquet, .jsonl or .json")


def check_row(row: Any, prompt_key: str = "prompt", reward_fn_key: str = "data_source") -> dict:
    """Validate one row; returns ``{messages, data_source, ground_truth, extra_info}`` or raises _Fault."""
    if isinstance(row, _Fault):
        raise row
    if not isinstance(row, dict):
        raise _Fault(f"the row is a {type(row).__name__}, not an object")
    if prompt_key not in row:
        raise _Fault(f"missing key {prompt_key!r} (keys: {sorted(row)})")
    msgs = row[prompt_key]
    if isinstance(msgs, str):
        raise _Fault(
            f"{prompt_key!r} is a string; it must be a list of chat messages",
            f"write it as [{{'role': 'user', 'content': <the text>}}]",
        )
    if not isinstance(msgs, (list, tuple)):
        raise _Fault(f"{prompt_key!r} is a {type(msgs).__name__}; it must be a list of chat messages")
    if not msgs:
        raise _Fault(f"empty prompt: {prompt_key!r} has no messages")
    clean = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _Fault(f"{prompt_key}[{j}] is not a {{'role', 'content'}} message: {str(m)[:80]!r}")
        if m["role"] not in ROLES:
            raise _Fault(f"{prompt_key}[{j}] has role {m['role']!r}; expected one of {ROLES}")
        if not isinstance(m["content"], str):
            raise _Fault(f"{prompt_key}[{j}].content is a {type(m['content']).__name__}, not a string")
        clean.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in clean):
        raise _Fault("empty prompt: every message's content is blank")
    ds = row.get(reward_fn_key)
    if not isinstance(ds, str) or not ds:
        raise _Fault(f"missing or non-string {reward_fn_key!r} (it selects the scorer)")
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise _Fault("missing reward_model.ground_truth")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise _Fault(f"extra_info is a {type(extra).__name__}; it must be an object or absent")
    return {"messages": clean, "data_source": ds, "ground_truth": rm["ground_truth"], "extra_info": extra or {}}


MIN_CHARS_PER_TOKEN_BOUND = 64
NORMALISER_MARGIN = 4


def chars_per_token_bound(tokenizer) -> int:
    """More characters of message content than ``max_prompt_length`` times this cannot fit in
    ``max_prompt_length`` tokens, so such a prompt can be dropped without tokenizing it. Why it is safe: the
    rendered prompt holds every message's content (the chat template only adds text), and one token stands for
    at most as many characters as its vocabulary entry is long (a byte-level BPE entry of L symbols decodes
    to L bytes, at most L characters; a SentencePiece piece is its characters, with '▁' for a space; byte
    fallback entries such as '<0x0A>' are longer than the one byte they stand for). The longest entry, never
    under 64, is then multiplied by 4 for a normaliser that composes a base character and its combining marks
    into one character before the vocabulary is applied. (A normaliser that deletes characters outright, as
    BERT's does with control characters, has no such bound; chat models' tokenizers do not delete text.)"""
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):  # a tokenizer without a vocabulary to read
        longest = 0
    return max(longest, MIN_CHARS_PER_TOKEN_BOUND) * NORMALISER_MARGIN


def render_prompt(messages: Sequence[dict], tokenizer, chat_template_kwargs: dict | None = None) -> str:
    """The prompt text: the tokenizer's chat template, or the plain fallback (module docstring)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
        )
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


# ----------------------------------------------------------------------------------------------
# the dataset
# ----------------------------------------------------------------------------------------------
class RLDataset(torch.utils.data.Dataset):
    """Checked, tokenised prompts. Items are dicts: ``input_ids`` (list of int), ``prompt_text``,
    ``messages``, ``data_source``, ``ground_truth``, ``extra_info``, ``source`` ("file: row N")."""

    def __init__(
        self,
        files: str | Sequence[str] | None = None,
        tokenizer=None,
        *,
        rows: Sequence[dict] | None = None,
        max_prompt_length: int = 1024,
        prompt_key: str = "prompt",
        reward_fn_key: str = "data_source",
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
        on_bad_row: str = "error",
        chat_template_kwargs: dict | None = None,
        max_samples: int = -1,
        shuffle: bool = False,
        seed: int | None = None,
    ):
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
        if truncation not in ("error", "left", "right"):
            raise ValueError(f"truncation must be 'error', 'left' or 'right', got {truncation!r}")
        if (files is None) == (rows is None):
            raise ValueError("give exactly one of files= or rows=")
        self.tokenizer = tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.stats = {"rows": 0, "bad_rows": 0, "filtered_overlong": 0, "truncated": 0}
        self.bad_rows: list[str] = []  # the first 20 bad-row messages

        sources: list[tuple[str, Iterable]] = []
        if rows is not None:
            sources.append(("<rows>", ((f"row {n}", r) for n, r in enumerate(rows, 1))))
        else:
            for path in [files] if isinstance(files, (str, os.PathLike)) else list(files):
                sources.append((str(path), iter_raw_rows(str(path))))

        checked: list[dict] = []
        for path, it in sources:
            skipped_here = 0
            for where, raw in it:
                self.stats["rows"] += 1
                try:
                    item = check_row(raw, prompt_key, reward_fn_key)
                except _Fault as f:
                    msg = f"{path}: {where}: {f.fault}"
                    if on_bad_row == "error":
                        raise BadRowError(
                            f"{msg}. Fix: {f.fix}. Or set data.on_bad_row=skip to skip and count bad rows."
                        ) from None
                    self.stats["bad_rows"] += 1
                    skipped_here += 1
                    if len(self.bad_rows) < 20:
                        self.bad_rows.append(msg)
                    continue
                item["source"] = f"{path}: {where}"
                checked.append(item)
            if skipped_here:
                logger.warning(
                    "%s: skipped %d bad row(s) (data.on_bad_row=skip); first: %s",
                    path, skipped_here, next((m for m in self.bad_rows if m.startswith(path)), ""),
                )

        if 0 < max_samples < len(checked):  # verl's max_samples: a seeded sample without replacement, or the first rows
            keep = (numpy.random.default_rng(seed).choice(len(checked), size=max_samples, replace=False) if shuffle
                    else range(max_samples))
            checked = [checked[int(i)] for i in keep]
        if filter_overlong_prompts and tokenizer is not None:
            # Drop, before rendering and tokenizing, the prompts whose characters alone cannot fit: a
            # 2M-character prompt would otherwise be tokenized whole just to be dropped (minutes, GBs).
            limit = self.max_prompt_length * chars_per_token_bound(tokenizer)
            kept = [it for it in checked if sum(len(m["content"]) for m in it["messages"]) <= limit]
            self.stats["filtered_overlong"] += len(checked) - len(kept)
            checked = kept
        texts = [render_prompt(it["messages"], tokenizer, chat_template_kwargs) for it in checked]
        if tokenizer is not None and texts:
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        else:
            ids = [None] * len(texts)
        self.items: list[dict] = []
        for it, text, tok in zip(checked, texts, ids):
            it["prompt_text"] = text
            if tok is not None and len(tok) > self.max_prompt_length:
                if filter_overlong_prompts:
                    self.stats["filtered_overlong"] += 1
                    continue
                if truncation == "error":
                    raise BadRowError(
                        f"{it['source']}: the prompt has {len(tok)} tokens, more than "
                        f"data.max_prompt_length={self.max_prompt_length}. Fix: raise data.max_prompt_length, "
                        f"set data.filter_overlong_prompts=true to drop such prompts, or "
                        f"data.truncation=left|right to cut them."
                    )
                tok = tok[-self.max_prompt_length :] if truncation == "left" else tok[: self.max_prompt_length]
                self.stats["truncated"] += 1
            it["input_ids"] = list(tok) if tok is not None else None
            self.items.append(it)
        if not self.items:
            raise BadRowError(
                f"no usable rows in {[p for p, _ in sources]}: stats {self.stats}; first bad rows: {self.bad_rows[:3]}"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def build_dataset(data_cfg, tokenizer, split: str = "train", synthetic_rows=None) -> RLDataset:
    """A dataset from ``data.*`` settings (``train_files`` / ``val_files``); ``None`` files give
    ``synthetic_rows(num, split)`` when given (a multi-turn environment's task generator), else the
    shipped synthetic arithmetic task (``trainer.data.synthetic``), in memory."""
    files = data_cfg.train_files if split == "train" else data_cfg.val_files
    kw = dict(
        max_prompt_length=data_cfg.max_prompt_length,
        prompt_key=data_cfg.prompt_key,
        reward_fn_key=data_cfg.reward_fn_key,
        filter_overlong_prompts=data_cfg.filter_overlong_prompts,
        truncation=data_cfg.truncation,
        on_bad_row=data_cfg.on_bad_row,
        max_samples=data_cfg.train_max_samples if split == "train" else data_cfg.val_max_samples,
        shuffle=data_cfg.shuffle,
        seed=1 if data_cfg.seed is None else data_cfg.seed,  # verl's unseeded None would not reproduce
    )
    if files is None:
        from trainer.data import synthetic

        n = 2048 if split == "train" else 256
        if synthetic_rows is not None:
            return RLDataset(tokenizer=tokenizer, rows=synthetic_rows(n, split), **kw)
        # 1-2 digit addition: the task the shipped tiny model (recipes/cpu/make_tiny_model.py) was pretrained on
        rows = synthetic.make_rows(n, "train" if split == "train" else "test", ops=("+",), max_digits=2)
        return RLDataset(tokenizer=tokenizer, rows=rows, **kw)
    files = list(files) if not isinstance(files, str) else [files]
    return RLDataset(files, tokenizer, **kw)


# ----------------------------------------------------------------------------------------------
# the sampler
# ----------------------------------------------------------------------------------------------
class PromptSampler:
    """Seeded, shuffled batches of indices with an exactly restorable position (module docstring)."""

    def __init__(self, num_items: int, seed: int = 1, shuffle: bool = True):
        if num_items <= 0:
            raise ValueError("PromptSampler needs at least one item")
        self.num_items, self.seed, self.shuffle = int(num_items), int(seed), bool(shuffle)
        self.epoch, self.offset = 0, 0
        self._perm_epoch, self._perm = -1, []

    def _order(self) -> list[int]:
        if self._perm_epoch != self.epoch:
            perm = list(range(self.num_items))
            if self.shuffle:
                random.Random(f"{self.seed}:{self.epoch}").shuffle(perm)
            self._perm_epoch, self._perm = self.epoch, perm
        return self._perm

    def next(self, batch_size: int) -> list[int]:
        """The next ``batch_size`` indices; moves to the next epoch when this one has too few left."""
        if not 0 < batch_size <= self.num_items:
            raise ValueError(f"batch_size={batch_size} must be in 1..{self.num_items} (the dataset size)")
        if self.offset + batch_size > self.num_items:
            self.epoch, self.offset = self.epoch + 1, 0
        idx = self._order()[self.offset : self.offset + batch_size]
        self.offset += batch_size
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_items": self.num_items, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        if int(state["num_items"]) != self.num_items:
            raise ValueError(
                f"sampler state is for a dataset of {state['num_items']} prompts but this one has {self.num_items}: "
                f"the data files (or filtering settings) changed since the checkpoint, so exact resume is impossible"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.seed, self.shuffle = int(state["seed"]), bool(state.get("shuffle", True))
        self._perm_epoch = -1
