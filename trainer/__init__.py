"""Coxswain: reinforcement-learning post-training of large language models on megatron-core and Ray."""

import os

__version__ = "0.1.0"

# Every process of a run imports this package (driver, Ray workers, servers): with COXSWAIN_CPU_BF16=fp32 its bf16
# matrix products take the fp32-accumulate path a GPU takes, not torch's generic CPU kernel (trainer/cpu_bf16.py).
# Imported only when asked: the package's light processes (the reward scorers, the orphan reaper, the SGLang venv
# installer) do not import torch.
if os.environ.get("COXSWAIN_CPU_BF16"):
    from trainer import cpu_bf16

    cpu_bf16.install()
