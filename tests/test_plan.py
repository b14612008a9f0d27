"""``Plan.from_config`` resolves each derived setting once, with verl's fallbacks, and ``LoopState``
saves and restores exactly what the loop carries."""

import pickle

import pytest
import torch

from tests.support.tiny import tiny_config
from trainer.algos.losses import get_policy_loss_fn
from trainer.config import ConfigError
from trainer.plan import LoopState, Plan


def plan(*overrides, **kw):
    return Plan.from_config(tiny_config(list(overrides)), total_steps=kw.get("total_steps", 10),
                            stop_token_ids=kw.get("stop", (7, 3)))


def test_widths_and_mini_batches_resolve_from_their_fallbacks():
    p = plan("data.max_response_length=12", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.actor.ppo_epochs=3", "critic.ppo_micro_batch_size_per_gpu=5")
    assert p.response_width == 12 and p.sampling.max_new_tokens == 12
    assert p.actor_update.mini_batch_size == 2 * 4 and p.actor_update.epochs == 3
    # the critic falls back to the actor's mini-batch and epochs (verl), with its own micro-batch
    assert (p.critic_update.mini_batch_size, p.critic_update.epochs, p.critic_update.micro_batch_size) == (8, 3, 5)
    # seq-mean-token-sum-norm's constant: loss_scale_factor, else the response width
    assert p.actor_update.policy.norm_constant == 12.0
    q = plan("data.max_response_length=12", "actor_rollout_ref.rollout.response_length=20",
             "actor_rollout_ref.actor.loss_scale_factor=100", "critic.ppo_mini_batch_size=3", "critic.ppo_epochs=2")
    assert q.response_width == 20 and q.actor_update.policy.norm_constant == 100.0
    assert (q.critic_update.mini_batch_size, q.critic_update.epochs) == (3 * 8, 2)


def test_sampling_seed_is_a_function_of_step_and_generation_batch():
    p = plan("actor_rollout_ref.rollout.seed=5", "actor_rollout_ref.rollout.top_k=-1")
    a, b = p.sampling.params(3, 0), p.sampling.params(3, 1)
    assert a["seed"] == 5 * 1_000_003 + 3 * 1009 and b["seed"] == a["seed"] + 1
    assert a["top_k"] is None and a["stop_token_ids"] == [7, 3] and a["n"] == 8
    v = p.val_sampling.params(0, 0)
    assert v["temperature"] == 0.0 and v["n"] == 1  # greedy validation by default


def test_rollout_is_and_on_policy_rule():
    p = plan("algorithm.rollout_is_threshold=1.5", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
             "data.train_batch_size=16")
    assert p.rollout_is.kwargs()["rollout_is_threshold"] == 1.5 and p.driver_needs_old_log_probs()
    assert p.on_policy(num_samples=128, step=1)  # one mini-batch of all 16 x 8, one epoch
    off = ("algorithm.rollout_is_threshold=null", "actor_rollout_ref.rollout.calculate_log_probs=false")
    assert not plan(*off).driver_needs_old_log_probs() and plan(*off).rollout_is is None
    # the sampler's log-probs asked for with IS off: the mismatch metrics only, no weights applied
    metrics_only = plan("algorithm.rollout_is_threshold=null").rollout_is
    assert metrics_only is not None and metrics_only.rollout_is is False
    # KL in reward or rejection sampling read the old log-probs before the update: no shortcut
    assert not plan("algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.ppo_mini_batch_size=16").on_policy(128, 1)
    assert not plan("actor_rollout_ref.actor.ppo_mini_batch_size=8", "data.train_batch_size=16").on_policy(128, 1)
    assert not plan("trainer.critic_warmup=2", "actor_rollout_ref.actor.ppo_mini_batch_size=16").on_policy(128, 2)


def test_plan_is_frozen_and_pickles():
    p = plan()
    with pytest.raises(Exception):
        p.n = 3
    assert pickle.loads(pickle.dumps(p)) == p  # it travels to workers as it is


def test_loop_state_round_trip():
    import random

    from trainer.algos.kl import make_kl_controller
    from trainer.data.dataset import PromptSampler

    def fresh():
        return LoopState(sampler=PromptSampler(50, seed=1), kl_ctrl=make_kl_controller("adaptive", kl_coef=0.1,
                                                                                        target_kl=0.1, horizon=10))

    s = fresh()
    s.sampler.next(7)
    s.kl_ctrl.update(0.5, n_steps=4)
    s.step, s.next_group_id, s.last_eval, s.run_id, s.history = 3, 21, 2, "abc", [{"step": 1}]
    saved = s.state_dict(worker_rng={"actor": [1]})
    want = (s.sampler.next(5), random.random())
    t = fresh()
    assert t.load_state_dict(saved) == {"actor": [1]}
    assert (t.step, t.next_group_id, t.last_eval, t.run_id, t.history) == (3, 21, 2, "abc", [{"step": 1}])
    assert t.kl_ctrl.value == s.kl_ctrl.value
    assert (t.sampler.next(5), random.random()) == want  # the same prompts and the same driver RNG draws


def scaled_pg(old_log_prob, log_prob, advantages, response_mask, *, agg, rollout_is_weights=None, my_scale, **family):
    """A plug-in loss with a hyper-parameter of its own: ``my_scale`` x the token mean of ``-A logp``."""
    m = response_mask.to(log_prob.dtype)
    return my_scale * (-(advantages * log_prob) * m).sum() / m.sum(), {}


def test_policy_loss_kwargs_reach_a_plugin_loss_and_built_ins_refuse_them():
    pl = plan("actor_rollout_ref.actor.policy_loss.loss_mode=tests.test_plan:scaled_pg",
              "actor_rollout_ref.actor.policy_loss.kwargs={my_scale: 0.5}").actor_update.policy
    assert pl.variant_kwargs["my_scale"] == 0.5
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -4.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    # called as the train worker calls every loss: the shared keywords plus the plan's variant keywords
    loss, _ = get_policy_loss_fn(pl.loss_mode)(
        old_log_prob=torch.zeros_like(lp), log_prob=lp, advantages=adv, response_mask=mask,
        agg=pl.agg(global_num_tokens=3.0, global_num_seqs=2.0, dp_size=1), rollout_is_weights=None,
        clip_ratio=pl.clip_ratio, clip_ratio_low=pl.clip_ratio_low, clip_ratio_high=pl.clip_ratio_high,
        clip_ratio_c=pl.clip_ratio_c, **pl.variant_kwargs)
    # -A logp on the 3 valid tokens: 1*1 + 1*2 + (-2)*0.5 = 2; mean 2/3; x my_scale 0.5 = 1/3
    assert loss.item() == pytest.approx(1 / 3, abs=1e-12)

    with pytest.raises(ConfigError, match=r"policy_loss.kwargs \['my_scale'\] are passed to a plug-in loss"):
        plan("actor_rollout_ref.actor.policy_loss.kwargs={my_scale: 0.5}")  # vanilla: a built-in
    with pytest.raises(ConfigError, match=r"policy_loss.kwargs \['clip_ratio'\] are keywords every policy loss"):
        plan("actor_rollout_ref.actor.policy_loss.loss_mode=tests.test_plan:scaled_pg",
             "actor_rollout_ref.actor.policy_loss.kwargs={clip_ratio: 0.1, my_scale: 1.0}")
