"""Learned reward models (``reward_model.*``, issue #20): the config surface and the training loop.

* Config: enabling without a checkpoint path, or without a micro-batch size, is refused with the key to
  set; the verl keys that are not built (re-tokenisation, a separate resource pool, generative RMs,
  overlong shaping on top of an RM score, ...) are refused with the reason.
* The rule (``trainer.rewards.reward_model``): the RM score goes on the response's last token; the
  score slot appended after the last valid token.
* The loop: a tiny reward model is TRAINED here (plain torch, a Bradley-Terry loss on correct vs wrong
  sums of the tiny arithmetic task, from the tiny policy's backbone), saved with ``save_pretrained``,
  and a short GRPO run of the real loop uses it as the reward (``reward_model.enable=true``): every step
  logs ``reward/rm_score/{mean,min,max}``, GRPO's score is the RM's, and the rule-based ``reward/acc`` is
  still logged. A rising RM score is NOT asserted: 8 CPU steps are too few for a trend above the
  prompt-to-prompt noise (the measured series are in the test).
"""

import os
import random
from pathlib import Path

import pytest
import torch

from tests.support.tiny import tiny_config
from trainer.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
RM_ON = ["reward_model.enable=true", "reward_model.model.path=/some/rm", "reward_model.micro_batch_size_per_gpu=8"]


