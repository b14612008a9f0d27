"""The DeepSpeed strategy against the Megatron one: the same HF model, the same batch, one PPO update
with the same optimizer settings (AdamW with weight decay, gradient clipping that binds, token-mean
loss over the whole mini-batch). Megatron TP1 on one rank, DeepSpeed ZeRO-1, -2 and -3 on two
data-parallel ranks (each with its half of the batch and the global token count): the same
``pg_loss``, ``grad_norm`` and learning rate, and the same log-probs after the step. The log-probs
before the step are compared too (the forward definitions agree: temperature first, full vocabulary),
and so are the critic's values and one critic update.
"""

import pytest
import torch
# imported before a spawned rank initialises megatron, whose CPU shims replace torch.cuda.Stream (which
# transformers' generation utilities annotate with at import time); a DeepSpeed rank never loads megatron
import transformers.models.qwen2.modeling_qwen2  # noqa: F401

from bridge_tiny import make_hf, random_seqs

pytestmark = pytest.mark.slow

PROMPTS = [4, 6, 3, 5]
RESPONSES = [6, 3, 8, 5]
OPTIM = dict(optimizer="adam", lr=2e-3, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
             adam_eps=1e-8, clip_grad=0.05, lr_schedule="cosine", lr_warmup_steps=1, lr_warmup_init=1e-4,
             lr_decay_steps=10, use_distributed_optimizer=False)


def _batch():
    from trainer.batch import RolloutBatch
    from trainer.rollout.single_turn import pad_left, pad_right

    prompts, responses = random_seqs(PROMPTS, seed=31), random_seqs(RESPONSES, seed=32)
    p_ids, p_mask = pad_left(prompts, max(map(len, prompts)), 0)
    r_ids, r_mask = pad_right(responses, max(map(len, responses)), 0, torch.long)
    b = RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)
    g = torch.Generator().manual_seed(33)
    b.advantages = torch.randn(r_ids.shape, generator=g) * r_mask
    b.values = torch.randn(r_ids.shape, generator=g) * r_mask
    b.returns = torch.randn(r_ids.shape, generator=g) * r_mask
    return b


def _settings(n):
    from trainer.plan import ForwardSettings, PolicyLoss, UpdateSettings, ValueLoss

    fwd = ForwardSettings(micro_batch_size=2, packed=False, temperature=0.7)
    pl = PolicyLoss(loss_mode="vanilla", agg_mode="token-mean", norm_constant=8.0, clip_ratio=0.2, clip_ratio_low=None,
                    clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.01, use_kl_loss=False, kl_loss_coef=0.0,
                    kl_loss_type="kl")
    upd = UpdateSettings(mini_batch_size=n, epochs=1, shuffle=False, micro_batch_size=1, temperature=0.7, policy=pl,
                         packed=False)
    vl = UpdateSettings(mini_batch_size=n, epochs=1, shuffle=False, micro_batch_size=1, temperature=1.0,
                        value=ValueLoss(agg_mode="token-mean", cliprange_value=0.5), packed=False)
    return fwd, upd, vl


