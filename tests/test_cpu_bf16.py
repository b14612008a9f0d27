"""trainer/cpu_bf16.py: bf16 products as fp32 accumulate plus one rounding, below autograd, on every thread.

The reference for each product is the definition itself in float64 (exact for these sizes' partial
sums up to fp32's own rounding) rounded to bf16; the kernels must equal fp32-then-round bit for bit and
stay within one bf16 ulp of the float64 product. Installed in a child process (COXSWAIN_CPU_BF16=fp32),
so this process keeps whatever the machine chose."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer import cpu_bf16

BF = torch.bfloat16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ref(fn, *xs, **kw):
    return fn(*[x.float() for x in xs], **kw).to(BF)


@pytest.mark.parametrize("seed", [0, 1])
def test_kernels_are_fp32_accumulate_then_one_rounding(seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(37, 53, generator=g).to(BF), torch.randn(53, 29, generator=g).to(BF)
    s = torch.randn(29, generator=g).to(BF)
    a3, b3, s3 = (torch.randn(3, 11, 17, generator=g).to(BF), torch.randn(3, 17, 5, generator=g).to(BF),
                  torch.randn(3, 11, 5, generator=g).to(BF))
    assert torch.equal(cpu_bf16._mm(a, b), _ref(torch.mm, a, b))
    assert torch.equal(cpu_bf16._mm(a, b.t().contiguous().t()), _ref(torch.mm, a, b))  # a strided operand
    assert torch.equal(cpu_bf16._addmm(s, a, b, beta=0.5, alpha=2.0), _ref(torch.addmm, s, a, b, beta=0.5, alpha=2.0))
    assert torch.equal(cpu_bf16._bmm(a3, b3), _ref(torch.bmm, a3, b3))
    assert torch.equal(cpu_bf16._baddbmm(s3, a3, b3, beta=1, alpha=1), _ref(torch.baddbmm, s3, a3, b3))
    exact = (a.double() @ b.double()).to(BF)
    ulp = 2.0 ** (torch.floor(torch.log2(exact.double().abs().clamp_min(1e-30))) - 7)
    assert ((cpu_bf16._mm(a, b).double() - exact.double()).abs() <= ulp).all()


def test_other_dtypes_take_torch_kernels():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(7, 3, generator=g, dtype=torch.float64)
    assert torch.equal(cpu_bf16._mm(a, b), a @ b) and cpu_bf16._mm(a, b).dtype == torch.float64
    with pytest.raises(RuntimeError, match="same dtype"):
        cpu_bf16._mm(a.float(), b)


def test_the_switch(monkeypatch):
    for value, on in (("native", False), ("", False), ("fp32", True), ("FP32", True)):
        monkeypatch.setenv("COXSWAIN_CPU_BF16", value)
        assert cpu_bf16.needed() is on, value
    monkeypatch.setenv("COXSWAIN_CPU_BF16", "fast")
    with pytest.raises(ValueError, match="COXSWAIN_CPU_BF16='fast'.*fp32.*native"):
        cpu_bf16.needed()


def test_off_unless_asked():
    env = {k: v for k, v in os.environ.items() if k != "COXSWAIN_CPU_BF16"}
    p = subprocess.run([sys.executable, "-c", "import trainer; from trainer import cpu_bf16; print(cpu_bf16._LIB is None)"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "True", p.stderr[-2000:]


CHILD = textwrap.dedent("""
    import threading, torch
    import trainer
    from trainer import cpu_bf16
    assert cpu_bf16._LIB is not None
    BF = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 16, generator=g).to(BF).requires_grad_()
    lin = torch.nn.Linear(16, 8).to(BF)

    class Mine(torch.autograd.Function):  # a hand-written backward, as megatron's linear layers have
        @staticmethod
        def forward(ctx, h, w):
            ctx.save_for_backward(h, w)
            return h.matmul(w.t())
        @staticmethod
        def backward(ctx, go):
            h, w = ctx.saved_tensors
            return go.matmul(w), go.reshape(-1, go.shape[-1]).t().matmul(h.reshape(-1, h.shape[-1]))

    out = {}
    def work():
        y = Mine.apply(lin(x), lin.weight[:, :8].contiguous())
        y.float().square().sum().backward()
        out["y"], out["gx"] = y.detach(), x.grad
    t = threading.Thread(target=work); t.start(); t.join()  # another thread: the kernels are per process

    # the same computation with every product written out as fp32 then one rounding
    xf, W, bias = x.detach(), lin.weight.detach(), lin.bias.detach()
    r = lambda t: t.to(BF)
    h = r(xf.float() @ W.float().t() + bias.float())
    W2 = W[:, :8].contiguous()
    y = r(h.float() @ W2.float().t())
    go = r(2 * y.float())
    gh = r(go.float() @ W2.float())
    gx = r(gh.float() @ W.float())
    assert torch.equal(out["y"], y), "forward"
    assert torch.equal(out["gx"], gx), "backward"
    print("ok")
""")


def test_installed_kernels_carry_forward_backward_and_threads():
    env = dict(os.environ, COXSWAIN_CPU_BF16="fp32")
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
