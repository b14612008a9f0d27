"""Issue 39, item 4: every numeric key has a declared range, checked at load (so ``--print-config`` and a
run both refuse it) with one line naming the key, the value, the range and the fix; duplicate loggers,
pipeline functions of the wrong shape, and paths that are not there. Loads only: no Ray, no training."""

import glob
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.support.tiny import TINY_YAML
from trainer.config import ConfigError, CoxswainConfig, load_config
from trainer.config.preflight import check_paths, missing_paths
from trainer.config.schema import KEY_RANGES, LEAVES, numeric_kind

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--config", TINY_YAML]  # the shipped tiny recipe: loads with no error of its own


def _problems(overrides: list[str]) -> list[str]:
    """The numbered problem lines of loading the tiny recipe with ``overrides`` ([] when it loads)."""
    try:
        load_config(BASE + overrides)
    except ConfigError as e:
        return [re.sub(r"^\s*\d+\. ", "", ln) for ln in str(e).splitlines()[1:] if re.match(r"^\s*\d+\. ", ln)]
    return []


def _walk(node, prefix=""):
    """Every leaf ``(dotted key, value)`` of a resolved config (a list is one leaf)."""
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in LEAVES:
            yield from _walk(v, key + ".")
        else:
            yield key, v


def test_every_numeric_leaf_of_the_default_config_has_a_declared_range():
    """Walk the resolved default config: each leaf whose schema type is a number (or a list of numbers) has a
    range, and its default lies in it. A new numeric key without a range in schema.RANGES fails here."""
    default = OmegaConf.to_container(OmegaConf.structured(CoxswainConfig), resolve=True, throw_on_missing=False)
    numeric = [k for k, _ in _walk(default) if k in LEAVES and numeric_kind(LEAVES[k])]
    assert len(numeric) > 150  # the walk reached the whole tree
    missing = [k for k in numeric if k not in KEY_RANGES or KEY_RANGES[k][0] is None]
    assert not missing, f"numeric keys without a declared range (add them to trainer.config.schema.RANGES): {missing}"
    for key, val in _walk(default):
        if key in KEY_RANGES and val is not None:
            rng, kind, is_list = KEY_RANGES[key]
            assert all(rng.admits(v, kind is int) for v in (val if is_list else [val])), (key, val, rng.text())


def _line(key, val, allowed, why, bad="is out of range"):
    return f"{key}={val} {bad}: allowed {allowed} for {why}; set {key} to a value in that range."


LR, TEMP = "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.rollout.temperature"


@pytest.mark.parametrize("override, expected", [
    # the values of the fuzz table, each refused with its one line
    (f"{LR}=-1", _line(LR, -1.0, "[0, inf)", "a learning rate")),
    (f"{LR}=nan", _line(LR, "nan", "[0, inf)", "a learning rate", "is not a finite number")),
    (f"{LR}=inf", _line(LR, "inf", "[0, inf)", "a learning rate", "is not a finite number")),
    (f"{TEMP}=nan", _line(TEMP, "nan", "[0, inf)", "a sampling temperature (0: greedy)", "is not a finite number")),
    (f"{TEMP}=-0.5", _line(TEMP, -0.5, "[0, inf)", "a sampling temperature (0: greedy)")),
    ("actor_rollout_ref.actor.entropy_coeff=inf",
     _line("actor_rollout_ref.actor.entropy_coeff", "inf", "(-inf, inf)", "any finite weight", "is not a finite number")),
    ("actor_rollout_ref.actor.clip_ratio=-0.2",
     _line("actor_rollout_ref.actor.clip_ratio", -0.2, "(0, inf)", "PPO's clip epsilon")),
    ("algorithm.kl_ctrl.kl_coef=-1", _line("algorithm.kl_ctrl.kl_coef", -1.0, "[0, inf)", "a loss / penalty weight (0: off)")),
    ("data.max_prompt_length=0", _line("data.max_prompt_length", 0, "[1, 1048576]", "tokens of one prompt")),
    ("data.max_response_length=99999999999999999999",
     _line("data.max_response_length", 99999999999999999999, "[1, 1048576]", "tokens of one response")),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=5",
     _line("actor_rollout_ref.rollout.gpu_memory_utilization", 5.0, "(0, 1]", "a fraction of the device's memory")),
    ("actor_rollout_ref.rollout.max_num_batched_tokens=0",
     _line("actor_rollout_ref.rollout.max_num_batched_tokens", 0, "[1, 16777216]", "tokens per prefill chunk")),
    ("actor_rollout_ref.rollout.n=100000000",
     _line("actor_rollout_ref.rollout.n", 100000000, "[1, 4096]",
           "responses per prompt; above 4096 one prompt's group alone fills an engine")),
    ("actor_rollout_ref.rollout.top_p=0",
     _line("actor_rollout_ref.rollout.top_p", 0.0, "(0, 1]", "a nucleus probability mass (1: off)")),
    ("actor_rollout_ref.rollout.top_p=1.5",
     _line("actor_rollout_ref.rollout.top_p", 1.5, "(0, 1]", "a nucleus probability mass (1: off)")),
    ("actor_rollout_ref.actor.optim.betas=[0.9,1.0]",
     _line("actor_rollout_ref.actor.optim.betas[1]", 1.0, "[0, 1)", "Adam's moment decay rates (torch.optim.Adam's range)")),
    ("trainer.seed=-3", _line("trainer.seed", -3, "[0, 4294967295]", "a random seed")),
    ("trainer.test_freq=99999999999999999999",  # no bound of its own: an int still fits the int64 numpy / torch hold
     _line("trainer.test_freq", 99999999999999999999, "[-9223372036854775808, 9223372036854775807]", "verl: <= 0 means never")),
])
def test_out_of_range_values_are_refused_with_one_line(override, expected):
    assert _problems([override]) == [expected]


