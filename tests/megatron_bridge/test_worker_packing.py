"""Packed sequences (``use_remove_padding``) and token-budget micro-batches (``use_dynamic_bsz``) in the
megatron worker, on a model shape no other test uses (Qwen2, 6 query / 3 kv heads, hidden 48, 3 layers):

* log-probs and entropies: padded fixed micro-batches = packed = packed within a token budget, and all
  equal transformers run on each sequence alone (no padding anywhere);
* one optimizer step from the same weights and Adam state: the padded, fixed-count update and the
  packed, token-budget update give the same loss, gradient norm and updated policy (the loss is
  normalised over the whole mini-batch, so neither the micro-batch split nor the padding matters);
* a sequence longer than the budget is refused with the key to raise.
"""

import pytest
import torch

from bridge_tiny import make_hf, random_seqs

pytestmark = pytest.mark.slow

PROMPTS = [3, 9, 2, 6, 5, 8, 4]
RESPONSES = [12, 1, 7, 4, 10, 2, 9]


def _batch(prompts, responses):
    from trainer.batch import RolloutBatch
    from trainer.rollout.single_turn import pad_left, pad_right

    p_ids, p_mask = pad_left(prompts, max(map(len, prompts)), 0)
    r_ids, r_mask = pad_right(responses, max(map(len, responses)), 0, torch.long)
    g = torch.Generator().manual_seed(3)
    b = RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)
    b.advantages = torch.randn(r_ids.shape, generator=g) * r_mask
    return b


def job(src, port, tmp):
    from dataclasses import replace

    from trainer.algos.losses import batch_norm_counts
    from trainer.plan import ForwardSettings, PolicyLoss, UpdateSettings
    from trainer.workers.dataplane import StepData, Transport, shard_batch
    from trainer.workers.megatron_worker import MegatronWorker

    optim = dict(optimizer="adam", lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                 adam_eps=1e-8, clip_grad=0.0, lr_schedule="constant", lr_warmup_steps=0, lr_decay_steps=10,
                 use_distributed_optimizer=False)
    w = MegatronWorker(role="actor", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, model_path=src,
                       optim=optim)
    prompts, responses = random_seqs(PROMPTS, seed=1), random_seqs(RESPONSES, seed=2)
    batch = _batch(prompts, responses)
    data = StepData(batch, Transport(in_process=True))
    shard, part = data.shards(1)[0], data.partition(1)
    fwd = {"padded": ForwardSettings(micro_batch_size=2, packed=False, temperature=0.7),
           "packed": ForwardSettings(micro_batch_size=4, packed=True, temperature=0.7),
           "budget": ForwardSettings(micro_batch_size=1, packed=True, max_token_len=24, temperature=0.7)}
    lp = {}
    for name, s in fwd.items():
        tok, ent = w.log_probs(shard, settings=s, entropy=True, key="old_log_probs")
        lp[name] = (part.gather([tok["old_log_probs"]]), ent)
    n = len(prompts)
    mbs = w._micro_batches(shard_batch(shard), fwd["budget"], ())
    budget_groups = [(len(mb["rows"]), int(mb["input_ids"].shape[1])) for mb in mbs]

    pl = PolicyLoss(loss_mode="vanilla", agg_mode="seq-mean-token-mean", norm_constant=12.0, clip_ratio=0.2,
                    clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False,
                    kl_loss_coef=0.0, kl_loss_type="kl")
    base = UpdateSettings(mini_batch_size=n, epochs=1, shuffle=False, micro_batch_size=2, temperature=0.7, policy=pl,
                          packed=False)
    counts = [tuple(float(c) for c in batch_norm_counts(batch.response_mask, "seq-mean-token-mean"))]
    extras = data.scatter(1, {"advantages": batch.advantages, "old_log_probs": lp["padded"][0]})[0]
    w.update_actor(shard, [list(range(n))], extras, settings=base, counts=counts)  # Adam state to checkpoint
    w.save(f"{tmp}/ckpt")
    out = {}
    for name, s in {"padded": base, "budget": replace(base, packed=True, max_token_len=24, micro_batch_size=1)}.items():
        w.load(f"{tmp}/ckpt")
        m = w.update_actor(shard, [list(range(n))], extras, settings=s, counts=counts)["metrics"][0]
        after = part.gather([w.log_probs(shard, settings=fwd["padded"], key="x")[0]["x"]])
        out[name] = (m, after)
    try:
        w.log_probs(shard, settings=replace(fwd["budget"], max_token_len=10))
        refused = None
    except ValueError as e:
        refused = str(e)
    return lp, out, budget_groups, refused


def test_packed_and_token_budget_equal_padded(tmp_path):
    from megatron_bridge.launch import find_free_port, spawn

    from bridge_tiny import hf_reference

    src = str(tmp_path / "m")
    model = make_hf("qwen2", src, seed=4, hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
                    intermediate_size=80, num_hidden_layers=3, tie_word_embeddings=False)
    lp, out, groups, refused = spawn(job, 1, src, find_free_port(), str(tmp_path))[0]
    prompts, responses = random_seqs(PROMPTS, seed=1), random_seqs(RESPONSES, seed=2)
    ref = hf_reference(model, [p + r for p, r in zip(prompts, responses)], temperature=0.7)
    padded, (packed, ent_p), (budget, ent_b) = lp["padded"][0], lp["packed"], lp["budget"]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        want = ref[i][0][len(p) - 1:len(p) + len(r) - 1]  # transformers on the sequence alone (tokens 1..L-1)
        for got in (padded, packed, budget):
            torch.testing.assert_close(got[i, :len(r)], want.float(), atol=2e-5, rtol=0)
            assert not got[i, len(r):].any()
    assert ent_p["count"] == ent_b["count"] == lp["padded"][1]["count"] == sum(RESPONSES)
    assert ent_p["sum"] == pytest.approx(lp["padded"][1]["sum"], abs=1e-4)
    assert ent_b["sum"] == pytest.approx(lp["padded"][1]["sum"], abs=1e-4)
    # the budget of 24 tokens: every micro-batch is one packed row within it, more than one of them
    assert len(groups) > 1 and all(t <= 24 for _, t in groups) and sum(b for b, _ in groups) == len(PROMPTS)
    (m_pad, after_pad), (m_bud, after_bud) = out["padded"], out["budget"]
    for k in ("actor/pg_loss", "actor/grad_norm"):
        # partials: (kind, numerator, denominator)
        assert m_bud[k][0] == m_pad[k][0] and m_bud[k][1:] == pytest.approx(m_pad[k][1:], rel=1e-4, abs=1e-7), k
    assert not torch.allclose(after_pad, padded)  # the step moved the policy...
    torch.testing.assert_close(after_bud, after_pad, atol=3e-5, rtol=0)  # ...the same way both times
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    assert refused is not None and "log_prob_max_token_len_per_gpu" in refused and f"{longest} tokens" in refused
