"""The megatron worker trims all-padding columns before its passes (``RolloutBatch.trim_padding``):
a shard padded wider than it needs gives exactly the log-probs and entropies of the tight shard, at
the same columns, with zeros on the extra response columns."""

import numpy as np
import torch

from bridge_tiny import make_case, random_seqs


def _batch(prompts, responses, P, T):
    from trainer.rollout.single_turn import pad_left, pad_right
    from trainer.batch import RolloutBatch

    p_ids, p_mask = pad_left(prompts, P, 0)
    r_ids, r_mask = pad_right(responses, T, 0, torch.long)
    return RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask).to_numpy_dict()


def job(src, prompts, responses, port):
    import megatron_bridge.logprobs as L
    from trainer.workers.megatron_worker import MegatronWorker

    widths, orig = [], L.compute_logprobs

    def recording(model, mbs, **kw):  # the worker imports it at call time: this is what it runs
        widths.append([tuple(mb["input_ids"].shape) for mb in mbs])
        return orig(model, mbs, **kw)

    L.compute_logprobs = recording
    w = MegatronWorker(role="ref", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, model_path=src)
    P, T = max(map(len, prompts)), max(map(len, responses))
    tight = w.compute_log_prob(_batch(prompts, responses, P, T), temperature=0.8, micro_batch_size=2, with_entropy=True)
    wide = w.compute_log_prob(_batch(prompts, responses, P + 5, T + 4), temperature=0.8, micro_batch_size=2,
                              with_entropy=True)
    return tight, wide, (P, T), widths


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
    for key in ("log_probs", "entropy"):
        assert tight[key].shape == (3, T) and wide[key].shape == (3, T + 4)
        assert np.array_equal(wide[key][:, :T], tight[key]), key  # bit-identical: the same tensors ran
        assert not wide[key][:, T:].any(), key
        # real response tokens got real values; pads none
        for i, r in enumerate(responses):
            assert np.all(tight[key][i, 1:len(r)] != 0) and not tight[key][i, len(r):].any()
