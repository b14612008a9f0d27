"""Config: verl keys accepted as written, clear errors, the resolved config written to the run dir."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.support.tiny import TINY_YAML, tiny_config
from trainer.config import ConfigError, all_keys, load_config

ROOT = Path(__file__).resolve().parents[2]

# Every key the foundation issue lists, with a value a verl script would pass.
REQUIRED = [
    "algorithm.rollout_is_threshold=2.0", "algorithm.rollout_is=false", "algorithm.rollout_is_threshold_lower=0.5",
    "algorithm.rollout_is_level=sequence", "algorithm.rollout_is_mode=clip", "algorithm.rollout_is_veto_threshold=1e-5",
    "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.clip_ratio_c=10.0", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "data.gen_batch_size=48", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
    "algorithm.filter_groups.max_num_gen_batches=10", "reward_model.overlong_buffer.enable=true",
    "reward_model.overlong_buffer.len=8", "reward_model.overlong_buffer.penalty_factor=1.0",
    "data.max_response_length=32", "actor_rollout_ref.rollout.calculate_log_probs=true",
    "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false", "algorithm.gamma=0.99",
    "algorithm.lam=0.95", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.002", "algorithm.kl_ctrl.target_kl=0.05", "algorithm.kl_ctrl.horizon=500",
    "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0.001",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", "critic.megatron.pipeline_model_parallel_size=2",
    "trainer.n_gpus_per_node=2",
    "attribution_driven_credit_assignment.enable=true", "attribution_driven_credit_assignment.evaluation_type=api",
    "attribution_driven_credit_assignment.model=qwen-max", "attribution_driven_credit_assignment.concurrent=16",
    "attribution_driven_credit_assignment.api_max_retries=3",
    "attribution_driven_credit_assignment.llm_evaluation_log_dir=/tmp/adca",
    "attribution_driven_credit_assignment.skip_type=skip_all_neg",
    "attribution_driven_credit_assignment.adca_grpo.prm_scheme=allocation",
    "attribution_driven_credit_assignment.adca_grpo.do_batch_norm=true",
    "attribution_driven_credit_assignment.adca_grpo.equal_trajectory_weight=false",
    "attribution_driven_credit_assignment.adca_grpo.fix_base=0.3",
    "attribution_driven_credit_assignment.adca_grpo.alpha=0.2", "attribution_driven_credit_assignment.adca_grpo.beta=1.0",
    "attribution_driven_credit_assignment.adca_grpo.orm_distribution=all_steps",
    "attribution_driven_credit_assignment.adca_grpo.prm_steps=10",
    "attribution_driven_credit_assignment.adca_grpo.enable_adca_metric=true",
    "attribution_driven_credit_assignment.adca_grpo.enable_length_normalization=true",
]


def test_every_required_key_is_accepted_and_typed():
    cfg = tiny_config(REQUIRED)
    for item in REQUIRED:
        key, raw = item.split("=", 1)
        got = OmegaConf.select(cfg, key)
        want = OmegaConf.from_dotlist([f"x={raw}"]).x  # YAML parsing of the raw string, independently
        assert got == want, key
    # numbers arrive as numbers, not strings
    assert isinstance(cfg.algorithm.rollout_is_veto_threshold, float) and cfg.algorithm.rollout_is_veto_threshold == 1e-5
    assert cfg.algorithm.rollout_is is False


def test_null_disables_optional_fields():
    cfg = tiny_config(["algorithm.rollout_is_threshold=null", "algorithm.rollout_is_veto_threshold=null"])
    assert cfg.algorithm.rollout_is_threshold is None and cfg.algorithm.rollout_is_veto_threshold is None


@pytest.mark.parametrize("bad, suggestion", [
    ("algorithm.rollout_is_treshold=2", "algorithm.rollout_is_threshold"),
    ("actor_rollout_ref.actor.clip_ratio_hgh=0.3", "actor_rollout_ref.actor.clip_ratio_high"),
    ("clip_ratio_high=0.3", "actor_rollout_ref.actor.clip_ratio_high"),  # leaf given without its section
    ("data.train_bach_size=4", "data.train_batch_size"),
    ("algorithm.filter_groups.enabled=true", "algorithm.filter_groups.enable"),
])
def test_unknown_key_names_closest(bad, suggestion):
    with pytest.raises(ConfigError) as e:
        tiny_config([bad])
    msg = str(e.value)
    assert bad.split("=")[0] in msg and f"Did you mean '{suggestion}'" in msg


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError) as e:
        tiny_config(["data.train_batch_size=abc"])
    msg = str(e.value)
    assert "data.train_batch_size" in msg and "'abc'" in msg and "int" in msg
    with pytest.raises(ConfigError) as e:
        tiny_config(["algorithm.rollout_is_threshold=high"])
    msg = str(e.value)
    assert "algorithm.rollout_is_threshold" in msg and "'high'" in msg and "float or null" in msg


def test_cross_field_errors_name_every_key():
    with pytest.raises(ConfigError) as e:
        tiny_config(["data.train_batch_size=10", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert "data.train_batch_size=10" in str(e.value) and "ppo_mini_batch_size=4" in str(e.value)

    with pytest.raises(ConfigError) as e:
        tiny_config(["algorithm.rollout_is_threshold=2", "algorithm.rollout_is_threshold_lower=3"])
    assert "algorithm.rollout_is_threshold_lower=3.0" in str(e.value) and "algorithm.rollout_is_threshold=2.0" in str(e.value)

    with pytest.raises(ConfigError) as e:
        tiny_config(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=6"])
    msg = str(e.value)
    for k in ("tensor_model_parallel_size=2", "pipeline_model_parallel_size=2", "trainer.nnodes=1",
              "trainer.n_gpus_per_node=6", "= 6"):
        assert k in msg

    # 8 prompts x 8 responses = 64 over DP 2 = 32 per rank, not divisible by micro 5
    with pytest.raises(ConfigError) as e:
        tiny_config(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"])
    assert "32 responses" in str(e.value) and "ppo_micro_batch_size_per_gpu=5" in str(e.value)


def test_routing_replay_keys():
    """verl's R3 keys: the replaying role and the recording engines need each other; R2, the file
    dumps are refused with the reason; the good pair resolves, with the native engine or SGLang
    (its adapter returns SGLang's captured routes: tests/rollout/test_sglang_routes.py), in workers or as the
    HTTP fleet (rollout.mode=async)."""
    R3 = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
    cfg = tiny_config(R3 + ["actor_rollout_ref.ref.router_replay.mode=R3"])
    assert cfg.actor_rollout_ref.actor.router_replay.mode == "R3" and cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay
    cases = {
        (R3[0],): "enable_rollout_routing_replay=true: add that line",
        (R3[1],): "no role replays them",
        ("actor_rollout_ref.actor.router_replay.mode=R2",): "R2 routing replay",
        ("actor_rollout_ref.actor.router_replay.mode=R4",): "'R4' is not one of",
        (*R3, "actor_rollout_ref.actor.router_replay.record_file=/tmp/r.pt"): "dumping routes to a file is not built",
    }
    assert tiny_config(R3 + ["actor_rollout_ref.rollout.name=sglang"]).actor_rollout_ref.rollout.name == "sglang"
    assert tiny_config(R3 + ["actor_rollout_ref.rollout.mode=async"]).actor_rollout_ref.rollout.mode == "async"
    for overrides, want in cases.items():
        with pytest.raises(ConfigError) as e:
            tiny_config(list(overrides))
        assert want in str(e.value), (overrides, str(e.value))
    # the tiny model is dense: refused before any worker starts; the shipped tiny MoE model is taken
    from trainer.main import check_model, resolve_model_paths

    with pytest.raises(ConfigError, match="is a dense model"):
        check_model(cfg)
    moe = tiny_config(R3 + [f"actor_rollout_ref.model.path={Path(TINY_YAML).parent / 'tiny_moe_model'}"])
    resolve_model_paths(moe)
    check_model(moe)


def test_all_errors_reported_together():
    with pytest.raises(ConfigError) as e:
        tiny_config(["data.train_batch_size=10", "algorithm.rollout_is_threshold=1", "algorithm.rollout_is_threshold_lower=2",
                     "algorithm.rollout_is_level=tokens"])
    msg = str(e.value)
    assert "Did you mean 'token'" in msg and "rollout_is_threshold_lower" in msg


def test_legacy_tis_key_gives_new_keys():
    with pytest.raises(ConfigError) as e:
        tiny_config(["actor_rollout_ref.actor.tis_imp_ratio_cap=2.0"])
    msg = str(e.value)
    assert "algorithm.rollout_is_threshold" in msg and "rollout_is_level" in msg and "rollout_is_mode" in msg


def test_fsdp_keys_point_to_megatron_equivalents():
    with pytest.raises(ConfigError) as e:
        tiny_config(["actor_rollout_ref.actor.fsdp_config.param_offload=true"])
    assert "actor_rollout_ref.actor.megatron" in str(e.value)


def test_yaml_file_and_override_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algorithm:\n  adv_estimator: rloo\n  gamma: 0.9\nactor_rollout_ref:\n  rollout:\n    n: 4\n")
    cfg = tiny_config(["--config", str(f), "algorithm.gamma=0.5"])
    assert cfg.algorithm.adv_estimator == "rloo" and cfg.algorithm.gamma == 0.5 and cfg.actor_rollout_ref.rollout.n == 4
    f.write_text("algorithm:\n  filter_groups:\n    enabel: true\n")
    with pytest.raises(ConfigError) as e:
        tiny_config(["--config", str(f)])
    assert str(f) in str(e.value) and "algorithm.filter_groups.enable" in str(e.value)


def test_plugin_function_names_pass_validation():
    cfg = tiny_config(["algorithm.adv_estimator=mypkg.adv:my_estimator",
                       "actor_rollout_ref.actor.policy_loss.loss_mode=mypkg.loss:f"])
    assert cfg.algorithm.adv_estimator == "mypkg.adv:my_estimator"
    with pytest.raises(ConfigError, match="Did you mean 'grpo'"):
        tiny_config(["algorithm.adv_estimator=grop"])


def test_every_schema_field_has_a_default_and_a_comment():
    import dataclasses
    import inspect

    import trainer.config as C

    classes = [c for c in vars(C).values() if inspect.isclass(c) and dataclasses.is_dataclass(c)]
    n = 0
    for cls in classes:
        src = [ln for c in cls.__mro__ if dataclasses.is_dataclass(c) for ln in inspect.getsource(c).splitlines()]
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
            line = next(ln for ln in src if ln.strip().startswith(f"{f.name}:"))
            assert "  # " in line, f"{cls.__name__}.{f.name} has no comment"
            n += 1
    assert n > 150 and len(all_keys()) > 200


def test_dapo_recipe_overrides_are_accepted(tmp_path):
    """Run the shipped DAPO recipe with python3 shadowed by a shell function that records its argv,
    then feed those exact arguments to the config loader."""
    out = tmp_path / "argv.json"
    script = (f'python3() {{ command python3 -c "import json,sys; json.dump(sys.argv[1:], open(\'{out}\',\'w\'))" "$@"; }}; '
              f"export -f python3; bash {ROOT / 'recipes' / 'run_dapo_qwen2.5_32b.sh'}")
    subprocess.run(["bash", "-c", script], check=True, cwd=tmp_path)
    argv = json.loads(out.read_text())
    assert argv[:2] == ["-m", "trainer.main"]
    cfg = load_config(argv[2:])
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28 and cfg.data.gen_batch_size == 1536
    assert cfg.reward_model.overlong_buffer.len == 4096 and cfg.trainer.nnodes == 16


def test_main_prints_and_writes_resolved_config(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "trainer.main", "--print-config", "--config", TINY_YAML,
                        f"trainer.default_local_dir={run_dir}",
                        "algorithm.gamma=0.97"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "gamma: 0.97" in p.stdout
    again = load_config(["--config", str(run_dir / "config.yaml")])
    assert again.algorithm.gamma == 0.97
    bad = subprocess.run([sys.executable, "-m", "trainer.main", "algorithm.gama=0.9"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "Did you mean 'algorithm.gamma'" in bad.stderr


def test_parallelism_and_offload_not_built_yet_are_refused_together():
    """Keys whose feature is not built are refused at load time, all in one error, never ignored."""
    keys = ["actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=2",
            "critic.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.optimizer_offload=true",
            "actor_rollout_ref.actor.megatron.override_transformer_config.fp8=hybrid",
            "critic.deepspeed_config.zero_stage=3", "async_training.staleness_threshold=0.5"]
    with pytest.raises(ConfigError) as e:
        tiny_config(keys)
    msg = str(e.value)
    for want in ("ref.megatron.virtual_pipeline_model_parallel_size=2 interleaves pipeline stages: it needs "
                 "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size >= 2",
                 "critic.megatron.param_offload=True: offload frees accelerator memory",
                 "optimizer_offload=True: offload frees accelerator memory", "override_transformer_config.fp8='hybrid': FP8",
                 "critic.deepspeed_config.{zero_stage} set, but critic.strategy=megatron",
                 "async_training.staleness_threshold=0.5 applies to async_training.mode=fully_async only"):
        assert want in msg, want
    assert msg.startswith("7 problems"), msg  # the reference follows the actor's transformer overrides: both named
    # offload is a GPU feature: refused on CPU (above), taken on GPU
    gpu = tiny_config(["trainer.device=cuda", "actor_rollout_ref.rollout.name=sglang", "critic.megatron.param_offload=true",
                       "actor_rollout_ref.actor.megatron.optimizer_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true"])
    assert gpu.actor_rollout_ref.actor.megatron.optimizer_offload and gpu.critic.megatron.param_offload
    # expert parallelism and the MoE losses, context parallelism and the interleaved pipeline are built:
    # accepted, CP inside the interleaved pipeline too
    tiny_config(["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01"])
    tiny_config(["actor_rollout_ref.actor.megatron.context_parallel_size=2"])
    tiny_config(["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"])
    tiny_config(["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
                 "actor_rollout_ref.actor.megatron.context_parallel_size=2", "trainer.n_gpus_per_node=4"])
    # sequence parallelism is built: accepted at any TP
    tiny_config(["actor_rollout_ref.actor.megatron.sequence_parallel=true",
                 "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    # recompute, packing and token budgets are built: accepted
    tiny_config(["actor_rollout_ref.model.enable_gradient_checkpointing=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                 "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=selective"])


def test_secrets_stay_out_of_the_printed_and_written_config(tmp_path, monkeypatch):
    """A value interpolated from the environment is printed, written (config.yaml, the MLflow artifact) and
    logged as its interpolation, never its value; a key named like a secret shows ***."""
    from trainer.config import public_container, save_resolved, to_yaml
    from trainer.tracking import flatten, redact

    monkeypatch.setenv("COXSWAIN_TEST_JUDGE", "judge-host-9d2f7")  # not secret-looking by its name
    monkeypatch.setenv("MY_API_KEY", "sk-live-0123456789")
    cfg = tiny_config(["attribution_driven_credit_assignment.base_url=http://${oc.env:COXSWAIN_TEST_JUDGE}:8000/v1",
                       "trainer.experiment_name=run-${oc.env:MY_API_KEY}",
                       "+actor_rollout_ref.rollout.engine_kwargs.api_key=plain-secret-value"])
    assert cfg.attribution_driven_credit_assignment.base_url == "http://judge-host-9d2f7:8000/v1"  # the run sees it
    text = to_yaml(cfg)
    path = save_resolved(cfg, str(tmp_path))
    params = redact(flatten(public_container(cfg)))
    for out in (text, open(path).read(), json.dumps(params)):
        for secret in ("judge-host-9d2f7", "sk-live-0123456789", "plain-secret-value"):
            assert secret not in out, (secret, out[:200])
    assert "${oc.env:COXSWAIN_TEST_JUDGE}" in text and "api_key: '***'" in text
    from trainer.config import load_config

    again = load_config(["--config", path])  # the written file still runs: the interpolation resolves again
    assert again.attribution_driven_credit_assignment.base_url == "http://judge-host-9d2f7:8000/v1"


def test_weight_sync_distributed_group_is_refused_where_it_cannot_run():
    """The group serves engine workers of their own (native or SGLang); elsewhere the key names the fix."""
    base = ["actor_rollout_ref.rollout.weight_sync=distributed_group"]
    tiny_config(base + ["trainer.placement=split"])  # engine workers of their own: fine
    tiny_config(base + ["trainer.placement=split", "actor_rollout_ref.rollout.name=sglang"])  # SGLang's broadcast
    with pytest.raises(ConfigError, match="hybrid engine"):
        tiny_config(base + ["trainer.placement=colocated", "actor_rollout_ref.hybrid_engine=true"])
    with pytest.raises(ConfigError, match="Ray engine workers"):
        tiny_config(base + ["trainer.placement=split", "actor_rollout_ref.rollout.mode=server"])
    with pytest.raises(ConfigError, match="weight_sync"):
        tiny_config(["actor_rollout_ref.rollout.weight_sync=nccl"])


def test_fp32_overlay_sets_every_role_to_float32():
    """recipes/cpu/fp32.yaml promises fp32 for every role: the reward model too (its megatron.dtype does not
    follow the actor's, and its deepspeed_config.dtype falls back to it)."""
    cfg = tiny_config()
    assert {k: OmegaConf.select(cfg, k) for k in (
        "actor_rollout_ref.actor.megatron.dtype", "actor_rollout_ref.ref.megatron.dtype",
        "actor_rollout_ref.rollout.dtype", "critic.megatron.dtype", "reward_model.megatron.dtype")} == dict.fromkeys((
        "actor_rollout_ref.actor.megatron.dtype", "actor_rollout_ref.ref.megatron.dtype",
        "actor_rollout_ref.rollout.dtype", "critic.megatron.dtype", "reward_model.megatron.dtype"), "float32")
    assert cfg.reward_model.deepspeed_config.dtype is None


def _problems(overrides) -> list[str]:
    """The numbered problems of a refused config, without their numbers."""
    with pytest.raises(ConfigError) as e:
        tiny_config(overrides)
    lines = str(e.value).splitlines()
    return [ln.split(". ", 1)[1] for ln in lines[1:]] if len(lines) > 1 else [str(e.value)]


def _ranks(key, v):  # a parallel size out of its declared range (trainer.config.schema.RANGES): a config error, not a division by zero
    return (f"{key}={v} is out of range: allowed [1, 65536] for a number of ranks (1: not split that way); set {key} to "
            f"a value in that range.")


@pytest.mark.parametrize("overrides, expected", [
    (["actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.ref.megatron.param_offload=false"],
     ["actor_rollout_ref.actor.megatron.param_offload=True: offload frees accelerator memory between phases; with "
      "trainer.device=cpu the parameters, gradients and optimizer state already live in host memory, so it would only "
      "copy them back and forth: remove the line (or train on GPUs: trainer.device=cuda)."]),
    (["actor_rollout_ref.actor.router_replay.record_file=/tmp/r"],
     ["actor_rollout_ref.actor.router_replay.record_file=/tmp/r: dumping routes to a file is not built; remove the line."]),
    (["actor_rollout_ref.ref.router_replay.replay_file=/tmp/r"],
     ["actor_rollout_ref.ref.router_replay.replay_file=/tmp/r: replaying routes from a file is not built; remove the line."]),
    (["actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu"],
     ["actor_rollout_ref.rollout.name=vllm: Coxswain's engines are sglang (GPU) and native (CPU or GPU); use "
      "actor_rollout_ref.rollout.name=native."]),
    (["actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda"],
     ["actor_rollout_ref.rollout.name=vllm: Coxswain's engines are sglang (GPU) and native (CPU or GPU); use "
      "actor_rollout_ref.rollout.name=sglang."]),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0", "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"],
     [_ranks("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", 0)]),
    (["critic.megatron.pipeline_model_parallel_size=0", "critic.megatron.context_parallel_size=-1", "algorithm.adv_estimator=gae"],
     [_ranks("critic.megatron.pipeline_model_parallel_size", 0), _ranks("critic.megatron.context_parallel_size", -1)]),
    (["actor_rollout_ref.ref.megatron.expert_model_parallel_size=0", "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=0"],
     [_ranks("actor_rollout_ref.ref.megatron.expert_model_parallel_size", 0),
      _ranks("actor_rollout_ref.ref.megatron.expert_tensor_parallel_size", 0)]),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=0"], [_ranks("actor_rollout_ref.rollout.tensor_model_parallel_size", 0)]),
])
def test_refusals_say_one_thing_once(overrides, expected):
    """Each refusal names the fault and its fix once; a zero parallel size is a config error, not a division by zero."""
    assert _problems(overrides) == expected
