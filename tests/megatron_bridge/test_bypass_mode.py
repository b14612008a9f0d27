"""verl's rollout-correction bypass mode in the megatron worker (``rollout_correction.bypass_mode``):
the old log-probs ARE the sampler's and the IS weights / rejection come from the current log-probs
inside the loss.

* ``ppo_clip``: the same update as the decoupled update handed the sampler's log-probs as its old
  log-probs with no IS weights (the PPO ratio pi / pi_rollout does the correction);
* ``reinforce`` with sequence-level truncated IS: ``pg_loss = token-mean(-w_seq A log pi)`` with
  ``w_seq = min(exp(sum_t (log pi - log pi_rollout)), 2)``, checked against a float64 computation from
  the worker's own log-probs before the step;
* a rejection option masks tokens inside the loss (a bound no token passes leaves a zero loss).
And the driver's batch normalisation of decoupled IS weights (mean 1 over tokens / sequences).
"""

import math

import pytest
import torch

from bridge_tiny import make_hf, random_seqs

pytestmark = pytest.mark.slow

PROMPTS = [4, 6, 3, 5]
RESPONSES = [6, 3, 8, 5]


def _batch():
    from trainer.batch import RolloutBatch
    from trainer.rollout.single_turn import pad_left, pad_right

    prompts, responses = random_seqs(PROMPTS, seed=21), random_seqs(RESPONSES, seed=22)
    p_ids, p_mask = pad_left(prompts, max(map(len, prompts)), 0)
    r_ids, r_mask = pad_right(responses, max(map(len, responses)), 0, torch.long)
    b = RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)
    g = torch.Generator().manual_seed(23)
    b.advantages = torch.randn(r_ids.shape, generator=g) * r_mask
    return b


def job(src, port, tmp):
    from trainer.algos.losses import batch_norm_counts
    from trainer.plan import ForwardSettings, PolicyLoss, Rejection, RolloutIS, UpdateSettings
    from trainer.workers.dataplane import StepData, Transport
    from trainer.workers.megatron_worker import MegatronWorker

    optim = dict(optimizer="adam", lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                 adam_eps=1e-8, clip_grad=0.0, lr_schedule="constant", lr_warmup_steps=0, lr_decay_steps=10,
                 use_distributed_optimizer=False)
    w = MegatronWorker(role="actor", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, model_path=src,
                       optim=optim)
    batch = _batch()
    n = batch.num_samples
    fwd = ForwardSettings(micro_batch_size=4, packed=True, temperature=1.0)
    pl = PolicyLoss(loss_mode="vanilla", agg_mode="token-mean", norm_constant=8.0, clip_ratio=0.2, clip_ratio_low=None,
                    clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                    kl_loss_type="kl")
    settings = UpdateSettings(mini_batch_size=n, epochs=1, shuffle=False, micro_batch_size=2, temperature=1.0,
                              policy=pl, packed=True)
    counts = [tuple(float(c) for c in batch_norm_counts(batch.response_mask, "token-mean"))]
    plain = StepData(batch, Transport(in_process=True))
    cur0 = torch.as_tensor(w.log_probs(plain.shards(1)[0], settings=fwd, key="lp")[0]["lp"])
    # one step first, so the checkpoint below holds Adam state to restore before every variant
    w.update_actor(plain.shards(1)[0], [list(range(n))], plain.scatter(1, {"advantages": batch.advantages,
                                                                          "old_log_probs": cur0})[0],
                   settings=settings, counts=counts)
    cur = torch.as_tensor(w.log_probs(plain.shards(1)[0], settings=fwd, key="lp")[0]["lp"])
    # a sampler that drifted from the trainer: per-token noise on the current log-probs
    g = torch.Generator().manual_seed(24)
    batch.rollout_log_probs = ((cur + 0.15 * torch.randn(cur.shape, generator=g)) * batch.response_mask).float()
    data = StepData(batch, Transport(in_process=True), with_rollout_log_probs=True)
    shard = data.shards(1)[0]
    seq_is = RolloutIS(rollout_is_level="sequence", rollout_is_mode="truncate", rollout_is_threshold=2.0,
                       rollout_is_threshold_lower=None, rollout_is_veto_threshold=None, rollout_is=True)
    w.save(f"{tmp}/ckpt")
    out = {"cur": cur, "roll": batch.rollout_log_probs}

    def run(name, extras, **kw):
        w.load(f"{tmp}/ckpt")
        from trainer.workers.metrics import reduce_partials

        part = w.update_actor(shard, [list(range(n))], extras, settings=settings, counts=counts, **kw)["metrics"]
        m = reduce_partials([part], 1)[0]  # one DP rank: its partial sums are the step's metrics
        after = torch.as_tensor(w.log_probs(shard, settings=fwd, key="lp")[0]["lp"])
        out[name] = (m, after)

    adv = {"advantages": batch.advantages}
    run("decoupled_with_sampler_old", data.scatter(1, {**adv, "old_log_probs": batch.rollout_log_probs})[0])
    bypass_extras = data.scatter(1, {**adv, "old_log_probs": batch.rollout_log_probs})[0]
    run("bypass_ppo_clip", bypass_extras, bypass=dict(loss="ppo_clip", rollout_is=seq_is, rejection=None))
    run("bypass_reinforce", bypass_extras, bypass=dict(loss="reinforce", rollout_is=seq_is, rejection=None))
    reject_all = (Rejection(divergence="k3", agg="token", lower=None, upper=-1.0),)  # k3 >= 0: nothing passes
    run("bypass_reject_all", bypass_extras, bypass=dict(loss="ppo_clip", rollout_is=None, rejection=reject_all))
    return out


