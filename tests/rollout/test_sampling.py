"""The sampler's pure functions against float64 per-row Python references."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.rollout.native import (
    blocked_inverse_cdf,
    blocked_max_argmax,
    filter_probs_sorted,
    inverse_cdf,
    sample_tokens,
)


def ref_first_exceeding(weights: list[float], u: float) -> int:
    # First index whose running float64 sum exceeds u * total.
    total = math.fsum(weights)
    acc = 0.0
    for j, w in enumerate(weights):
        acc += w
        if acc > u * total:
            return j
    return max(j for j, w in enumerate(weights) if w > 0)


def ref_filtered_probs(z: list[float], top_k: int, top_p: float) -> list[float]:
    """float64 reference of the sampling distribution over the vocab: softmax(z), keep the top_k most
    likely (0 = all), renormalise, keep a token when the mass of strictly better-ranked tokens < top_p,
    renormalise. Ties ranked by index, as a stable descending sort does."""
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    if top_k:
        order = order[:top_k]
    m = max(z[i] for i in order)
    w = {i: math.exp(z[i] - m) for i in order}
    tot = math.fsum(w.values())
    kept, before = [], 0.0
    for i in order:
        if before < top_p:
            kept.append(i)
        before += w[i] / tot
    tot2 = math.fsum(w[i] for i in kept)
    out = [0.0] * len(z)
    for i in kept:
        out[i] = w[i] / tot2
    return out


def ref_log_softmax(z: list[float], i: int) -> float:
    m = max(z)
    return z[i] - m - math.log(math.fsum(math.exp(v - m) for v in z))


@settings(max_examples=60, deadline=None)
@given(V=st.sampled_from([7, 2048, 3000, 4099]), R=st.integers(1, 5), levels=st.integers(2, 50), seed=st.integers(0, 2**31))
def test_blocked_argmax_is_first_argmax(V, R, levels, seed):
    # Few distinct values -> many ties; torch.argmax returns the first max, and so must we.
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (R, V), generator=g).float()
    m, i = blocked_max_argmax(x)
    assert torch.equal(i, x.argmax(-1)) and torch.equal(m, x.amax(-1))


def test_inverse_cdf_against_reference():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(50, 37, generator=g, dtype=torch.float64)
    probs[probs < 0.3] = 0.0  # zero-mass entries must never be drawn
    probs[:, -1] = 0.0
    u = torch.rand(50, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2**-53  # the two extremes of [0, 1)
    got = inverse_cdf(probs, u)
    for r in range(50):
        assert int(got[r]) == ref_first_exceeding(probs[r].tolist(), float(u[r]))
        assert probs[r, got[r]] > 0


def test_blocked_inverse_cdf_matches_flat():
    g = torch.Generator().manual_seed(1)
    w = torch.rand(200, 4096, generator=g)  # fp32 weights, block size 1024
    w[w < 0.5] = 0.0
    w[:, 1024:2048] = 0.0  # a whole empty block
    u = torch.rand(200, generator=g, dtype=torch.float64)
    assert torch.equal(blocked_inverse_cdf(w, u), inverse_cdf(w, u))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.6), (4, 0.5), (1, 1.0), (0, 1e-9)])
def test_filter_probs_sorted_against_reference(top_k, top_p):
    g = torch.Generator().manual_seed(2)
    z = torch.randn(8, 10, generator=g)
    vals, idx = torch.sort(z, dim=-1, descending=True, stable=True)
    got = filter_probs_sorted(vals, top_k=top_k, top_p=top_p)
    got = got / got.sum(-1, keepdim=True)
    for r in range(8):
        ref = ref_filtered_probs(z[r].tolist(), top_k, top_p)
        for j in range(10):
            assert abs(float(got[r, j]) - ref[int(idx[r, j])]) < 1e-6


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.7)])
def test_sample_tokens_draw_and_logprob(temperature, top_k, top_p):
    # Each row's token is the reference inverse-CDF draw of the filtered distribution at its uniform,
    # and its logprob is the FULL-vocabulary log_softmax(logits / T) (T = 1 when greedy).
    g = torch.Generator().manual_seed(3)
    V = 3000  # blocked paths on (block 1000)
    logits = 3 * torch.randn(64, V, generator=g)
    u = torch.rand(64, generator=g, dtype=torch.float64)
    tokens, logprobs = sample_tokens(logits, u, temperature=temperature, top_k=top_k, top_p=top_p)
    T = temperature or 1.0
    for r in range(64):
        z = (logits[r].double() / T).tolist()
        if temperature == 0:
            assert int(tokens[r]) == int(logits[r].argmax())
        elif top_k == 0 and top_p == 1.0:
            # Unfiltered: the CDF runs over the vocabulary in id order.
            p = ref_filtered_probs(z, top_k, top_p)
            assert int(tokens[r]) == ref_first_exceeding(p, float(u[r])), r
        else:
            # Filtered: the CDF runs over the kept tokens in descending-probability order.
            p = ref_filtered_probs(z, top_k, top_p)
            order = sorted(range(V), key=lambda i: (-z[i], i))
            assert int(tokens[r]) == order[ref_first_exceeding([p[i] for i in order], float(u[r]))], r
        assert abs(float(logprobs[r]) - ref_log_softmax(z, int(tokens[r]))) < 2e-5


def test_sample_tokens_frequencies():
    # 40000 draws from one 6-token distribution with top_k=4, top_p=0.9, T=0.8: empirical frequencies
    # within 5 standard errors of the reference distribution, and never a filtered-out token.
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, 3.0])
    ref = ref_filtered_probs((logits.double() / 0.8).tolist(), 4, 0.9)
    n = 40000
    u = torch.rand(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    tokens, _ = sample_tokens(logits.expand(n, 6).contiguous(), u, temperature=0.8, top_k=4, top_p=0.9)
    counts = torch.bincount(tokens, minlength=6).double() / n
    for j in range(6):
        if ref[j] == 0:
            assert counts[j] == 0
        else:
            se = math.sqrt(ref[j] * (1 - ref[j]) / n)
            assert abs(counts[j] - ref[j]) < 5 * se, (j, counts[j], ref[j])
