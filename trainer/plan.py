"""The config resolved once: a frozen ``Plan`` of every derived setting, and the loop's ``LoopState``.

Why. Defaults that depend on other keys (the response width is ``rollout.response_length`` or
``data.max_response_length``; a mini-batch holds ``ppo_mini_batch_size * rollout.n`` responses; the
critic's mini-batch and epochs fall back to the actor's; the warmup is a step count or a ratio of the
horizon) used to be re-resolved at each use site, and the rollout-IS settings dict was rebuilt every
step. ``Plan.from_config`` resolves each once; the loop and the role groups read ``plan.*`` and
never the raw config. ``Plan`` holds only plain values (frozen dataclasses, tuples, dicts of numbers),
so it pickles to Ray workers as it is.

``LoopState`` is everything the loop carries from step to step (step, prompt sampler, KL controller,
next group id, last eval step, tracker run id, metric history, the driver's RNG states); its
``state_dict()`` / ``load_state_dict()`` are the one path used by both checkpoint save and resume,
so what is saved is exactly what is restored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf

from trainer.algos.correction import parse_is_threshold
from trainer.algos.losses import LossAgg
from trainer.async_rollout import AsyncSettings
from trainer.checkpoint import capture_rng, restore_rng
from trainer.config import OverlongBufferConfig, need_critic, need_ref
from trainer.verl_compat import parse_rejection


@dataclass(frozen=True)
class PolicyLoss:
    """The actor's loss: policy-loss variant, PPO clipping, entropy bonus, KL loss."""
    loss_mode: str
    agg_mode: str
    norm_constant: float  # seq-mean-token-sum-norm's constant (loss_scale_factor, else the response width)
    clip_ratio: float
    clip_ratio_low: Optional[float]
    clip_ratio_high: Optional[float]
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    variant_kwargs: dict = field(default_factory=dict)  # the variant's own keywords (Clip-Cov, KL-Cov, SAPO, DRO, CPGD)

    def agg(self, *, global_num_tokens: float, global_num_seqs: float, dp_size: int) -> LossAgg:
        return LossAgg(mode=self.agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                       dp_size=dp_size, norm_constant=self.norm_constant)


@dataclass(frozen=True)
class ValueLoss:
    cliprange_value: float
    agg_mode: str


@dataclass(frozen=True)
class ForwardSettings:
    """One role's forward-only pass (old / reference log-probs, values): ``micro_batch_size``
    responses per forward on one rank, or (``max_token_len``, verl's ``use_dynamic_bsz``)
    micro-batches filled up to that many tokens; ``packed`` (``use_remove_padding``): each
    micro-batch is one THD row of its real tokens, no padding. ``with_sum_pi_squared`` (the actor's
    old-log-prob pass under verl's ``actor.calculate_sum_pi_squared``): the pass also returns
    ``sum_pi_squared`` [B, T], ``sum_v pi(v)^2`` at each response position."""
    micro_batch_size: int
    max_token_len: Optional[int] = None
    packed: bool = True
    temperature: float = 1.0
    budget_key: str = "log_prob_max_token_len_per_gpu"  # named in the error when a sequence does not fit
    with_sum_pi_squared: bool = False


@dataclass(frozen=True)
class UpdateSettings:
    """One role's update: ``epochs`` passes over the step's batch in mini-batches of
    ``mini_batch_size`` RESPONSES (one optimizer step each), ``micro_batch_size`` responses (or
    ``max_token_len`` tokens) per forward/backward on one rank, packed or padded."""
    mini_batch_size: int
    epochs: int
    shuffle: bool
    micro_batch_size: int
    temperature: float = 1.0
    policy: Optional[PolicyLoss] = None  # actor
    value: Optional[ValueLoss] = None  # critic
    max_token_len: Optional[int] = None
    packed: bool = True
    budget_key: str = "ppo_max_token_len_per_gpu"


