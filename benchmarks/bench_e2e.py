"""End-to-end GRPO throughput: Coxswain's embedded recipe against TRL's ``GRPOTrainer``, same model, same
data, same group size and lengths, in the same run.

Metric: trained tokens/s = (prompt + sampled completion tokens of the step's batch, every one of which is
also trained on) / wall time of the step. Steady state excludes the first step of each run (lazy
initialisation) and everything before it (startup, reported separately); the headline uses the median
step time over the remaining steps. The time per phase is reported for both, and so is the CPU time
per step (Coxswain: its whole process tree, driver + raylet + Ray workers + scorer processes; TRL: its
process, all threads) with tokens per CPU-second: a figure far less sensitive to other jobs on a
shared machine than wall time (which is what the headline uses).

Setup, identical on both sides:
  * model: a random-init Qwen2 built locally (``transformers`` config + ``save_pretrained``; nothing is
    downloaded): hidden 192, 6 layers, 6 query / 2 kv heads, SwiGLU 512, vocab 1024, tied embeddings:
    2.56M parameters, float32 (``--quick``: hidden 64, 2 layers, vocab 256: 0.13M);
  * tokenizer: a byte-pair tokenizer trained here with the ``tokenizers`` library on synthetic arithmetic
    text (1024 entries: ``<pad>`` and merged digit strings / operators), plus ``<eos>`` with id 1024, one
    past the model's last output row. No chat template, so both sides see the raw prompt text;
  * data: the shipped synthetic task rows (``trainer.data.synthetic.make_rows``: 2048 train problems, 1-2
    digit addition, exactly what ``data.train_files=null`` gives Coxswain); reward
    ``trainer.rewards.scorers.arith_score`` (Coxswain: its reward manager; TRL: a reward function
    calling the same scorer). A random model scores 0, so GRPO advantages are 0, but both sides still run
    the whole forward / backward / optimizer step (grad norm 0); the compute is the same;
  * no early EOS on either side: the tokenizer's EOS id (1024) is outside the model's vocabulary (1024
    logits), so neither sampler can ever draw it, and every completion is exactly ``max new tokens``
    long (checked: Coxswain ``response_length/mean``, TRL ``completions/mean_length``);
  * 64 completions per step = 8 prompts x 8 generations (``--quick``: 4 x 4), 64 new tokens (quick 16),
    temperature 1, no top-k / top-p, one optimizer step per RL step (one mini-batch, one PPO epoch),
    no KL term / no reference model, Adam lr 1e-4, weight decay 0.01, grad clip 1.0, token-mean loss
    (TRL ``loss_type="dapo"``: normalised by the active tokens of the whole batch, the same thing), no
    activation recomputation (TRL's ``gradient_checkpointing`` defaults to True: switched off here).

Coxswain: ``trainer.main.train`` with the embedded recipe's defaults (actor megatron-core TP=1 DP=2 over
2 CPU slots, one native engine per slot colocated, local Ray cluster, 2 scorer processes, one torch
thread per worker) and only the keys above overridden, console logging only, no eval, no checkpoints.
Three Coxswain runs: ``coxswain``, the recipe as shipped (verl's precision defaults: megatron mixed
precision, i.e. bf16 weights and activations with fp32 main params, grads and Adam state, attention
as Hugging Face's eager bf16 attention computes it; a bf16 rollout engine; eager); ``coxswain-compile``, the same plus the
one compile switch ``trainer.compile=true`` (``torch.compile`` of the actor's model chunk; the engines'
decode step compiled, launched from inductor's C++ wrapper, its matmuls on inductor's C++ GEMM
template) and padded rather than packed sequences, ``actor_rollout_ref.actor.megatron.use_remove_padding=false``
(no completion ends early here, so packing saves nothing, and under ``torch.compile`` the packed
attention is a graph break): ``FAST_SETTINGS``; and ``coxswain-fp32``, the recipe with
``recipes/cpu/fp32.yaml`` (fp32 everywhere, what the tests run), for reference. Coxswain's batch is as
wide as its longest prompt and response
and each data-parallel shard is trimmed to its own; TRL pads to the longest prompt of its batch, so
both compute over the same widths.
With one mini-batch and one PPO epoch the update is on-policy, so Coxswain runs no separate old-log-prob
forward (its update takes its own detached log-probs, exactly as TRL does with ``num_iterations=1``,
``beta=0``). TRL 1.16:
``GRPOTrainer`` on CPU (``use_cpu=True``), ``transformers`` ``generate`` for rollout, in one process
with ``--trl-threads`` torch threads, fp32; plus (full size) one run at the most threads with
``bf16=True`` (CPU autocast), the precision Coxswain's fast run trains in. Every TRL variant gets
its own run and the FASTEST one is the baseline (the conservative choice); likewise the fastest
Coxswain run is Coxswain's figure. The table shows every run.

Each framework runs in its own subprocess (in the order given by ``--order``), so neither sees the other's
threads, Ray processes or allocator state. Imports are outside the startup figure on both sides.

    python benchmarks/bench_e2e.py [--quick] [--json PATH] [--steps N] [--trl-threads 1,2] [--rounds R]
        [--order coxswain,trl] [--no-fast] [--coxswain-args KEY=VALUE ...]

After the runs, a third child times the step's matrix products alone (``run_floor``: every weight GEMM of
the update's forward and both backward products over each DP rank's tokens, and of the engines' prefill
and decode steps, in bf16 on one thread, each at its exact shape, best of 3): the GEMM floor, in CPU
seconds per step. It prints how much CPU time per step a 2x and a 3x lead over TRL's most CPU-efficient
run would leave for everything else (attention, norms, casts, the log-probs over the vocabulary,
sampling, the optimizer, the driver and Ray), and what each Coxswain run spends beyond the floor, split
into its role workers and the rest of its process tree (driver, raylet, GCS, scorers).

``--rounds R`` repeats the whole set, alternating the frameworks, and each side's best round counts (the
load of a shared machine moves between runs by 2x and more).

Needs TRL (``pip install "trl==1.16.0"``, the benchmark extra; it leaves torch alone).
The last line printed is the headline: Coxswain / TRL steady-state tokens/s.

History: component timings at this benchmark's model and batch size (6 query / 2 kv heads, 6 layers,
32 x 80 tokens, one CPU core) that set choices in the product code (moved here from its docstrings):
  * ``megatron_bridge.attention``: torch's CPU flash-attention backward in bf16 was about 10x slower
    than in fp32 (Sapphire Rapids core: 474 ms against 47 ms per forward+backward of 6 layers), hence
    the fp32 kernel in the bf16 run; AMX makes the matmuls around attention about 5x faster in bf16.
    Since 2026-11-27 bf16 attention on CPU is written out as HF's eager attention instead (bf16
    matmuls, fp32 softmax; one op for scale, upcast and mask): 3.3-4.4 ms against 7.6-7.9 ms per layer
    for the fp32 kernel (AMD EPYC core with AVX512-BF16, 32 x 70 tokens).
  * ``megatron_bridge.attention``: SDPA's native GQA instead of ``repeat_interleave`` copies:
    forward+backward 17 ms instead of 22 ms per layer.
  * ``megatron_bridge.attention``: on the permuted ``[s, b, heads, d]`` views the kernel's forward ran
    ~30% slower in the training step than on contiguous ``[b, heads, s, d]`` inputs.
  * ``megatron_bridge.attention.grouped_qkv_split`` (QKV split on a head axis): on the flattened split the
    fused bias + RoPE kernels ran as scalar loops, 4.5 ms of 17 per layer.
  * ``megatron_bridge.train._use_fused_adam``: torch's fused AdamW kernel took the optimizer step from
    32 to 9 ms per step (including the copy to the bf16 model weights).
  * ``trainer.rollout.single_turn.pad_left``: filling the 64 rows in numpy; a per-row torch assignment
    cost about 4x more.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)

# Coxswain's compile switch (trainer.compile=true: torch.compile of the actor's model chunk, and the
# rollout engines' decode step compiled, launched from C++ (cpp_wrapper), its matmuls on inductor's C++
# GEMM template (AMX / AVX-512 micro-kernels; decode_gemm=cpp)), plus padded rather than packed rows.
FAST_SETTINGS = ["trainer.compile=true",
                 # every completion here is exactly max-new-tokens long, so packing saves no pad token,
                 # and under torch.compile the packed (THD) attention and RoPE are graph breaks:
                 # padded was 0.54 against 0.62 s per compiled bf16 update at this shape
                 "actor_rollout_ref.actor.megatron.use_remove_padding=false"]
# exact fp32 numerics (what the tests run): a reference row
FP32_SETTINGS = ["--config", os.path.join(ROOT, "recipes", "cpu", "fp32.yaml")]

SIZES = {
    "full": dict(vocab=1024, hidden=192, layers=6, heads=6, kv=2, ffn=512, prompts=8, n=8, new=64, steps=6),
    "quick": dict(vocab=256, hidden=64, layers=2, heads=4, kv=2, ffn=192, prompts=4, n=4, new=16, steps=3),
}


# ----------------------------------------------------------------------------------------------
# assets: tokenizer, model, rows
# ----------------------------------------------------------------------------------------------
def _arith_corpus(n: int, seed: int = 0):
    r = random.Random(seed)
    for _ in range(n):
        a, b, op = r.randint(0, 9999), r.randint(0, 999), r.choice("+-*")
        c = a + b if op == "+" else a - b if op == "-" else a * b
        yield f"{a}{op}{b}={c}"


def build_assets(out_dir: str, size: dict) -> dict:
    """Tokenizer + random Qwen2 in ``out_dir`` (an HF model directory both frameworks load)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    V = size["vocab"]
    tok = Tokenizer(models.BPE())
    # operators stand alone; digit strings merge (so "37+58=" is 4 tokens)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[+\-*=]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.train_from_iterator(_arith_corpus(50_000), trainers.BpeTrainer(
        vocab_size=V, special_tokens=["<pad>"], initial_alphabet=list("0123456789+-*="), show_progress=False))
    if tok.get_vocab_size() != V:
        raise RuntimeError(f"the BPE trainer made {tok.get_vocab_size()} entries, wanted {V}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")
    fast.add_special_tokens({"eos_token": "<eos>"})  # id V: one past the model's last logit
    assert fast.eos_token_id == V and fast.pad_token_id == 0
    cfg = Qwen2Config(vocab_size=V, hidden_size=size["hidden"], intermediate_size=size["ffn"],
                      num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                      num_key_value_heads=size["kv"], max_position_embeddings=256, tie_word_embeddings=True,
                      rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    model.generation_config.eos_token_id = None
    model.save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    return {"params": sum(p.numel() for p in model.parameters()), "tokenizer_entries": len(fast),
            "model_vocab": V, "eos_id": fast.eos_token_id}


def task_rows():
    # the same rows trainer.data.dataset.build_dataset gives Coxswain when data.train_files is null
    from trainer.data.synthetic import make_rows

    return make_rows(2048, "train", ops=("+",), max_digits=2)


# ----------------------------------------------------------------------------------------------
# Coxswain side (runs in its own process)
# ----------------------------------------------------------------------------------------------
def run_coxswain(spec: dict) -> dict:
    import trainer.tracking as tracking
    from trainer.config import load_config
    from trainer.main import train

    size, steps = spec["size"], spec["steps"]
    import psutil

    log_times: dict[int, float] = {}
    log_cpu: dict[int, float] = {}
    orig = tracking.Tracker.log_metrics
    me = psutil.Process()

    log_split: dict[int, dict[str, float]] = {}

    def tree_cpu() -> tuple[float, dict[str, float]]:
        """CPU seconds used so far by the driver and every live descendant (raylet, Ray workers, scorers),
        in all and split into the role workers (the Ray actors that train and generate) and the rest."""
        split = {"workers": 0.0, "driver + Ray + scorers": 0.0}
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                worker = p.name().startswith("ray::") and "Worker" in p.name()
                split["workers" if worker else "driver + Ray + scorers"] += t.user + t.system
            except psutil.Error:
                pass
        return sum(split.values()), split

    def stamped(self, metrics, step):  # when each step's metrics arrive (right after its step timer stops)
        log_times[int(step)] = time.perf_counter()
        log_cpu[int(step)], log_split[int(step)] = tree_cpu()
        return orig(self, metrics, step)

    tracking.Tracker.log_metrics = stamped
    cfg = load_config(["--config", os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml"),
        f"actor_rollout_ref.model.path={spec['model_dir']}",
        f"data.train_batch_size={size['prompts']}", f"actor_rollout_ref.rollout.n={size['n']}",
        f"data.max_response_length={size['new']}", "data.max_prompt_length=16",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={size['prompts']}",  # one optimizer step per RL step
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={size['prompts'] * size['n'] // 2}",  # one micro-batch per DP rank
        "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.optim.weight_decay=0.01",
        "actor_rollout_ref.actor.optim.clip_grad=1.0", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[console]", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={spec['run_dir']}", "trainer.experiment_name=bench_e2e",
        *spec.get("extra", []),
    ])
    t0 = time.perf_counter()
    out = train(cfg)
    t_end = time.perf_counter()
    import ray

    ray.shutdown()
    hist = [h for h in out["history"] if h["step"] >= 1]
    step_s = [h["timing_s/step"] for h in hist]
    first_start = log_times[1] - step_s[0]
    phases = {}
    for key in ("gen", "generate", "reward", "old_log_prob", "adv", "update_actor", "update_weights"):
        vals = [h.get(f"timing_s/{key}", 0.0) for h in hist]
        phases[key] = vals
    # the trainer's own MFU per pass (perf/mfu/*: the model's FLOPs over the pass's time and this core's
    # measured matmul peak, trainer/perf.py), steady-state steps only
    mfu = {k: [h[k] for h in hist[1:] or hist if k in h] for k in sorted({k for h in hist for k in h if k.startswith("perf/mfu/")})}
    return {
        "mfu": {k.split("/")[-1]: statistics.median(v) for k, v in mfu.items() if v},
        "framework": "coxswain", "step_s": step_s, "tokens": [h["perf/total_num_tokens"] for h in hist],
        "completion_tokens": [h["response_length/mean"] * size["prompts"] * size["n"] for h in hist],
        "response_length_mean": [h["response_length/mean"] for h in hist], "phases_s": phases,
        "startup_s": first_start - t0, "teardown_s": t_end - log_times[max(log_times)], "total_s": t_end - t0,
        "threads": "1 per worker (2 actor ranks, 2 engines) + driver",
        # CPU seconds of the whole process tree between consecutive step logs (steps 2..N)
        "cpu_s": [log_cpu[k] - log_cpu[k - 1] for k in sorted(log_cpu) if k - 1 in log_cpu],
        # the same, per part: mean over steps 2..N (from the step-1 to the last log)
        "cpu_split_s": {part: (log_split[max(log_split)][part] - log_split[1][part]) / (max(log_split) - 1)
                        for part in log_split[1]} if max(log_split) > 1 else {},
    }


# ----------------------------------------------------------------------------------------------
# TRL side (runs in its own process)
# ----------------------------------------------------------------------------------------------
def run_trl(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.rewards.scorers import arith_score

    size, steps = spec["size"], spec["steps"]
    rows = task_rows()
    ds = Dataset.from_list([{"prompt": r["prompt"][0]["content"], "ground_truth": r["reward_model"]["ground_truth"]}
                            for r in rows])

    def arith_reward(completions, ground_truth, **_):
        return [arith_score(c, g)["score"] for c, g in zip(completions, ground_truth)]

    args = GRPOConfig(
        output_dir=spec["run_dir"], per_device_train_batch_size=size["prompts"] * size["n"],
        gradient_accumulation_steps=1, num_generations=size["n"], max_completion_length=size["new"],
        num_iterations=1, beta=0.0, loss_type="dapo", temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=1e-4, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant",
        max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=spec.get("precision") == "bf16",
        disable_tqdm=True, seed=1, dataloader_num_workers=0,
        gradient_checkpointing=False)  # TRL's default is True; Coxswain recomputes nothing, so neither does TRL
    step_begin, step_end, cpu_begin, cpu_end, trl_logs = [], [], [], [], []
    phase: dict[str, list[float]] = {k: [] for k in ("generate_and_score", "generate", "reward", "compute_loss",
                                                     "training_step")}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, s, c, **k):
            step_begin.append(time.perf_counter())
            cpu_begin.append(time.process_time())  # all threads of this process

        def on_step_end(self, a, s, c, **k):
            step_end.append(time.perf_counter())
            cpu_end.append(time.process_time())

        def on_log(self, a, s, c, logs=None, **k):
            if logs and "num_tokens" in logs:  # the per-step log (not the end-of-training summary)
                trl_logs.append(dict(logs))

    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=arith_reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])

    def wrap(name, key):
        fn = getattr(trainer, name)

        def timed_fn(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phase[key].append(time.perf_counter() - t)

        setattr(trainer, name, timed_fn)

    for name, key in (("_generate_and_score_completions", "generate_and_score"), ("_generate", "generate"),
                      ("_calculate_rewards", "reward"), ("compute_loss", "compute_loss"),
                      ("training_step", "training_step")):
        wrap(name, key)
    trainer.train()
    t_end = time.perf_counter()
    step_s = [e - b for b, e in zip(step_begin, step_end)]
    # num_tokens is TRL's running count of prompt + completion tokens
    cum = [lg["num_tokens"] for lg in trl_logs]
    tokens = [c - p for c, p in zip(cum, [0.0] + cum[:-1])]
    n = len(step_s)
    gs, gen, rew = phase["generate_and_score"][:n], phase["generate"][:n], phase["reward"][:n]
    ts, cl = phase["training_step"][:n], phase["compute_loss"][:n]
    phases = {
        "generate": gen, "reward": rew,
        "score/prep (rest of generate_and_score)": [a - b - c for a, b, c in zip(gs, gen, rew)],
        "forward+loss (compute_loss)": cl,
        "backward (rest of training_step)": [t - a - c for t, a, c in zip(ts, gs, cl)],
        "optimizer + bookkeeping (rest of step)": [s - t for s, t in zip(step_s, ts)],
    }
    return {
        "framework": "trl", "threads": spec["threads"], "precision": spec.get("precision", "fp32"), "step_s": step_s, "tokens": tokens,
        "completion_tokens": [lg["completions/mean_length"] * size["prompts"] * size["n"] for lg in trl_logs],
        "response_length_mean": [lg["completions/mean_length"] for lg in trl_logs], "phases_s": phases,
        "startup_s": step_begin[0] - t0, "teardown_s": t_end - step_end[-1], "total_s": t_end - t0,
        "cpu_s": [e - b for b, e in zip(cpu_begin, cpu_end)][1:],
    }


# ----------------------------------------------------------------------------------------------
# GEMM floor (runs in its own process)
# ----------------------------------------------------------------------------------------------
def run_floor(spec: dict) -> dict:
    """CPU seconds per step that the step's matrix products alone take on this core, in bf16 on one
    thread, each timed at its exact shape with nothing else running: a bound no framework can beat with
    these GEMM kernels, against which the rest of a step's cost (attention, norms, casts, sampling,
    optimizer, the driver, Ray) is what is left to win.

    Counted: every weight GEMM of the model (q/k/v, o, gate/up, down per layer; the tied LM head).
    Training: forward, input-gradient and weight-gradient products over each DP rank's tokens (2 ranks).
    Generation: the prompts' prefill and one decode step per new token over each engine's rows (2
    engines), on oneDNN-prepacked weights as the native engine runs them. Not counted: attention's
    small batched products (about 1% of the FLOPs) and everything that is not a matmul."""
    import torch

    torch.set_num_threads(1)
    size, tokens = spec["size"], spec["tokens_per_step"]
    h, ffn, V, L = size["hidden"], size["ffn"], size["vocab"], size["layers"]
    D = h // size["heads"]
    shapes = [(h + 2 * size["kv"] * D, h, L), (h, h, L), (2 * ffn, h, L), (h, ffn, L), (V, h, 1)]  # (out, in, count)

    def timed(f, reps: int) -> float:
        for _ in range(3):
            f()
        best = float("inf")
        for _ in range(3):  # best of 3 batches of reps: the machine may be shared
            t = time.perf_counter()
            for _ in range(reps):
                f()
            best = min(best, (time.perf_counter() - t) / reps)
        return best

    def decode_s(M: int, shapes=shapes) -> float:
        total = 0.0
        for n, k, count in shapes:
            w = torch.randn(n, k).bfloat16()
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            x = torch.randn(M, k).bfloat16()
            total += count * timed(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 100)
        return total

    def train_s(T: int) -> float:
        total = 0.0
        for n, k, count in shapes:
            x, w, dy = torch.randn(T, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(T, n).bfloat16()
            total += count * (timed(lambda: torch.mm(x, w.t()), 10) + timed(lambda: torch.mm(dy, w), 10)
                              + timed(lambda: torch.mm(dy.t(), x), 10))
        return total

    rows = size["prompts"] * size["n"]
    prompt_tokens = tokens - rows * size["new"]
    # per engine: the prefill of its prompts (the LM head only at each row's last position), then
    # new - 1 decode steps (the prefill's logits give the first token)
    gen = 2 * (decode_s(max(1, prompt_tokens // 2), shapes[:-1]) + decode_s(rows // 2, shapes[-1:])
               + (size["new"] - 1) * decode_s(rows // 2))
    update = 2 * train_s(tokens // 2)
    per_token = 2 * sum(n * k * c for n, k, c in shapes)
    flops = per_token * (3 * tokens + rows * size["new"]) + (per_token - 2 * h * V) * prompt_tokens
    return {"framework": "floor", "gen_cpu_s": gen, "update_cpu_s": update, "cpu_s": gen + update,
            "gflops": flops / 1e9}


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def steady(res: dict) -> dict:
    """Steady state: every step after the first."""
    s = res["step_s"][1:] or res["step_s"]
    tok = res["tokens"][1:] or res["tokens"]
    ctok = res["completion_tokens"][1:] or res["completion_tokens"]
    med = statistics.median(s)
    per_step_tokens = statistics.median(tok)
    cpu = statistics.median(res["cpu_s"]) if res.get("cpu_s") else float("nan")
    return {"median_step_s": med, "cpu_s_per_step": cpu, "tok_per_cpu_s": per_step_tokens / cpu,
            "best_step_s": min(s), "mean_step_s": sum(s) / len(s),
            "tokens_per_step": per_step_tokens, "tok_s": per_step_tokens / med, "tok_s_best": per_step_tokens / min(s),
            "tok_s_aggregate": sum(tok) / sum(s), "completion_tok_s": statistics.median(ctok) / med}


def run_child(kind: str, spec: dict, log_path: str) -> dict:
    out_json = spec["result_path"]
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", kind, "--_spec", json.dumps(spec)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if rc != 0 or not os.path.exists(out_json):
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{kind} run failed (exit {rc}); log {log_path}:\n{tail}")
    with open(out_json) as f:
        return json.load(f)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="0.13M model, 4x4 completions x 16 tokens, 3 steps")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--steps", type=int, default=None, help="steps per framework (default 6; quick 3)")
    ap.add_argument("--trl-threads", default=None, help="comma list of torch thread counts for TRL runs "
                    "(default 1,2; quick 1); the fastest is the baseline")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the whole set of runs, alternating frameworks; each side's best round counts")
    ap.add_argument("--order", default="coxswain,trl", help="which framework runs first (one name: only that one)")
    ap.add_argument("--coxswain-args", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra Coxswain config overrides, for experiments (printed with the results)")
    ap.add_argument("--no-fast", action="store_true",
                    help="skip the coxswain-compile and coxswain-fp32 runs (the recipe as shipped only; --quick always does)")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_spec", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        spec = json.loads(a._spec)
        res = {"coxswain": run_coxswain, "trl": run_trl, "floor": run_floor}[a._child](spec)
        with open(spec["result_path"], "w") as f:
            json.dump(res, f)
        return res

    from _common import load_average, machine, table, write_json

    size = dict(SIZES["quick" if a.quick else "full"])
    steps = a.steps or size["steps"]
    if steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is excluded from the steady state)")
    threads = [int(x) for x in (a.trl_threads or ("1" if a.quick else "1,2")).split(",")]
    tmp = tempfile.mkdtemp(prefix="bench_e2e_")
    model_dir = os.path.join(tmp, "model")
    assets = build_assets(model_dir, size)
    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        raise SystemExit('bench_e2e needs TRL: pip install "trl==1.16.0" (the benchmark extra)')
    print(f"machine: {machine(f'trl {trl_version}')} (shared machine: wall times are noisy)", flush=True)
    print(f"model: random Qwen2, {assets['params'] / 1e6:.2f}M params, vocab {assets['model_vocab']} "
          f"(+ unreachable <eos> id {assets['eos_id']}), float32; {size['prompts']} prompts x {size['n']} "
          f"completions x {size['new']} new tokens per step, {steps} steps per framework", flush=True)

    runs = []
    # named variants: (run name, framework, spec keys). Each framework's fastest variant is its figure.
    cox_variants = [("coxswain", {"extra": list(a.coxswain_args)})]
    if not (a.no_fast or a.quick):  # (compiling takes longer than the whole --quick budget)
        cox_variants.append(("coxswain-compile", {"extra": [*FAST_SETTINGS, *a.coxswain_args]}))
        cox_variants.append(("coxswain-fp32", {"extra": [*FP32_SETTINGS, *a.coxswain_args]}))
    trl_variants = [(f"trl-t{th}", {"threads": th, "precision": "fp32"}) for th in threads]
    if not a.quick:
        trl_variants.append((f"trl-t{max(threads)}-bf16", {"threads": max(threads), "precision": "bf16"}))
    by_fw = {"coxswain": cox_variants, "trl": trl_variants}
    plan = [(rnd, fw, name, keys) for rnd in range(a.rounds) for fw in a.order.split(",") for name, keys in by_fw[fw]]
    for rnd, fw, vname, keys in plan:
        name = vname + (f"-r{rnd + 1}" if a.rounds > 1 else "")
        spec = dict(size=size, steps=steps, model_dir=model_dir, run_dir=os.path.join(tmp, name), threads=None,
                    result_path=os.path.join(tmp, f"{name}.json"), extra=[])
        spec.update(keys)
        load0 = load_average()
        t = time.perf_counter()
        res = run_child(fw, spec, os.path.join(tmp, f"{name}.log"))
        res.update(name=name, wall_s=time.perf_counter() - t, load_before=load0, load_after=load_average(),
                   steady=steady(res), overrides=spec["extra"])
        runs.append(res)
        print(f"  ran {name}: {res['wall_s']:.0f}s, load avg {load0:.1f} -> {res['load_after']:.1f}", flush=True)

    for r in runs:  # the no-early-EOS setup really gave full-length completions everywhere
        assert all(abs(x - size["new"]) < 1e-6 for x in r["response_length_mean"]), (r["name"], r["response_length_mean"])
    for r in runs:
        if r["framework"] == "coxswain" and r["overrides"]:
            print(f"{r['name']}: overrides beyond the recipe: {' '.join(r['overrides'])}")
    coxs = [r for r in runs if r["framework"] == "coxswain"]
    cox = max(coxs, key=lambda r: r["steady"]["tok_s"]) if coxs else None
    trls = [r for r in runs if r["framework"] == "trl"]
    best = max(trls, key=lambda r: r["steady"]["tok_s"]) if trls else cox

    rows = []
    for r in runs:
        s = r["steady"]
        rows.append([r["name"], s["tokens_per_step"], s["median_step_s"], s["best_step_s"], s["tok_s"],
                     s["completion_tok_s"], s["cpu_s_per_step"], s["tok_per_cpu_s"], r["startup_s"],
                     f"{s['tok_s'] / best['steady']['tok_s']:.2f}x"])
    print(table(["run", "tokens/step", "median step s", "best step s", "tokens/s", "completion tok/s",
                 "cpu s/step", "tokens/cpu-s", "startup s", "vs TRL best" if trls else "vs coxswain"], rows, "{:.2f}"))
    print("\ntime per phase, median over steady-state steps (s):")
    for r in runs:
        parts = [f"{k} {statistics.median(v[1:] or v):.3f}" for k, v in r["phases_s"].items()]
        print(f"  {r['name']}: " + ", ".join(parts) + f"; step {r['steady']['median_step_s']:.3f}")
    result = dict(machine=machine(f"trl {trl_version}"), quick=a.quick, size=size, steps=steps, assets=assets,
                  runs=runs, coxswain_args=a.coxswain_args, headline=None, floor=None)
    if coxs:  # what the step's matmuls alone cost on this core, and what each run spends beyond them
        tokens = int(coxs[0]["steady"]["tokens_per_step"])
        floor = run_child("floor", dict(size=size, tokens_per_step=tokens, result_path=os.path.join(tmp, "floor.json")),
                          os.path.join(tmp, "floor.log"))
        result["floor"] = floor
        trl_cpu = max(trls, key=lambda r: r["steady"]["tok_per_cpu_s"]) if trls else None
        vs = (f" = {tokens / floor['cpu_s'] / trl_cpu['steady']['tok_per_cpu_s']:.2f}x {trl_cpu['name']}'s tokens "
              f"per CPU-second" if trl_cpu else "")
        print(f"\nGEMM floor: the step's matmuls alone ({floor['gflops']:.1f} GFLOP; bf16, one thread, each timed at its "
              f"shape on this core): generation {floor['gen_cpu_s']:.3f} + update {floor['update_cpu_s']:.3f} = "
              f"{floor['cpu_s']:.3f} CPU-s per step, i.e. at most {tokens / floor['cpu_s']:.0f} tokens per CPU-second{vs} "
              f"if nothing else cost anything")
        if trl_cpu:
            for x in (2, 3):
                budget = tokens / (x * trl_cpu["steady"]["tok_per_cpu_s"]) - floor["cpu_s"]
                print(f"  {x}x {trl_cpu['name']} per CPU-second leaves {budget:.3f} CPU-s per step for everything but those matmuls")
        print(f"  the floor's matmuls run at {floor['gflops'] / floor['cpu_s']:.1f} GFLOP/s per core; the trainer's MFU "
              f"(perf/mfu/*, median over steps 2..N, against the matmul peak it measured at start-up):")
        for r in coxs:
            parts = ", ".join(f"{k} {100 * v:.1f}%" for k, v in r.get("mfu", {}).items()) or "not logged"
            print(f"    {r['name']}: {parts}")
        for r in coxs:
            split = ", ".join(f"{k} {v:.3f}" for k, v in r.get("cpu_split_s", {}).items())
            print(f"  {r['name']}: {r['steady']['cpu_s_per_step'] - floor['cpu_s']:.3f} CPU-s per step beyond the floor "
                  f"(the tree's CPU-s per step, mean over steps 2..N: {split})")
    if cox is None or not trls:  # an experiment with one framework only: no ratio to claim
        write_json(a.json, result)
        r = cox or best
        print(f"headline: {r['name']} only, steady-state tokens/s = {r['steady']['tok_s']:.0f} (no ratio: one framework ran)")
        return result
    best_trl = best
    ratio = cox["steady"]["tok_s"] / best_trl["steady"]["tok_s"]
    # per CPU-second: Coxswain's most CPU-efficient run against TRL's most CPU-efficient one (not the fastest:
    # TRL's extra thread buys wall time with more CPU time than it saves)
    trl_cpu = max(trls, key=lambda r: r["steady"]["tok_per_cpu_s"])
    cox_cpu = max(coxs, key=lambda r: r["steady"]["tok_per_cpu_s"])
    cpu_ratio = cox_cpu["steady"]["tok_per_cpu_s"] / trl_cpu["steady"]["tok_per_cpu_s"]
    result["headline"] = {"coxswain_tok_s": cox["steady"]["tok_s"], "trl_tok_s": best_trl["steady"]["tok_s"],
                          "coxswain_run": cox["name"], "trl_run": best_trl["name"], "ratio": ratio,
                          "tokens_per_cpu_s_ratio": cpu_ratio, "tokens_per_cpu_s_runs": [cox_cpu["name"], trl_cpu["name"]]}
    # per setting: against TRL's fastest run (tokens/s) and its most CPU-efficient one (tokens/CPU-s)
    print(f"\nagainst TRL's fastest run ({best_trl['name']}, tokens/s) and its most CPU-efficient one "
          f"({trl_cpu['name']}, tokens per CPU-second):")
    settings = {}
    for base in ("coxswain", "coxswain-compile", "coxswain-fp32"):
        mine = [r for r in coxs if r["name"] == base or r["name"].startswith(base + "-r")]
        if not mine:
            continue
        top = max(mine, key=lambda r: r["steady"]["tok_s"])
        topc = max(mine, key=lambda r: r["steady"]["tok_per_cpu_s"])
        settings[base] = {"tok_s_ratio": top["steady"]["tok_s"] / best_trl["steady"]["tok_s"],
                          "tok_per_cpu_s_ratio": topc["steady"]["tok_per_cpu_s"] / trl_cpu["steady"]["tok_per_cpu_s"]}
        print(f"  {base:18s} tokens/s {settings[base]['tok_s_ratio']:.2f}x   tokens per CPU-second "
              f"{settings[base]['tok_per_cpu_s_ratio']:.2f}x")
    result["headline"]["settings"] = settings
    write_json(a.json, result)
    print(f"headline: Coxswain / TRL GRPOTrainer steady-state tokens/s = {cox['steady']['tok_s']:.0f} / "
          f"{best_trl['steady']['tok_s']:.0f} ({best_trl['name']}) = {ratio:.2f}x "
          f"({assets['params'] / 1e6:.2f}M params, {size['prompts'] * size['n']} completions x {size['new']} tokens; "
          f"tokens per CPU-second {cox_cpu['name']} / {trl_cpu['name']} = {cpu_ratio:.2f}x)")
    return result


if __name__ == "__main__":
    main()
