"""Coxswain: one distribution holding the ``trainer`` and ``megatron_bridge`` packages.

torch is pinned to the exact CPU build on disk: an unpinned torch (asked for here or by a dependency)
pulls gigabytes of CUDA wheels. Every addition is checked with ``pip install --dry-run``.
"""

from setuptools import Extension, find_packages, setup

TORCH = "torch==2.13.0"

install_requires = [
    TORCH,
    "megatron-core==0.16.1",
    "psutil",  # megatron-core imports it without declaring it
    "numpy",
    "omegaconf>=2.3,<2.4",
    "hydra-core==1.3.8",  # verl's command-line grammar (+key, ~key, lists) and --config-path/--config-name composition
    "tensordict>=0.15",
    "wrapt>=1.14",  # trainer/lazy_dynamo.py: its post-import hook (tensordict without torch._dynamo at import); C wheel, no dependencies
    "safetensors>=0.4",
    "transformers>=4.50",
    "ray>=2.40",
    "mlflow>=3.0",
    "pyarrow>=15",
    "tqdm",
    "matplotlib>=3.7",  # trainer/report.py draws report.png (it arrived only through mlflow before)
    "rich",
    "math-verify>=0.9",
    "aiohttp>=3.9",  # OpenAI-compatible server (trainer.serve) and LLM-judge client  # math answer equivalence for the math scorers (pure python, no torch)
    "deepspeed==0.19.8",  # the DeepSpeed strategy (trainer/workers/deepspeed_worker.py); its ops build on first use only, none is used on CPU
    "xxhash>=3.4",  # the weight-sync check's hash (trainer/rollout/engine.py: new_hasher); C wheel, no dependencies
    "sglang-router==0.3.2",  # the rollout fleet's router (trainer/rollout/fleet.py); Rust wheel, no torch (deps: aiohttp, fastapi, uvicorn, orjson, setproctitle)
]

extras = {
    "dev": ["pytest>=8", "hypothesis>=6", "pytest-timeout", "pytest-xdist>=3.5",  # the suite runs on 2 workers (-n 2)
            "wandb>=0.19", "tensorboard>=2.14",
            "peft==0.18.0",  # tests/megatron_bridge/test_lora.py loads an exported adapter with peft; pulls accelerate, no torch
            "mkdocs-material==9.6.23"],  # the docs site (mkdocs.yml), built in strict mode by tests/test_docs.py; no torch
    "trackers": ["wandb>=0.19", "tensorboard>=2.14"],  # trainer.logger wandb (offline without WANDB_API_KEY) and tensorboard; no torch
    "gpu": ["transformer-engine[pytorch]"],
    # exact API of trainer/rollout/sglang_engine.py; the newest release pinning torch==2.13.0. GPU only: its dependencies
    # are CUDA builds. On CPU: `python -m trainer.rollout.sglang_cpu install` (requirements-sglang-cpu.txt, a second venv).
    "sglang": ["sglang==0.5.21"],
    "bench": ["trl==1.16.0"],  # only benchmarks/bench_e2e.py's baseline; never a product dependency
}

setup(
    name="coxswain",
    version="0.1.0",
    description="Reinforcement-learning post-training of LLMs on megatron-core, Ray and SGLang",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["trainer", "trainer.*", "megatron_bridge", "megatron_bridge.*"]),
    include_package_data=True,
    install_requires=install_requires,
    extras_require=extras,
    entry_points={"console_scripts": ["coxswain=trainer.main:cli"]},
    # the weight sync's checked copy (trainer/sync/_copycheck.c, called through ctypes). optional: without a
    # C compiler the install goes on and the sync checks its copies in Python, slower (trainer.sync.shared_memory.KERNEL is None)
    ext_modules=[Extension("trainer.sync._copycheck", ["trainer/sync/_copycheck.c"], extra_compile_args=["-O2"],
                           optional=True)],
)