def job(kind, stage, src, port, extra=None):
    import torch.distributed as dist

    from trainer.algos.losses import batch_norm_counts
    from trainer.workers.dataplane import StepData, Transport

    rank, world = dist.get_rank(), dist.get_world_size()
    common = dict(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, model_path=src)
    if kind == "megatron":
        from trainer.workers.megatron_worker import MegatronWorker

        actor = MegatronWorker(role="actor", optim=OPTIM, **common)
        critic = MegatronWorker(role="critic", optim=OPTIM, **common)
    elif kind == "fsdp2":
        from megatron_bridge import cpu_shims

        from trainer.workers.train_worker import TrainWorker

        cpu_shims.uninstall_mode()  # the spawn helper set megatron up; an FSDP rank runs plain torch
        opts = {"param_dtype": "fp32", **(extra or {})}
        actor = TrainWorker(role="actor", strategy="fsdp2", optim=OPTIM, **common, **opts)
        critic = TrainWorker(role="critic", strategy="fsdp2", optim=OPTIM, **common, **opts)
    else:
        from megatron_bridge import cpu_shims

        from trainer.workers.deepspeed_worker import DeepSpeedWorker

        cpu_shims.uninstall_mode()  # the spawn helper set megatron up; a DeepSpeed rank runs plain torch

        actor = DeepSpeedWorker(role="actor", optim=OPTIM, zero_stage=stage, **common, **(extra or {}))
        critic = DeepSpeedWorker(role="critic", optim=OPTIM, zero_stage=stage, **common, **(extra or {}))
    batch = _batch()
    n = batch.num_samples
    fwd, upd, vl = _settings(n)
    data = StepData(batch, Transport(in_process=True))
    whole = data.shards(1)[0]
    dp, dp_rank = actor.mesh["dp_size"], actor.mesh["dp_rank"]  # Ulysses ranks of one DP shard share it
    before = torch.as_tensor(actor.log_probs(whole, settings=fwd, key="lp", entropy=True)[0]["lp"])
    old = before.clone()  # the old policy = the start of the step
    counts = [tuple(float(c) for c in batch_norm_counts(batch.response_mask, "token-mean"))]
    part = data.partition(dp)
    mine = data.shards(dp)[dp_rank]
    extras = data.scatter(dp, {"advantages": batch.advantages, "old_log_probs": old})[dp_rank]
    rows = [list(range(len(part.rows[dp_rank])))]
    res = actor.update_actor(mine, rows, extras, settings=upd, counts=counts)
    after = torch.as_tensor(actor.log_probs(whole, settings=fwd, key="lp")[0]["lp"])
    values = torch.as_tensor(critic.values(whole, settings=fwd)["values"])
    cx = data.scatter(dp, {"values": batch.values, "returns": batch.returns})[dp_rank]
    cres = critic.update_critic(mine, rows, cx, settings=vl, counts=counts)
    values_after = torch.as_tensor(critic.values(whole, settings=fwd)["values"])
    blocks = None
    if kind == "fsdp2":  # this rank's direct-reshard blocks, each with the values it would write
        s = actor.strategy
        assert s.read_rows and critic.strategy.read_rows  # built from each rank's own checkpoint rows
        blocks = [(b.hf_name, b.rows, b.cols, b.src(s.local_param(b.param)).clone()) for b in s.reshard_blocks()]
        full = {n: t.clone() for n, t in s.hf_params()}  # collective: every rank
    return {"before": before, "after": after, "metrics": res["metrics"], "values": values,
            "values_after": values_after, "critic_metrics": cres["metrics"], "dp": dp, "dp_rank": dp_rank,
            "blocks": blocks, "full": full if blocks is not None else None}


def _run(kind, stage, src, world, extra=None, every=False):
    from megatron_bridge.launch import find_free_port, spawn

    out = spawn(job, world, kind, stage, src, find_free_port(), extra)
    ranks = out
    from trainer.workers.metrics import reduce_partials

    dp = out[0].get("dp", world)
    first = [next(o for o in out if o["dp_rank"] == d) for d in range(dp)]  # one rank per DP shard, as RoleGroup reads
    m = reduce_partials([o["metrics"] for o in first], dp)[0]
    cm = reduce_partials([o["critic_metrics"] for o in first], dp)[0]
    return (out[0], m, cm, ranks) if every else (out[0], m, cm)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("ds") / "m")
    make_hf("qwen2", src, seed=35, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=56, num_hidden_layers=2, tie_word_embeddings=True)
    return src


