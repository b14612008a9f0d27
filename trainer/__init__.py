"""Coxswain: reinforcement-learning post-training of large language models on megatron-core and Ray."""

__version__ = "0.1.0"
