"""Train step: TP=2 and PP=2 must reproduce TP=1 (loss, grad norm, parameters) to 1e-5, for the policy
(log-prob + entropy loss, SGD, active grad clipping) and for the critic (value head, MSE)."""

import math

import pytest

from bridge_tiny import loss_micro_batches, make_case, policy_loss, random_seqs, value_loss

STEPS = 2


def train_job(src: str, seqs):
    import torch.distributed as dist

    from bridge_tiny import gather_hf
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.launch import set_parallel
    from megatron_bridge.model import build_model
    from megatron_bridge.train import OptimConfig, make_trainer, train_step

    hf = read_hf_config(src)
    mbs = loss_micro_batches(seqs, seed=7)
    out = {}
    for lname, tp, pp in (("tp1", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)):
        for role in ("policy", "critic"):
            set_parallel(tp=tp, pp=pp)
            model = build_model(hf, value_head=role == "critic")  # the head's init is layout-free
            load_hf_weights(model, src)
            tr = make_trainer(model, OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.05 if role == "policy" else 0.0))
            hist = []
            for _ in range(STEPS):
                fn = policy_loss if role == "policy" else value_loss
                hist.append(train_step(tr, mbs, fn, with_entropy=role == "policy", temperature=0.9))
            params = gather_hf(tr.model)
            if dist.get_rank() == 0:
                out[(lname, role)] = (hist, params)
    return out if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_train_step_tp2_pp2_match_tp1(tmp_path):
    from megatron_bridge.launch import spawn

    src = str(tmp_path / "m")
    make_case("llama_gqa2_untied_llama3rope", src)
    seqs = random_seqs([6, 9, 4, 11, 5, 7, 3], seed=2)
    out = spawn(train_job, 2, src, seqs)[0]
    for role in ("policy", "critic"):
        ref_hist, ref_params = out[("tp1", role)]
        # the step really trained: parameters moved, and clipping was active for the policy
        assert ref_hist[0]["loss"] != ref_hist[1]["loss"]
        if role == "policy":
            assert ref_hist[0]["grad_norm"] > 0.05 and ref_hist[0]["lr"] == 0.5
            assert math.isfinite(ref_hist[0]["mean_logp"])
        for lname in ("tp2", "pp2"):
            hist, params = out[(lname, role)]
            for a, b in zip(hist, ref_hist):
                assert abs(a["loss"] - b["loss"]) < 1e-5, (lname, role, a, b)
                assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * max(1.0, b["grad_norm"]), (lname, role, a, b)
            assert sorted(params) == sorted(ref_params)
            worst = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
            assert worst < 1e-5, (lname, role, worst)
    from safetensors.torch import load_file

    init = load_file(f"{src}/model.safetensors")
    for role in ("policy", "critic"):
        trained = out[("tp1", role)][1]
        moved = max(float((trained[k] - init[k]).abs().max()) for k in trained if k in init)
        assert moved > 1e-3, (role, moved)  # the comparison above is between models that really moved


def test_lr_schedule_warmup_then_cosine_golden():
    from megatron_bridge.train import OptimConfig, make_scheduler

    class FakeOpt:  # the scheduler only touches param_groups
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    opt = FakeOpt()
    sched = make_scheduler(opt, OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_steps=6,
                                            lr_schedule="cosine"))
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step(increment=1)
    # warmup: 0, 1e-3 * 1/2, 1e-3; cosine over steps 2..6: min + (max-min) * (1 + cos(pi * (s-2)/4)) / 2
    expect = [0.0, 5e-4, 1e-3] + [1e-4 + 9e-4 * (1 + math.cos(math.pi * (s - 2) / 4)) / 2 for s in (3, 4, 5, 6)] + [1e-4]
    assert all(abs(a - b) < 1e-12 for a, b in zip(lrs, expect)), (lrs, expect)
    opt2 = FakeOpt()
    s2 = make_scheduler(opt2, OptimConfig(lr=2e-3, lr_warmup_steps=1, lr_schedule="constant"))
    got = []
    for _ in range(4):
        got.append(opt2.param_groups[0]["lr"])
        s2.step(increment=1)
    assert got == [0.0, 2e-3, 2e-3, 2e-3]
