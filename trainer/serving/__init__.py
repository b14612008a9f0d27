"""Coxswain's HTTP servers over the native engine, and what their clients share with them.

* :mod:`trainer.serving.app`: the one aiohttp skeleton (engine + batcher lifecycle, bearer-key
  middleware, JSON errors, bind and ready line, SIGINT / SIGTERM shutdown, shared CLI flags).
* :mod:`trainer.serving.openai`: the OpenAI-compatible protocol (``python -m trainer.serve``).
* :mod:`trainer.serving.sglang_native`: SGLang's native protocol, ``/generate`` and weight updates
  (``python -m trainer.rollout.native_server``; the rollout fleet's servers).

The weight wire codec (:mod:`trainer.wire`) and the free ports and ready lines (:mod:`trainer.net`) that the
servers share with the code that launches and calls them (the rollout fleet, the judge server) sit one floor
below, at the top level of ``trainer``, so the fleet never imports the servers.
"""