@dataclass(frozen=True)
class RolloutIS:
    """Keyword arguments of ``trainer.algos.rollout_is.compute_rollout_is_weights``."""
    rollout_is_level: str
    rollout_is_mode: str
    rollout_is_threshold: float
    rollout_is_threshold_lower: Optional[float]
    rollout_is_veto_threshold: Optional[float]
    rollout_is: bool

    def kwargs(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Rejection:
    """Keyword arguments of ``trainer.algos.rollout_is.compute_rejection_mask``."""
    divergence: str
    agg: str
    lower: Optional[float]
    upper: Optional[float]


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one kind of generation (training or validation); ``params(step, g)``
    gives the engine's ``SamplingParams`` keywords with a seed that is a function of (step,
    generation batch), so a resumed run samples exactly the same."""
    n: int
    temperature: float
    top_p: float
    top_k: Optional[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    seed: int
    return_routed_experts: bool = False  # R3 routing replay: the engines return each token's experts

    def params(self, step: int, gen_batch: int) -> dict:
        return dict(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    max_new_tokens=self.max_new_tokens, stop_token_ids=list(self.stop_token_ids),
                    seed=self.seed * 1_000_003 + step * 1009 + gen_batch,
                    **({"return_routed_experts": True} if self.return_routed_experts else {}))


@dataclass(frozen=True)
class Plan:
    # sizes
    total_steps: int
    train_batch_size: int  # prompts per step
    gen_batch_size: int  # prompts per generation batch (DAPO)
    n: int  # responses per prompt
    max_prompt_length: int  # a cap: batches are as wide as their longest prompt
    response_width: int  # a cap: batches are as wide as their longest response
    val_batch_size: Optional[int]
    # generation
    sampling: Sampling
    val_sampling: Sampling
    multi_turn: Optional[dict]  # the agent loop's settings, None = single-turn
    filter_groups: dict
    overlong: dict
    # the three model roles
    actor_update: UpdateSettings
    critic_update: UpdateSettings
    actor_log_prob: ForwardSettings  # old log-probs (rollout.log_prob_*)
    ref_log_prob: ForwardSettings
    critic_values: ForwardSettings
    # the RL math on the driver
    rollout_is: Optional[RolloutIS]
    rejection: Optional[tuple]  # of Rejection: every option's mask applies (verl's comma list); None = off
    bypass: Optional[str]  # verl's rollout_correction bypass mode: None (decoupled) | ppo_clip | reinforce
    is_batch_normalize: bool  # IS weights divided by their batch mean (token or sequence level)
    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: str
    need_ref: bool
    need_critic: bool
    critic_warmup: int
    # schedule
    test_freq: int
    val_before_train: bool
    balance_batch: bool  # verl's trainer.balance_batch: token-balanced DP shards, else contiguous chunks
    save_freq: int
    one_step_off: bool = False  # async_training.mode=one_step_off (trainer.batch_source)
    fully_async: Optional[Any] = None  # async_training.mode=fully_async: trainer.async_rollout.AsyncSettings
    # the estimator's own keywords (GDPO's reward-component weights, CPGD's weighting); GDPO's components
    # are read from the scorer's dict under these keys (``reward_keys``) when the batch is scored
    adv_kwargs: dict = field(default_factory=dict)
    reward_keys: tuple = ()
    rm_scores: Optional[ForwardSettings] = None  # the learned reward model's forward (reward_model.*); None = no RM
    # what the step and the loop read instead of the raw config (trainer.step, trainer.main)
    adca: Optional[dict] = None  # attribution_driven_credit_assignment as plain values when ADCA-GRPO runs, else None
    rollout_only: bool = False  # trainer.debug.rollout_only: generate and score, no training
    train_only: bool = False  # trainer.debug.train_only: replay dumped batches instead of generating
    dump_batch_path: Optional[str] = None  # trainer.debug.dump_batch_path
    parallel_phases: bool = True  # trainer.parallel_phases (null: on CPU only)
    rank_slots: int = 1  # trainer.nnodes * trainer.n_gpus_per_node (perf/throughput's divisor)
    log_val_generations: int = 0  # trainer.log_val_generations

    @classmethod
    def from_config(cls, cfg, *, total_steps: int, stop_token_ids=()) -> "Plan":
        r, al = cfg.actor_rollout_ref.rollout, cfg.algorithm
        mt = multi_turn_settings(cfg)
        turn_tokens = int((mt is not None and r.multi_turn.max_tokens_per_turn) or r.response_length)
        stops = tuple(int(t) for t in stop_token_ids)
        is_, rej = rollout_correction(al)
        if is_ is None and r.calculate_log_probs:  # the sampler's log-probs asked for with IS off: mismatch metrics only
            is_ = RolloutIS(rollout_is_level="token", rollout_is_mode="truncate", rollout_is_threshold=2.0,
                            rollout_is_threshold_lower=None, rollout_is_veto_threshold=None, rollout_is=False)
        return cls(
            total_steps=int(total_steps), train_batch_size=cfg.data.train_batch_size,
            gen_batch_size=cfg.data.gen_batch_size or cfg.data.train_batch_size, n=r.n,
            max_prompt_length=cfg.data.max_prompt_length, response_width=int(r.response_length),
            val_batch_size=cfg.data.val_batch_size,
            sampling=sampling_settings(r, r, r.n, turn_tokens, stops, routes=bool(r.enable_rollout_routing_replay)),
            val_sampling=sampling_settings(r, r.val_kwargs, r.val_kwargs.n, turn_tokens, stops), multi_turn=mt,
            filter_groups=OmegaConf.to_container(al.filter_groups), overlong=overlong_shaping(cfg),
            **role_settings(cfg), rollout_is=is_, rejection=rej, bypass=bypass_loss(al),
            is_batch_normalize=bool(al.rollout_correction.rollout_is_batch_normalize), adv_estimator=al.adv_estimator,
            gamma=al.gamma, lam=al.lam, norm_adv_by_std_in_grpo=al.norm_adv_by_std_in_grpo,
            use_kl_in_reward=bool(al.use_kl_in_reward), kl_penalty=al.kl_penalty, need_ref=need_ref(cfg),
            need_critic=need_critic(cfg), critic_warmup=cfg.trainer.critic_warmup, test_freq=cfg.trainer.test_freq,
            val_before_train=cfg.trainer.val_before_train, balance_batch=bool(cfg.trainer.balance_batch),
            save_freq=cfg.trainer.save_freq,
            one_step_off=cfg.async_training.mode == "one_step_off", fully_async=async_settings(cfg), adv_kwargs=adv_kwargs(al),
            reward_keys=tuple(al.gdpo_reward_keys or ()) if al.adv_estimator == "gdpo" else (),
            rm_scores=rm_forward(cfg), adca=adca_settings(cfg), rollout_only=bool(cfg.trainer.debug.rollout_only),
            train_only=bool(cfg.trainer.debug.train_only), dump_batch_path=cfg.trainer.debug.dump_batch_path,
            parallel_phases=bool(cfg.trainer.device == "cpu" if cfg.trainer.parallel_phases is None
                                 else cfg.trainer.parallel_phases),
            rank_slots=int(cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node),
            log_val_generations=int(cfg.trainer.log_val_generations))

    # ------------------------------------------------------------------ rules
    def on_policy(self, num_samples: int, step: int) -> bool:
        """One epoch of one mini-batch, and nothing before the update reads the old log-probs: the
        update's own forward runs at the start-of-step weights, so its detached log-probs ARE the
        old log-probs and their separate forward is skipped (verl takes the same shortcut).
        Never with ``sum_pi_squared``: the optimal token baseline's advantages are made from the old
        log-probs and ``sum pi^2``, and the update reads the advantages, so both must exist before the
        update's forward runs; the separate old-log-prob pass (which also returns ``sum pi^2``) runs.
        Fully async included: decoupled PPO's proximal policy is the actor at the start of the update,
        which is exactly what the update's one forward runs at (stale samples change the behaviour
        log-probs, the sampler's, not the proximal ones), so the shortcut gives the same numbers."""
        u = self.actor_update
        return (is_on_policy(num_samples=num_samples, mini_batch_size=u.mini_batch_size, epochs=u.epochs)
                and step > self.critic_warmup and self.rejection is None and not self.use_kl_in_reward
                and not self.is_batch_normalize and self.bypass is None and not self.sum_pi_squared)

    def trains_actor(self, step: int) -> bool:
        return step > self.critic_warmup

    def should_eval(self, step: int, last_eval_step: Optional[int]) -> bool:
        """Eval at most once per step boundary: every ``test_freq`` steps and after the last step."""
        return should_eval(step, self.test_freq, self.total_steps, last_eval_step)

    def should_save(self, step: int) -> bool:
        return self.save_freq > 0 and (step % self.save_freq == 0 or step == self.total_steps)

    @property
    def sum_pi_squared(self) -> bool:
        """verl's ``actor.calculate_sum_pi_squared``: the old-log-prob pass returns ``sum pi^2`` and the
        driver reads it (the optimal token baseline, the ``variance_proxy/*`` metrics)."""
        return self.actor_log_prob.with_sum_pi_squared

    def driver_needs_old_log_probs(self) -> bool:
        """The driver computes on the old log-probs only for rollout IS / rejection / KL in reward and
        with ``sum pi^2`` (the optimal token baseline's weights ``1 - 2 pi + sum pi^2``); otherwise they go
        from the actor's ranks to its update by reference."""
        if self.bypass is not None:  # old log-probs are the sampler's; IS / rejection run inside the loss
            return False
        return self.rollout_is is not None or self.rejection is not None or self.use_kl_in_reward or self.sum_pi_squared


