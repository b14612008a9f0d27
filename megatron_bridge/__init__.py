"""HF <-> megatron-core bridge: the only package that imports ``megatron``."""
