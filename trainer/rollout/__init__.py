"""Rollout engines and the loops that drive them.

* ``engine``: the interface every engine promises (generate with log-probs, weights in, sleep / wake);
  ``registry``: engines by ``rollout.name`` (or a user's ``pkg.module:Class``), each declaring its capabilities;
  ``weights``: the weights' wire format every engine and transport shares (flat buckets, digests, probes);
  ``adapters``: LoRA adapters in, merged weights held (adapter-only syncs, ``lora.merge=false``).
* ``native``: the pure-torch engine over ``hf_model`` (a plain-torch Llama / Qwen decoder); ``async_engine``:
  its asyncio front for many callers; ``generate``: a jsonl generation CLI.
* ``sglang_engine``: one ``sglang.Engine`` behind the interface; ``sglang_cpu``: SGLang's CPU install and
  shims; ``sglang_http``: real SGLang servers' command line and weight pushes.
* ``fleet`` / ``fleet_client``: HTTP engine servers behind sglang-router, and the engine-shaped client;
  ``native_server``: the native engine behind SGLang's native HTTP protocol.
* ``single_turn`` / ``multi_turn``: prompts to a typed batch; the agent loop of policy and environment turns.
"""
