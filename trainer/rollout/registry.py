"""The rollout engines by name, and what each one can do.

``actor_rollout_ref.rollout.name`` is looked up here: a built-in name (:data:`ENGINES`) or a user's own
engine as ``pkg.module:Class`` (the way a user loss or hook is named). An engine class declares its
:class:`Capabilities` as the class attribute ``capabilities``; the config checks, the cluster and the
fleet ask those (``capabilities(name).partial_rollout``), never the engine's name. So a new engine is
one module (its class, with its capabilities) plus one line in :data:`ENGINES`, or no line at all when
it is named by its ``pkg.module:Class`` spec.

Built-in engines are registered as ``"pkg.module:Class"`` strings and imported on first use, so
importing this module imports no engine (and never sglang); it imports nothing of Coxswain's either,
so the engine interface (:mod:`trainer.rollout.engine`) can take :class:`Capabilities` from here.

What makes a class an engine (checked when it is loaded, so a wrong spec fails at config load):
``capabilities`` is a :class:`Capabilities`, and it has ``from_rollout`` (the constructor the rollout
worker calls; :class:`~trainer.rollout.engine.RolloutEngine` gives one), ``generate``,
``update_weights`` and ``weights_checksum``.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Capabilities:
    """What a rollout engine can do; the defaults are what any engine that follows
    :class:`~trainer.rollout.engine.RolloutEngine` gets without more work."""

    # weight transports it accepts, by the protocol names trainer/sync's transports declare (checked against
    # them when the transports are chosen, so a new transport needs no line here); the object store needs only
    # update_weights, so every engine takes it
    weight_protocols: tuple[str, ...] = ("object_store",)
    partial_rollout: bool = False  # abort keeps the tokens sampled so far, so a response can resume
    routing_replay: bool = False  # SamplingParams.return_routed_experts: MoE experts per token (R3)
    multi_turn: bool = True  # the agent loop drives it (one generate per turn)
    # an adapter-only sync (lora.merge=false) can reach it: hf_views() gives its weights by HF name, which
    # trainer.rollout.adapters.AdapterEngine merges the adapters into (through update_weights)
    lora_adapters: bool = False
    devices: tuple[str, ...] = ("cpu",)  # trainer.device values it runs on
    # how it runs as an HTTP server in the fleet (rollout.mode=server / async): "pkg.module:Class" of its
    # server adapter (trainer.rollout.fleet has the built-in ones), None when it runs only in a worker
    server: str | None = None
    # trainer.compile=true compiles its decode step (engine kwargs compile_decode, compile_options,
    # decode_gemm: the native engine's)
    compiled_decode: bool = False
    # a second generate call may join a running one (streaming admission): the rollout then keeps two in flight
    concurrent_generate: bool = False

    def __post_init__(self):
        if "object_store" not in self.weight_protocols:
            raise ValueError(f"Capabilities.weight_protocols={self.weight_protocols}: object_store always (the "
                             "transport every engine takes)")
        if not self.devices or any(d not in DEVICES for d in self.devices):
            raise ValueError(f"Capabilities.devices={self.devices}: one or more of {DEVICES}")


ENGINES: dict[str, str] = {
    "native": "trainer.rollout.native:NativeEngine",  # torch, CPU or GPU (the reference)
    "sglang": "trainer.rollout.sglang_engine:SGLangEngine",  # sglang.Engine; GPU, or SGLang's CPU path
}

KEY = "actor_rollout_ref.rollout.name"
_ENGINE_METHODS = ("from_rollout", "generate", "update_weights", "weights_checksum")


def load_spec(spec: str, key: str):
    """``pkg.module:Name`` -> the object; a ``ValueError`` naming ``key``, the fault and the fix otherwise."""
    mod_name, _, attr = spec.partition(":")
    if spec.count(":") != 1 or not mod_name or not attr:
        raise ValueError(f"{key}: '{spec}' is not of the form 'pkg.module:Class'.")
    try:
        return pkgutil.resolve_name(spec)  # imports pkg.module, then takes Name from it
    except AttributeError:
        raise ValueError(f"{key}: module '{mod_name}' has no '{attr}'.") from None
    except Exception as e:  # noqa: BLE001 - a user module that fails to import, for any reason
        raise ValueError(f"{key}: cannot import '{spec}' ({type(e).__name__}: {e}); the module must be importable "
                         f"from the driver's working directory or PYTHONPATH (and the rollout workers').") from None


def engine_class(name: str) -> type:
    """The engine class ``rollout.name`` names: a key of :data:`ENGINES`, or a user's ``pkg.module:Class``.
    A ``ValueError`` says what is wrong (unknown name: the names there are; a spec that does not import or
    is not an engine class: why, and what an engine class needs)."""
    if ":" not in str(name):
        if name not in ENGINES:
            raise ValueError(f"{KEY}='{name}' is not a rollout engine: the engines are {sorted(ENGINES)}, or your own "
                             f"as 'pkg.module:Class'.")
        return load_spec(ENGINES[name], f"{KEY}={name}")
    cls = load_spec(name, KEY)
    if not isinstance(cls, type):
        raise ValueError(f"{KEY}: '{name}' is a {type(cls).__name__}, not a class; name the engine class "
                         f"(a subclass of trainer.rollout.engine.RolloutEngine).")
    if not isinstance(getattr(cls, "capabilities", None), Capabilities):
        raise ValueError(f"{KEY}: class '{name}' declares no capabilities; an engine class sets the class "
                         f"attribute capabilities = trainer.rollout.registry.Capabilities(...).")
    missing = [m for m in _ENGINE_METHODS if not callable(getattr(cls, m, None))]
    missing += sorted(getattr(cls, "__abstractmethods__", ()))  # declared by the interface, not implemented
    if missing:
        raise ValueError(f"{KEY}: class '{name}' is not a rollout engine: it does not implement {', '.join(missing)} "
                         f"(subclass trainer.rollout.engine.RolloutEngine and implement them).")
    return cls


def capabilities(name: str) -> Capabilities:
    """What the engine ``name`` (as :func:`engine_class` takes it) declares it can do."""
    return engine_class(name).capabilities


def server_adapter(name: str) -> type:
    """The class that runs engine ``name`` as the fleet's HTTP servers (its ``capabilities.server``)."""
    spec = capabilities(name).server
    if spec is None:
        raise ValueError(f"{KEY}={name} runs only inside a rollout worker, not as an HTTP server: use "
                         f"actor_rollout_ref.rollout.mode=sync, or an engine that serves (native, sglang).")
    return load_spec(spec, f"{KEY}={name}: capabilities.server")
