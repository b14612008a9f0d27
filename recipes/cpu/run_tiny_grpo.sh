#!/usr/bin/env bash
# GRPO on the shipped tiny model (recipes/cpu/tiny_model, made by make_tiny_model.py) and the synthetic
# addition task, on a 2-core CPU: actor on megatron-core (TP=1, DP=2 over 2 CPU slots), native rollout
# engine, local Ray cluster, local MLflow store (./mlruns). These values are also the config defaults,
# so `python -m trainer.main` runs the same job. Extra key=value overrides pass through, e.g.
#   bash recipes/cpu/run_tiny_grpo.sh actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m trainer.main \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=recipes/cpu/tiny_model \
    data.train_batch_size=16 \
    data.max_prompt_length=64 \
    data.max_response_length=8 \
    actor_rollout_ref.rollout.name=native \
    actor_rollout_ref.rollout.n=8 \
    algorithm.rollout_is_threshold=2.0 \
    algorithm.rollout_is_level=token \
    algorithm.rollout_is_mode=truncate \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.total_training_steps=40 \
    trainer.test_freq=5 \
    trainer.experiment_name=tiny_grpo \
    "$@"