def is_on_policy(*, num_samples: int, mini_batch_size: int, epochs: int) -> bool:
    return epochs == 1 and mini_batch_size >= num_samples


def should_eval(step: int, test_freq: int, total_steps: int, last_eval_step: Optional[int]) -> bool:
    if test_freq is None or test_freq <= 0 or step == last_eval_step:
        return False
    return step % test_freq == 0 or step == total_steps


def rollout_correction(al) -> tuple[Optional[RolloutIS], Optional[tuple]]:
    """The rollout-IS settings and rejection options from either spelling: the flat PR #3694 keys
    (``algorithm.rollout_is_threshold`` ...) or verl's newer ``algorithm.rollout_correction`` tree
    (truncated IS at ``rollout_is`` level; ``rollout_rs`` options in the rejection's own units; with
    ``rollout_is`` null the weights are not applied but the mismatch metrics are still computed)."""
    rc = al.rollout_correction
    if rc.rollout_is is not None or rc.rollout_rs is not None:
        upper, lower = parse_is_threshold(rc.rollout_is_threshold)  # "lo_hi": IcePop, the weights outside zeroed
        is_ = RolloutIS(rollout_is_level=rc.rollout_is or "token", rollout_is_mode="truncate" if lower is None else "clip",
                        rollout_is_threshold=upper, rollout_is_threshold_lower=lower,
                        rollout_is_veto_threshold=rc.rollout_token_veto_threshold, rollout_is=rc.rollout_is is not None)
        rej = None
        if rc.rollout_rs is not None:
            th = rc.rollout_rs_threshold
            if th is None and rc.rollout_rs in ("token", "sequence", "geometric"):  # verl 0.6: null = the IS threshold
                th = rc.rollout_is_threshold
            rej = tuple(Rejection(**r) for r in parse_rejection(rc.rollout_rs, th, rc.rollout_rs_threshold_lower))
        return is_, rej
    is_ = None if al.rollout_is_threshold is None else RolloutIS(
        rollout_is_level=al.rollout_is_level, rollout_is_mode=al.rollout_is_mode,
        rollout_is_threshold=al.rollout_is_threshold, rollout_is_threshold_lower=al.rollout_is_threshold_lower,
        rollout_is_veto_threshold=al.rollout_is_veto_threshold, rollout_is=bool(al.rollout_is))
    rej = None if al.rollout_rs is None else (Rejection(divergence=al.rollout_rs_divergence, agg=al.rollout_rs,
                                                        lower=al.rollout_rs_threshold_lower, upper=al.rollout_rs_threshold),)
    return is_, rej