def test_bypass_mode(tmp_path):
    from megatron_bridge.launch import find_free_port, spawn

    src = str(tmp_path / "m")
    make_hf("qwen2", src, seed=25, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=56, num_hidden_layers=2, tie_word_embeddings=True)
    out = spawn(job, 1, src, find_free_port(), str(tmp_path))[0]
    b = _batch()
    m = b.response_mask.bool()
    # ppo_clip: the decoupled update with the sampler's log-probs as old ones, exactly
    (m_dec, after_dec), (m_pc, after_pc) = out["decoupled_with_sampler_old"], out["bypass_ppo_clip"]
    assert m_pc["actor/pg_loss"] == pytest.approx(m_dec["actor/pg_loss"], rel=1e-6, abs=1e-9)
    torch.testing.assert_close(after_pc[m], after_dec[m], atol=1e-6, rtol=0)
    # reinforce: token-mean(-w_seq A log pi) at the start-of-step weights, float64
    cur, roll = out["cur"].double(), out["roll"].double()
    md = m.double()
    w_seq = torch.exp(((cur - roll) * md).sum(-1)).clamp(max=2.0)  # [B]
    want = (-(w_seq[:, None] * b.advantages.double() * cur) * md).sum() / md.sum()
    m_rf, after_rf = out["bypass_reinforce"]
    assert m_rf["actor/pg_loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    assert abs(m_rf["actor/pg_loss"] - m_pc["actor/pg_loss"]) > 1e-4  # a different objective
    assert not torch.allclose(after_rf[m], after_pc[m])
    # rejection inside the loss: nothing kept, no gradient (Adam's momentum still moves the weights)
    m_rj, _ = out["bypass_reject_all"]
    assert m_rj["actor/pg_loss"] == 0.0 and m_rj["actor/grad_norm"] == 0.0 and m_pc["actor/grad_norm"] > 0


def test_driver_batch_normalized_is_weights():
    from trainer.step import apply_rollout_is
    from trainer.plan import RolloutIS

    b = _batch()
    g = torch.Generator().manual_seed(26)
    mask = b.response_mask.double()
    b.old_log_probs = (torch.randn(mask.shape, generator=g) * 0.3 * mask).float()
    b.rollout_log_probs = (torch.randn(mask.shape, generator=g) * 0.3 * mask).float()
    for level in ("token", "sequence"):
        s = RolloutIS(rollout_is_level=level, rollout_is_mode="truncate", rollout_is_threshold=2.0,
                      rollout_is_threshold_lower=None, rollout_is_veto_threshold=None, rollout_is=True)
        met = apply_rollout_is(b, s, normalize=True)
        w = b.rollout_is_weights.double()
        d = (b.old_log_probs.double() - b.rollout_log_probs.double()) * mask
        raw = torch.exp(d).clamp(max=2.0) if level == "token" else torch.exp(d.sum(-1, keepdim=True)).clamp(max=2.0).expand_as(d)
        factor = (raw * mask).sum() / mask.sum() if level == "token" else raw[:, 0].mean()
        torch.testing.assert_close(w * mask, raw / factor * mask, atol=1e-5, rtol=0)
        assert met["rollout_is_batch_norm_factor"] == pytest.approx(float(factor), rel=1e-5)
        mean = (w * mask).sum() / mask.sum() if level == "token" else (w[:, 0]).mean()
        assert float(mean) == pytest.approx(1.0, rel=1e-5)
        assert not math.isclose(float(factor), 1.0, rel_tol=1e-3)  # the normalisation did something


DP_PROMPTS = [4, 6, 3, 5, 2, 6, 4, 3]
DP_RESPONSES = [6, 3, 8, 5, 7, 2, 4, 6]


def _dp_batch():
    from trainer.batch import RolloutBatch
    from trainer.rollout.single_turn import pad_left, pad_right

    prompts, responses = random_seqs(DP_PROMPTS, seed=31), random_seqs(DP_RESPONSES, seed=32)
    p_ids, p_mask = pad_left(prompts, max(map(len, prompts)), 0)
    r_ids, r_mask = pad_right(responses, max(map(len, responses)), 0, torch.long)
    b = RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)
    b.advantages = torch.randn(r_ids.shape, generator=torch.Generator().manual_seed(33)) * r_mask
    return b


