"""One rank of a DeepSpeed ZeRO model group: actor, reference or critic on a Hugging Face model.

The strategy-neutral :class:`~trainer.workers.train_worker.TrainWorker` on the ``deepspeed`` strategy
(:class:`trainer.strategies.deepspeed.DeepSpeedStrategy`, which documents the ZeRO stages, the
per-token definitions, the optimizer step and the checkpoint format). Its keywords are the
strategy's: ``zero_stage``, ``params_dtype``, ``optim``, ``seed``, ``gradient_checkpointing``,
``offload_params``, ``offload_optimizer``.
"""

from __future__ import annotations

from trainer.workers.train_worker import TrainWorker


class DeepSpeedWorker(TrainWorker):
    """A rank on DeepSpeed; its weights reach the rollout engines through ``sync_send`` / ``sync_stream``
    (:mod:`trainer.sync`, held by every :class:`TrainWorker`)."""

    strategy_name = "deepspeed"
