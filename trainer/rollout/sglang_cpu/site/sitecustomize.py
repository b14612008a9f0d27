"""Started in every Python process that has ``trainer/rollout/sglang_cpu/site`` on its path: set by
:func:`trainer.rollout.sglang_cpu.activate` through PYTHONPATH, so SGLang's scheduler / detokenizer
subprocesses and ``python -m sglang.launch_server`` get it too. CPU and test support only."""

import coxswain_sglang_host_alloc
import coxswain_sglang_no_pin
import coxswain_torchvision_hook

coxswain_torchvision_hook.install()
coxswain_sglang_host_alloc.install()
coxswain_sglang_no_pin.install()