def test_a_follower_key_is_refused_once_at_its_source():
    """rollout.prompt_length follows data.max_prompt_length (verl's interpolation): one line, the source's."""
    assert _problems(["data.max_prompt_length=0"]) == [
        _line("data.max_prompt_length", 0, "[1, 1048576]", "tokens of one prompt")]


@pytest.mark.parametrize("override", [
    "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.top_k=0",  # verl: -1 or 0 = off
    "trainer.test_freq=-1", "trainer.save_freq=-1",  # verl: never
    "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",  # verl: use lr_warmup_steps_ratio
    "actor_rollout_ref.actor.entropy_coeff=-0.001", "actor_rollout_ref.rollout.temperature=0",
    "actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.rollout.gpu_memory_utilization=1",
    "actor_rollout_ref.rollout.n=4096", "data.max_response_length=1048576",
    "algorithm.rollout_is_threshold=null", "data.gen_batch_size=null",
])
def test_verl_meanings_at_the_edges_are_accepted(override):
    assert not [p for p in _problems([override]) if "out of range" in p or "finite" in p]


def _recorded_argv(script: Path, tmp_path: Path) -> list[str]:
    """A recipe script's trainer argv, recorded by shadowing python / python3 with a shell function."""
    out = tmp_path / f"{script.stem}.json"
    rec = f'command python3 -c "import json,sys; json.dump(sys.argv[1:], open(\'{out}\',\'w\'))" "$@"'
    subprocess.run(["bash", "-c", f"python3() {{ {rec}; }}; python() {{ {rec}; }}; export -f python3 python; bash {script}"],
                   check=True, cwd=tmp_path, capture_output=True)
    argv = json.loads(out.read_text())
    assert argv[:2] == ["-m", "trainer.main"]
    return argv[2:]


RECIPES = sorted(glob.glob(str(ROOT / "recipes" / "*.sh")) + glob.glob(str(ROOT / "recipes" / "cpu" / "*.sh")))


