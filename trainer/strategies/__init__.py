"""Training strategies: what builds and trains the model on one rank, behind one small interface.

The train worker (:class:`trainer.workers.train_worker.TrainWorker`) is strategy-neutral: it unpacks
batches, plans micro-batches, assembles the losses, gathers metrics and orchestrates checkpoints. It
holds one :class:`Strategy`, which does the rest:

* build the model on this rank (its constructor: the distributed set-up, the weights, the optimizer);
* ``compute(mbs, ...)``: forward-only per-token outputs of each micro-batch (log-probs, entropy,
  ``sum pi^2``, or a critic's values); ``train_step(mbs, loss_fn, ...)``: forward and backward over the
  micro-batches with the worker's loss, then one optimizer step;
* how a micro-batch is laid out: ``packs`` (one THD row of the real tokens, ``pack`` / ``unpack``) or
  padded rows, and ``min_micro_batches`` (an interleaved pipeline needs one per stage); ``loss_group()``, the
  ranks that run the loss on the other rows of a micro-batch (a collective inside the loss runs over it);
* the weights the transports read (:mod:`trainer.sync`): ``hf_buckets(bucket_bytes)``, ``hf_params()``
  (HF-named full tensors, collective over the model group) and ``reshard_blocks()`` (this rank's own
  blocks of the HF tensors, or None where the strategy cannot say) with ``local_param(ref)``, the local
  tensor a block reads;
* ``reference_policy()``: a context in which ``compute`` gives the reference policy (LoRA: the adapters off);
* ``save`` / ``load`` / ``export_hf``; ``load_state`` / ``offload_state`` / ``offload_status`` (what is
  kept in host memory between calls); ``rng_state`` / ``set_rng_state``; ``mesh``, the rank's
  coordinates (``dp_rank``, ``dp_size``, ``tp_*``, ``pp_*``, ``vpp_size``, ``cp_*``, ``ep_*``).

* ``from_section(section, ...)`` (a classmethod): the strategy's own keywords from its role's config
  section (``actor_rollout_ref.actor``, ``critic``, ...). It runs in the worker process, so the driver
  passes every role the same way (its section, its optimizer, the launch settings) and never reads a
  strategy's keys itself.

The built-in strategies: ``megatron`` (megatron-core through ``megatron_bridge``), ``deepspeed`` (ZeRO on the HF
model) and ``fsdp2`` (PyTorch FSDP2 on the HF model, with Ulysses sequence parallelism from ``ulysses``; verl's
``fsdp`` name runs on it too). ``hf_model`` holds what the two HF-model strategies share (loading, the per-token
outputs, the export); ``hf_lora`` LoRA on an HF model through peft (the deepspeed and fsdp2 actors'), with the megatron
actor's keys and init.

The registry is a plain dict from a strategy's name (``*.strategy`` in the config) to
``"pkg.module:Class"``; ``"pkg.module:Class"`` itself names a user's own. A new strategy is one module
with a :class:`Strategy` subclass plus one line in :data:`STRATEGIES` (or none: name it as
``*.strategy=pkg.module:Class``).
"""

from __future__ import annotations

import abc
import importlib
from typing import Any, Callable, Iterator

import torch

from trainer.batch import pack_padded, unpack_padded
from trainer.fsutil import bucketed
from trainer.checkpoint import capture_rng, restore_rng

# Loaded lazily by name (importlib), never imported here: importing megatron-core or DeepSpeed costs a
# process seconds, and the driver, which only names the strategy of each role, must not pay it. Only a
# worker process that runs a strategy imports its module.
STRATEGIES: dict[str, str] = {
    "megatron": "trainer.strategies.megatron:MegatronStrategy",
    "deepspeed": "trainer.strategies.deepspeed:DeepSpeedStrategy",
    "fsdp2": "trainer.strategies.fsdp2:FSDP2Strategy",
    # verl's FSDP1 spelling runs on FSDP2: the same sharded data parallelism and the same numbers (FSDP1's
    # flat-parameter wrapper is deprecated in torch); its FSDP1-only keys are refused at load time
    "fsdp": "trainer.strategies.fsdp2:FSDP2Strategy",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def strategy_spec(name: str) -> str:
    """The ``"pkg.module:Class"`` of strategy ``name`` (a registered name or such a spec itself); checked
    without importing it (the driver validates every role's strategy at load time)."""
    target = STRATEGIES.get(name, name)
    if ":" not in target:
        raise ValueError(f"unknown training strategy {name!r}: use one of {sorted(STRATEGIES)} or 'pkg.module:Class'")
    return target


def load_strategy(name: str) -> type[Strategy]:
    """The strategy class registered as ``name``, or the class ``"pkg.module:Class"`` names."""
    module, cls = strategy_spec(name).split(":", 1)
    try:
        found = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"training strategy {name!r}: cannot load {cls} from {module} ({e}); check the module is "
                         f"importable in the worker processes (PYTHONPATH) and the class name") from e
    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise ValueError(f"training strategy {name!r} names {found!r}, which is not a trainer.strategies.Strategy "
                         f"subclass")
    return found


