"""Offload: a role's parameters, gradients and optimizer state leave device memory between the phases
that use them (verl's ``param_offload`` / ``grad_offload`` / ``optimizer_offload``).

A colocated job time-shares each GPU between the rollout engine and the trainer's roles; while the
engine generates, the actor's weights (2 bytes / parameter in bf16), gradient buffer (4) and Adam state
with fp32 master weights (12) sit idle and can go to host memory, then come back for the next phase.

How: per storage, not per tensor. Megatron's DDP keeps every gradient (and, with the distributed
optimizer, every parameter) as a view into one flat buffer, and other views of the same memory
(``param.main_grad``, bucket shards) are held elsewhere; moving tensors with ``t.data = t.to("cpu")``
would cut those views loose. Instead each distinct storage is copied into a (pinned, on CUDA) host
buffer and resized to zero bytes, which frees the device memory while every view keeps pointing at
the storage; loading resizes it back and copies the bytes in. A storage whose contents the next phase
overwrites anyway (the gradient buffer, zeroed at the start of each step) is freed without a copy and
comes back zeroed.

The mechanism is device-agnostic (its CPU tests free and restore real storages); offloading only
saves memory where the tensors live on an accelerator, so the config refuses the keys on CPU.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from megatron_bridge.model import chunks
from megatron_bridge.train import optimizers


class StorageOffload:
    """The storages of ``tensors()`` (deduplicated) moved to host memory and back, in place.
    ``keep``: copy the contents (else the storage comes back zero-filled)."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]], keep: bool = True, name: str = "state"):
        self.tensors, self.keep, self.name = tensors, keep, name
        self.held: list | None = None  # [(storage, host bytes or None, nbytes)] while offloaded

    @property
    def offloaded(self) -> bool:
        return self.held is not None

    def offload(self) -> int:
        """Free the storages (copied to host first when ``keep``); returns the bytes freed."""
        if self.held is not None:
            return 0
        held, seen, cuda = [], set(), False
        for t in self.tensors():
            st = t.untyped_storage()
            n = st.nbytes()
            if n == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            if not st.resizable():  # checked before anything is freed: all or nothing
                raise RuntimeError(f"offload ({self.name}): a {tuple(t.shape)} {t.dtype} tensor's memory is not resizable (a "
                                   f"memory-mapped or foreign buffer); give it its own storage first (own_storages)")
            host = None
            if self.keep:
                cuda |= st.device.type == "cuda"
                host = torch.empty(n, dtype=torch.uint8, pin_memory=st.device.type == "cuda")
                host.copy_(_bytes(st), non_blocking=True)
            held.append((st, host, n))
        if cuda:
            torch.cuda.synchronize()  # the copies must land before the device memory is released
        for st, _, _ in held:
            st.resize_(0)
        self.held = held
        return sum(n for _, _, n in held)

    def load(self) -> None:
        """Bring every offloaded storage back, with its bytes (or zeros)."""
        if self.held is None:
            return
        cuda = False
        for st, host, n in self.held:
            st.resize_(n)
            dst = _bytes(st)
            if host is None:
                dst.zero_()
            else:
                cuda |= st.device.type == "cuda"
                dst.copy_(host, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()
        self.held = None


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the distinct storages of ``tensors`` hold now."""
    seen, n = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n


def _bytes(st: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a uint8 tensor (a view: writes land in the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


def model_params(model) -> Callable[[], list[torch.Tensor]]:
    """Every parameter of every chunk (DDP-wrapped or not)."""

    return lambda: [p for c in chunks(model) for p in c.parameters()]


def grad_buffers(ddp_chunks) -> Callable[[], list[torch.Tensor]]:
    """Megatron DDP's flat gradient buffers (dense and expert-parallel) of each chunk."""
    def tensors():
        out = []
        for d in ddp_chunks if isinstance(ddp_chunks, (list, tuple)) else [ddp_chunks]:
            for buf in [*getattr(d, "buffers", []), *getattr(d, "expert_parallel_buffers", [])]:
                out.append(buf.grad_data)
        return out
    return tensors


def optimizer_state(optimizer, model) -> Callable[[], list[torch.Tensor]]:
    """The optimizer's state tensors (Adam moments) and its own parameter copies (the fp32 master
    weights of mixed precision); the model's parameters themselves (fp32 training, where the optimizer
    steps them directly) are left to the parameter offload."""

    def tensors():
        own = {p.untyped_storage().data_ptr() for p in model_params(model)()}
        out = []
        for o in optimizers(optimizer):
            inner = getattr(o, "optimizer", o)
            for g in inner.param_groups:
                for p in g["params"]:
                    if p.untyped_storage().data_ptr() not in own:
                        out.append(p)
                    out += [v for v in inner.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return out
    return tensors


def own_storages(model, optimizer=None) -> int:
    """Give every parameter and optimizer state tensor whose memory torch cannot resize (a checkpoint
    load can leave tensors over a memory-mapped file) a copy of its own, so it can be offloaded; the
    tensor objects stay (the optimizer keeps its references). Returns how many were copied."""

    n = 0
    for p in model_params(model)():
        if p.untyped_storage().nbytes() and not p.untyped_storage().resizable():
            p.data = p.data.clone()
            n += 1
    for o in optimizers(optimizer) if optimizer is not None else ():
        inner = getattr(o, "optimizer", o)
        for st in inner.state.values():
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and v.dim() > 0 and not v.untyped_storage().resizable():
                    st[k] = v.clone()
                    n += 1
    return n
