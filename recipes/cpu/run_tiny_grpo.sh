#!/usr/bin/env bash
# GRPO on the shipped tiny model and synthetic arithmetic task, on a 2-core CPU.
# Embedded defaults: a local Ray cluster (ray.init() with no address) and a local MLflow store.
# Extra key=value overrides are passed through: bash recipes/cpu/run_tiny_grpo.sh trainer.total_training_steps=5
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m trainer.main \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=16 \
    data.max_prompt_length=64 \
    data.max_response_length=32 \
    actor_rollout_ref.rollout.name=native \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.experiment_name=tiny_grpo \
    "$@"
