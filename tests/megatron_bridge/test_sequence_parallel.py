"""Sequence parallelism (``*.megatron.sequence_parallel`` with TP > 1): megatron-core's own SP on CPU
with gloo (all-gather / reduce-scatter of the sequence dim around each TP block, the layer norms' grads
all-reduced over TP by ``finalize_model_grads``), on a shape no other test uses (Llama, 4 query / 2 kv
heads, hidden 40, 3 layers, and a Qwen3 with q/k norms, whose norms run on the gathered sequence; odd
sequence lengths so the rows are padded to a multiple of TP).

TP=2 + SP against TP=1 from the same weights: actor log-probs (padded and packed rows), one optimizer
step (loss, gradient norm and the updated policy), and the critic's values and one critic step (its
value head is replicated over TP, so it sees the gathered sequence)."""

import pytest
import torch

from bridge_tiny import make_hf, random_seqs

pytestmark = pytest.mark.slow

PROMPTS = [3, 8, 5, 6, 2]
RESPONSES = [7, 2, 9, 4, 5]  # rows of 10, 10, 14, 10, 7 tokens: packed 51 (odd), padded width 17 (odd)


def _batch():
    from trainer.batch import RolloutBatch
    from trainer.rollout.single_turn import pad_left, pad_right

    prompts, responses = random_seqs(PROMPTS, seed=5), random_seqs(RESPONSES, seed=6)
    p_ids, p_mask = pad_left(prompts, max(map(len, prompts)), 0)
    r_ids, r_mask = pad_right(responses, max(map(len, responses)), 0, torch.long)
    b = RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)
    g = torch.Generator().manual_seed(7)
    b.advantages = torch.randn(r_ids.shape, generator=g) * r_mask
    b.returns = torch.randn(r_ids.shape, generator=g) * r_mask
    return b


def job(src, port, tp, sp):
    import torch.distributed as dist

    from trainer.algos.losses import batch_norm_counts
    from trainer.plan import ForwardSettings, PolicyLoss, UpdateSettings, ValueLoss
    from trainer.workers.dataplane import StepData, Transport
    from trainer.workers.megatron_worker import MegatronWorker

    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ.get("RANK", 0))
    optim = dict(optimizer="adam", lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                 adam_eps=1e-8, clip_grad=0.0, lr_schedule="constant", lr_warmup_steps=0, lr_decay_steps=10,
                 use_distributed_optimizer=False)
    out = {}
    batch = _batch()
    n = batch.num_samples
    data = StepData(batch, Transport(in_process=True))
    shard = data.shards(1)[0]  # DP 1: every TP rank holds the whole batch
    counts = [tuple(float(c) for c in batch_norm_counts(batch.response_mask, "token-mean"))]
    fwd = {"padded": ForwardSettings(micro_batch_size=2, packed=False, temperature=0.9),
           "packed": ForwardSettings(micro_batch_size=5, packed=True, temperature=0.9)}
    for role, port_off in (("actor", 0), ("critic", 1)):
        w = MegatronWorker(role=role, rank=rank, world_size=tp, master_addr="127.0.0.1", master_port=port + port_off,
                           model_path=src, tp=tp, optim=optim, sequence_parallel=sp)
        assert w.model.config.sequence_parallel == (sp and tp > 1)
        if role == "actor":
            for name, s in fwd.items():
                out[name] = torch.as_tensor(w.log_probs(shard, settings=s, key="lp")[0]["lp"])
            pl = PolicyLoss(loss_mode="vanilla", agg_mode="token-mean", norm_constant=9.0, clip_ratio=0.2,
                            clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0,
                            use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="kl")
            settings = UpdateSettings(mini_batch_size=n, epochs=1, shuffle=False, micro_batch_size=3, temperature=0.9,
                                      policy=pl, packed=True)
            extras = data.scatter(1, {"advantages": batch.advantages, "old_log_probs": out["padded"]})[0]
            m = w.update_actor(shard, [list(range(n))], extras, settings=settings, counts=counts)["metrics"][0]
            out["actor_metrics"] = {k: m[k] for k in ("actor/pg_loss", "actor/grad_norm")}
            out["after"] = torch.as_tensor(w.log_probs(shard, settings=fwd["packed"], key="lp")[0]["lp"])
        else:
            vals = torch.as_tensor(w.values(shard, settings=fwd["padded"])["values"])
            out["values_packed"] = torch.as_tensor(w.values(shard, settings=fwd["packed"])["values"])
            out["values"] = vals
            settings = UpdateSettings(mini_batch_size=n, epochs=1, shuffle=False, micro_batch_size=2, temperature=1.0,
                                      value=ValueLoss(cliprange_value=0.5, agg_mode="token-mean"), packed=False)
            extras = data.scatter(1, {"values": vals, "returns": batch.returns})[0]
            m = w.update_critic(shard, [list(range(n))], extras, settings=settings, counts=counts)["metrics"][0]
            out["critic_metrics"] = {k: v for k, v in m.items() if k in ("critic/vf_loss", "critic/grad_norm")}
            out["values_after"] = torch.as_tensor(w.values(shard, settings=fwd["packed"])["values"])
        w.shutdown() if hasattr(w, "shutdown") else None
    return out


@pytest.mark.parametrize("kind, extra", [("llama", {}), ("qwen3", {"head_dim": 12})],
                         ids=["llama", "qwen3_qknorm"])
def test_tp2_sequence_parallel_equals_tp1(tmp_path, kind, extra):
    from megatron_bridge.launch import find_free_port, spawn

    src = str(tmp_path / "m")
    make_hf(kind, src, seed=11, hidden_size=40, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=72, num_hidden_layers=3, tie_word_embeddings=False, **extra)
    ref = spawn(job, 1, src, find_free_port(), 1, False)[0]
    got = spawn(job, 2, src, find_free_port(), 2, True)
    mask = _batch().response_mask.bool()
    for r in got:  # both TP ranks hold the same results
        for k in ("padded", "packed", "after", "values", "values_packed", "values_after"):
            torch.testing.assert_close(r[k][mask], ref[k][mask], atol=3e-5, rtol=0, msg=k)
        for k, v in {**ref["actor_metrics"], **ref["critic_metrics"]}.items():
            got_k = {**r["actor_metrics"], **r["critic_metrics"]}[k]  # partials: (kind, numerator, denominator)
            assert got_k[0] == v[0] and got_k[1:] == pytest.approx(v[1:], rel=1e-4, abs=1e-6), k
    assert not torch.allclose(ref["after"][mask], ref["packed"][mask])  # the step moved the policy
    assert not torch.allclose(ref["values_after"][mask], ref["values"][mask])  # and the critic
