"""``sum_v pi(v)^2`` per response token (verl's ``actor.calculate_sum_pi_squared``, the optimal token
baseline's input) from the actor's old-log-prob pass, against a float64 reference from transformers.

* The vocab-parallel function alone (no process group): logits far apart (a float32 ``exp`` of the raw
  logits would overflow) and vocabulary padding, against ``softmax(float64)^2`` summed.
* The workers, one two-rank job: the megatron actor at TP=1 (two data-parallel ranks), TP=2 (each rank
  half of the padded vocabulary: the max and both sums go through the TP group), PP=2 and CP=2, padded and
  packed micro-batches, and the DeepSpeed actor (ZeRO-3 over the two ranks). Reference: transformers on each
  sequence alone in float64, ``sum exp(2 log_softmax(logits / T))`` at the position that chose the token.
  The tiny model's final norm is scaled up so that the distributions range from near-uniform to peaked
  (sum pi^2 from ~0.2 to ~0.95 here; a random tiny model alone gives ~1/V everywhere, where any
  vocabulary-sized error would hide). Tolerance 2e-5 absolute (float32 forward).
"""

import pytest
import torch
# imported before a spawned rank initialises megatron, whose CPU shims replace torch.cuda.Stream (which
# transformers' generation utilities annotate with at import time)
import transformers.models.qwen2.modeling_qwen2  # noqa: F401

from bridge_tiny import VOCAB, make_hf, random_seqs

PROMPTS = [4, 7, 2, 5]
RESPONSES = [9, 3, 6, 1]
TEMP = 0.7
# two ranks each: data parallel, tensor parallel (vocab-parallel sums), pipeline parallel (the last stage
# broadcasts the field), context parallel (each rank half of every sequence; the field is gathered)
LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}}


def test_vocab_parallel_sum_pi_squared_is_stable_and_masks_padding():
    from megatron_bridge.logprobs import vocab_parallel_sum_pi_squared

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 12, generator=g) * 40.0  # [B, S, V_local]: exp() of these overflows float32
    logits[0, 0] = 0.0  # uniform over the 10 real ids
    logits[1, 1, 3] = 1e4  # one id takes all the mass
    logits[..., 10:] = 7e3  # padding rows (ids >= vocab_size=10) hold garbage: they must get probability 0
    ref = torch.softmax(logits[..., :10].double() / 0.5, -1).pow(2).sum(-1)  # [B, S]
    got = vocab_parallel_sum_pi_squared(logits, vocab_size=10, temperature=0.5)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-5)
    assert got[0, 0] == pytest.approx(0.1) and got[1, 1] == pytest.approx(1.0)
    # float64 logits stay float64
    torch.testing.assert_close(vocab_parallel_sum_pi_squared(logits.double(), vocab_size=10, temperature=0.5), ref,
                               atol=1e-12, rtol=0)


def _batch():
    from trainer.batch import RolloutBatch
    from trainer.rollout.single_turn import pad_left, pad_right

    prompts, responses = random_seqs(PROMPTS, seed=41), random_seqs(RESPONSES, seed=42)
    p_ids, p_mask = pad_left(prompts, max(map(len, prompts)), 0)
    r_ids, r_mask = pad_right(responses, max(map(len, responses)), 0, torch.long)
    return RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)


def job(src):
    from dataclasses import replace

    import torch.distributed as dist

    from megatron_bridge import cpu_shims
    from trainer.plan import ForwardSettings
    from trainer.workers.dataplane import StepData, Transport
    from trainer.workers.deepspeed_worker import DeepSpeedWorker
    from trainer.workers.megatron_worker import MegatronWorker

    rank, world = dist.get_rank(), dist.get_world_size()
    common = dict(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=0, model_path=src)
    data = StepData(_batch(), Transport(in_process=True))
    shard, part = data.shards(1)[0], data.partition(1)  # every rank scores the whole batch
    fwd = {"padded": ForwardSettings(micro_batch_size=3, packed=False, temperature=TEMP, with_sum_pi_squared=True),
           "packed": ForwardSettings(micro_batch_size=4, packed=True, temperature=TEMP, with_sum_pi_squared=True)}
    out = {}
    for lname, par in LAYOUTS.items():  # the process group exists: each worker only re-lays megatron's mesh
        w = MegatronWorker(role="actor", **par, **common)
        for name, s in fwd.items():
            res, _ = w.log_probs(shard, settings=s, entropy=True, key="old_log_probs")
            out[(f"megatron_{lname}", name)] = {k: part.gather([v]) for k, v in res.items()}
    out["fields_without_the_key"] = sorted(w.log_probs(shard, settings=replace(fwd["padded"], with_sum_pi_squared=False),
                                                       key="old_log_probs")[0])
    del w
    cpu_shims.uninstall_mode()  # a DeepSpeed rank runs plain torch
    ds = DeepSpeedWorker(role="actor", zero_stage=3, **common)
    res, _ = ds.log_probs(shard, settings=fwd["padded"], key="old_log_probs")
    out[("deepspeed_zero3", "padded")] = {k: part.gather([v]) for k, v in res.items()}
    return out


@torch.no_grad()
def _reference(model):
    """[B, T] float64 log-probs and sum pi^2 of each response token, transformers on each sequence alone."""
    prompts, responses = random_seqs(PROMPTS, seed=41), random_seqs(RESPONSES, seed=42)
    T = max(RESPONSES)
    lp_ref, spp_ref = torch.zeros(len(PROMPTS), T, dtype=torch.float64), torch.zeros(len(PROMPTS), T, dtype=torch.float64)
    m = model.double()
    for i, (p, r) in enumerate(zip(prompts, responses)):
        logp = torch.log_softmax(m(torch.tensor([p + r])).logits[0] / TEMP, -1)  # [L, V] float64
        rows = torch.arange(len(p) - 1, len(p) + len(r) - 1)  # the positions that chose the response tokens
        lp_ref[i, :len(r)] = logp[rows].gather(-1, torch.tensor(r)[:, None])[:, 0]
        spp_ref[i, :len(r)] = (2.0 * logp[rows]).exp().sum(-1)
    return lp_ref, spp_ref


@pytest.mark.slow
def test_actor_sum_pi_squared_matches_transformers_float64(tmp_path):
    from megatron_bridge.launch import spawn

    src = str(tmp_path / "m")
    model = make_hf("qwen2", src, seed=8, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=56, num_hidden_layers=2, tie_word_embeddings=False)
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)  # peaked distributions (see the module docstring)
    model.save_pretrained(src)
    lp_ref, spp_ref = _reference(model)
    mask = _batch().response_mask.bool()
    assert spp_ref[mask].min() < 0.3 and spp_ref[mask].max() > 0.9  # near-uniform to peaked
    assert VOCAB % 2 == 0 and VOCAB % 128  # TP=2 pads the vocabulary: rank 1 holds padding rows
    out = spawn(job, 2, src)
    for rank_out in out:
        assert rank_out["fields_without_the_key"] == ["old_log_probs"]  # computed only when asked
        runs = {k: v for k, v in rank_out.items() if isinstance(k, tuple)}
        assert len(runs) == 2 * len(LAYOUTS) + 1, sorted(runs)
        for name, res in runs.items():
            spp = res["sum_pi_squared"].double()
            worst = float((spp - spp_ref)[mask].abs().max())
            assert worst < 2e-5, (name, worst)
            assert (spp[~mask] == 0).all(), name
            # the same positions as the log-probs (alignment): these match the reference too
            assert float((res["old_log_probs"].double() - lp_ref)[mask].abs().max()) < 1e-4, name
