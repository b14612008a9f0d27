"""The loop with the bench_e2e throughput settings: the actor in bf16 mixed precision and
torch.compile, the rollout engine with its decode step compiled. The config keys reach the workers,
every resharding sync still verifies (bf16 actor -> fp32 engine), and the numbers are those of the
fp32 run to bf16 accuracy, not identical (the actor really trained in bf16); the compiled decode
samples exactly what the eager engine samples, before and after a weight sync. In-process workers,
one rank: the wiring is what is tested."""

from pathlib import Path

import pytest

from tests.support.tiny import tiny_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "cpu" / "tiny_model")
pytestmark = pytest.mark.slow

BASE = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "data.max_response_length=6",
        f"actor_rollout_ref.model.path={TINY}", "trainer.logger=[console]", "trainer.total_training_steps=2",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
        "trainer.debug.in_process=true", "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.optim.lr=1e-3"]


def test_bf16_compiled_actor_in_the_loop(tmp_path):
    from trainer.main import train

    runs = {}
    for name, extra in (("fp32", []), ("bf16", ["actor_rollout_ref.actor.megatron.dtype=bfloat16",
                                                 "actor_rollout_ref.actor.megatron.use_torch_compile=true"]),
                        ("fp32_compiled_decode", ["actor_rollout_ref.rollout.engine_kwargs.compile_decode=true"])):
        cfg = tiny_config(BASE + extra + [f"trainer.default_local_dir={tmp_path / name}"])
        runs[name] = train(cfg)["history"]
    fp, bf = runs["fp32"], runs["bf16"]
    assert [h["step"] for h in bf] == [1, 2]
    for h in bf:
        assert h["sync/verified"] == 1.0
    # step 1 samples from the untouched HF weights (fp32 engine): the same rollout, the same rewards
    assert bf[0]["critic/score/mean"] == fp[0]["critic/score/mean"]
    assert bf[0]["response_length/mean"] == fp[0]["response_length/mean"]
    # the trainer's log-probs: bf16 differs from the fp32 sampler far more than fp32 does, but stays close
    kf, kb = fp[0]["mismatch/mismatch_k3_kl"], bf[0]["mismatch/mismatch_k3_kl"]
    assert 0 <= kf < 1e-7 < kb < 1e-1, (kf, kb)
    g_f, g_b = fp[0]["actor/grad_norm"], bf[0]["actor/grad_norm"]
    assert g_f > 0 and g_b != g_f and abs(g_b - g_f) < 0.1 * g_f, (g_f, g_b)
    # compiled decode: step 2 samples from the synced step-1 weights; stale weights would change the
    # samples and raise the trainer/sampler mismatch far above fp32 rounding
    cd = runs["fp32_compiled_decode"]
    for h_e, h_c in zip(fp, cd):
        assert h_c["sync/verified"] == 1.0
        for key in ("critic/score/mean", "response_length/mean", "actor/grad_norm"):
            assert h_c[key] == pytest.approx(h_e[key], rel=1e-4, abs=1e-7), (h_c["step"], key)
        assert h_c["mismatch/mismatch_k3_kl"] < 1e-7, h_c["mismatch/mismatch_k3_kl"]
