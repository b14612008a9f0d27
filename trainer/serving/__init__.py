"""Coxswain's HTTP servers over the native engine, and what their clients share with them.

* :mod:`trainer.serving.app`: the one aiohttp skeleton (engine + batcher lifecycle, bearer-key
  middleware, JSON errors, bind and ready line, SIGINT / SIGTERM shutdown, shared CLI flags).
* :mod:`trainer.serving.openai`: the OpenAI-compatible protocol (``python -m trainer.serve``).
* :mod:`trainer.serving.sglang_native`: SGLang's native protocol, ``/generate`` and weight updates
  (``python -m trainer.rollout.native_server``; the rollout fleet's servers).
* :mod:`trainer.serving.wire`: the weight wire codec (named tensors <-> safetensors blobs), used by
  the native server and the fleet client (:mod:`trainer.rollout.fleet`).
* :mod:`trainer.serving.net`: free ports and the servers' ready lines (no heavy imports), for the
  launchers (the fleet, :mod:`trainer.rewards.judge_server`).

Nothing is imported here, so ``trainer.serving.net`` and ``trainer.serving.wire`` stay light.
"""
