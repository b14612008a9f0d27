"""Generate responses for a jsonl file with the native engine.

    python -m trainer.rollout.generate --model HF_DIR --input IN.jsonl --out OUT.jsonl \
        [--temperature T --top-p P --top-k K --max-new-tokens N --n N --seed S]

Each input line is ``{"prompt_ids": [...]}`` or ``{"prompt": "text"}`` (tokenized with the tokenizer in
HF_DIR; ``--chat`` wraps it as one user message with the chat template). Other keys are kept. Each
output line is the input line plus ``response_ids``, ``logprobs`` (per response token, under
``log_softmax(logits / T)``; see :mod:`trainer.rollout.engine`) and ``finish_reason``; with ``--n > 1``
there is one output line per sample, with ``sample_index``. When a tokenizer was loaded, ``response``
holds the decoded text. Temperature 0 is greedy. Stop tokens default to the model's EOS ids, the
trainer's rule (:func:`trainer.hf_io.stop_token_ids`: the union of the tokenizer's, generation_config.json's
and config.json's); ``--stop-token-ids`` overrides.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from trainer.hf_io import stop_token_ids
from trainer.rollout.engine import SamplingParams
from trainer.rollout.native import NativeEngine


# The shared stop-id rule under the name trainer.serve and the native server import.
eos_token_ids = stop_token_ids


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer.rollout.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="local HF checkpoint dir (Llama / Qwen2 / Qwen3)")
    ap.add_argument("--input", required=True, help="jsonl with prompt_ids or prompt per line")
    ap.add_argument("--out", required=True, help="output jsonl")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop-token-ids", type=str, default=None, help="comma list; default: the model's EOS ids; '' = none")
    ap.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to text prompts")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=None, help="default: longest prompt + max_new_tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    with open(a.input, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tokenizer = None
    if any("prompt_ids" not in r for r in rows):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model)
    prompts = []
    for i, r in enumerate(rows):
        if "prompt_ids" in r:
            prompts.append([int(t) for t in r["prompt_ids"]])
        elif "prompt" in r:
            if a.chat:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer(r["prompt"], add_special_tokens=True)["input_ids"]
            prompts.append(list(ids))
        else:
            raise SystemExit(f"line {i + 1}: needs 'prompt_ids' or 'prompt'")
    if a.stop_token_ids is None:
        stop = stop_token_ids(a.model, tokenizer)
    else:
        stop = [int(t) for t in a.stop_token_ids.split(",") if t.strip()]
    params = SamplingParams(
        n=a.n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_new_tokens=a.max_new_tokens,
        stop_token_ids=stop, seed=a.seed,
    )
    max_seq_len = a.max_seq_len or (max((len(p) for p in prompts), default=1) + a.max_new_tokens)
    engine = NativeEngine(a.model, max_batch_size=a.max_batch_size, max_seq_len=max_seq_len,
                          dtype=getattr(torch, a.dtype), num_threads=a.threads)
    outputs = engine.generate(prompts, params)
    with open(a.out, "w", encoding="utf-8") as f:
        for r, outs in zip(rows, outputs):
            for j, o in enumerate(outs):
                rec = dict(r)
                if a.n > 1:
                    rec["sample_index"] = j
                rec["response_ids"] = o.token_ids
                rec["logprobs"] = o.logprobs
                rec["finish_reason"] = o.finish_reason
                if tokenizer is not None:
                    rec["response"] = tokenizer.decode(o.token_ids, skip_special_tokens=False)
                f.write(json.dumps(rec) + "\n")
    s = engine.stats
    print(f"generated {s['generated_tokens']} tokens for {len(rows)} prompts x {a.n} in {s['seconds']:.2f}s "
          f"({s['generated_tokens'] / max(s['seconds'], 1e-9):.1f} tok/s) -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
