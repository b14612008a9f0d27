#!/usr/bin/env bash
# GRPO on the shipped tiny model (recipes/cpu/tiny_model, made by make_tiny_model.py) and the synthetic
# addition task, on a 2-core CPU: actor on megatron-core (TP=1, DP=2 over 2 CPU slots), native rollout
# engine, local Ray cluster, local MLflow store (./mlruns). The settings are in recipes/cpu/tiny_grpo.yaml
# (on top of verl's defaults). Extra key=value overrides pass through, e.g.
#   bash recipes/cpu/run_tiny_grpo.sh actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m trainer.main --config recipes/cpu/tiny_grpo.yaml "$@"
