"""Rewards: from a response to a score on its last token.

* ``manager``: scores a batch in a pool of scorer processes (``scoring_worker``, kept light; ``orphan_guard``
  ends the pool's fork server with the driver) and places each score on its last token.
* ``scorers``: the rule-based scorers by ``data_source`` (math-verify, GSM8K, countdown, code).
* ``sandbox``: untrusted code run against tests, contained (its private halves: the referee, the harness and
  the wire between them); ``sandbox_fusion``: the same through a remote SandboxFusion service.
* ``reward_model``: learned reward models (where the score is read, how it becomes the reward).
* ``judge``: ADCA-GRPO's LLM judge client; ``judge_server``: a local judge in a subprocess (an HF checkpoint,
  or ``rule_judge``: an environment's rule step judge behind the same chat interface).
"""
