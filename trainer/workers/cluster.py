"""The controller's view of the hardware: the typed role groups (``actor``, ``ref``, ``critic``:
:mod:`trainer.workers.roles`) and the ``rollout`` (:mod:`trainer.workers.rollouts`), placed on a Ray
cluster (or in the driver process for debugging), and the ``transport`` of the step's data plane.

Ray: ``ray.init()`` with no address starts an embedded local cluster (the default); ``RAY_ADDRESS``
joins an existing one. On CPU every rank is one CPU slot; Ray's logical CPU count is raised to the
number of slots the layout needs, since CPU "devices" may be shared (colocated mode does exactly that).

On a joined cluster with ``trainer.nnodes`` > 1 the ranks are laid out node by node
(:class:`trainer.workers.group.Placement`): ``n_gpus_per_node`` consecutive ranks per node, so a
tensor-parallel group stays on one node (its size must divide ``n_gpus_per_node``), data parallelism
spans the nodes, and each colocated engine shares its actor rank's slot. Where every worker landed
is written to ``<run dir>/placement.json`` (each rank's Ray node id and IP as the worker reports it, its
mesh coordinates, the driver's node).
"""

from __future__ import annotations

import os

from trainer.config.preflight import check_node_layout
from trainer.lora import lora_settings
from trainer.plan import need_critic, need_ref
from trainer.rollout.registry import capabilities
from trainer.net import free_port
from trainer.sync import choose
from trainer.workers.dataplane import Transport
from trainer.workers.group import Placement, WorkerGroup, embedded_ray, embedded_ray_kept, init_ray
from trainer.workers.hybrid_worker import HybridWorker
from trainer.workers.roles import ActorGroup, ActorReference, CriticGroup, RefGroup, RewardModelGroup
from trainer.workers.rollout_worker import RolloutWorker
from trainer.workers.rollouts import EngineRollout, FleetRollout, HybridRollout
from trainer.workers.train_worker import TrainWorker


def _plain(d) -> dict:
    """A config mapping as plain Python containers (nested ones too), for the engines' kwargs."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(d, resolve=True) if isinstance(d, DictConfig) else dict(d)


def compiled_engine_kwargs(engine_kwargs: dict, *, name: str, device: str, model_path: str) -> dict:
    """``trainer.compile=true`` for a rollout engine: the native engine's compiled decode step, launched from
    inductor's C++ wrapper with its matmuls on the C++ GEMM template on CPU (each setting only where
    ``engine_kwargs`` does not name it: the user's own choice wins). Engines without a compiled decode step
    (``capabilities.compiled_decode``: SGLang's) and MoE models (whose decode cannot compile) keep their kwargs."""
    from trainer.hf_io import ArchConfig

    if not capabilities(name).compiled_decode or ArchConfig.from_pretrained(model_path).is_moe:
        return engine_kwargs
    out = dict(engine_kwargs)
    out.setdefault("compile_decode", True)
    if device == "cpu" and out["compile_decode"]:
        out["compile_options"] = {"cpp_wrapper": True, **(out.get("compile_options") or {})}
        out.setdefault("decode_gemm", "cpp")
    return out


def bridge_optim(o, *, clip_grad, total_steps: int, use_dist: bool) -> dict:
    """verl's optimizer keys -> megatron_bridge's: a negative ``lr_warmup_steps`` means "use the ratio", and a
    non-positive ``total_training_steps`` means the run's own step count (verl injects it the same way)."""
    horizon = o.total_training_steps if o.total_training_steps and o.total_training_steps > 0 else total_steps
    warm = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * horizon)
    return dict(optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
                adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=clip_grad, lr_schedule=o.lr_decay_style,
                lr_warmup_steps=warm, lr_warmup_init=o.lr_warmup_init,
                lr_decay_steps=o.lr_decay_steps if o.lr_decay_steps is not None else horizon,
                use_distributed_optimizer=use_dist,
                # megatron-core OptimizerConfig fields (strategy=megatron only; refused elsewhere at load)
                overrides=_plain(o.override_optimizer_config or {}))


