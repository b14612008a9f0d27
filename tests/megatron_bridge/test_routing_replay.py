"""Routing replay through the bridge (megatron_bridge.routing_replay): with a recorded routing table the
megatron MoE layers send every token to the recorded experts, weighted by their own router, so the
log-probs equal the native torch forward that replays the same routing (itself checked against
transformers without replay in tests/rollout/test_moe_engine.py), in every token layout the bridge
has: left-padded and packed rows, EP=2, TP=2 with sequence parallelism, CP=2. Tokens without a record
keep the router's choice. A train step with replay under PP=2 and full activation recompute (the
recomputed routers replay their own micro-batch's routing) equals PP=1 without recompute, and differs
from a step without replay."""

import pytest
import torch

from bridge_tiny import loss_micro_batches, make_hf, policy_loss, random_seqs

MOE = {
    "qwen3_moe": dict(num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
}
TEMP = 0.8


def random_routes(seqs, layers: int, experts: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    """Per sequence ``[L, R, k]``: k distinct random experts per token and layer, and about a third of
    the tokens without a record (-1: the router chooses)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in seqs:
        r = torch.stack([torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(layers)])
                         for _ in s])  # [L, R, k]
        r[torch.rand(len(s), generator=g) < 0.33] = -1
        out.append(r)
    return out


def with_routes(mbs: list[dict], seqs, routes) -> list[dict]:
    """``routed_experts`` for each micro-batch of ``loss_micro_batches`` (left-padded, right-padded, packed)."""
    out, i = [], 0
    for mb in mbs:
        mb = dict(mb)
        if "cu_seqlens" in mb:
            n = len(mb["cu_seqlens"]) - 1
            mb["routed_experts"] = torch.cat(routes[i:i + n])  # [T, R, k]
        else:
            n, S = mb["input_ids"].shape
            real = mb["attention_mask"].bool()
            t = torch.full((n, S, *routes[0].shape[1:]), -1, dtype=torch.int16)
            for j in range(n):
                t[j, real[j]] = routes[i + j].to(torch.int16)
            mb["routed_experts"] = t
        out.append(mb)
        i += n
    return out


def replay_job(src: str, seqs, routes):
    import torch.distributed as dist

    from bridge_tiny import gather_hf
    from megatron_bridge import routing_replay
    from megatron_bridge.convert import load_hf_weights
    from megatron_bridge.hf_config import read_hf_config
    from megatron_bridge.launch import set_parallel
    from megatron_bridge.logprobs import compute_logprobs
    from megatron_bridge.model import build_model
    from megatron_bridge.train import OptimConfig, make_trainer, train_step

    hf = read_hf_config(src)
    base = loss_micro_batches(seqs)
    mbs = with_routes(base, seqs, routes)
    fwd = [{k: mb[k] for k in ("input_ids", "attention_mask", "cu_seqlens", "routed_experts") if k in mb} for mb in mbs]
    out = {}
    layouts = {"ep1": dict(), "ep2": dict(ep=2), "tp2_sp": dict(tp=2), "cp2": dict(cp=2)}
    for name, par in layouts.items():
        set_parallel(**par)
        model = build_model(hf, sequence_parallel=name == "tp2_sp")
        load_hf_weights(model, src)
        assert routing_replay.install(model) == hf.num_layers
        out[(name, "lp")] = compute_logprobs(model, fwd, temperature=TEMP)
        if name == "ep1":  # the same model routing freely
            free = [{k: v for k, v in mb.items() if k != "routed_experts"} for mb in fwd]
            out["free"] = compute_logprobs(model, free, temperature=TEMP)
    for name, pp, rc in (("pp1", 1, None), ("pp2_recompute", 2,
                                            {"recompute_granularity": "full", "recompute_method": "uniform",
                                             "recompute_num_layers": 1}), ("no_replay", 1, None)):
        set_parallel(pp=pp)
        model = build_model(hf, recompute=rc)
        load_hf_weights(model, src)
        routing_replay.install(model)
        tr = make_trainer(model, OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0))
        out[(name, "step")] = train_step(tr, base if name == "no_replay" else mbs, policy_loss, temperature=TEMP,
                                         with_entropy=True)
        out[(name, "trained")] = gather_hf(tr.model)
    return out if dist.get_rank() == 0 else None


def native_reference(src: str, seqs, routes) -> list[torch.Tensor]:
    """Per sequence, the native torch model replaying ``routes``: log-probs of tokens 1..L-1 at TEMP."""
    from trainer.rollout.hf_model import CausalLM

    m = CausalLM.from_pretrained(src)
    out = []
    for s, r in zip(seqs, routes):
        logits = m.forward(torch.tensor([s]), routing=r[None]).float()[0] / TEMP
        out.append(torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


def rows_of(lp: dict, mbs: list[dict]) -> list[torch.Tensor]:
    """Per sequence (micro-batch order), the bridge's log-probs of tokens 1..L-1."""
    from megatron_bridge.logprobs import unpack

    out = []
    for o, mb in zip(lp, mbs):
        x = o["logprobs"]
        if "cu_seqlens" in mb:
            out += [t[1:] for t in unpack(x, mb["cu_seqlens"])]
        else:
            real = mb["attention_mask"].bool()
            out += [x[j][real[j]][1:] for j in range(len(real))]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MOE))
def test_routing_replay_in_every_layout(tmp_path, kind):
    from megatron_bridge.launch import spawn

    src = str(tmp_path / "m")
    cfg = make_hf(kind, src, **MOE[kind]).config
    seqs = random_seqs([7, 12, 4, 9, 5, 6, 8], seed=5)
    routes = random_routes(seqs, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok)
    out = spawn(replay_job, 2, src, seqs, routes)[0]
    ref = native_reference(src, seqs, routes)
    mbs = with_routes(loss_micro_batches(seqs), seqs, routes)
    for name in ("ep1", "ep2", "tp2_sp", "cp2"):
        got = rows_of(out[(name, "lp")], mbs)
        worst = max(float((g - r).abs().max()) for g, r in zip(got, ref))
        assert worst < 5e-5, (kind, name, worst)
    free = rows_of(out["free"], mbs)
    assert max(float((g - r).abs().max()) for g, r in zip(free, ref)) > 1e-2  # the replay changed the routing
    a, b, c = out[("pp2_recompute", "step")], out[("pp1", "step")], out[("no_replay", "step")]
    assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * max(1, b["grad_norm"])
    assert abs(c["loss"] - b["loss"]) > 1e-4  # without replay: another objective
    t1, t2, t0 = out[("pp1", "trained")], out[("pp2_recompute", "trained")], out[("no_replay", "trained")]
    assert max(float((t1[k] - t2[k]).abs().max()) for k in t1) < 1e-5
    assert max(float((t1[k] - t0[k]).abs().max()) for k in t1) > 1e-4