def adv_kwargs(al) -> dict:
    """Keywords only some estimators read (each swallows the others' through ``**kwargs``)."""
    if al.adv_estimator == "gdpo":
        w = al.gdpo_reward_weights
        return {"gdpo_reward_weights": None if w is None else tuple(float(x) for x in w)}
    if al.adv_estimator == "cpgd":
        return {"weight_factor_in_cpgd": str(al.weight_factor_in_cpgd)}
    return {}


def bypass_loss(al) -> Optional[str]:
    """verl's bypass mode (``rollout_correction.bypass_mode``): the old log-probs ARE the sampler's (no
    old-log-prob forward), IS weights and rejection are computed inside the loss from the current
    log-probs against the sampler's; ``ppo_clip`` clips the ratio to the sampler's policy (no extra IS
    weights), ``reinforce`` is the policy gradient ``-w A log pi`` with the truncated IS weights ``w``."""
    rc = al.rollout_correction
    if not rc.bypass_mode:
        return None
    return "reinforce" if (rc.loss_type == "reinforce" or rc.use_policy_gradient) else "ppo_clip"


def rm_forward(cfg) -> Optional[ForwardSettings]:
    """The reward model's forward settings (verl's ``reward_model.micro_batch_size_per_gpu`` /
    ``use_dynamic_bsz`` / ``forward_max_token_len_per_gpu``); None when no reward model is enabled."""
    rm = cfg.reward_model
    if not rm.enable:
        return None
    return ForwardSettings(micro_batch_size=rm.micro_batch_size_per_gpu,
                           max_token_len=int(rm.forward_max_token_len_per_gpu) if rm.use_dynamic_bsz else None,
                           packed=role_packs(rm, rm.model.use_remove_padding), budget_key="reward_model.forward_max_token_len_per_gpu")


