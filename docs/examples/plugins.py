"""The plug-ins of docs/extending.md, one of each kind, named in the config as ``docs.examples.plugins:NAME``
(run from the repository root, or put the module on ``PYTHONPATH`` on every node).

``tests/test_docs.py`` resolves a config naming each of them (``--print-config``): hooks and pipelines are
imported when the config loads, estimators and losses when the run starts.
"""

from trainer.algos.advantages import compute_grpo_outcome_advantage
from trainer.algos.losses import vanilla
from trainer.envs.base import Environment, StepResult
from trainer.pipeline import Step, default_pipeline
from trainer.rollout.native import NativeEngine


def clipped_grpo(*, token_level_rewards, response_mask, index, **kwargs):
    """An advantage estimator: GRPO's advantages clipped to [-2, 2]. Keyword arguments only; take what you
    use and swallow the rest (``**kwargs``); return ``(advantages, returns)``, both ``[B, T]``."""
    adv, _ = compute_grpo_outcome_advantage(token_level_rewards=token_level_rewards, response_mask=response_mask,
                                            index=index, **kwargs)
    adv = adv.clamp(-2.0, 2.0) * response_mask
    return adv, adv


def tight_ppo(old_log_prob, log_prob, advantages, response_mask, **kwargs):
    """A policy loss: PPO clip with a tighter band. Same signature as ``trainer.algos.losses.vanilla``:
    ``[B, T]`` tensors in, ``(loss, metrics)`` out; ``agg`` (the aggregation) and ``rollout_is_weights``
    come in ``kwargs`` and must be honoured (here ``vanilla`` does)."""
    kwargs.update(clip_ratio=0.1, clip_ratio_low=None, clip_ratio_high=None)
    return vanilla(old_log_prob, log_prob, advantages, response_mask, **kwargs)


def reward_stats(batch, metrics):
    """A hook (``trainer.hooks.after_reward``): ``f(batch, metrics)``; add metrics, change rewards in place,
    or return ``batch[keep]`` to drop samples."""
    scores = batch.scores.float()
    metrics["my/score_nonzero_fraction"] = float((scores != 0).float().mean())


def no_reference(s: Step) -> None:
    """A pipeline (``trainer.pipeline``): the default step without the reference pass or the KL loss."""
    s.generate()
    s.forward_passes(ref=False)
    s.advantages()
    if s.critic is not None:
        s.update_critic()
    if s.trains_actor:
        s.update_actor(kl_loss=False)
        s.sync_weights()
    s.validate()


def default_step(s: Step) -> None:
    """The default pipeline, named explicitly: the place to start a pipeline of your own."""
    default_pipeline(s)


class CountingEngine(NativeEngine):
    """A rollout engine (``actor_rollout_ref.rollout.name``): the native engine, counting the prompts it was
    given. Its ``capabilities`` (what the config checks, the cluster and the fleet ask) are the native engine's;
    an engine of its own would declare its own ``Capabilities``."""

    prompts_seen = 0

    def generate(self, prompt_token_ids, params=None, *args, **kwargs):
        self.prompts_seen += len(prompt_token_ids)
        if params is None:
            return super().generate(prompt_token_ids, *args, **kwargs)
        return super().generate(prompt_token_ids, params, *args, **kwargs)


class Countdown(Environment):
    """A multi-turn environment (``actor_rollout_ref.rollout.multi_turn.environment``): the policy must say
    the task's number; each wrong answer is told "no" until three turns have passed."""

    def reset(self, task, seed=None):
        self.target, self.turns = str(task["reward_model"]["ground_truth"]), 0
        return list(task["prompt"])

    def step(self, action_text):
        self.turns += 1
        if action_text.strip().startswith(self.target):
            return StepResult(observation=None, reward=1.0, done=True, info={"success": True})
        return StepResult(observation="no", done=self.turns >= 3)
