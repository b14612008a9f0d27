"""Build the tiny model the CPU recipe trains: a character-level Qwen2 on 1-2 digit addition.

    python recipes/cpu/make_tiny_model.py [--out recipes/cpu/tiny_model] [--steps 2500] [--seed 0]

What it makes (about 1.7 MB, all in HF format, loadable by ``transformers`` and by Coxswain):
  * ``tokenizer.json``: a 16-symbol character tokenizer (``<pad> <eos> 0-9 + - * =``) with a chat
    template that renders a conversation as the concatenated message contents, so the prompt of the
    synthetic task row ``[{"role": "user", "content": "37+58="}]`` is exactly ``3 7 + 5 8 =``;
  * ``config.json`` + ``model.safetensors``: a 4-layer Qwen2 (GQA 4:2, tied embeddings, ~0.4M params).

How it is pretrained, and why the held-out accuracy starts low: the supervised corpus is the training
split of the synthetic task (``trainer.data.synthetic``; the held-out problems never appear) with a
deliberately systematic error: each problem's target is the true sum with probability ``p_correct``
(0.35), the sum plus one with probability ``p_off_by_one`` (0.50), and a random nearby number otherwise.
The model therefore learns to add, puts the right answer well inside its sampling distribution, but
its greedy answer is usually one too high. Greedy held-out accuracy starts far below the ceiling
(about 0.3), while sampling at temperature 1 finds the right answer about a third of the time — exactly
the situation in which outcome-reward RL (GRPO) has signal and visibly moves the greedy policy. The
script prints the greedy and sampled held-out accuracy at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

VOCAB = ["<pad>", "<eos>", *"0123456789", "+", "-", "*", "="]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def make_tokenizer(out_dir: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out_dir)
    return fast


def make_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(VOCAB), hidden_size=96, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6,
                      bos_token_id=None, eos_token_id=1, pad_token_id=0, torch_dtype="float32")
    return Qwen2ForCausalLM(cfg)


def noisy_target(answer: int, rng: random.Random, p_correct: float, p_off_by_one: float) -> int:
    u = rng.random()
    if u < p_correct:
        return answer
    if u < p_correct + p_off_by_one:
        return answer + 1
    return max(0, answer + rng.choice([-10, -2, -1, 2, 10]))


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def batch_of(tok, rows, rng, p_correct, p_off_by_one, eos_id):
    seqs, loss_starts = [], []
    for r in rows:
        prompt = r["prompt"][0]["content"]
        tgt = noisy_target(int(r["reward_model"]["ground_truth"]), rng, p_correct, p_off_by_one)
        p_ids = encode(tok, prompt)
        seqs.append(p_ids + encode(tok, str(tgt)) + [eos_id])
        loss_starts.append(len(p_ids))
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (s, st) in enumerate(zip(seqs, loss_starts)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        labels[i, st: len(s)] = torch.tensor(s[st:])  # loss on the answer and <eos> only
    return ids, attn, labels


@torch.no_grad()
def held_out_accuracy(model, tok, rows, *, sample: bool, seed: int = 0) -> float:
    from trainer.rewards.scorers import arith_score

    model.eval()
    prompts = [encode(tok, r["prompt"][0]["content"]) for r in rows]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left-pad for generation
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=5, do_sample=sample,
                         temperature=1.0 if sample else None, top_k=0 if sample else None, top_p=None,
                         pad_token_id=0, eos_token_id=1)
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    model.train()
    return sum(arith_score(t, r["reward_model"]["ground_truth"])["acc"] for t, r in zip(texts, rows)) / len(rows)


def main(argv=None) -> None:
    from trainer.data.synthetic import make_rows

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_model"))
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--p-correct", type=float, default=0.35)
    ap.add_argument("--p-off-by-one", type=float, default=0.50)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)  # one thread: faster than two on a busy 2-core machine, and reproducible

    tok = make_tokenizer(a.out)
    model = make_model(a.seed)
    n_params = sum(p.numel() for p in model.parameters())
    kw = dict(ops=("+",), min_digits=1, max_digits=2)
    train_rows = make_rows(4000, "train", seed=a.seed, **kw)
    test_rows = make_rows(256, "test", seed=a.seed, **kw)
    rng = random.Random(a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.05)
    t0 = time.time()
    model.train()
    for step in range(1, a.steps + 1):
        rows = rng.sample(train_rows, a.batch)
        ids, attn, labels = batch_of(tok, rows, rng, a.p_correct, a.p_off_by_one, tok.eos_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == a.steps:
            print(f"step {step}/{a.steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    model.save_pretrained(a.out, safe_serialization=True)
    greedy = held_out_accuracy(model, tok, test_rows, sample=False)
    sampled = held_out_accuracy(model, tok, test_rows, sample=True)
    info = dict(params=n_params, steps=a.steps, seed=a.seed, p_correct=a.p_correct, p_off_by_one=a.p_off_by_one,
                held_out_greedy_acc=greedy, held_out_sampled_acc=sampled, seconds=round(time.time() - t0, 1))
    with open(os.path.join(a.out, "pretrain_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
