"""A run prints no warning the user cannot act on: the gloo / distributed-optimizer note once at load
(not once per worker), Ray's zero-copy notes silenced where the tensors are only read, and verl's
default checkpoint directory ignored by git."""

import os
import subprocess
import sys
import warnings

import torch
from ray._private import tensor_serialization_utils as ray_tensors

from tests.support.tiny import tiny_config
from trainer.config import load as config_load
from trainer.workers import group


def test_the_gloo_distributed_optimizer_note_is_one_line_at_load_and_workers_filter_it():
    tiny_config(["trainer.device=cpu", "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true"])
    notes = [n for n in config_load.LAST_LOAD_NOTES if "reduce-scatter" in n]
    assert notes == ["actor_rollout_ref.actor.megatron.use_distributed_optimizer=true: the distributed optimizer needs "
                     "reduce-scatter, which gloo (trainer.device=cpu) lacks, so the plain optimizer runs (same update, "
                     "state not sharded); set it to false to drop this note; on trainer.device=cuda it applies."]
    # what a Ray worker gets: Python parses every filter (a comma inside a message would split it into an invalid
    # one, printed as "Invalid -W option ignored" by every worker) and megatron_bridge's warning stays silent
    code = ("import warnings; warnings.warn('distributed optimizer needs reduce-scatter, which gloo lacks: using the "
            "plain optimizer'); warnings.warn('Apex is not installed.'); print('ran')")
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONWARNINGS=group._quiet_warnings_env()),
                       capture_output=True, text=True, check=True)
    assert (p.stdout, p.stderr) == ("ran\n", "")
    tiny_config(["trainer.device=cpu", "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false"])
    assert not [n for n in config_load.LAST_LOAD_NOTES if "reduce-scatter" in n]


def test_ray_zero_copy_tensors_pass_without_warnings():
    with warnings.catch_warnings(record=True) as seen:
        group.quiet_ray_tensors()  # what every Ray worker (worker_setup) and the driver (init_ray) run
        fn, args = ray_tensors.zero_copy_tensors_reducer(torch.arange(6, dtype=torch.float32))
        arr = fn(*args)
    assert torch.equal(arr, torch.arange(6, dtype=torch.float32))
    assert [str(w.message)[:60] for w in seen] == []
    # elsewhere, a read-only array still warns: in a fresh process, since torch warns about it once per process
    # (an earlier test in this one may have used up that once)
    code = ("import warnings, numpy as np, torch; from trainer.workers import group; group.quiet_ray_tensors(); "
            "a = np.zeros(3); a.flags.writeable = False; torch.from_numpy(a)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0 and "not writable" in r.stderr, r.stderr[-2000:]


def test_verl_default_checkpoint_dir_is_ignored_by_git():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(["git", "check-ignore", "-q", "checkpoints/my_project/my_exp/global_step_1/x.pt"], cwd=root)
    assert r.returncode == 0
