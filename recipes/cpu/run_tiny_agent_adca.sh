#!/usr/bin/env bash
# ADCA-GRPO on a multi-turn environment, on a 2-core CPU: the Tower-of-Hanoi game played by the shipped
# tiny ChatML agent model (recipes/cpu/tiny_agent_model, made by make_tiny_agent_model.py: random
# weights, so it exercises the pipeline rather than solving the puzzle). Each step: the agent loop plays
# 8 tasks x 4 episodes of up to 3 assistant turns, an LLM judge labels every assistant turn GOOD or BAD,
# and ADCA fuses those labels with the episode's outcome into per-turn advantages.
# The judge is served locally (evaluation_type=local: `python -m trainer.serve` on the agent model in a
# subprocess). To use an API judge instead, as AgentEvolver's recipes do:
#   DASHSCOPE_API_KEY=... bash recipes/cpu/run_tiny_agent_adca.sh \
#       attribution_driven_credit_assignment.evaluation_type=api attribution_driven_credit_assignment.model=qwen-max
# On top of recipes/cpu/tiny_grpo.yaml (the tiny CPU settings) and verl's defaults.
# Other environments: actor_rollout_ref.rollout.multi_turn.environment=calculator (a calculator tool).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m trainer.main --config recipes/cpu/tiny_grpo.yaml \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.model.path=recipes/cpu/tiny_agent_model \
    data.train_batch_size=8 \
    data.val_batch_size=32 \
    data.max_prompt_length=384 \
    data.max_response_length=192 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.multi_turn.enable=true \
    actor_rollout_ref.rollout.multi_turn.environment=hanoi \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3 \
    actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=24 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    attribution_driven_credit_assignment.enable=true \
    attribution_driven_credit_assignment.evaluation_type=local \
    attribution_driven_credit_assignment.skip_type=none \
    attribution_driven_credit_assignment.judge_max_tokens=16 \
    attribution_driven_credit_assignment.adca_grpo.prm_scheme=decouple \
    trainer.total_training_steps=3 \
    trainer.test_freq=3 \
    trainer.experiment_name=tiny_agent_adca \
    "$@"