@dataclass
class LoopState:
    """What the loop carries between steps; one ``state_dict`` for save and resume."""
    sampler: Any  # trainer.data.dataset.PromptSampler
    kl_ctrl: Any  # trainer.algos.kl controller
    step: int = 0
    next_group_id: int = 0
    last_eval: Optional[int] = None
    run_id: Optional[str] = None
    history: list = field(default_factory=list)

    def state_dict(self, worker_rng: dict | None = None) -> dict:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "rng": capture_rng(), "worker_rng": worker_rng or {}, "next_group_id": self.next_group_id,
                "last_eval": self.last_eval, "mlflow_run_id": self.run_id, "history": self.history}

    def load_state_dict(self, st: dict) -> dict:
        """Restore; returns the workers' RNG states for the role groups."""
        self.sampler.load_state_dict(st["sampler"])
        self.kl_ctrl.load_state_dict(st["kl_ctrl"])
        restore_rng(st["rng"])
        self.step, self.next_group_id, self.last_eval = st["step"], st["next_group_id"], st["last_eval"]
        self.run_id, self.history = st.get("mlflow_run_id"), list(st.get("history", []))
        return st.get("worker_rng", {})


def adca_settings(cfg) -> Optional[dict]:
    """ADCA-GRPO's settings as plain values when it runs, else None. It runs when asked for either way:
    the seed recipes set ``attribution_driven_credit_assignment.enable`` (next to ``adv_estimator=grpo``);
    ``algorithm.adv_estimator=adca_grpo`` says the same."""
    ac = cfg.attribution_driven_credit_assignment
    if not (ac.enable or cfg.algorithm.adv_estimator == "adca_grpo"):
        return None
    return OmegaConf.to_container(ac, resolve=True)


