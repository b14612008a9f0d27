"""A training strategy is one class: a user's own, named ``"pkg.module:Class"``, trains through the
strategy-neutral :class:`trainer.workers.train_worker.TrainWorker` with no core file changed.

The strategy here is the smallest model there is: a unigram policy, ``log pi(y) = log_softmax(theta /
T)[y]`` at every position, trained by plain SGD. Its log-probs and one PPO step are checked against
float64 arithmetic done by hand below, so a worker that mis-assembled the loss, normalised it per
micro-batch instead of over the mini-batch, or read the wrong grid positions would fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.plan import ForwardSettings, PolicyLoss, UpdateSettings
from trainer.strategies import STRATEGIES, Strategy, load_strategy
from trainer.workers.train_worker import TrainWorker

V, LR, TEMP = 5, 0.5, 0.7
THETA0 = [0.3, -0.2, 0.9, 0.0, -0.5]


class UnigramStrategy(Strategy):
    """Every token's log-prob is ``log_softmax(theta / T)`` at its id, whatever came before it."""

    def __init__(self, *, role, rank, lr: float):
        self.mesh = {"dp_rank": 0, "dp_size": 1, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
                     "vpp_size": 1, "cp_rank": 0, "cp_size": 1, "ep_rank": 0, "ep_size": 1}
        self.model = torch.nn.Parameter(torch.tensor(THETA0, dtype=torch.float64))
        self.lr, self.micro_batches_seen = lr, []

    def _outputs(self, mb, temperature):
        logp = torch.log_softmax(self.model / temperature, -1)[mb["input_ids"]]  # [b, S]
        return {"logprobs": logp * mb["attention_mask"]}

    def compute(self, mbs, *, temperature, with_entropy, with_sum_pi_squared=False):
        with torch.no_grad():
            return [self._outputs(mb, temperature) for mb in mbs]

    def train_step(self, mbs, loss_fn, *, temperature=1.0, **kw):
        self.micro_batches_seen.append(len(mbs))
        total = 0.0
        for mb in mbs:
            loss, _ = loss_fn(self._outputs(mb, temperature), mb)
            loss.backward()
            total += float(loss.detach())
        with torch.no_grad():
            gn = float(self.model.grad.norm())
            self.model -= self.lr * self.model.grad
            self.model.grad = None
        return {"loss": total, "grad_norm": gn, "lr": self.lr, "skipped": 0.0}

    def hf_params(self):
        yield "theta", self.model.detach()

    def save(self, ckpt_dir, extra=None):
        return ckpt_dir

    def load(self, ckpt_dir, contents=("model", "optimizer", "extra")):
        return {}

    def export_hf(self, out_dir, source_dir=None):
        return out_dir


# two rows: prompt widths 1 / 2 (left-padded to 2), responses of 3 / 2 tokens (right-padded to 3)
PROMPTS = np.array([[0, 1], [3, 2]])
RESPONSES = np.array([[4, 2, 2], [0, 1, 0]])
AM = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
RMASK = AM[:, 2:]
ADV = np.array([[1.0, -2.0, 0.5], [3.0, 1.0, 0.0]], dtype=np.float32)


def _worker():
    return TrainWorker(role="actor", rank=0, strategy=f"{__name__}:UnigramStrategy", lr=LR)


def _shard():
    return {"prompts": PROMPTS, "responses": RESPONSES, "attention_mask": AM, "response_mask": RMASK}


def _log_softmax64(theta):
    x = np.asarray(theta, dtype=np.float64) / TEMP
    return x - np.log(np.exp(x).sum())


def test_registry_names_the_built_ins_and_refuses_an_unknown_name():
    assert STRATEGIES == {"megatron": "trainer.strategies.megatron:MegatronStrategy",
                          "deepspeed": "trainer.strategies.deepspeed:DeepSpeedStrategy",
                          "fsdp2": "trainer.strategies.fsdp2:FSDP2Strategy",
                          "fsdp": "trainer.strategies.fsdp2:FSDP2Strategy"}  # verl's FSDP1 name runs on FSDP2
    with pytest.raises(ValueError, match="unknown training strategy 'fsdp9'"):
        load_strategy("fsdp9")
    assert load_strategy(f"{__name__}:UnigramStrategy") is UnigramStrategy


def test_log_probs_through_a_plugin_strategy():
    w = _worker()
    assert w.layout()["dp_size"] == 1 and w.layout()["rank"] == 0
    # packed=True is asked for, but the strategy runs padded rows: the worker must not pack
    out, _ = w.log_probs(_shard(), settings=ForwardSettings(micro_batch_size=1, packed=True, temperature=TEMP))
    ref = _log_softmax64(THETA0)[RESPONSES] * RMASK  # [2, 3], the response positions of the grid
    np.testing.assert_allclose(out["log_probs"], ref, rtol=1e-6, atol=1e-7)


def test_one_ppo_step_is_the_full_mini_batch_gradient():
    """Vanilla PPO at ratio 1 (old = current log-probs), token-mean over the mini-batch's 5 response
    tokens: loss = -(1/5) sum_i A_i exp(logp_i - old_i), so dloss/dtheta = -(1/5) sum_i A_i
    d logp_i/dtheta, and d log_softmax(theta/T)[y]/dtheta = (onehot(y) - softmax(theta/T)) / T. Two
    micro-batches of one row each must add up to exactly that (one SGD step of LR)."""
    w = _worker()
    old, _ = w.log_probs(_shard(), settings=ForwardSettings(micro_batch_size=2, temperature=TEMP), key="old_log_probs")
    pl = PolicyLoss(loss_mode="vanilla", agg_mode="token-mean", norm_constant=1.0, clip_ratio=0.2, clip_ratio_low=None,
                    clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                    kl_loss_type="kl")
    settings = UpdateSettings(mini_batch_size=2, epochs=1, shuffle=False, micro_batch_size=1, temperature=TEMP, policy=pl)
    res = w.update_actor(_shard(), [[0, 1]], {"advantages": ADV, "old_log_probs": old["old_log_probs"]},
                         settings=settings, counts=[(5.0, 2.0)])
    assert w.strategy.micro_batches_seen == [2]

    p = np.exp(_log_softmax64(THETA0))
    grad = np.zeros(V)
    for y, a in zip(RESPONSES[RMASK.astype(bool)], ADV[RMASK.astype(bool)].astype(np.float64)):
        grad -= a * (np.eye(V)[y] - p) / TEMP / 5.0
    np.testing.assert_allclose(w.strategy.model.detach().numpy(), np.array(THETA0) - LR * grad, rtol=1e-6, atol=1e-9)
    m = res["metrics"][0]
    # pg_loss at ratio 1: -(1 - 2 + 0.5 + 3 + 1) / 5 = -0.7 (a SUM partial of the one rank's share)
    assert m["actor/pg_loss"] == ("sum", pytest.approx(-0.7, rel=1e-6), 1.0)
    assert m["actor/grad_norm"] == ("mean", pytest.approx(float(np.linalg.norm(grad)), rel=1e-6), 1.0)