@pytest.fixture(scope="module")
def megatron_ref(model_dir):
    return _run("megatron", 0, model_dir, 1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_megatron_tp1(stage, model_dir, megatron_ref):
    ref, m_ref, cm_ref = megatron_ref
    out, m, cm = _run("deepspeed", stage, model_dir, 2)
    mask = _batch().response_mask.bool()
    torch.testing.assert_close(out["before"][mask], ref["before"][mask], atol=2e-5, rtol=0)
    assert (out["before"][~mask] == 0).all()
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/entropy_loss"):
        assert m[k] == pytest.approx(m_ref[k], rel=1e-4, abs=1e-6), (k, m[k], m_ref[k])
    assert m["actor/grad_norm"] > OPTIM["clip_grad"]  # the clipping binds: its semantics are compared too
    moved = (out["after"] - out["before"])[mask].abs().max()
    assert moved > 1e-3  # the step changed the policy ...
    torch.testing.assert_close(out["after"][mask], ref["after"][mask], atol=5e-5, rtol=0)  # ... exactly as megatron's
    torch.testing.assert_close(out["values"][mask], ref["values"][mask], atol=2e-5, rtol=0)
    for k in ("critic/vf_loss", "critic/grad_norm"):
        assert cm[k] == pytest.approx(cm_ref[k], rel=1e-4, abs=1e-6), (k, cm[k], cm_ref[k])
    torch.testing.assert_close(out["values_after"][mask], ref["values_after"][mask], atol=5e-5, rtol=0)


def test_gradient_checkpointing_and_bf16(model_dir, megatron_ref):
    """Activation recompute changes no number (ZeRO-3 with HF gradient checkpointing equals megatron TP1
    without it); bf16 parameters train (the gradient norm within 1% of fp32's)."""
    ref, m_ref, _ = megatron_ref
    out, m, _ = _run("deepspeed", 3, model_dir, 2, {"gradient_checkpointing": True})
    mask = _batch().response_mask.bool()
    assert m["actor/grad_norm"] == pytest.approx(m_ref["actor/grad_norm"], rel=1e-4)
    torch.testing.assert_close(out["after"][mask], ref["after"][mask], atol=5e-5, rtol=0)
    out, m, cm = _run("deepspeed", 2, model_dir, 2, {"params_dtype": "bfloat16"})
    assert m["actor/grad_norm"] == pytest.approx(m_ref["actor/grad_norm"], rel=1e-2)
    assert m["actor/grad_norm"] != m_ref["actor/grad_norm"]  # really in bf16
    assert (out["after"] - out["before"])[mask].abs().max() > 1e-3


def _matches_megatron(out, m, cm, ref, m_ref, cm_ref):
    mask = _batch().response_mask.bool()
    torch.testing.assert_close(out["before"][mask], ref["before"][mask], atol=2e-5, rtol=0)
    assert (out["before"][~mask] == 0).all()
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/entropy_loss"):
        assert m[k] == pytest.approx(m_ref[k], rel=1e-4, abs=1e-6), (k, m[k], m_ref[k])
    assert m["actor/grad_norm"] > OPTIM["clip_grad"]
    assert (out["after"] - out["before"])[mask].abs().max() > 1e-3
    torch.testing.assert_close(out["after"][mask], ref["after"][mask], atol=5e-5, rtol=0)
    torch.testing.assert_close(out["values"][mask], ref["values"][mask], atol=2e-5, rtol=0)
    for k in ("critic/vf_loss", "critic/grad_norm"):
        assert cm[k] == pytest.approx(cm_ref[k], rel=1e-4, abs=1e-6), (k, cm[k], cm_ref[k])
    torch.testing.assert_close(out["values_after"][mask], ref["values_after"][mask], atol=5e-5, rtol=0)


@pytest.mark.parametrize("opts", [
    {"packed": False},  # two data-parallel shards, padded rows
    {"packed": True, "sp": 2},  # one shard split over a Ulysses pair, packed
    {"packed": False, "sp": 2, "gradient_checkpointing": True, "fsdp_size": 1},  # + HSDP mesh (2 x 1), recompute
], ids=["dp2-padded", "sp2-packed", "sp2-padded-hsdp-ckpt"])
def test_fsdp2_matches_megatron_tp1(opts, model_dir, megatron_ref):
    """FSDP2 on two ranks, with and without Ulysses SP=2 and packing, equals megatron TP1 on one: the
    log-probs and values before, the actor's and the critic's loss, gradient norm and learning rate, and
    the log-probs and values after one step."""
    ref, m_ref, cm_ref = megatron_ref
    out, m, cm, every = _run("fsdp2", 0, model_dir, 2, opts, every=True)
    _matches_megatron(out, m, cm, ref, m_ref, cm_ref)
    # the direct-reshard plan (shared-memory weight sync): the ranks' row blocks tile every HF tensor exactly once
    # (a hybrid mesh's replicas write nothing) and hold its values
    full = every[0]["full"]
    seen = {n: torch.zeros(t.shape[0], dtype=torch.int64) for n, t in full.items()}
    for o in every:
        for name, (r0, r1), (c0, c1), vals in o["blocks"]:
            seen[name][r0:r1] += 1
            assert (c0, c1) == (0, full[name][0].numel())
            torch.testing.assert_close(vals, full[name].reshape(full[name].shape[0], -1)[r0:r1], atol=0, rtol=0)
    assert all((c == 1).all() for c in seen.values()), {n: c.tolist() for n, c in seen.items() if not (c == 1).all()}