@pytest.mark.parametrize("script", RECIPES, ids=[Path(p).name for p in RECIPES])
def test_recipes_load(script, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the scripts cd to the repository root; their relative paths are from there
    load_config(_recorded_argv(Path(script), tmp_path))


VERL_SCRIPTS = sorted(glob.glob(str(ROOT / "tests" / "data" / "verl_scripts" / "*.json")))


@pytest.mark.parametrize("path", VERL_SCRIPTS, ids=[Path(p).stem for p in VERL_SCRIPTS])
def test_verl_scripts_values_are_in_range(path):
    """verl's own scripts (refused or not for features, as test_config_surface says) set no value out of range."""
    args = [a for a in json.loads(Path(path).read_text())["args"] if a != "actor_rollout_ref.rollout.name=vllm"]
    try:
        load_config(args + ["actor_rollout_ref.rollout.name=sglang"])
    except ConfigError as e:
        assert "out of range" not in str(e) and "not a finite number" not in str(e), str(e)


def test_duplicate_loggers_are_refused():
    assert _problems(["trainer.logger=[console,mlflow,mlflow]"]) == [
        "trainer.logger=['console', 'mlflow', 'mlflow'] names ['mlflow'] more than once; list each logger once."]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "w39_user_steps.py").write_text(textwrap.dedent("""
        def pipeline(step):
            pass

        def hook(batch, metrics):
            return None

        def three(a, b, c):
            pass

        class Stepper:
            def __call__(self, step):
                pass

        stepper = Stepper()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "w39_user_steps"


def test_pipeline_and_hooks_of_the_loop_shape_load(user_module):
    assert _problems([f"trainer.pipeline={user_module}:pipeline", f"trainer.hooks.after_rollout=[{user_module}:hook]"]) == []
    assert _problems([f"trainer.pipeline={user_module}:stepper"]) == []


@pytest.mark.parametrize("override, expected", [
    ("trainer.pipeline=os:system",
     "trainer.pipeline='os:system' is a function of Python's standard library ('posix'), not one written for the loop, "
     "which calls it as f(step): name your own function."),
    ("trainer.pipeline=shutil:rmtree",
     "trainer.pipeline='shutil:rmtree' is a function of Python's standard library ('shutil'), not one written for the "
     "loop, which calls it as f(step): name your own function."),
    ("trainer.pipeline=MOD:three",
     "trainer.pipeline='MOD:three' has the signature (a, b, c), but the loop calls it as f(step) (missing a required "
     "argument: 'b'): give it exactly those positional parameters."),
    ("trainer.hooks.after_reward=[MOD:pipeline]",
     "trainer.hooks.after_reward='MOD:pipeline' has the signature (step), but the loop calls it as f(batch, metrics) "
     "(too many positional arguments): give it exactly those positional parameters."),
])
def test_pipeline_and_hooks_of_another_shape_are_refused(user_module, override, expected):
    assert _problems([override.replace("MOD", user_module)]) == [expected.replace("MOD", user_module)]


MISSING = ["data.train_files=/nonexistent/w39/train.parquet", "actor_rollout_ref.model.path=/nonexistent/w39/model",
           "custom_reward_function.path=/nonexistent/w39/score.py"]


def test_missing_paths_are_named_together():
    cfg = load_config(BASE + MISSING)  # the load itself does not look at the disk (login nodes)
    expected = ["actor_rollout_ref.model.path='/nonexistent/w39/model' does not exist on this machine",
                "data.train_files='/nonexistent/w39/train.parquet' does not exist on this machine",
                "custom_reward_function.path='/nonexistent/w39/score.py' does not exist on this machine"]
    assert missing_paths(cfg) == expected
    with pytest.raises(ConfigError) as e:
        check_paths(cfg)
    assert all(line in str(e.value) for line in expected)
    assert missing_paths(load_config(BASE)) == []  # the shipped model is found from the repository root


def _cli(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "trainer.main", *args, f"trainer.default_local_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_print_config_notes_missing_paths_and_a_run_refuses_them(tmp_path):
    """--print-config (a login node) resolves and lists the missing paths as notes; a run stops on them, before
    any worker starts, with rc 2 naming each."""
    p = _cli(["--print-config", "--config", TINY_YAML, *MISSING], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "note: data.train_files='/nonexistent/w39/train.parquet' does not exist on this machine" in p.stderr
    assert "note: custom_reward_function.path='/nonexistent/w39/score.py' does not exist" in p.stderr
    run = _cli(["--config", TINY_YAML, *MISSING], tmp_path)
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "paths the run reads are missing" in out and "/nonexistent/w39/score.py" in out


def test_print_config_refuses_out_of_range(tmp_path):
    p = _cli(["--print-config", "--config", TINY_YAML, "actor_rollout_ref.actor.optim.lr=nan"], tmp_path)
    assert p.returncode == 2 and "actor_rollout_ref.actor.optim.lr=nan is not a finite number" in p.stderr


def test_the_mixed_type_is_threshold_is_finite():
    """algorithm.rollout_correction.rollout_is_threshold is a number or verl's 'lo_hi' string (no numeric type for
    the leaf walk): its parser refuses inf and nan too."""
    base = ["actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_is_threshold=null",
            "algorithm.rollout_correction.rollout_is=token"]
    for bad, shown in (("inf", "inf"), ("nan", "nan"), ("0.5_inf", "'0.5_inf'")):  # hydra reads inf / nan as floats
        assert _problems(base + [f"algorithm.rollout_correction.rollout_is_threshold={bad}"]) == [
            f"algorithm.rollout_correction.rollout_is_threshold={shown}: need finite bounds with 0 < lower <= upper and "
            f"upper > 0."], bad
    assert _problems(base + ["algorithm.rollout_correction.rollout_is_threshold=2.0"]) == []


def test_paths_following_the_shipped_model_are_found_from_any_directory(tmp_path, monkeypatch):
    """The reward model's input_tokenizer follows the actor's relative path, found from the repository root as the
    run finds the model itself (trainer.main.resolve_model_paths): not reported missing from another directory."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(BASE + ["reward_model.enable=true", f"reward_model.model.path={ROOT / 'recipes' / 'cpu' / 'tiny_model'}",
                              "reward_model.micro_batch_size_per_gpu=8"])
    assert str(cfg.reward_model.model.input_tokenizer) == "recipes/cpu/tiny_model"
    assert missing_paths(cfg) == []