class Strategy(abc.ABC):
    """One rank's model under a training library. Subclasses set ``mesh`` and ``model`` in their
    constructor (keyword arguments: ``role``, ``rank``, ``world_size``, ``master_addr``,
    ``master_port``, ``model_path`` and their own options)."""

    mesh: dict
    model: Any
    routing_replay: bool = False  # R3: micro-batches carry the rollout's routed experts
    packs: bool = False  # micro-batches may be packed THD rows (``pack`` / ``unpack``); else padded rows

    @classmethod
    def from_section(cls, section, *, optim: dict | None, checkpointing: bool, routing_replay: bool,
                     compile: bool) -> dict:
        """This strategy's keywords from its role's config section (``section``: e.g. ``actor_rollout_ref.actor``,
        resolved, as an omegaconf ``DictConfig``): ``optim`` is None for a forward-only role, ``checkpointing`` verl's
        ``enable_gradient_checkpointing``, ``routing_replay`` R3, ``compile`` ``trainer.compile``."""
        raise NotImplementedError(f"{cls.__name__} does not read a role's config section: give it its keywords "
                                  f"directly, or define from_section")

    # ------------------------------------------------------------------ model and micro-batches
    def module(self):
        """The trained module (or megatron's list of model chunks), as the weight readers take it."""
        return self.model

    @property
    def min_micro_batches(self) -> int:
        return 1

    def loss_group(self):
        """The process group of the ranks that run the loss over different rows of the same micro-batch, in
        lockstep (one call per micro-batch each), or None when this rank is alone. A collective inside the
        loss runs over it (bypass mode's batch-normalised IS weights). It may also hold ranks with copies of
        the same rows (sequence parallel peers here; megatron's override leaves its tensor-parallel peers
        out): what is reduced over it is a ratio of sums, which copies do not change. The default is the
        role's whole world."""
        ok = torch.distributed.is_available() and torch.distributed.is_initialized()
        return torch.distributed.group.WORLD if ok and torch.distributed.get_world_size() > 1 else None

    def group_reduce(self, t: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
        """``t`` reduced (``sum`` or ``max``) over ``group`` on the group's device (NCCL needs the GPU);
        returned on ``t``'s device."""
        dist = torch.distributed
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else t.device
        x = t.to(dev).clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        return x.to(t.device)

    def pack(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        """A micro-batch of padded rows as one packed row (``input_ids [1, N]``, ``cu_seqlens``, and
        ``pack_index`` back to the grid); used only where ``packs`` is True."""
        return pack_padded(input_ids, attention_mask)

    def unpack(self, values: torch.Tensor, pack_index: torch.Tensor, shape: tuple) -> torch.Tensor:
        """A packed per-token output ``[1, N]`` back on the ``[b, S]`` grid (zeros on pads; differentiable)."""
        return unpack_padded(values, pack_index, shape)

    @abc.abstractmethod
    def compute(self, mbs: list[dict], *, temperature: float, with_entropy: bool,
                with_sum_pi_squared: bool = False) -> list[dict]:
        """Forward-only per-token outputs of each micro-batch on its own layout (no grad)."""

    @abc.abstractmethod
    def train_step(self, mbs: list[dict], loss_fn: Callable, **kw) -> dict:
        """One optimizer step over the micro-batches; ``loss_fn(outs, mb) -> (loss, metrics)``.
        Returns ``loss``, ``grad_norm``, ``lr``, ``skipped``."""

    def reference_policy(self):
        """A context manager inside which :meth:`compute` gives the reference policy's outputs from this rank's
        own model (LoRA: the actor with its adapters off), so no reference group is needed. A strategy that
        holds no reference beside its trained weights raises NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} holds no reference policy beside its trained weights: "
                                  f"run a reference group")

    # ------------------------------------------------------------------ weights (read by trainer.sync)
    @abc.abstractmethod
    def hf_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` one at a time; collective over the model group."""

    def hf_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named weight buckets of about ``bucket_bytes``, collective (every rank sees full tensors)."""
        yield from bucketed(self.hf_params(), bucket_bytes)

    def reshard_blocks(self) -> list | None:
        """This rank's blocks of the HF tensors (``megatron_bridge.reshard.Block``); None: not supported."""
        return None

    def local_param(self, ref: str) -> torch.Tensor:
        """The local tensor a block of :meth:`reshard_blocks` reads (``Block.param``)."""
        raise NotImplementedError(f"{type(self).__name__} plans no reshard blocks")

    # ------------------------------------------------------------------ checkpoints
    @abc.abstractmethod
    def save(self, ckpt_dir: str, extra: dict | None = None) -> str:
        ...

    @abc.abstractmethod
    def load(self, ckpt_dir: str, contents=("model", "optimizer", "extra")) -> dict:
        ...

    @abc.abstractmethod
    def export_hf(self, out_dir: str, source_dir: str | None = None) -> str | None:
        ...

    # ------------------------------------------------------------------ offload, RNG
    def load_state(self, parts) -> None:
        """Bring ``parts`` ("params", "grads", "optimizer") of what is offloaded into device memory."""

    def offload_state(self) -> None:
        """Move whatever the strategy offloads back to host memory."""

    def offload_status(self) -> dict:
        return {"offloaded": {}, "bytes": {}, "resident": {}}

    def rng_state(self) -> dict:
        return capture_rng()

    def set_rng_state(self, state: dict) -> None:
        restore_rng(state)