def async_settings(cfg):
    """``async_training.mode=fully_async``: its resolved settings (None in the other modes)."""
    if cfg.async_training.mode != "fully_async":
        return None
    return AsyncSettings.from_config(cfg)


def overlong_shaping(cfg) -> dict:
    """DAPO's soft overlong punishment (DAPO, Yu et al. 2025, sec. 3.4) from verl's two spellings:
    the dapo reward manager's ``reward_model.reward_kwargs.overlong_buffer_cfg`` with
    ``reward_kwargs.max_resp_len`` (verl's main trainer and its DAPO scripts), or the DAPO recipe's
    ``reward_model.overlong_buffer`` (max length = the response budget). Returns ``{enable, len,
    penalty_factor, log, max_resp_len}``; ``max_resp_len`` None means the sampling budget."""
    rm = cfg.reward_model
    kw = OmegaConf.to_container(rm.reward_kwargs, resolve=True) or {}
    ob = kw.get("overlong_buffer_cfg") if rm.reward_manager == "dapo" else None
    out = OmegaConf.to_container(rm.overlong_buffer, resolve=True)
    out["max_resp_len"] = None
    if ob is not None and (ob.get("enable") or not out["enable"]):
        out = {**asdict(OverlongBufferConfig()), **ob, "max_resp_len": kw.get("max_resp_len")}
    return out


def multi_turn_settings(cfg) -> dict | None:
    """The agent loop's settings (``rollout.multi_turn``), or None for single-turn generation; a trajectory's
    tokens are capped by the prompt cap plus the response budget."""
    r = cfg.actor_rollout_ref.rollout
    if not r.multi_turn.enable:
        return None
    width, total = int(r.response_length), cfg.data.max_prompt_length + int(r.response_length)
    return dict(environment=r.multi_turn.environment, max_assistant_turns=r.multi_turn.max_assistant_turns,
                max_user_turns=r.multi_turn.max_user_turns,
                max_tokens_per_trajectory=min(r.multi_turn.max_tokens_per_trajectory or total, total),
                concurrency=r.multi_turn.concurrency, max_response_length=width)


def sampling_settings(r, src, n: int, turn_tokens: int, stops: tuple, routes: bool = False) -> Sampling:
    """Sampling from ``src`` (``rollout`` or its ``val_kwargs``); ``do_sample=false`` or temperature 0 is greedy."""
    greedy = (not src.do_sample) or src.temperature == 0
    return Sampling(n=int(n), temperature=0.0 if greedy else float(src.temperature), top_p=float(src.top_p),
                    top_k=src.top_k if src.top_k and src.top_k > 0 else None, max_new_tokens=turn_tokens,
                    stop_token_ids=stops, seed=int(r.seed), return_routed_experts=routes)


def policy_loss_settings(cfg) -> PolicyLoss:
    """The actor's loss: verl's keys, and each variant's own keywords (a plug-in loss's from ``policy_loss.kwargs``)."""
    a = cfg.actor_rollout_ref.actor
    pl = a.policy_loss
    return PolicyLoss(
        # verl's "bypass_mode" loss name is its rollout_correction.bypass_mode (required by the config check):
        # the worker's bypass branch computes IS / rejection around vanilla PPO (ppo_clip) or gpg (reinforce)
        loss_mode="vanilla" if pl.loss_mode == "bypass_mode" else pl.loss_mode, agg_mode=a.loss_agg_mode,
        norm_constant=float(a.loss_scale_factor if a.loss_scale_factor is not None
                            else cfg.actor_rollout_ref.rollout.response_length),
        clip_ratio=a.clip_ratio, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c, entropy_coeff=float(a.entropy_coeff), use_kl_loss=bool(a.use_kl_loss),
        kl_loss_coef=float(a.kl_loss_coef), kl_loss_type=a.kl_loss_type,
        variant_kwargs=dict(clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub,
                            kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef,
                            tau_pos=float(a.tau_pos), tau_neg=float(a.tau_neg),  # SAPO
                            dro_beta=None if pl.dro_beta is None else float(pl.dro_beta),  # DRO
                            policy_drift_coeff=float(a.policy_drift_coeff),  # CPGD
                            # a plug-in loss's own keywords (the config check keeps them to plug-ins)
                            **OmegaConf.to_container(pl.kwargs, resolve=True)))


