"""Per-token KL estimators, KL-in-reward, and the fixed / adaptive KL coefficient controllers.

Estimators of KL(pi || pi_ref) from one sampled token (Schulman 2020, "Approximating KL
divergence", http://joschu.net/blog/kl-approx.html), with ``log r = logprob - ref_logprob``:

    "kl"  / "k1"          log r                                 unbiased, high variance, can be < 0
    "abs"                 |log r|
    "mse" / "k2"          0.5 (log r)^2                         biased, low variance, >= 0
    "low_var_kl" / "k3"   q - log q - 1,  q = exp(ref_logprob - logprob) = pi_ref / pi
                                                                unbiased, low variance, >= 0

k3 deviation (numerical stability, as verl does): ``log q`` is clamped to [-20, 20] before the
``exp`` (so a token the policy made ~impossible cannot give ``inf``), and the k3 value is clamped
to [-10, 10] (it is >= 0, so in effect capped at 10).

Straight-through suffix ``"+"`` (e.g. ``"k3+"``, ``"k1+"``): the VALUE of the named estimator
with the GRADIENT of k2, ``d/dlogp 0.5 (log r)^2 = log r``, whose expectation under the policy is
the gradient of the true KL. Useful with ``use_kl_loss``, where k3's own gradient is biased.

KL in the reward (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
arXiv:1909.08593; verl's ``use_kl_in_reward``): ``rewards_t = scores_t - beta * kl_t`` on the
response tokens. The coefficient ``beta`` comes from a controller:

* ``FixedKLController`` keeps ``beta`` constant;
* ``AdaptiveKLController`` (Ziegler et al. 2019, sec. 2.2): ``e = clip(KL / KL_target - 1,
  -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``, with ``KL`` the current mean
  per-sequence KL and ``n_steps`` the number of samples in the batch (verl's convention).

Both controllers have ``state_dict()`` / ``load_state_dict()`` so the checkpoint restores ``beta``.
"""

from __future__ import annotations

from typing import Callable

import torch

from trainer.algos.utils import load_fn, masked_mean


def _k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob  # [B, T]


def _abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()  # [B, T]


def _k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()  # [B, T]


def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    log_q = (ref_logprob - logprob).clamp(-20.0, 20.0)  # [B, T] clamped so exp stays finite
    return (torch.exp(log_q) - log_q - 1.0).clamp(-10.0, 10.0)  # [B, T]


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": _k1,
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
}


_CHUNK_NUMEL = 1 << 18  # elements per row chunk of a no-grad call: ~1 MiB of float32 temporaries


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str = "kl") -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` by the estimator named ``kl_penalty`` (see module docstring).

    A trailing ``"+"`` gives the straight-through variant (value of the estimator, gradient of k2).
    ``"pkg.module:function"`` loads a user's ``f(logprob, ref_logprob) -> [B, T]``.
    """
    needs_grad = torch.is_grad_enabled() and (logprob.requires_grad or ref_logprob.requires_grad)
    one_op = kl_penalty in ("kl", "k1")  # a single subtraction makes no temporary to keep in cache
    if (not needs_grad and not one_op and logprob.dim() == 2 and logprob.shape == ref_logprob.shape
            and logprob.numel() > _CHUNK_NUMEL):
        # the driver's whole-batch call (KL in reward, metrics): row chunks whose temporaries stay in cache, so
        # each element is read once and written once (a 4-op estimator on [8192, 4096] would otherwise make
        # four [B, T] temporaries: 3x the time, measured in benchmarks/bench_algos.py). Same values exactly.
        name = kl_penalty[:-1] if isinstance(kl_penalty, str) and kl_penalty.endswith("+") else kl_penalty
        fn = load_fn(name, KL_ESTIMATORS, "kl_penalty")
        B, T = logprob.shape
        step = max(1, _CHUNK_NUMEL // T)
        first = fn(logprob[:step], ref_logprob[:step])
        out = torch.empty((B, T), dtype=first.dtype, device=first.device)
        out[:step] = first
        for s in range(step, B, step):
            out[s:s + step] = fn(logprob[s:s + step], ref_logprob[s:s + step])
        return out
    if isinstance(kl_penalty, str) and kl_penalty.endswith("+"):
        value = load_fn(kl_penalty[:-1], KL_ESTIMATORS, "kl_penalty")(logprob, ref_logprob)  # [B, T]
        grad_carrier = _k2(logprob, ref_logprob)  # [B, T]
        # forward: value; backward: d(k2)
        return grad_carrier - grad_carrier.detach() + value.detach()
    return load_fn(kl_penalty, KL_ESTIMATORS, "kl_penalty")(logprob, ref_logprob)


@torch.no_grad()
def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``rewards = scores - kl_coef * kl`` on the valid tokens (scores pass through elsewhere).

    ``logprob`` is the policy's (old) log-prob of the sampled tokens, ``ref_logprob`` the reference
    model's. Metrics (0-dim detached tensors): ``actor/reward_kl_penalty`` is the batch mean of each
    sequence's token-mean KL (this is the ``current_kl`` to feed ``controller.update``) and
    ``actor/reward_kl_penalty_coeff`` the coefficient used.
    """
    mask = response_mask.to(token_level_scores.dtype)  # [B, T]
    kld = _kl_value(logprob, ref_logprob, kl_penalty).to(token_level_scores.dtype) * mask  # [B, T]
    rewards = token_level_scores - kl_coef * kld  # [B, T]
    seq_kl = masked_mean(kld, mask, dim=-1)  # [B] token-mean per sequence
    current_kl = seq_kl.mean() if seq_kl.numel() else torch.zeros((), device=seq_kl.device)
    metrics = {
        "actor/reward_kl_penalty": current_kl.detach().float(),
        "actor/reward_kl_penalty_coeff": torch.tensor(float(kl_coef)),
    }
    return rewards, metrics


def _kl_value(logprob, ref_logprob, name):
    # the straight-through suffix only changes gradients; rewards need just the value
    return kl_penalty(logprob, ref_logprob, name[:-1] if isinstance(name, str) and name.endswith("+") else name)


# --------------------------------------------------------------------------------------------------
# controllers
# --------------------------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl=None, n_steps: int = 0) -> None:
        """No-op (kept so the controller loop can call every controller the same way)."""

    def state_dict(self) -> dict:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_type(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. (2019) proportional controller driving the measured KL toward ``target_kl``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl is None or float(target_kl) <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl must be > 0 for the adaptive controller, got {target_kl}")
        if horizon is None or float(horizon) <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps: int) -> None:
        """``current_kl``: the batch's mean per-sequence KL (float or 0-dim tensor); ``n_steps``: the
        number of samples it was measured on."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)  # clipped proportional error
        self.value *= 1.0 + error * float(n_steps) / self.horizon

    def state_dict(self) -> dict:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        _check_type(state, "adaptive")
        # only the coefficient is state; target and horizon are settings and come from the config
        # (stored in state_dict for the record, so a resumed run may retune them).
        self.value = float(state["value"])


def _check_type(state: dict, expected: str) -> None:
    got = state.get("type", expected)
    if got != expected:
        raise ValueError(f"KL controller state is for a '{got}' controller, cannot load it into a '{expected}' one")


def make_kl_controller(
    type: str = "fixed",  # noqa: A002 -- verl's key name (algorithm.kl_ctrl.type)
    kl_coef: float = 0.001,
    target_kl: float | None = None,
    horizon: float | None = None,
    **kwargs,
):
    """Build the controller named by ``algorithm.kl_ctrl.type`` ("fixed" or "adaptive")."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type '{type}'; valid: 'fixed', 'adaptive'")
