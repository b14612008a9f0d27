"""The driver's view of the workers.

* ``roles``: the typed role groups the loop calls (``ActorGroup``, ``RefGroup``, ``CriticGroup``);
* ``rollouts``: the one ``Rollout`` protocol and its three transports (engine workers, the hybrid
  engine inside the actor's processes, the HTTP fleet), with the checksum-verified weight sync;
* ``dataplane``: the step's batch, sharded once per DP size and shipped by object reference;
* ``cluster``: builds them from the config on a Ray placement (or in the driver, for debugging);
* ``group``: N Ray actors (or in-process objects) of one worker class, and placement;
* ``megatron_worker`` / ``hybrid_worker`` / ``rollout_worker``: one rank of each kind (the strategy
  behind a role group, and the engine).
"""
