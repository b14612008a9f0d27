"""The driver's view of the workers.

* ``roles``: the typed role groups the loop calls (``ActorGroup``, ``RefGroup``, ``CriticGroup``);
* ``rollouts``: the one ``Rollout`` protocol and its three transports (engine workers, the hybrid
  engine inside the actor's processes, the HTTP fleet), with the checksum-verified weight sync;
* ``dataplane``: the step's batch, sharded once per DP size and shipped by object reference;
* ``cluster``: builds them from the config on a Ray placement (or in the driver, for debugging);
* ``group``: N Ray actors (or in-process objects) of one worker class, and placement;
* ``train_worker``: one rank of a role, strategy-neutral (batches, micro-batches, losses, metrics), holding
  its training strategy (:mod:`trainer.strategies`); ``megatron_worker`` / ``deepspeed_worker`` only name theirs;
  ``hybrid_worker``: a rank that also hosts its engine; ``rollout_worker``: one engine in its own process;
* ``metrics``: per-rank partial metrics combined over the data-parallel ranks by the driver.
"""