def role_packs(role, verl_flag) -> bool:
    """Whether a role's micro-batches are packed rows: a megatron role by its ``megatron.use_remove_padding``
    (Coxswain's key, default true); any other strategy by verl's ``use_remove_padding`` (``verl_flag``: the
    actor's ``actor.use_remove_padding``, which follows ``model.use_remove_padding``; the reference's
    ``model.use_remove_padding``; the critic's and RM's ``model.use_remove_padding``). The strategy still
    decides whether it can pack (``Strategy.packs``)."""
    if role.strategy == "megatron":
        return bool(role.megatron.use_remove_padding)
    return bool(verl_flag)


def _budget(on: bool, n: int) -> int | None:
    """A dynamic batch's token budget per rank (verl's ``use_dynamic_bsz``), or None for fixed micro-batches."""
    return int(n) if on else None


def role_settings(cfg) -> dict:
    """Each role's update and forward settings: ``actor_update``, ``critic_update``, ``actor_log_prob``,
    ``ref_log_prob``, ``critic_values``. Packing is per role (:func:`role_packs`)."""
    a, r, c, ref = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.critic, cfg.actor_rollout_ref.ref
    model = cfg.actor_rollout_ref.model
    packed, c_packed, temp = role_packs(a, a.use_remove_padding), role_packs(c, c.model.use_remove_padding), float(r.temperature)
    return dict(
        actor_update=UpdateSettings(
            mini_batch_size=a.ppo_mini_batch_size * r.n, epochs=a.ppo_epochs, shuffle=a.shuffle,
            micro_batch_size=a.ppo_micro_batch_size_per_gpu, temperature=temp, policy=policy_loss_settings(cfg),
            max_token_len=_budget(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu), packed=packed,
            budget_key="actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
        critic_update=UpdateSettings(
            mini_batch_size=c.ppo_mini_batch_size * r.n, epochs=c.ppo_epochs, shuffle=a.shuffle,
            micro_batch_size=c.ppo_micro_batch_size_per_gpu,
            value=ValueLoss(cliprange_value=c.cliprange_value, agg_mode=c.loss_agg_mode),
            max_token_len=_budget(c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu), packed=c_packed,
            budget_key="critic.ppo_max_token_len_per_gpu"),
        actor_log_prob=ForwardSettings(
            micro_batch_size=r.log_prob_micro_batch_size_per_gpu, packed=packed, temperature=temp,
            max_token_len=_budget(r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu),
            budget_key="actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            with_sum_pi_squared=bool(a.calculate_sum_pi_squared)),
        ref_log_prob=ForwardSettings(
            micro_batch_size=ref.log_prob_micro_batch_size_per_gpu, packed=role_packs(ref, model.use_remove_padding),
            temperature=temp, max_token_len=_budget(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu),
            budget_key="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
        critic_values=ForwardSettings(
            micro_batch_size=c.ppo_micro_batch_size_per_gpu, packed=c_packed,
            max_token_len=_budget(c.use_dynamic_bsz, c.forward_max_token_len_per_gpu),
            budget_key="critic.forward_max_token_len_per_gpu"))
