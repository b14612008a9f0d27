"""A DP shard reaches the worker trimmed to its own width (``trainer.workers.dataplane.StepData``): a
batch padded wider than it needs gives exactly the log-probs of the tight batch, at the same columns,
and the gathered result has zeros on the extra response columns."""

import numpy as np
import torch

from bridge_tiny import make_case, random_seqs


def _batch(prompts, responses, P, T):
    from trainer.batch import RolloutBatch
    from trainer.rollout.single_turn import pad_left, pad_right

    p_ids, p_mask = pad_left(prompts, P, 0)
    r_ids, r_mask = pad_right(responses, T, 0, torch.long)
    return RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)


def job(src, prompts, responses, port):
    import megatron_bridge.logprobs as L
    from trainer.workers.megatron_worker import MegatronWorker

    widths, orig = [], L.compute_logprobs

    def recording(model, mbs, **kw):  # the worker imports it at call time: this is what it runs
        widths.append([tuple(mb["input_ids"].shape) for mb in mbs])
        return orig(model, mbs, **kw)

    L.compute_logprobs = recording
    w = MegatronWorker(role="ref", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, model_path=src)
    from trainer.plan import ForwardSettings
    from trainer.workers.dataplane import StepData, Transport

    P, T = max(map(len, prompts)), max(map(len, responses))
    out = {}
    for name, (p, t) in {"tight": (P, T), "wide": (P + 5, T + 4)}.items():
        data = StepData(_batch(prompts, responses, p, t), Transport(in_process=True))
        shard = data.shards(1)[0]
        tokens, ent = w.log_probs(shard, settings=ForwardSettings(micro_batch_size=2, packed=False, temperature=0.8),
                                 entropy=True)
        out[name] = (data.partition(1).gather([tokens["log_probs"]]).numpy(), ent)
    return out["tight"], out["wide"], (P, T), widths


def test_padding_columns_do_not_change_log_probs(tmp_path):
    import multiprocessing as mp

    from megatron_bridge.launch import find_free_port

    src = str(tmp_path / "m")
    make_case("qwen2_bias_gqa2_tied", src)
    prompts = random_seqs([3, 5, 2], seed=1)
    responses = random_seqs([4, 6, 1], seed=2)
    with mp.get_context("spawn").Pool(1) as pool:
        tight, wide, (P, T), widths = pool.apply(job, (src, prompts, responses, find_free_port()))
    # the wide shard reached the model trimmed to the tight shard's shapes (P + T columns, not P+5 + T+4)
    assert widths[0] == widths[1] == [(2, P + T), (1, P + T)], widths
    (tight, ent_t), (wide, ent_w) = tight, wide
    assert tight.shape == (3, T) and wide.shape == (3, T + 4)
    assert np.array_equal(wide[:, :T], tight)  # bit-identical: the same tensors ran
    assert not wide[:, T:].any()
    assert ent_t == ent_w and ent_t["count"] == sum(map(len, responses))
    # real response tokens got real values; pads none
    for i, r in enumerate(responses):
        assert np.all(tight[i, 1:len(r)] != 0) and not tight[i, len(r):].any()