def dp_job(src, tmp, level):
    """Two data-parallel ranks, each its shard (4 rows) in micro-batches of 2 rows: one bypass-reinforce step
    with batch-normalised IS weights. Returns (on rank 0) the start-of-step log-probs, the sampler's and the
    step's metrics (both ranks' partials reduced as the driver reduces them)."""
    import torch.distributed as dist

    from trainer.algos.losses import batch_norm_counts
    from trainer.plan import PolicyLoss, RolloutIS, UpdateSettings, ForwardSettings
    from trainer.workers.dataplane import StepData, Transport
    from trainer.workers.megatron_worker import MegatronWorker
    from trainer.workers.metrics import reduce_partials

    rank = dist.get_rank()
    optim = dict(optimizer="adam", lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                 adam_eps=1e-8, clip_grad=0.0, lr_schedule="constant", lr_warmup_steps=0, lr_decay_steps=10,
                 use_distributed_optimizer=False)
    w = MegatronWorker(role="actor", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=0, model_path=src,
                       optim=optim)
    batch = _dp_batch()
    plain = StepData(batch, Transport(in_process=True))
    part = plain.partition(2)
    lp = w.log_probs(plain.shards(2)[rank], settings=ForwardSettings(micro_batch_size=4, packed=True, temperature=1.0),
                     key="lp")[0]["lp"]
    every = [None, None]
    dist.all_gather_object(every, lp)
    cur = part.gather(every).float()  # [B, T] the start-of-step policy, batch order
    g = torch.Generator().manual_seed(34)  # the same drifted sampler on both ranks
    batch.rollout_log_probs = ((cur + 0.3 * torch.randn(cur.shape, generator=g)) * batch.response_mask).float()
    data = StepData(batch, Transport(in_process=True), with_rollout_log_probs=True)
    pl = PolicyLoss(loss_mode="vanilla", agg_mode="token-mean", norm_constant=8.0, clip_ratio=0.2, clip_ratio_low=None,
                    clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                    kl_loss_type="kl")
    settings = UpdateSettings(mini_batch_size=batch.num_samples, epochs=1, shuffle=False, micro_batch_size=2,
                              temperature=1.0, policy=pl, packed=True)
    counts = [tuple(float(c) for c in batch_norm_counts(batch.response_mask, "token-mean"))]
    ris = RolloutIS(rollout_is_level=level, rollout_is_mode="truncate", rollout_is_threshold=2.0,
                    rollout_is_threshold_lower=None, rollout_is_veto_threshold=None, rollout_is=True)
    extras = data.scatter(2, {"advantages": batch.advantages, "old_log_probs": batch.rollout_log_probs})[rank]
    n_local = len(part.rows[rank])
    res = w.update_actor(data.shards(2)[rank], [list(range(n_local))], extras, settings=settings, counts=counts,
                         bypass=dict(loss="reinforce", rollout_is=ris, rejection=None, batch_normalize=True))
    parts = [None, None]
    dist.all_gather_object(parts, res["metrics"])
    return {"cur": cur, "roll": batch.rollout_log_probs, "rows": [r.tolist() for r in part.rows],
            "metrics": reduce_partials(parts, 2)[0]}


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bypass_batch_normalized_weights_span_the_data_parallel_ranks(tmp_path, level):
    """verl's ``run_with_rollout_corr.sh`` (bypass, ``loss_type=reinforce``, ``rollout_is_batch_normalize``): the
    weights exist only inside the loss, so each micro-batch is normalised over every data-parallel rank's share of
    it (verl's ``distributed_masked_mean``). The reference is verl 0.9.1's own
    ``compute_rollout_correction_and_rejection_mask`` on the micro-batch's rows of both ranks together; normalising
    each rank's share alone gives another loss (checked), so the all-reduce is what the test sees."""
    from megatron_bridge.launch import spawn
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    src = str(tmp_path / "m")
    make_hf("qwen2", src, seed=35, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=56, num_hidden_layers=2, tie_word_embeddings=True)
    out = spawn(dp_job, 2, src, str(tmp_path), level)[0]
    b = _dp_batch()
    cur, roll, mask, adv = out["cur"].double(), out["roll"].double(), b.response_mask.double(), b.advantages.double()

    def loss(groups):  # token-mean over the whole mini-batch of -w A log pi, w normalised within each group
        total = 0.0
        for rows in groups:
            ix = torch.tensor(rows)
            wp, _, _ = compute_rollout_correction_and_rejection_mask(
                old_log_prob=cur[ix], rollout_log_prob=roll[ix], response_mask=mask[ix], rollout_is=level,
                rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
            total += float((-(wp.batch["rollout_is_weights"] * adv[ix] * cur[ix]) * mask[ix]).sum())
        return total / float(mask.sum())

    r0, r1 = out["rows"]  # micro-batch j: local rows 2j, 2j+1 of each rank
    verl_groups = [r0[2 * j:2 * j + 2] + r1[2 * j:2 * j + 2] for j in range(2)]
    per_rank_groups = [r[2 * j:2 * j + 2] for r in (r0, r1) for j in range(2)]
    want, alone = loss(verl_groups), loss(per_rank_groups)
    got = out["metrics"]["actor/pg_loss"]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert abs(alone - want) > 1e-3 * max(abs(want), 1e-3), (alone, want)  # the ranks' shares alone differ
