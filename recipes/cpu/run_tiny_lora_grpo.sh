#!/usr/bin/env bash
# LoRA GRPO on the shipped tiny model: recipes/cpu/run_tiny_grpo.sh's job with rank-8 adapters on the frozen
# megatron actor (recipes/cpu/tiny_lora_grpo.yaml over recipes/cpu/tiny_grpo.yaml). Extra key=value overrides pass
# through, e.g.
#   bash recipes/cpu/run_tiny_lora_grpo.sh actor_rollout_ref.model.lora.rank=4
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m trainer.main --config recipes/cpu/tiny_grpo.yaml --config recipes/cpu/tiny_lora_grpo.yaml "$@"
