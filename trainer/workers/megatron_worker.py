"""One rank of a megatron-core model group: actor, reference, critic or reward model.

The strategy-neutral :class:`~trainer.workers.train_worker.TrainWorker` on the ``megatron`` strategy
(:class:`trainer.strategies.megatron.MegatronStrategy`: TP / PP / VPP / CP / EP through
``megatron_bridge``). Its keywords are the strategy's (``tp``, ``pp``, ``vpp``, ``cp``, ``ep``,
``etp``, ``moe``, ``pp_layers``, ``params_dtype``, ``compile``, ``optim``, ``seed``, ``recompute``,
``sequence_parallel``, ``routing_replay``, ``offload``).
"""

from __future__ import annotations

from trainer.workers.train_worker import TrainWorker


class MegatronWorker(TrainWorker):
    """A rank on megatron-core; its weights reach the rollout engines through ``sync_send`` / ``sync_stream``
    (:mod:`trainer.sync`, held by every :class:`TrainWorker`)."""

    strategy_name = "megatron"
