#!/usr/bin/env bash
# The CPU twin of recipes/run_dapo_qwen3_30b_a3b.sh: that very script at the size of the shipped tiny
# Qwen3-MoE (recipes/cpu/tiny_moe_model, made by make_tiny_moe_model.py: 4 experts, top-2) on 2 CPU slots.
# The sizes come in through its environment variables; the lines below override what a CPU cannot take:
# experts over 2 ranks (EP=2) instead of 8, the native engine instead of SGLang, float32, the shipped
# synthetic task instead of the data files. CI runs it for 2 steps (tests/test_recipes.py).
set -euo pipefail
cd "$(dirname "$0")/../.."

MAX_PROMPT_LENGTH=64 MAX_RESPONSE_LENGTH=8 TRAIN_PROMPT_BSZ=8 N_RESP_PER_PROMPT=4 TRAIN_PROMPT_MINI_BSZ=4 \
MODEL_PATH=${MODEL_PATH:-"recipes/cpu/tiny_moe_model"} CKPTS_DIR=${CKPTS_DIR:-"runs/DAPO/DAPO-tiny-moe"} NNODES=1 \
bash recipes/run_dapo_qwen3_30b_a3b.sh \
    data.train_files=null \
    data.val_files=null \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=2 \
    actor_rollout_ref.actor.megatron.dtype=float32 \
    actor_rollout_ref.rollout.name=native \
    actor_rollout_ref.rollout.dtype=float32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    ++reward_model.reward_kwargs.overlong_buffer_cfg.len=4 \
    trainer.project_name=DAPO-MoE \
    trainer.experiment_name=DAPO-tiny-moe \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    trainer.save_freq=5 \
    trainer.total_epochs=1 \
    trainer.log_val_generations=2 \
    "$@"
