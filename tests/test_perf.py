"""perf/mfu/*: the FLOP count against hand counts, the MFU division, the peak table and the CPU peak."""

import pytest
import torch

from trainer.hf_io import ArchConfig
from trainer.perf import PassCost, PeakTable, gpu_peak_tflops, matmul_params, measure_cpu_peak, mfu, mfu_metrics, model_flops

# a Llama with GQA 2:1: hidden 64, 4 heads x 16, 2 KV heads, SwiGLU 128, 2 layers, vocabulary 1000
DENSE = ArchConfig.from_hf_dict({
    "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
# a Qwen2-MoE: hidden 32, 4 heads x 8, 2 KV heads, 8 experts of width 16 (top-2), a shared expert of 24
MOE = ArchConfig.from_hf_dict({
    "model_type": "qwen2_moe", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
    "tie_word_embeddings": True})


def test_dense_flops_hand_count():
    # per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288; MLP 3*64*128 = 24576 -> 36864
    # 2 layers 73728, LM head 64*1000 = 64000: N = 137728
    assert matmul_params(DENSE) == 137728
    # sequences of 10 and 6 tokens: sum T = 16, sum T^2 = 136
    # forward: 2*137728*16 + 4*(2 layers*4 heads*16)*136 = 4407296 + 69632 = 4476928; training x3
    assert model_flops(DENSE, [10, 6], backward=False) == 4476928
    assert model_flops(DENSE, [10, 6]) == 13430784
    # the critic: a 64 x 1 value head instead of the LM head
    assert matmul_params(DENSE, value_head=True) == 73728 + 64


def test_moe_flops_hand_count():
    # per layer: attention q 32*32 + k 32*16 + v 32*16 + o 32*32 = 3072; router 32*8 = 256,
    # 2 routed experts 2*3*32*16 = 3072, shared expert 3*32*24 = 2304 and its gate 32 -> 5664
    # 2 layers 2*(3072+5664) = 17472, tied LM head 32*100 = 3200 (a multiply all the same): N = 20672
    assert matmul_params(MOE) == 20672
    # one sequence of 5: forward 2*20672*5 + 4*(2*4*8)*25 = 206720 + 6400 = 213120
    assert model_flops(MOE, [5], backward=False) == 213120
    assert model_flops(MOE, [5]) == 639360


def test_mfu_division_and_metrics():
    assert mfu(1e12, 2.0, 2, 1.0) == pytest.approx(0.25)
    assert mfu(1e12, 0.0, 2, 1.0) is None
    passes = [PassCost("actor", "update_actor", DENSE, 2, 1e-6, epochs=2),
              PassCost("ref", "ref", DENSE, 1, 1e-6, backward=False)]
    out = mfu_metrics(passes, {"timing_s/update_actor": 4.0}, [10, 6])
    # 2 epochs x 13430784 FLOPs / (4 s x 2 devices x 1e6 FLOP/s); the reference did not run: no metric
    assert out == {"perf/mfu/actor": pytest.approx(2 * 13430784 / (4.0 * 2 * 1e6))}


def test_peaks():
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == 19.5
    assert gpu_peak_tflops("Some New Accelerator", "bfloat16") is None
    before = torch.get_num_threads()
    assert measure_cpu_peak(threads=1, size=256, repeats=2) > 0
    assert torch.get_num_threads() == before
    peaks = PeakTable("cpu", 1)
    p = peaks("float32")
    assert p > 0 and peaks("float32") == p  # measured once
    assert peaks.params["perf/peak_tflops/float32"] == f"{p:.6g}" and "measured" in peaks.params["perf/peak_source"]


def test_cpu_peak_is_the_best_layout(monkeypatch):
    """torch's CPU kernels differ by operand layout (bf16 on an AVX2 machine: ``a @ b`` 0.8 GFLOP/s,
    ``a @ b.T`` 7): the peak is the faster one, so an nn.Linear-shaped model cannot pass 100% MFU."""
    import time as _time

    import trainer.perf as perf

    real = torch.matmul

    def slow_unless_transposed(a, b):
        if b.is_contiguous():  # a @ b: the slow layout here
            _time.sleep(0.02)
        return real(a, b)

    monkeypatch.setattr(perf.torch, "matmul", slow_unless_transposed)
    fast = measure_cpu_peak(threads=1, size=64, repeats=2)
    assert 2 * 64 ** 3 / fast / 1e12 < 0.01  # the 20 ms layout was not the one kept
