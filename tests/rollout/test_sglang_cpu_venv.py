"""The SGLang CPU venv sees the project's own environment when the project itself lives in a virtual
environment (issue 38 item 9): ``python -m venv --system-site-packages`` alone links the *base* interpreter's
packages, so ray, omegaconf and Coxswain would be missing there and torch would be installed twice.

Real venvs and real interpreters, no pip run (``make_venv`` is the part of ``install`` that decides what
the venv sees; pip then only adds sglang and its pins)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _py(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _site(py: str) -> str:
    return subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="venv layout checked on Linux (bin/python)")
def test_sglang_venv_made_from_a_project_venv_sees_the_project_venv(tmp_path):
    project = str(tmp_path / "project-venv")
    # the project's venv: it sees this interpreter's packages (torch, ray, ...) and holds one of its own
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", project], check=True)
    psite = _site(_py(project))
    with open(os.path.join(psite, "coxswain_probe_only_in_project_venv.py"), "w") as f:
        f.write("WHERE = 'project venv'\n")
    # Coxswain itself, installed into the project venv (as an editable install would: a .pth to the checkout)
    with open(os.path.join(psite, "coxswain_checkout.pth"), "w") as f:
        f.write(REPO + "\n")

    sg = str(tmp_path / "sglang-venv")
    code = f"from trainer.rollout.sglang_cpu.__main__ import make_venv; print(make_venv({sg!r}))"
    made = subprocess.run([_py(project), "-c", code], check=True, capture_output=True, text=True, cwd=str(tmp_path))
    assert made.stdout.strip().splitlines()[-1] == _py(sg)

    probe = textwrap.dedent(f"""
        import sys, coxswain_probe_only_in_project_venv as p, trainer, omegaconf, torch
        print(); print(p.WHERE)
        print(torch.__version__)
        paths = [x.rstrip('/') for x in sys.path]
        print(paths.index({psite.rstrip('/')!r}))
        print(min(i for i, x in enumerate(paths) if x.startswith({sys.base_prefix.rstrip('/')!r}) and x.endswith('site-packages')))
        print(paths.index({_site(_py(sg)).rstrip('/')!r}))
    """)
    out = subprocess.run([_py(sg), "-c", probe], capture_output=True, text=True, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    where, torch_version, i_project, i_base, i_own = out.stdout.strip().splitlines()[-5:]
    assert where == "project venv"
    assert torch_version.startswith("2.13.0")  # the one torch, not a second install
    # sglang's own venv first (its pins win), then the project venv, then the base interpreter
    assert int(i_own) < int(i_project) < int(i_base)
    # the trainer runs from it (the reported failure: `.venv-sglang-cpu/bin/python -m trainer.main` died on
    # `import omegaconf`): the tiny recipe resolves, megatron-core's config fields and all
    run = subprocess.run([_py(sg), "-m", "trainer.main", "--print-config", "--config",
                          os.path.join(REPO, "recipes", "cpu", "tiny_grpo.yaml"), f"trainer.default_local_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "resolved config written to" in run.stdout


def test_make_venv_from_the_base_interpreter_adds_no_extra_site(tmp_path, monkeypatch):
    from trainer.rollout.sglang_cpu import __main__ as m

    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    assert m.own_site_dirs() == []
