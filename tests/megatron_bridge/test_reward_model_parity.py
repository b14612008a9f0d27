"""Learned reward models (``reward_model.*``): the role's scores equal transformers'
``AutoModelForSequenceClassification`` logits on the same tokens.

A tiny random ``Qwen2ForSequenceClassification`` (num_labels=1, a non-zero ``score`` head, perturbed
norms and biases) scores prompts (left-padded) + responses (right-padded) of different lengths. The
reference is transformers on one right-padded batch (it pools the logits at the last non-pad token).
The worker reads the head at each row's last valid token (``trainer.rewards.reward_model``):

* megatron, TP1 on one rank: padded micro-batches, packed (THD) micro-batches, and a token budget;
* megatron, TP2 with sequence parallelism on two ranks (packed);
* DeepSpeed ZeRO-3 on two ranks (parameters partitioned) and ZeRO-1 on one.

A checkpoint without a ``score`` head (a causal LM) is refused by both strategies with the reason.

Re-tokenised inputs (``reward_model.model.input_tokenizer``, verl's default): an RM with its own
tokenizer and chat template scores what the actor generated; the worker's scores of the
:class:`~trainer.rewards.reward_model.RMInputs` batch equal transformers on the conversation tokenized by
hand from the template's definition.
"""

import os
import sys

import pytest
import torch
# imported before a spawned rank initialises megatron (see test_deepspeed_parity.py)
import transformers.models.qwen2.modeling_qwen2  # noqa: F401

from bridge_tiny import VOCAB, make_hf, random_seqs

# the spawned megatron ranks re-import this module and take rm_tokenizer by its bare name: outside pytest the name
# ``tests`` is verl's wheel's package, so ``tests.support`` does not resolve there
SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

pytestmark = pytest.mark.slow

PROMPTS = [4, 9, 2, 6, 3]
RESPONSES = [7, 1, 11, 4, 9]
PAD = VOCAB - 1  # the HF reference's pad id; the random tokens never use it


def make_rm(path: str, seed: int = 5):
    """A tiny random Qwen2ForSequenceClassification (num_labels=1), saved to ``path``; returns it."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                      num_labels=1, pad_token_id=PAD, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
        model.score.weight.copy_(torch.randn_like(model.score.weight))  # well away from 0: scores of order 1
    model.save_pretrained(path)
    return model


def _seqs():
    return random_seqs(PROMPTS, seed=11, vocab=PAD), random_seqs(RESPONSES, seed=12, vocab=PAD)


def _batch():
    from trainer.batch import RolloutBatch
    from trainer.rollout.single_turn import pad_left, pad_right

    prompts, responses = _seqs()
    p_ids, p_mask = pad_left(prompts, max(map(len, prompts)), 0)
    r_ids, r_mask = pad_right(responses, max(map(len, responses)), 0, torch.long)
    return RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask)


@torch.no_grad()
def hf_scores(model) -> torch.Tensor:
    """transformers on one right-padded batch of prompt + response."""
    prompts, responses = _seqs()
    seqs = [p + r for p, r in zip(prompts, responses)]
    L = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (L - len(s)) for s in seqs])
    am = (ids != PAD).long()
    return model(input_ids=ids, attention_mask=am).logits[:, 0].float()


def retok_job(src, tok_dir, port, tp=1):
    """Megatron ranks score the actor's generated batch re-tokenised for the RM."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from trainer.plan import ForwardSettings
    from trainer.rewards.reward_model import RMInputs
    from trainer.workers.dataplane import StepData, Transport
    from trainer.workers.megatron_worker import MegatronWorker
    from rm_tokenizer import ANSWERS, PROMPTS, TINY, generated as _generated

    actor = AutoTokenizer.from_pretrained(TINY)
    rm_batch = RMInputs(actor, AutoTokenizer.from_pretrained(tok_dir))(_generated(actor, PROMPTS, ANSWERS))
    w = MegatronWorker(role="reward", rank=dist.get_rank(), world_size=dist.get_world_size(), master_addr="127.0.0.1",
                       master_port=port, model_path=src, tp=tp, sequence_parallel=tp > 1)
    data = StepData(rm_batch, Transport(in_process=True))
    part, shard = data.partition(1), data.shards(1)[0]
    return part.gather([w.rm_scores(shard, settings=ForwardSettings(micro_batch_size=2, packed=True))["rm_scores"]])


