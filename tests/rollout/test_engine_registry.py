"""The rollout-engine registry (trainer/rollout/registry.py): names and ``pkg.module:Class`` specs resolve to
engine classes or are refused with the fault and the fix; capabilities are read from the class; the config
and the fleet ask capabilities, not names."""

import dataclasses
import subprocess
import sys

import pytest

from tests.rollout.plugin_engine import TinyEngine
from tests.support.tiny import tiny_config
from trainer.config import ConfigError
from trainer.rollout.fleet import Fleet, NativeServers, SGLangServers
from trainer.rollout.native import NativeEngine
from trainer.rollout.registry import ENGINES, Capabilities, capabilities, engine_class, server_adapter
from trainer.rollout.sglang_engine import SGLangEngine
from trainer.sync import choose

PLUGIN = "tests.rollout.plugin_engine:TinyEngine"


class NoResume(NativeEngine):
    """The native engine with one capability taken away: the checks must see the class's own declaration."""

    capabilities = dataclasses.replace(NativeEngine.capabilities, partial_rollout=False)


def test_builtin_names_resolve_to_their_classes_and_capabilities():
    assert sorted(ENGINES) == ["native", "sglang"]
    assert engine_class("native") is NativeEngine and engine_class("sglang") is SGLangEngine
    nat, sg = capabilities("native"), capabilities("sglang")
    assert nat.partial_rollout and nat.routing_replay and nat.compiled_decode and nat.concurrent_generate
    assert set(nat.weight_protocols) == {"shared_memory", "dist_group", "hybrid", "object_store"}
    assert sg.routing_replay and not (sg.partial_rollout or sg.compiled_decode or sg.concurrent_generate)
    assert set(sg.weight_protocols) == {"broadcast", "object_store"}
    assert server_adapter("native") is NativeServers and server_adapter("sglang") is SGLangServers


def test_a_spec_is_answered_from_the_class_it_names():
    assert engine_class(PLUGIN) is TinyEngine
    assert capabilities(PLUGIN) is TinyEngine.capabilities
    assert capabilities(PLUGIN).weight_protocols == ("object_store",) and capabilities(PLUGIN).devices == ("cpu",)
    # a subclass that takes a capability away is read as itself, not as its parent (nor by its name)
    assert capabilities(f"{__name__}:NoResume").partial_rollout is False
    assert capabilities("native").partial_rollout is True


@pytest.mark.parametrize("name, message", [
    ("vllm", r"'vllm' is not a rollout engine: the engines are \['native', 'sglang'\], or your own as 'pkg.module:Class'"),
    ("os:path", r"'os:path' is a module, not a class"),
    ("trainer.rollout.registry:capabilities", r"is a function, not a class"),
    ("no_such_pkg.engines:Fast", r"cannot import 'no_such_pkg.engines:Fast' \(ModuleNotFoundError.*PYTHONPATH"),
    ("tests.rollout.plugin_engine:Missing", r"module 'tests.rollout.plugin_engine' has no 'Missing'"),
    ("trainer.rollout.engine:SamplingParams", r"declares no capabilities.*capabilities = trainer.rollout.registry"),
    ("trainer.rollout.engine:RolloutEngine", r"does not implement abort, generate, update_weights, weights_checksum"),
    ("a:b:c", r"not of the form 'pkg.module:Class'"),
])
def test_a_wrong_name_or_spec_is_refused_with_the_fault(name, message):
    with pytest.raises(ValueError, match=message):
        engine_class(name)


def test_capabilities_refuse_unknown_protocols_and_devices():
    # a protocol name is checked against the registered transports when they are chosen (trainer.sync.choose), so
    # a new transport needs no line in this registry: the capability is accepted, the choice refuses it
    caps = Capabilities(weight_protocols=("carrier_pigeon", "object_store"))
    with pytest.raises(ValueError, match=r"\['carrier_pigeon'\] that no registered transport serves"):
        choose(caps.weight_protocols, "workers", "auto")
    with pytest.raises(ValueError, match="object_store always"):
        Capabilities(weight_protocols=("shared_memory",))
    with pytest.raises(ValueError, match=r"one or more of \('cpu', 'cuda'\)"):
        Capabilities(devices=("tpu",))


def test_an_engine_without_a_server_is_refused_by_the_fleet(tmp_path):
    with pytest.raises(ValueError, match="runs only inside a rollout worker, not as an HTTP server"):
        Fleet(str(tmp_path), backend=PLUGIN, log_dir=str(tmp_path))


def test_importing_the_registry_imports_no_engine():
    code = ("import sys, trainer.rollout.registry as r; "
            "print(sorted(m for m in sys.modules if m.startswith(('trainer.rollout.native', 'trainer.rollout.sglang', "
            "'sglang', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_config_takes_a_spec_and_asks_its_capabilities():
    cfg = tiny_config([f"actor_rollout_ref.rollout.name={PLUGIN}"])
    assert cfg.actor_rollout_ref.rollout.name == PLUGIN
    with pytest.raises(ConfigError, match=r"module 'tests.rollout.plugin_engine' has no 'Nope'"):
        tiny_config(["actor_rollout_ref.rollout.name=tests.rollout.plugin_engine:Nope"])
    with pytest.raises(ConfigError, match=r"'natve' is not one of \['native', 'sglang'\].*Did you mean 'native'"):
        tiny_config(["actor_rollout_ref.rollout.name=natve"])
    # partial rollout is asked of the class: refused for one that does not declare it, whatever its name
    fully = ["trainer.placement=split", "async_training.mode=fully_async", "async_training.require_batches=2",
             "async_training.partial_rollout=true"]
    tiny_config(fully)  # the native engine declares it
    with pytest.raises(ConfigError, match=r"capabilities.partial_rollout.*rollout.name=tests.rollout.test_engine_registry:NoResume"):
        tiny_config(fully + ["actor_rollout_ref.rollout.name=tests.rollout.test_engine_registry:NoResume"])
