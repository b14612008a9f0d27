"""HF <-> megatron-core bridge: the only package that imports ``megatron``.

Modules (import the one you need; nothing heavy is imported here):

* ``hf_config``  — read a Llama / Qwen2 / Qwen3 ``config.json``; TransformerConfig kwargs; RoPE; padding.
* ``launch``     — ``init_distributed`` (gloo on CPU, nccl on GPU; Ray actors, torchrun) and ``spawn``.
* ``model``      — ``build_model``: GPTModel on this rank's TP/PP slice (TE spec on GPU, local on CPU).
* ``convert``    — HF safetensors <-> megatron tensors with TP split / PP assignment; ``load_hf_weights``.
* ``logprobs``   — vocab-parallel log-probs / entropy, padded and packed batches, ``compute_logprobs``,
                   and the CLI ``python -m megatron_bridge.logprobs``.
* ``train``      — ``make_trainer`` (DDP + optimizer + LR schedule) and ``train_step(loss_fn)``.
* ``checkpoint`` — atomic dist_checkpointing save / load, reshardable across TP/PP.
* ``export``     — ``iter_hf_weights`` (bucketed stream in HF naming) and ``export_hf``.
* ``cpu_shims``  — the three CUDA shims megatron-core needs on a CPU-only torch (no-op with CUDA).
* ``lazy_compile`` — megatron-core imported without loading dynamo (its ``torch.compile`` decorators compile on
                   first call); installed here, before any bridge module imports megatron.

A rank's life, e.g. in a Ray actor::

    launch.init_distributed(rank, world, addr, port, tp=2, pp=1)
    m = model.build_model(hf_config.read_hf_config(path)); convert.load_hf_weights(m, path)
    tr = train.make_trainer(m, train.OptimConfig(lr=1e-6))
    old = logprobs.compute_logprobs(tr.model, micro_batches)
    metrics = train.train_step(tr, micro_batches, loss_fn)
    for bucket in export.iter_hf_weights(tr.model, 512 << 20): ...
"""

from megatron_bridge import lazy_compile  # noqa: E402  (stdlib only: this package stays light to import)

lazy_compile.install()
