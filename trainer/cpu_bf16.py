"""bf16 matrix products on a CPU without bf16 instructions, computed as a GPU computes them.

A bf16 GEMM on a tensor core (and on a CPU with AMX or AVX-512-BF16, through oneDNN) multiplies bf16
inputs, accumulates in fp32 and rounds the result to bf16 once:

    C_bf16 = round_bf16( sum_k float(A_ik) * float(B_kj) )

Every product of two bf16 numbers is exact in fp32 (8 + 8 significant bits fit in 24), so the same
arithmetic is an fp32 GEMM of the upcast inputs followed by one rounding. On a CPU without bf16
instructions (an AVX2-only EPYC, for one) torch's own bf16 kernels are a generic fallback: measured on
one such 2-core machine, a 1024^3 bf16 matmul ran at 0.8 GFLOP/s against 60 in fp32, and a 2240 x 96 x 256
``nn.Linear`` took 46 ms in bf16 against 4.6 ms as fp32-then-round. The tiny CPU recipe trains in bf16,
so on such a machine every step and every test ran several times slower than on an AMX Xeon.

:func:`install` registers, for the CPU dispatch key only, ``aten::mm``, ``addmm``, ``bmm`` and ``baddbmm``
kernels that take bf16 operands through the fp32 path above and hand every other dtype to torch's own
kernel (reached through the op's ``.out`` overload, which keeps its registration). The kernels sit below
autograd, so forward and backward products (torch's formulas and megatron's own backward alike) take
them, on every thread. Results may differ from torch's fallback kernel in the last bf16 bit (summation
order), as any two GEMM libraries do; runs stay deterministic.

Opt-in for now: ``COXSWAIN_CPU_BF16=fp32`` installs these kernels (in every process that imports
``trainer``; SGLang's own processes do not), unset or ``native`` keeps torch's. Programs that train in bf16 to
measure something else than kernels (``benchmarks/bench_adca.py``) opt in where the CPU lacks bf16 instructions
(:func:`enable_where_slow`). Not installed everywhere: the kernels are Python, about 30 us per call over torch's
for every dtype (a 8 x 64 x 64 fp32 linear: 19 us native, 50 us through them), which an fp32 run of a tiny
model would pay on every product (a whole-suite run with them installed everywhere was no faster and
changed the timing ``test_async_fully``'s partial-rollout test leaned on). On by default would mean installed
only in the processes whose model computes in bf16; not built yet.
"""

from __future__ import annotations

import os
import warnings

import torch

_LIB = None  # the torch.library registration (kept alive: dropping it unregisters the kernels)
_BF16 = torch.bfloat16


def needed() -> bool:
    """``COXSWAIN_CPU_BF16``: ``fp32`` yes; ``native`` or unset no (see the module docstring)."""
    choice = os.environ.get("COXSWAIN_CPU_BF16", "").lower()
    if choice not in ("", "native", "fp32"):
        raise ValueError(f"COXSWAIN_CPU_BF16={choice!r}: use 'fp32' (fp32 accumulate, one rounding) or 'native' "
                         "(torch's kernels, the default)")
    return choice == "fp32"


def _through_fp32(op):
    """A CPU kernel for ``op`` (``mm``, ``addmm``, ``bmm`` or ``baddbmm``; operands ``[self,] a, b``): all-bf16
    operands go through the fp32 product and one rounding, any other dtype through torch's own kernel, both by
    the op's ``.out`` overload (its registration is not the one replaced, so nothing recurses)."""
    out_op = getattr(torch.ops.aten, op).out

    def kernel(*operands, **scalars):  # scalars: addmm's / baddbmm's beta and alpha
        a, b = operands[-2:]
        shape = (*a.shape[:-1], b.shape[-1])
        if all(t.dtype == _BF16 for t in operands):
            wide = [t.float() for t in operands]
            return out_op(*wide, **scalars, out=a.new_empty(shape, dtype=torch.float32)).to(_BF16)
        return out_op(*operands, **scalars, out=a.new_empty(shape))

    return kernel


_OPS = ("mm", "addmm", "bmm", "baddbmm")
_mm, _addmm, _bmm, _baddbmm = (_through_fp32(op) for op in _OPS)


def install() -> bool:
    """Register the kernels (idempotent; a no-op where :func:`needed` is False). True when they are active."""
    global _LIB
    if _LIB is not None:
        return True
    if not needed():
        return False
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # torch warns that a kernel is overridden for the key: that is the point
        warnings.simplefilter("ignore")
        for name, fn in zip(_OPS, (_mm, _addmm, _bmm, _baddbmm)):
            lib.impl(name, fn, "CPU")
    _LIB = lib
    return True


def native_bf16() -> bool:
    """Whether this CPU has bf16 instructions oneDNN uses (AVX-512-BF16 or AMX): torch's own kernels are fast there."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def enable_where_slow() -> bool:
    """For a program that trains in bf16 to compare something other than kernels (a benchmark of algorithms, a
    CPU rehearsal): where the CPU has no bf16 instructions and ``COXSWAIN_CPU_BF16`` is unset, set it to ``fp32``
    (so the Ray workers and servers this process starts inherit it) and install the kernels here. An explicit
    ``COXSWAIN_CPU_BF16`` is left as it is. True when the kernels are active in this process."""
    if not os.environ.get("COXSWAIN_CPU_BF16") and not native_bf16():
        os.environ["COXSWAIN_CPU_BF16"] = "fp32"
    return install()
