#!/usr/bin/env bash
# ADCA-GRPO on a multi-turn environment, on a 2-core CPU: Towers (trainer.envs.towers: Tower of Hanoi from any
# position to any goal peg, one move per turn, 2-3 discs) played by the shipped tiny agent
# (recipes/cpu/tiny_towers_model, made by make_tiny_towers_model.py: it plays legally but its greedy move is
# usually a habit that makes no progress; see its pretrain_info.json). Each step: 16 tasks x 8 episodes; a
# judge labels every move GOOD (it brought the goal closer) or BAD, and ADCA fuses those labels with the
# episode's outcome into per-turn advantages. Held-out success is measured on positions never trained on.
# The judge is the environment's rule behind the OpenAI chat interface (evaluation_type=rule: `python -m
# trainer.rewards.rule_judge` in a subprocess), so the judge client's HTTP, parsing, retries and fallbacks run.
# Other judges:
#   ... attribution_driven_credit_assignment.evaluation_type=local   # a local LLM judge (trainer.serve)
#   DASHSCOPE_API_KEY=... bash recipes/cpu/run_tiny_agent_adca.sh \
#       attribution_driven_credit_assignment.evaluation_type=api attribution_driven_credit_assignment.model=qwen-max
# A judge that falls back on more than a tenth of a step's trajectories stops the run
# (attribution_driven_credit_assignment.max_fallback_fraction=1 goes on anyway).
# The settings are in recipes/cpu/tiny_agent_adca.yaml, on top of recipes/cpu/tiny_grpo.yaml and verl's defaults.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m trainer.main --config recipes/cpu/tiny_grpo.yaml --config recipes/cpu/tiny_agent_adca.yaml "$@"