# TP=2 with sequence parallelism only: retokenising is the driver's (rank-independent), and TP=1's scores are
# test_megatron_tp1_scores_equal_transformers' (one spawned world less for the suite)
@pytest.mark.parametrize("tp", [2])
def test_retokenised_inputs_score_as_transformers_on_the_rm_template(tmp_path, tp):
    from megatron_bridge.launch import find_free_port, spawn
    from tests.support.rm_tokenizer import VOCAB as RM_VOCAB, by_hand, make_rm_tokenizer
    from tests.support.rm_tokenizer import ANSWERS, PROMPTS
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok_dir, src = str(tmp_path / "tok"), str(tmp_path / "rm")
    make_rm_tokenizer(tok_dir)
    pad = RM_VOCAB["<pad>"]
    cfg = Qwen2Config(vocab_size=len(RM_VOCAB), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                      pad_token_id=pad, tie_word_embeddings=False)
    torch.manual_seed(7)
    model = Qwen2ForSequenceClassification(cfg).float().eval()
    with torch.no_grad():
        model.score.weight.copy_(torch.randn_like(model.score.weight))
    model.save_pretrained(src)
    seqs = [by_hand([{"role": "user", "content": p}], a) for p, a in zip(PROMPTS, ANSWERS)]
    L = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (L - len(s)) for s in seqs])
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=(ids != pad).long()).logits[:, 0].float()
    assert want.std() > 0.05
    for got in spawn(retok_job, tp, src, tok_dir, find_free_port(), tp):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def job(kind, src, port, tp=1, zero_stage=1, sp=1):
    import torch.distributed as dist

    from trainer.plan import ForwardSettings
    from trainer.workers.dataplane import StepData, Transport

    rank, world = dist.get_rank(), dist.get_world_size()
    common = dict(role="reward", rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                  model_path=src)
    if kind == "megatron":
        from trainer.workers.megatron_worker import MegatronWorker

        w = MegatronWorker(tp=tp, sequence_parallel=tp > 1, **common)
    elif kind == "fsdp2":
        from megatron_bridge import cpu_shims

        from trainer.workers.train_worker import TrainWorker

        cpu_shims.uninstall_mode()  # an FSDP rank runs plain torch
        w = TrainWorker(strategy="fsdp2", param_dtype="fp32", sp=sp, **common)
    else:
        from megatron_bridge import cpu_shims

        from trainer.workers.deepspeed_worker import DeepSpeedWorker

        cpu_shims.uninstall_mode()  # a DeepSpeed rank runs plain torch
        w = DeepSpeedWorker(zero_stage=zero_stage, **common)
    data = StepData(_batch(), Transport(in_process=True))
    part, shard = data.partition(1), data.shards(1)[0]  # every rank scores the whole batch (ZeRO-3 gathers in step)
    settings = {"padded": ForwardSettings(micro_batch_size=2, packed=False),
                "packed": ForwardSettings(micro_batch_size=3, packed=True),
                "budget": ForwardSettings(micro_batch_size=1, packed=True, max_token_len=16)}
    return {k: part.gather([w.rm_scores(shard, settings=s)["rm_scores"]]) for k, s in settings.items()}


def _spawn(world, *args, **kw):
    from megatron_bridge.launch import find_free_port, spawn

    return spawn(job, world, *args[:1], args[1], find_free_port(), **kw)


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("rm") / "rm")
    model = make_rm(src)
    want = hf_scores(model)
    assert want.abs().min() > 1e-3 and want.std() > 0.05  # scores that tell the rows apart
    return src, want


TOL = dict(atol=1e-4, rtol=0)


def test_megatron_tp1_scores_equal_transformers(rm):
    src, want = rm
    out = _spawn(1, "megatron", src)[0]
    for name, got in out.items():
        torch.testing.assert_close(got, want, **TOL, msg=name)


def test_megatron_tp2_sequence_parallel_scores_equal_transformers(rm):
    src, want = rm
    for got in _spawn(2, "megatron", src, tp=2):  # every TP rank returns the same scores
        for name, g in got.items():
            torch.testing.assert_close(g, want, **TOL, msg=name)


# ZeRO-3 over two ranks only: the DeepSpeed worker's scoring code is the same at every stage, and ZeRO-3 adds what
# the others lack, parameters gathered inside the forward (a world of one at ZeRO-1 was one spawn more for the suite)
@pytest.mark.parametrize("world,stage", [(2, 3)])
def test_deepspeed_scores_equal_transformers(rm, world, stage):
    src, want = rm
    for got in _spawn(world, "deepspeed", src, zero_stage=stage):
        for name, g in got.items():
            torch.testing.assert_close(g, want, **TOL, msg=name)


@pytest.mark.parametrize("sp", [1, 2])
def test_fsdp2_scores_equal_transformers(rm, sp):
    """FSDP2 on two ranks (sharded; with Ulysses SP=2 each rank runs half of every row), padded and packed."""
    src, want = rm
    for got in _spawn(2, "fsdp2", src, sp=sp):
        for name, g in got.items():
            torch.testing.assert_close(g, want, **TOL, msg=name)


def test_checkpoint_without_score_head_is_refused(tmp_path):
    from trainer.rewards.reward_model import check_score_head

    lm = str(tmp_path / "lm")
    make_hf("qwen2", lm)  # a causal LM: lm_head, no score
    with pytest.raises(ValueError, match="has no 'score' head"):
        check_score_head(lm, 64)
    with pytest.raises(RuntimeError, match="has no 'score' head"):  # the rank's error, as spawn re-raises it
        _spawn(1, "megatron", lm)
