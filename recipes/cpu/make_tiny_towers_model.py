"""Build the tiny agent that plays Towers (``trainer.envs.towers``), shipped in ``recipes/cpu/tiny_towers_model``.

    python recipes/cpu/make_tiny_towers_model.py [--out recipes/cpu/tiny_towers_model] [--steps 600] [--seed 0]

What it makes: a 4-layer Llama (hidden 96, GQA 4:2, tied embeddings, ~0.5M parameters) over the character
tokenizer and ChatML template of ``make_tiny_agent_model.py`` (``<|im_end|>`` ends a turn), pretrained on
whole multi-turn Towers episodes (2-3 discs, the training split's positions only) played by a noisy
expert. At each state the expert writes one move:

  * an optimal move (one that lowers the distance to the goal) with probability ``p_optimal`` (0.46);
  * the state's *habit* with probability ``p_habit`` (0.50): a fixed legal move that does not make
    progress (the first such move in A, B, C order), so the error is systematic, not noise;
  * a uniformly random legal move otherwise.

The loss is on the assistant turns only. The model learns to play legally and keeps the right move well
inside its sampling distribution, but its greedy move is usually the habit: greedy play solves almost
nothing, sampling at temperature 1 solves about a fifth of the episodes. That is where outcome RL has a
signal and a step judge has something to say (the habit is a BAD step, the optimal move a GOOD one).
The script plays the held-out positions greedily and sampled at the end and writes ``pretrain_info.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from make_tiny_agent_model import build_tokenizer  # noqa: E402  (the shipped agent tokenizer and template)

from trainer.envs import towers  # noqa: E402


def expert_move(state, goal, rng: random.Random, p_optimal: float, p_habit: float):
    legal = towers.legal_moves(state)
    best = towers.optimal_moves(state, goal)
    other = [m for m in legal if m not in best]
    u = rng.random()
    if u < p_optimal or not other:
        return rng.choice(best)
    if u < p_optimal + p_habit:
        return other[0]
    return rng.choice(legal)


def episode(task: dict, rng: random.Random, p_optimal: float, p_habit: float) -> list[dict]:
    """The conversation of one expert episode, played through the environment itself."""
    env = towers.TowersEnv()
    msgs = env.reset(task)
    while True:
        src, dst = expert_move(env.state, env.goal, rng, p_optimal, p_habit)
        text = f"{towers.PEGS[src]}->{towers.PEGS[dst]}"
        msgs.append({"role": "assistant", "content": text})
        res = env.step(text)
        if res.done:
            return msgs
        msgs.append({"role": "user", "content": res.observation})


def encode(tok, msgs: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the conversation as the chat template renders it, and the loss mask (assistant content
    and its ``<|im_end|>``)."""
    ids, mask = [], []
    for m in msgs:
        head = tok("<|im_start|>" + m["role"] + "\n", add_special_tokens=False)["input_ids"]
        body = tok(m["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        tail = tok("\n", add_special_tokens=False)["input_ids"]
        learn = m["role"] == "assistant"
        ids += head + body + tail
        mask += [0] * len(head) + [int(learn)] * len(body) + [0] * len(tail)
    return ids, mask


def make_model(vocab: int, eos: int, seed: int):
    # Llama, not Qwen2: transformers 5 loads any qwen2 checkpoint's tokenizer as Qwen2Tokenizer, whose byte-level
    # pre-tokenizer replaces this character tokenizer's and drops every space and newline; for llama it keeps
    # the tokenizer.json as written (TokenizersBackend)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=96, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6,
                      bos_token_id=None, eos_token_id=eos, pad_token_id=0, torch_dtype="float32")
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def play(model, tok, tasks: list[dict], *, sample: bool, seed: int = 0) -> float:
    """Success rate of the model on ``tasks``, one move per generated turn (greedy or at temperature 1)."""
    model.eval()
    torch.manual_seed(seed)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    wins = 0
    for task in tasks:
        env = towers.TowersEnv()
        msgs = env.reset(task)
        while True:
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=sample, temperature=1.0 if sample else None, top_k=0 if sample else None,
                                 top_p=None, pad_token_id=0, eos_token_id=eos)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            msgs.append({"role": "assistant", "content": text})
            res = env.step(text)
            if res.done:
                wins += int(res.info["success"])
                break
            msgs.append({"role": "user", "content": res.observation})
    model.train()
    return wins / len(tasks)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_towers_model"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--p-optimal", type=float, default=0.46)
    ap.add_argument("--p-habit", type=float, default=0.50)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)  # one thread: faster than two on a busy 2-core machine, and reproducible

    tok = build_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model = make_model(len(tok), eos, a.seed)
    rng = random.Random(a.seed)
    train_tasks = towers.make_tasks(4000, seed=a.seed, split="train")
    test_tasks = towers.make_tasks(128, seed=a.seed, split="test")
    probe = episode(train_tasks[0], random.Random(0), a.p_optimal, a.p_habit)  # the encoding is the template's
    assert tok.decode(encode(tok, probe)[0]) == tok.apply_chat_template(probe, tokenize=False)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.05)
    t0 = time.time()
    model.train()
    for step in range(1, a.steps + 1):
        seqs = [encode(tok, episode(t, rng, a.p_optimal, a.p_habit)) for t in rng.sample(train_tasks, a.batch)]
        width = max(len(s) for s, _ in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, (s, m) in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
            labels[i, :len(s)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(s), -100)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == a.steps:
            print(f"step {step}/{a.steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = eos
    model.save_pretrained(a.out, safe_serialization=True)
    tok.save_pretrained(a.out)
    reloaded = AutoTokenizer.from_pretrained(a.out)  # what Coxswain loads must tokenize as the training did
    assert reloaded(probe[-1]["content"] + " \n")["input_ids"] == tok(probe[-1]["content"] + " \n")["input_ids"]
    greedy = play(model, tok, test_tasks, sample=False)
    sampled = play(model, tok, test_tasks, sample=True)
    info = dict(params=sum(p.numel() for p in model.parameters()), steps=a.steps, seed=a.seed,
                p_optimal=a.p_optimal, p_habit=a.p_habit, held_out_greedy_success=greedy,
                held_out_sampled_success=sampled, seconds=round(time.time() - t0, 1))
    with open(os.path.join(a.out, "pretrain_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
