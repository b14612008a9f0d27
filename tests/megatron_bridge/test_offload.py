"""Offload (``*.megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``, megatron_bridge.offload)
in the megatron worker: between its methods the role's parameters, gradient buffer and optimizer state
(Adam moments; under bf16 also the fp32 master weights) are freed in place (storages resized to zero
bytes, every view intact) and come back for the methods that use them. Two updates, log-probs, a weight
stream and a checkpoint round trip with everything offloaded give bit-identical results to the same
worker without offload, in fp32 and in bf16 mixed precision. The mechanism is device-agnostic; the keys
are refused with trainer.device=cpu, where nothing is saved (tests/config/test_config.py), and the GPU test
checks the device memory it frees."""

import pytest
import torch

from bridge_tiny import make_hf, random_seqs
from test_worker_packing import _batch

pytestmark = pytest.mark.slow
PROMPTS, RESPONSES = [3, 9, 2, 6, 5], [7, 1, 4, 8, 3]
OPTIM = dict(optimizer="adam", lr=1e-2, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
             clip_grad=1.0, lr_schedule="constant", lr_warmup_steps=0, lr_decay_steps=10, use_distributed_optimizer=False)


def job(src, port, tmp, dtype, offload, device="cpu"):
    from trainer.algos.losses import batch_norm_counts
    from trainer.plan import ForwardSettings, PolicyLoss, UpdateSettings
    from trainer.workers.dataplane import StepData, Transport
    from trainer.workers.megatron_worker import MegatronWorker

    w = MegatronWorker(role="actor", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, model_path=src,
                       optim=OPTIM, params_dtype=dtype, offload=offload)
    status = [w.offload_status()]
    batch = _batch(random_seqs(PROMPTS, seed=1), random_seqs(RESPONSES, seed=2))
    data = StepData(batch, Transport(in_process=True))
    shard, part = data.shards(1)[0], data.partition(1)
    fwd = ForwardSettings(micro_batch_size=2, packed=True, temperature=0.7)
    pl = PolicyLoss(loss_mode="vanilla", agg_mode="token-mean", norm_constant=8.0, clip_ratio=0.2, clip_ratio_low=None,
                    clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                    kl_loss_type="kl")
    upd = UpdateSettings(mini_batch_size=len(PROMPTS), epochs=1, shuffle=False, micro_batch_size=2, temperature=0.7,
                         policy=pl, packed=True)
    counts = [tuple(float(c) for c in batch_norm_counts(batch.response_mask, "token-mean"))]
    out = {"metrics": [], "lp": []}
    for _ in range(2):
        old = part.gather([w.log_probs(shard, settings=fwd, key="old_log_probs")[0]["old_log_probs"]])
        extras = data.scatter(1, {"advantages": batch.advantages, "old_log_probs": old})[0]
        out["metrics"].append(w.update_actor(shard, [list(range(len(PROMPTS)))], extras, settings=upd, counts=counts)
                              ["metrics"][0])
        status.append(w.offload_status())
        out["lp"].append(old)
    out["stream"] = {n: t.clone() for b in w.weight_buckets(1 << 16) for n, t in (b or [])}
    status.append(w.offload_status())
    w.save(f"{tmp}/ckpt")
    w.update_actor(shard, [list(range(len(PROMPTS)))], extras, settings=upd, counts=counts)
    w.load(f"{tmp}/ckpt")  # back to the saved weights and Adam state
    out["reloaded"] = w.weights_checksum()
    out["after_load"] = w.update_actor(shard, [list(range(len(PROMPTS)))], extras, settings=upd, counts=counts)["metrics"][0]
    out["status"] = status + [w.offload_status()]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_between_phases_changes_nothing_but_memory(tmp_path, dtype):
    from megatron_bridge.launch import find_free_port, spawn

    src = str(tmp_path / "m")
    make_hf("qwen2", src, seed=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=80,
            num_hidden_layers=2, tie_word_embeddings=False)
    everything = dict(params=True, grads=True, optimizer=True)
    base = spawn(job, 1, src, find_free_port(), str(tmp_path / "a"), dtype, None)[0]
    off = spawn(job, 1, src, find_free_port(), str(tmp_path / "b"), dtype, everything)[0]
    for a, b in zip(base["metrics"] + [base["after_load"]], off["metrics"] + [off["after_load"]]):
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
            assert a[k] == b[k], (k, a[k], b[k])
    for a, b in zip(base["lp"], off["lp"]):
        assert torch.equal(a, b)
    assert base["lp"][0].abs().sum() > 0 and not torch.equal(base["lp"][0], base["lp"][1])  # the update moved it
    assert sorted(base["stream"]) == sorted(off["stream"])
    assert all(torch.equal(base["stream"][n], off["stream"][n]) for n in base["stream"])
    assert base["reloaded"] == off["reloaded"]
    assert base["status"][0] == {"offloaded": {}, "bytes": {}, "resident": {}}
    n_params = sum(t.numel() for t in base["stream"].values())
    width = 2 if dtype == "bfloat16" else 4
    for st in off["status"]:  # after init and after every method: all three parts in host memory
        assert st["offloaded"] == {"optimizer": True, "grads": True, "params": True}, st
        assert st["resident"] == {"optimizer": 0, "grads": 0, "params": 0}, st
    freed = off["status"][-1]["bytes"]
    assert freed["params"] >= n_params * width  # (plus megatron's padded vocabulary rows)
    assert freed["grads"] >= n_params * 4  # fp32 gradient buffer
    # Adam's two moments, and under bf16 the fp32 master weights besides
    assert freed["optimizer"] >= n_params * 4 * (3 if dtype == "bfloat16" else 2)


@pytest.mark.gpu
def test_offload_frees_gpu_memory(tmp_path):
    """On a GPU: device memory falls by the offloaded bytes between phases and the results match."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on a lent device: pytest -m gpu)")
    import os

    from trainer.workers.megatron_worker import MegatronWorker

    src = str(tmp_path / "m")
    make_hf("qwen2", src, seed=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=512,
            num_hidden_layers=4, tie_word_embeddings=False)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    from megatron_bridge.launch import find_free_port

    w = MegatronWorker(role="actor", rank=0, world_size=1, master_addr="127.0.0.1", master_port=find_free_port(),
                       model_path=src, optim=OPTIM, params_dtype="bfloat16",
                       offload=dict(params=True, grads=True, optimizer=True))
    torch.cuda.synchronize()
    low = torch.cuda.memory_allocated()
    w._load_state(("params", "grads", "optimizer"))
    high = torch.cuda.memory_allocated()
    w._offload_state()
    assert high - low >= sum(w.offload_status()["bytes"].values()) * 0.9
    assert torch.cuda.memory_allocated() <= low * 1.05 + (1 << 20)