# ----------------------------------------------------------------------------------------------------- config
def _problems(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        tiny_config(overrides)
    return str(e.value)


def test_enable_without_a_path_or_micro_batch_is_refused():
    msg = _problems(["reward_model.enable=true"])
    assert "reward_model.enable=true needs reward_model.model.path" in msg and "ForSequenceClassification" in msg
    assert "reward_model.micro_batch_size_per_gpu is not set" in msg and msg.startswith("2 problems")
    assert "reward_model.micro_batch_size_per_gpu=0 is out of range: allowed [1, 16777216]" in _problems(RM_ON + ["reward_model.micro_batch_size_per_gpu=0"])
    # a path nothing would read
    assert "reward_model.enable=false, so nothing would read it" in _problems(["reward_model.model.path=/some/rm"])


def test_a_complete_reward_model_config_loads():
    c = tiny_config(RM_ON)
    assert c.reward_model.strategy == "megatron" and c.reward_model.megatron.tensor_model_parallel_size == 1
    from trainer.plan import rm_forward

    s = rm_forward(c)
    assert s.micro_batch_size == 8 and s.max_token_len is None and s.packed
    c = tiny_config(RM_ON + ["reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=512",
                             "reward_model.strategy=deepspeed", "reward_model.deepspeed_config.zero_stage=3"])
    assert rm_forward(c).max_token_len == 512
    assert rm_forward(tiny_config()) is None
    # the actor's tokenizer, spelt out or null, is what the RM reads
    tiny_config(RM_ON + [f"reward_model.model.input_tokenizer={c.actor_rollout_ref.model.path}"])
    tiny_config(RM_ON + ["reward_model.model.input_tokenizer=null"])


@pytest.mark.parametrize("line,why", [
    ("reward_model.max_length=0", "reward_model.max_length=0 is out of range: allowed [1, 1048576]"),
    ("reward_model.model.input_tokenizer=null reward_model.max_length=64", "nothing is re-tokenised"),
    ("reward_model.micro_batch_size=8", "legacy) micro-batch size is not supported"),
    ("reward_model.enable_resource_pool=true", "a separate resource pool is not built"),
    ("reward_model.n_gpus_per_node=4", "a separate resource pool is not built"),
    ("reward_model.load_weight=false", "always loads its checkpoint"),
    ("reward_model.rollout.name=sglang", "generative reward models"),
    ("reward_model.use_reward_loop=false", "reward loop"),
    ("reward_model.megatron.use_dist_checkpointing=true", "distributed checkpoints are not implemented"),
    ("reward_model.overlong_buffer.enable=true", "verl never shapes it"),
    ("reward_model.strategy=zero3", "is not one of ['megatron', 'deepspeed', 'fsdp2', 'fsdp']"),
    ("reward_model.megatron.tensor_model_parallel_size=3", "does not divide the world size"),
    ("reward_model.deepspeed_config.zero_stage=3", "reward_model.strategy=megatron"),
    ("actor_rollout_ref.rollout.multi_turn.enable=true", "scoring whole episodes with a reward model is not built"),
])
def test_unbuilt_reward_model_keys_are_refused_with_the_reason(line, why):
    assert why in _problems(RM_ON + line.split())


# ----------------------------------------------------------------------------------------------------- re-tokenising
def test_rm_inputs_are_the_rm_templates_tokens(tmp_path):
    from transformers import AutoTokenizer

    from tests.support.rm_tokenizer import ANSWERS, PROMPTS, by_hand, generated as _generated, make_rm_tokenizer
    from trainer.rewards.reward_model import RMInputs

    actor = AutoTokenizer.from_pretrained(TINY)
    make_rm_tokenizer(str(tmp_path / "rmtok"))
    conv = RMInputs(actor, AutoTokenizer.from_pretrained(tmp_path / "rmtok"))
    batch = _generated(actor, PROMPTS, ANSWERS)
    want = [by_hand([{"role": "user", "content": p}], a) for p, a in zip(PROMPTS, ANSWERS)]
    assert conv.ids(batch) == want  # the actor's EOS dropped, one BOS, the RM's ids (not the actor's)
    rm_batch = conv(batch)
    got = [row[m.bool()].tolist() for row, m in zip(rm_batch.input_ids, rm_batch.attention_mask)]
    assert got == want  # prompt + one-token response = the whole sequence, the last token last
    assert (RMInputs(actor, AutoTokenizer.from_pretrained(tmp_path / "rmtok"), max_length=5).ids(batch)
            == [w[:5] for w in want])  # verl's truncation='right'


def test_an_rm_tokenizer_without_a_chat_template_is_refused(tmp_path):
    from transformers import AutoTokenizer

    from trainer.rewards.reward_model import RMInputs

    tok = AutoTokenizer.from_pretrained(TINY)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*input_tokenizer=null"):
        RMInputs(tok, tok)


def test_run_refuses_a_checkpoint_without_a_score_head(tmp_path):
    from trainer.main import check_model

    c = tiny_config(["reward_model.enable=true", f"reward_model.model.path={TINY}",
                     "reward_model.micro_batch_size_per_gpu=8", f"actor_rollout_ref.model.path={TINY}"])
    with pytest.raises(ConfigError, match="has no 'score' head"):  # the policy itself: a causal LM
        check_model(c)


# ----------------------------------------------------------------------------------------------------- the rule
def test_score_slot_and_placement():
    from trainer.rewards.reward_model import last_token_index, place_scores, with_score_token

    pm = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    ram = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    resp = torch.arange(12).view(3, 4) + 20
    r, m, slot = with_score_token(torch.ones(3, 3, dtype=torch.long), resp, pm, ram, token_id=7)
    assert slot.tolist() == [2, 4, 0]  # right after the last valid token (the prompt's, for an empty response)
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert r[0, 2] == 7 and r[1, 4] == 7 and r[2, 0] == 7 and r[0, :2].tolist() == [20, 21]
    assert last_token_index(torch.cat([pm, ram], 1)).tolist() == [4, 6, 2]
    tls = place_scores(torch.tensor([0.5, -1.0, 2.0]), torch.tensor([2, 4, 0]), 4)
    assert tls.tolist() == [[0, 0.5, 0, 0], [0, 0, 0, -1.0], [0, 0, 0, 0]]  # none for the empty response


# ----------------------------------------------------------------------------------------------------- the loop
def _wrong(ans: int, rng: random.Random) -> str:
    """A wrong answer: off by a little, off by a lot, or not a number."""
    u = rng.random()
    if u < 0.6:
        return str(max(0, ans + rng.choice([-10, -2, -1, 1, 2, 10])))
    if u < 0.8:
        return str(rng.randrange(0, 199))if rng.random() < 0.5 else str(ans) + rng.choice("0123456789")
    return "".join(rng.choice("0123456789+-*=") for _ in range(rng.randint(1, 6)))


def train_reward_model(out_dir: str, *, steps: int = 300, seed: int = 0) -> float:
    """A Qwen2ForSequenceClassification (num_labels=1) on the tiny policy's backbone, trained with the
    Bradley-Terry loss -log sigmoid(r(correct) - r(wrong)) plus pointwise logistic terms on the task's prompts as the trainer
    tokenises them; saved to ``out_dir``. Returns its held-out pair accuracy."""
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification

    from trainer.data.dataset import build_dataset

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(TINY)
    cfg = tiny_config([f"actor_rollout_ref.model.path={TINY}"])
    train_ds, val_ds = build_dataset(cfg.data, tok, "train", None), build_dataset(cfg.data, tok, "val", None)
    model = Qwen2ForSequenceClassification.from_pretrained(TINY, num_labels=1, pad_token_id=tok.pad_token_id)
    eos = tok.eos_token_id

    def pairs(ds, n):
        rows = [ds[rng.randrange(len(ds))] for _ in range(n)]
        good, bad = [], []
        for it in rows:
            ans = int(it["ground_truth"])
            good.append(list(it["input_ids"]) + tok(str(ans), add_special_tokens=False)["input_ids"] + [eos])
            bad.append(list(it["input_ids"]) + tok(_wrong(ans, rng), add_special_tokens=False)["input_ids"]
                       + ([eos] if rng.random() < 0.8 else []))
        return good, bad

    def score(seqs):  # right-padded; HF pools at the last non-pad token, the trainer's rule
        L = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (L - len(s)) for s in seqs])
        return model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits[:, 0]

    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        good, bad = pairs(train_ds, 64)
        g, b = score(good), score(bad)
        # Bradley-Terry ranks within a prompt but leaves each prompt's offset free, and the offsets (prompt
        # difficulty) would swamp a step-to-step trend; the pointwise logistic terms pin the scale: r ~ logit P(correct)
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        loss = (-torch.nn.functional.logsigmoid(g - b).mean() + bce(g, torch.ones_like(g))
                + bce(b, torch.zeros_like(b)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        good, bad = pairs(val_ds, 256)
        acc = float((score(good) > score(bad)).float().mean())
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)  # an RM checkpoint carries its tokenizer (verl loads it from the RM's path)
    return acc


@pytest.mark.slow
def test_grpo_with_a_trained_reward_model_raises_its_score(tmp_path, monkeypatch):
    from trainer.main import train

    rm_dir = str(tmp_path / "rm")
    pair_acc = train_reward_model(rm_dir, steps=150)
    # it ranks a correct sum above a wrong one on most held-out pairs (0.707 measured at seed 0 after 150 steps,
    # 0.73 after 300: a 0.4M-parameter verifier of 1-2 digit addition trained for ~20 CPU seconds is far from
    # perfect, which the loop tolerates)
    assert pair_acc > 0.65, pair_acc
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    steps = 3  # what is asserted holds at every step; no trend is asserted (see below), so no more steps are run
    try:
        out = train(tiny_config([
            f"actor_rollout_ref.model.path={TINY}", f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.logger=[mlflow]", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.optim.lr=3e-4",
            "reward_model.enable=true", f"reward_model.model.path={rm_dir}", "reward_model.micro_batch_size_per_gpu=32",
            "reward_model.model.input_tokenizer=null",  # it was trained on the actor's ids, EOS included: feed those
            "reward_model.megatron.dtype=float32", "reward_model.megatron.sequence_parallel=false"]))
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    hist = out["history"]
    rm = [h["reward/rm_score/mean"] for h in hist]
    acc = [h["reward/acc"] for h in hist]
    print("rm_score/mean per step:", [round(x, 3) for x in rm], "acc:", [round(x, 3) for x in acc])
    assert len(rm) == steps and all("reward/rm_score/min" in h and "reward/rm_score/max" in h for h in hist)
    # the RM score is the reward: GRPO's score is the RM's, the rule-based accuracy is still logged
    assert all(h["critic/score/mean"] == pytest.approx(h["reward/rm_score/mean"], abs=1e-5) for h in hist)
    assert all(0.0 <= a <= 1.0 for a in acc)
    # Not asserted: a rising RM score. In 8 steps of 16 prompts the per-step mean is dominated by which prompts
    # were drawn (measured: BT-only RM 3.71 3.17 3.57 2.78 4.02 3.17 3.63 3.14, rule acc 0.31 -> 0.45 over the
    # same run; BT + pointwise RM 0.72 0.44 0.58 0.71 0.77 0.60 0.67 0.45): no trend a short CPU run can show.
