#!/usr/bin/env bash
# The CPU twin of recipes/run_dapo_qwen2.5_32b.sh: that very script (every line of it: DAPO clip-higher,
# dynamic sampling, token-level loss, overlong shaping, rollout IS with veto, packed token-budget
# micro-batches, full recompute, sequence parallelism, the dapo reward manager, MLflow, auto-resume) at
# the size of the shipped tiny model and the synthetic addition task, on 2 CPU slots. The sizes come in
# through its environment variables; the lines below override what a CPU cannot take: megatron TP=2
# x PP=1 instead of TP=8 x PP=2, the native engine instead of SGLang, float32, the shipped task instead
# of the data files. CI runs it for 2 steps (tests/test_recipes.py).
set -euo pipefail
cd "$(dirname "$0")/../.."

MAX_PROMPT_LENGTH=64 MAX_RESPONSE_LENGTH=8 TRAIN_PROMPT_BSZ=8 N_RESP_PER_PROMPT=4 TRAIN_PROMPT_MINI_BSZ=4 \
MODEL_PATH=${MODEL_PATH:-"recipes/cpu/tiny_model"} CKPTS_DIR=${CKPTS_DIR:-"runs/DAPO/DAPO-tiny"} NNODES=1 \
bash recipes/run_dapo_qwen2.5_32b.sh \
    data.train_files=null \
    data.val_files=null \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1 \
    actor_rollout_ref.actor.megatron.use_distributed_optimizer=False \
    actor_rollout_ref.actor.megatron.dtype=float32 \
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2 \
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=native \
    actor_rollout_ref.rollout.dtype=float32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    reward_model.overlong_buffer.len=4 \
    trainer.project_name=DAPO \
    trainer.experiment_name=DAPO-tiny \
    trainer.device=cpu \
    trainer.n_gpus_per_node=2 \
    "$@"