class Cluster:
    """Every role group and the rollout, placed: built in named steps (the Ray cluster and its slots, the
    engines' settings, the trained and forward-only roles, the rollout with its weight transports)."""

    def __init__(self, cfg, total_steps: int):
        check_node_layout(cfg)
        t, r = cfg.trainer, cfg.actor_rollout_ref.rollout
        self.world = world = t.nnodes * t.n_gpus_per_node
        self.in_process = t.debug.in_process
        self.colocated = t.placement == "colocated"
        self.device = t.device
        self._compile = t.compile
        # rollout engines: 0 = one per device of a colocated placement (as verl's hybrid engine: world / rollout TP;
        # on CPU one per slot, so generation uses every core at one thread each), 1 in split placement
        self.num_engines = r.num_engines or (max(1, world // max(1, r.tensor_model_parallel_size))
                                             if self.colocated else 1)
        self.placement, self.owns_ray = self._start_ray(t)
        self.rendezvous: dict[str, str] = {}
        self.transport = Transport(self.in_process)
        rkw = self._engine_kwargs(cfg)
        # hybrid engine (verl's): each actor rank hosts its colocated engine, so a sync is a local copy
        self.hybrid = (cfg.actor_rollout_ref.hybrid_engine and self.colocated and r.mode == "sync"
                       and "hybrid" in capabilities(r.name).weight_protocols and self.num_engines == world)
        self._build_roles(cfg, total_steps, rkw)
        self.rollout = self._build_rollout(cfg, rkw)
        if self.placement is not None:
            self.write_placement(os.path.join(cfg.trainer.default_local_dir, "placement.json"))

    # ------------------------------------------------------------------ set-up steps
    def _start_ray(self, t) -> tuple[Placement | None, bool]:
        """The Ray cluster (embedded, or joined through ``RAY_ADDRESS``) and the placement of its slots; none in
        process. Returns ``(placement, owns_ray)``."""
        world = self.world
        if self.in_process:
            if world != 1:
                raise ValueError(f"trainer.debug.in_process=true runs every worker inside the driver, which holds one "
                                 f"rank: set trainer.nnodes=1 trainer.n_gpus_per_node=1 (got a world of {world}).")
            return None, False
        use_gpu = t.device == "cuda"
        n_slots = world + (0 if self.colocated else self.num_engines)
        # an embedded cluster lives as long as this Cluster (a later one may need other resources)
        # ours: an embedded cluster started now, or one an earlier run in this process kept (keep_embedded_ray)
        owns_ray = init_ray(num_cpus=None if use_gpu else max(os.cpu_count() or 1, n_slots)) or embedded_ray()
        # an embedded cluster is one node, whatever trainer.nnodes says; a joined one is laid out node by node
        return Placement(n_slots, use_gpu, nnodes=1 if owns_ray else t.nnodes, per_node=t.n_gpus_per_node,
                         joined=not owns_ray), owns_ray

    def _threads(self, k: int) -> int:
        """CPU threads for each of ``k`` ranks. A local CPU cluster runs one phase at a time (sync mode): the
        megatron ranks share the node's cores while they train; elsewhere each rank has its own device."""
        local_cpu = self.device != "cuda" and not self.in_process and not os.environ.get("RAY_ADDRESS")
        if not local_cpu:
            return 1
        n_cpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, n_cpu // max(1, k))

    def _rendezvous(self, name: str) -> tuple[str, int]:
        """A torch.distributed rendezvous for group ``name``, on its rank 0's node."""
        addr, port = self.placement.rendezvous() if self.placement is not None else ("127.0.0.1", free_port())
        self.rendezvous[name] = f"{addr}:{port}"
        return addr, port

    def _rollout_bundle(self, i: int) -> int:
        """Engine ``i``'s slot: its actor rank's (colocated) or one of its own after the actor's (split)."""
        return i if self.colocated else self.world + i

    def _group(self, kind, name: str, cls, kws: list[dict]):
        return kind(WorkerGroup(name, cls, kws, in_process=self.in_process, placement=self.placement, share=0.25),
                    self.transport)

    def _role_group(self, kind, name: str, rcfg, role: str, optim: dict | None, path: str, *, rollout: dict | None = None,
                    checkpointing: bool = False, routing_replay: bool = False, hf_overrides=None,
                    lora: dict | None = None):
        """A role on its section's strategy (``rcfg.strategy``: a registered name or ``pkg.module:Class``) over all
        ``world`` ranks. The driver hands every strategy the same things (its role's config section, the optimizer,
        the launch settings, the rendezvous) and the strategy reads its own keys in the worker
        (``Strategy.from_section``). ``rollout``: the engine settings of a hybrid rank, which hosts its engine."""
        addr, port = self._rendezvous(name)
        common = dict(role=role, world_size=self.world, master_addr=addr, master_port=port, model_path=path,
                      strategy=rcfg.strategy, section=_plain(rcfg), num_threads=self._threads(self.world),
                      launch=dict(optim=optim, checkpointing=bool(checkpointing), routing_replay=bool(routing_replay),
                                  compile=bool(self._compile)),
                      **({"rollout": rollout} if rollout is not None else {}),
                      # verl's model.override_config; given only when set, so a strategy that has no such keyword
                      # (a user's) still starts without it
                      **({"hf_overrides": _plain(hf_overrides)} if hf_overrides else {}),
                      # LoRA settings (trainer.lora), the same way: only where on (the checks allow it on megatron only)
                      **({"lora": lora} if lora else {}))
        cls = HybridWorker if rollout is not None else TrainWorker
        return self._group(kind, name, cls, [dict(common, rank=i) for i in range(self.world)])

    def _engine_kwargs(self, cfg) -> dict:
        """Every rollout engine's settings (the same for each engine)."""
        r, t = cfg.actor_rollout_ref.rollout, cfg.trainer
        model_path, lora = cfg.actor_rollout_ref.model.path, lora_settings(cfg)
        return dict(model_path=model_path, name=r.name, max_batch_size=r.max_num_seqs,
                    max_seq_len=r.prompt_length + r.response_length,  # the engines' context: prompt cap + response budget
                    dtype=r.dtype, num_threads=1,  # one thread per process: 2-core CPUs thrash when oversubscribed
                    generate_threads=r.generate_threads or 1,
                    engine_kwargs=compiled_engine_kwargs(_plain(r.engine_kwargs), name=r.name, device=t.device,
                                                         model_path=model_path) if t.compile else _plain(r.engine_kwargs),
                    tokenizer_path=cfg.actor_rollout_ref.model.tokenizer_path or model_path,
                    settings=dict(**({"hf_overrides": _plain(cfg.actor_rollout_ref.model.override_config)}
                                     if cfg.actor_rollout_ref.model.override_config else {}),
                                  device=t.device,  # the engines run where the trainer does
                                  **({"enable_rollout_routing_replay": True} if r.enable_rollout_routing_replay else {}),
                                  tensor_model_parallel_size=r.tensor_model_parallel_size,
                                  gpu_memory_utilization=r.gpu_memory_utilization, seed=r.seed,
                                  max_num_batched_tokens=r.max_num_batched_tokens,
                                  enable_chunked_prefill=r.enable_chunked_prefill, enforce_eager=r.enforce_eager),
                    # lora.merge=false: the syncs move the adapters, which each engine merges (trainer.rollout.adapters)
                    **({"adapters": {"scale": lora.scale}} if lora is not None and not lora.merge else {}))

    def _build_roles(self, cfg, total_steps: int, rkw: dict) -> None:
        """The actor (hosting the engines when hybrid), and the reference, critic and reward model where run."""
        a, model_path = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model.path
        clip = a.grad_clip if a.grad_clip is not None else a.optim.clip_grad
        actor_optim = bridge_optim(a.optim, clip_grad=clip, total_steps=total_steps,
                                   use_dist=a.megatron.use_distributed_optimizer)
        lora = lora_settings(cfg)
        self.actor = self._role_group(ActorGroup, "actor", a, "actor", actor_optim, model_path,
                                      rollout=rkw if self.hybrid else None,
                                      checkpointing=cfg.actor_rollout_ref.model.enable_gradient_checkpointing,
                                      routing_replay=a.router_replay.mode == "R3",
                                      hf_overrides=cfg.actor_rollout_ref.model.override_config,
                                      lora=lora.as_dict() if lora else None)
        self.ref = self.critic = self.reward_model = None
        if need_ref(cfg) and lora is not None:
            # the reference is the actor's base weights, which LoRA leaves frozen: its own ranks compute it with the
            # adapters off (verl's LoRA reference), and no second copy of the model is started
            self.ref = ActorReference(self.actor.group, self.transport)
        elif need_ref(cfg):
            rf = cfg.actor_rollout_ref.ref
            self.ref = self._role_group(RefGroup, "ref", rf, "ref", None, model_path,
                                        routing_replay=rf.router_replay.mode == "R3",
                                        hf_overrides=cfg.actor_rollout_ref.model.override_config)
        if need_critic(cfg):
            c = cfg.critic
            c_optim = bridge_optim(c.optim, clip_grad=c.optim.clip_grad, total_steps=total_steps,
                                   use_dist=c.megatron.use_distributed_optimizer)
            self.critic = self._role_group(CriticGroup, "critic", c, "critic", c_optim, c.model.path or model_path,
                                           checkpointing=c.model.enable_gradient_checkpointing,
                                           hf_overrides=c.model.override_config)
        if cfg.reward_model.enable:  # forward-only, like the reference (trainer/rewards/reward_model.py)
            rm = cfg.reward_model
            self.reward_model = self._role_group(RewardModelGroup, "reward_model", rm, "reward", None, rm.model.path,
                                                 hf_overrides=rm.model.override_config)

    def _build_rollout(self, cfg, rkw: dict):
        """The rollout (HTTP fleet, hybrid engine or engine workers) with its weight transports, chosen once from
        what the engine accepts, where it runs and ``rollout.weight_sync``."""
        r, n_eng = cfg.actor_rollout_ref.rollout, self.num_engines
        bucket = r.update_weights_bucket_megabytes << 20
        free = self.colocated and r.free_cache_engine  # colocated engines give their memory back while the trainer runs
        server = r.mode in ("server", "async")
        transports = choose(capabilities(r.name).weight_protocols,
                            "server" if server else "hybrid" if self.hybrid else "workers", r.weight_sync)
        if server:  # verl's async mode: HTTP engine servers behind sglang-router, outside Ray
            # on a joined cluster each server runs on its slot's node (a host actor there); embedded: local processes
            hosts = ([self.placement.options(self._rollout_bundle(i), 0.25) for i in range(n_eng)]
                     if self.placement is not None and not self.owns_ray else None)
            return FleetRollout(rkw["model_path"], num_servers=n_eng, threads_per_server=rkw["generate_threads"],
                                max_batch_size=r.max_num_seqs, max_seq_len=rkw["max_seq_len"], dtype=r.dtype,
                                tokenizer_path=rkw["tokenizer_path"], bucket_bytes=bucket,
                                log_dir=os.path.join(cfg.trainer.default_local_dir, "fleet_logs"), hosts=hosts,
                                backend=r.name, device=cfg.trainer.device, transports=transports,
                                routed_experts=bool(r.enable_rollout_routing_replay))
        if self.hybrid:
            return HybridRollout(self.actor, free_cache=free, bucket_bytes=bucket, engine_dtype=r.dtype,
                                 transports=transports, adapters="adapters" in rkw)
        streams = 2 if capabilities(r.name).concurrent_generate else 1  # a call joins the engine's running loop
        return EngineRollout(
            WorkerGroup("rollout", RolloutWorker, [rkw] * n_eng, in_process=self.in_process, placement=self.placement,
                        bundle_of=self._rollout_bundle, share=0.25, max_concurrency=streams + 1),
            free_cache=free, bucket_bytes=bucket, engine_dtype=r.dtype, concurrent_calls=streams,
            transports=transports, adapters="adapters" in rkw)

    # ------------------------------------------------------------------ views
    def _own_ref(self):
        """The reference group where it has ranks of its own (not the actor's: ``ActorReference``)."""
        return self.ref if self.ref is not None and not self.ref.shares_actor else None

    def groups(self) -> dict:
        """The Ray worker groups by name (a hybrid rollout lives in the actor's processes; so does a reference
        computed by the actor's ranks)."""
        out = {n: g.group for n, g in (("actor", self.actor), ("ref", self._own_ref()), ("critic", self.critic),
                                       ("reward_model", self.reward_model)) if g is not None}
        if isinstance(self.rollout, EngineRollout):
            out["rollout"] = self.rollout.group
        return out

    def fleet_servers(self) -> list[dict]:
        """Where each HTTP rollout server runs (server mode on a joined cluster)."""
        from trainer.rollout.fleet import RemoteProc

        if not isinstance(self.rollout, FleetRollout):
            return []
        return [{"server": s.index, "url": s.url, "node_id": s.proc.node_id, "ip": s.proc.node_ip}
                if isinstance(s.proc, RemoteProc) else {"server": s.index, "url": s.url, "node_id": None, "ip": "local"}
                for s in self.rollout.fleet.servers]

    def placement_map(self) -> dict:
        """Where every rank runs, as its worker reports it: ``{"driver": {...}, "groups": {name: [{"rank",
        "node_id", "ip", mesh coordinates...}]}}``; ``hybrid_rollout``: the engines are in the actor's ranks."""
        import ray

        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        head = next((n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n.get("Resources", {})), None)
        here = ray.get_runtime_context().get_node_id()
        groups = {}
        for name, g in self.groups().items():
            layouts = getattr({"actor": self.actor, "ref": self.ref, "critic": self.critic,
                               "reward_model": self.reward_model}.get(name), "layouts", None) or [{}] * g.size
            groups[name] = [{"rank": r, "node_id": nid, "ip": ips.get(nid, "?"),
                             **{k: v for k, v in lay.items() if k != "rank"}}
                            for r, (nid, lay) in enumerate(zip(g.where(), layouts))]
        return {"nnodes": self.placement.nnodes, "per_node": self.placement.per_node,
                "driver": {"node_id": here, "ip": ips.get(here, "?"), "is_head": here == head},
                "head_node_id": head, "rendezvous": dict(self.rendezvous), "hybrid_rollout": self.hybrid,
                "groups": groups, "fleet": self.fleet_servers()}

    def write_placement(self, path: str) -> None:
        import json

        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.placement_map(), f, indent=1)

    def trained(self) -> dict:
        """The groups whose weights a checkpoint holds, by name."""
        return {n: g for n, g in (("actor", self.actor), ("critic", self.critic)) if g is not None}

    def rng_states(self) -> dict:
        """Every worker's RNG state, per group and rank (for exact resume)."""
        return {n: g.rng_state() for n, g in {**self.trained(), "ref": self._own_ref()}.items() if g is not None}

    def set_rng_states(self, states: dict) -> None:
        for n, g in {**self.trained(), "ref": self._own_ref()}.items():
            if g is not None and n in states:
                g.set_rng_state(states[n])

    def save(self, ckpt_dir: str) -> None:
        for n, g in self.trained().items():
            g.save(os.path.join(ckpt_dir, n))

    def load(self, ckpt_dir: str) -> None:
        for n, g in self.trained().items():
            g.load(os.path.join(ckpt_dir, n))

    def shutdown(self) -> None:
        for g in (self.rollout, self.reward_model, self.ref, self.critic, self.actor):
            if g is not None:
                g.shutdown()
        if self.placement is not None:
            self.placement.remove()
        if self.owns_ray and not embedded_ray_kept():
            import ray

            ray.shutdown()
