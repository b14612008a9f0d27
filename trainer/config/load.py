"""Loading a configuration: YAML files, hydra-style ``--config-path/--config-name``, ``key=value``
overrides (verl's legacy keys and aliases included), the resolve step (:func:`resolve`, the one place a
loaded config is normalised), then the checks (:mod:`trainer.config.checks`, which only read); and writing
one back out (``public_container``, ``to_yaml``, ``save_resolved``).

Errors are ``ConfigError`` with a message that names the key(s) at fault and the fix: unknown keys
suggest the closest valid key, wrong types name the key, value and expected type, legacy verl keys name
their replacements.
"""

from __future__ import annotations

import os
import stat
import tempfile
import typing
from typing import List, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf._utils import get_yaml_loader
from omegaconf.errors import OmegaConfBaseException, ValidationError

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

from trainer.config.checks import error_report, megatron_roles, need_critic, validation_errors
from trainer.config.schema import (LEAVES, ConfigError, closest_key, field_type, flatten_keys,
                                   is_schema_key, schema_defaults, type_name)
from trainer.config.secrets import SECRET_KEY, mask_url_credentials, secret_values
from trainer.optimizer_overrides import cpu_note as optimizer_cpu_note, turned_off as optimizer_turned_off
from trainer.transformer_overrides import cpu_note, kernels_turned_off
from trainer.verl_compat import verl_only
from trainer.verl_keys import FSDP_ONLY, MEGATRON

# ----------------------------------------------------------------------------------------------
# key discovery, legacy keys, choices
# ----------------------------------------------------------------------------------------------
LEGACY_KEYS = {
    "actor_rollout_ref.actor.tis_imp_ratio_cap": (
        "was removed with verl's TIS rework: use algorithm.rollout_is_threshold=<cap> "
        "(with algorithm.rollout_is_level=token and algorithm.rollout_is_mode=truncate for the old behaviour; "
        "see also algorithm.rollout_is, rollout_is_threshold_lower, rollout_is_veto_threshold)"
    ),
    "actor_rollout_ref.rollout.tis_imp_ratio_cap": "was removed: use algorithm.rollout_is_threshold=<cap>",
}

# Other spellings of a key that a pasted recipe may use: alias -> canonical key. The loader moves an
# alias's value to its canonical key (both set -> an error naming both).
KEY_ALIASES: dict[str, str] = {
    # verl >= 0.7 moved the weight-sync bucket under checkpoint_engine
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
    # verl >= 0.6's top-level reward_manager section names the same manager
    "reward_manager.name": "reward_model.reward_manager",
    # the ADCA seed (AgentEvolver) reads these at either level: its recommended YAML and its trainer differ
    "attribution_driven_credit_assignment.adca_grpo.skip_type": "attribution_driven_credit_assignment.skip_type",
    "attribution_driven_credit_assignment.enable_adca_metric":
        "attribution_driven_credit_assignment.adca_grpo.enable_adca_metric",
    "attribution_driven_credit_assignment.consistent_scale": "attribution_driven_credit_assignment.adca_grpo.consistent_scale",
    "attribution_driven_credit_assignment.pos_unconsistent_scale":
        "attribution_driven_credit_assignment.adca_grpo.pos_unconsistent_scale",
    "attribution_driven_credit_assignment.neg_unconsistent_scale":
        "attribution_driven_credit_assignment.adca_grpo.neg_unconsistent_scale",
    # verl's FSDP engine config carries the role's Ulysses size inside fsdp_config too
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size": "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "critic.model.fsdp_config.ulysses_sequence_parallel_size": "critic.ulysses_sequence_parallel_size",
    # verl's FSDP actor reads the entropy switches at the role level, its engine config under fsdp_config
    **{f"{r}.{k}": f"{r}.fsdp_config.{k}" for r in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")
       for k in ("entropy_checkpointing", "entropy_from_logits_with_chunking")},
}


# ----------------------------------------------------------------------------------------------
# reading a YAML file, bounded
# ----------------------------------------------------------------------------------------------
# A config file is a few KB; these bounds are orders of magnitude above any real one and far below what
# hurts: an alias bomb ("billion laughs": nine levels of ten aliases each) composes into a few dozen
# nodes, but OmegaConf copies every alias's expansion, so 10^9 nodes would hang the load.
MAX_CONFIG_BYTES = 4 << 20
MAX_CONFIG_NODES = 200_000  # nodes after expanding every alias
MAX_CONFIG_DEPTH = 64  # nesting of mappings and lists
# the top-level sections a Coxswain or verl config may have (a file with none of them is not a config)
KNOWN_SECTIONS = frozenset(k.split(".", 1)[0] for k in (*LEAVES, *MEGATRON, *FSDP_ONLY)) | {"defaults", "hydra"}


def _short(text: str, n: int = 60) -> str:
    """A key or value from a user's file, cut short: an error names it, never echoes a file's content."""
    text = str(text)
    return text if len(text) <= n else text[: n - 3] + "..."


def _yaml_bounds(root: yaml.Node) -> None:
    """Raise ValueError when the composed document nests deeper than MAX_CONFIG_DEPTH, refers to itself
    (an anchor inside its own alias: OmegaConf would recurse until RecursionError), or expands to more
    than MAX_CONFIG_NODES nodes. Sizes are memoised per node, so a bomb is measured without expanding it."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        if depth > MAX_CONFIG_DEPTH:
            raise ValueError(f"nested more than {MAX_CONFIG_DEPTH} levels deep; flatten it")
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ValueError("an anchor is used inside itself (a self-referencing alias); remove that alias")
        open_nodes.add(key)
        if isinstance(node, yaml.MappingNode):
            children = [c for pair in node.value for c in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        total = 1
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_CONFIG_NODES:
                raise ValueError(f"expands to more than {MAX_CONFIG_NODES} values once its aliases are expanded "
                                 f"(an alias bomb?); write the values out or use fewer aliases")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root, 0)


def read_config_file(path: str) -> dict:
    """A ``--config`` file as a plain mapping, or ValueError with a one-line reason that names the file and
    never quotes its content: not a regular file, too large, not UTF-8, not YAML (line and column only),
    over the bounds above, or not a mapping of config sections."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"file '{path}' does not exist") from None
    except OSError as e:
        raise ValueError(f"file '{path}' cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"'{path}' is a directory; give a YAML file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
        raise ValueError(f"'{path}' is not a regular file; give a YAML file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"file '{path}' is {st.st_size} bytes, more than a config's limit of {MAX_CONFIG_BYTES}")
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1).decode("utf-8")
    except PermissionError:
        raise ValueError(f"file '{path}' cannot be read (permission denied)") from None
    except OSError as e:
        raise ValueError(f"file '{path}' cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"file '{path}' is not UTF-8 text, so not a YAML config") from None
    loader = get_yaml_loader()(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return {}
        _yaml_bounds(root)
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as e:  # its str() quotes the offending line: name the place only
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"file '{path}' is not valid YAML{where}: {_short(e.problem or e.context or '', 100)}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"file '{path}' is not valid YAML ({type(e).__name__})") from None
    except RecursionError:  # the composer recurses once per nesting level
        raise ValueError(f"file '{path}': nested more than {MAX_CONFIG_DEPTH} levels deep; flatten it") from None
    except ValueError as e:
        raise ValueError(f"file '{path}': {e}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ValueError(f"file '{path}' is not a config mapping of known keys: its top level is a {type(data).__name__}; "
                         f"a config maps sections (data:, actor_rollout_ref:, trainer:, ...) to their keys")
    if data and not any(isinstance(k, str) and k in KNOWN_SECTIONS for k in data):
        names = ", ".join(repr(_short(k, 30)) for k in list(data)[:3]) + (", ..." if len(data) > 3 else "")
        raise ValueError(f"file '{path}' is not a config mapping of known keys: none of its {len(data)} top-level "
                         f"keys ({names}) is a config section (data, actor_rollout_ref, trainer, ...)")
    return data


class _Load:
    """One load: every problem of every layer (files, hydra composition, command line) is collected and
    reported together; ``notes`` lists the verl keys accepted with no effect."""

    def __init__(self):
        self.cfg = schema_defaults()
        self.default = schema_defaults()
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.set_by: dict[str, tuple[str, str]] = {}  # canonical key -> (origin, spelling) (two spellings in one layer: an error)

    def error(self, origin: str, msg: str) -> None:
        self.errors.append(f"{origin}: {msg}")

    def set(self, key: str, value, origin: str, *, delete: bool = False, from_base: bool = False) -> None:
        """Apply one ``key=value`` (or ``~key``) of a layer, or record why it cannot be applied."""
        key = spelled = key.strip()
        key = KEY_ALIASES.get(key, key)
        prev = self.set_by.get(key)
        if prev is not None and prev[0] == origin and prev[1] != spelled:  # two spellings of one setting in one layer
            self.error(origin, f"'{prev[1]}' and '{spelled}' are the same setting; give only one.")
            return
        if key in LEGACY_KEYS:
            self.error(origin, f"'{key}' {LEGACY_KEYS[key]}")
            return
        if key.split(".", 1)[0] == "hydra" or key.rsplit(".", 1)[-1] == "_target_":
            return  # hydra's own settings (run dirs, job logging) and verl's dataclass hints: nothing to train
        if not is_schema_key(key):
            kind, why = verl_only(key, value)
            if kind == "ok" or (kind == "refused" and delete):
                return
            if kind == "no_effect":
                self.notes.append(f"{key}={value!r}: no effect in Coxswain ({why})")
                return
            if kind == "refused":
                self.error(origin, why)
                return
            guess = closest_key(key)
            self.error(origin, f"unknown config key '{_short(key)}'." + (f" Did you mean '{guess}'?" if guess else "")
                       + " (all keys: python -m trainer.main --help-keys)")
            return
        if delete:
            value = OmegaConf.select(self.default, key, default=None)
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=False)
        elif key in LEAVES and isinstance(value, str) and not value.startswith("${"):
            base = field_type(LEAVES[key])
            if typing.get_origin(base) in (list, List):  # verl's trainer.logger=console: a one-item list
                value = [v.strip() for v in value.split(",") if v.strip()]
        try:
            OmegaConf.update(self.cfg, key, value, merge=isinstance(value, dict))
        except ValidationError:
            expected = type_name(LEAVES[key]) if key in LEAVES else "a value of the schema's type"
            self.error(origin, f"key '{key}' got {_short(repr(value))} ({type(value).__name__}), but expects {expected}.")
            return
        except OmegaConfBaseException as e:
            self.error(origin, f"key '{key}': {_short(str(getattr(e, 'msg', e)), 200)}")
            return
        self.set_by[key] = (origin, spelled)

    def layer(self, node, origin: str, *, from_base: bool = False) -> None:
        for key, value in flatten_keys(node).items():
            self.set(key, value, origin, from_base=from_base)


def _parse_argv(argv: list[str]) -> tuple[list[str], Optional[str], Optional[str], list[str], list[str]]:
    """``[--config FILE]... [--config-path DIR --config-name NAME] overrides...`` -> its parts and errors."""
    files, overrides, errs = [], [], []
    opts = {"--config-path": None, "--config-name": None, "--config-dir": None}
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if name in ("--config", "--config-file", "-c") or name in opts or (name == "-cp" or name == "-cn"):
            name = {"-cp": "--config-path", "-cn": "--config-name"}.get(name, name)
            if not eq:
                if i + 1 >= len(argv):
                    errs.append(f"{a} needs a value")
                    break
                val, i = argv[i + 1], i + 1
            if name in opts:
                opts[name] = val.strip("'\"")
            else:
                files.append(val)
        elif a.startswith("--"):
            errs.append(f"unknown option '{a}': use --config FILE.yaml, --config-path DIR --config-name NAME, "
                        f"and key.sub=value overrides")
        else:
            overrides.append(a)
        i += 1
    path = opts["--config-path"] or opts["--config-dir"]
    return files, path, opts["--config-name"], overrides, errs


# verl's trainer config names: a --config-name that names one of them (with no such file in the
# config path) means verl's defaults, which are this schema's, with every role on that base's strategy
# (verl's ppo_trainer, the default config of verl's main_ppo, trains every role with FSDP)
VERL_BASES = {"ppo_megatron_trainer": "megatron", "ppo_trainer": "fsdp"}
STRATEGY_KEYS = ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy",
                 "reward_model.strategy")


def _base_dir() -> str:
    """A config dir holding verl's base names written from this schema (verl's defaults), each with its
    roles' strategy, so a user's hydra config with ``defaults: [ppo_trainer, _self_]`` (verl's DAPO recipe) or
    ``[ppo_megatron_trainer, _self_]`` composes with no verl checkout."""
    d = tempfile.mkdtemp(prefix="coxswain_base_")
    for name, strategy in VERL_BASES.items():
        base = schema_defaults()
        for key in STRATEGY_KEYS:
            OmegaConf.update(base, key, strategy)
        with open(os.path.join(d, name + ".yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(base))
    return d


def _compose(ld: _Load, path: Optional[str], name: str) -> None:
    """``--config-path/--config-name``: verl's base names mean the schema's defaults; any other config is
    composed with hydra (its ``defaults`` list may name ``ppo_megatron_trainer``) and applied as a layer."""
    origin = f"--config-name={name}"
    stem = name[:-5] if name.endswith(".yaml") else name
    cdir = os.path.abspath(os.path.expanduser(path)) if path else None
    has_file = bool(cdir) and os.path.isfile(os.path.join(cdir, stem + ".yaml"))
    if not has_file and stem in VERL_BASES:
        for key in STRATEGY_KEYS:
            ld.set(key, VERL_BASES[stem], origin, from_base=True)
        return
    if not has_file:
        ld.error(origin, f"no config '{stem}.yaml' in --config-path={path!r}; give the directory that holds it "
                         f"(verl's own names ppo_megatron_trainer / ppo_trainer need no directory).")
        return
    try:  # the same bounds as --config before hydra reads it (hydra's own loader has none)
        read_config_file(os.path.join(cdir, stem + ".yaml"))
    except ValueError as e:
        ld.error(origin, str(e))
        return
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=cdir, version_base=None):
            node = compose(config_name=stem, overrides=[f"hydra.searchpath=[file://{_base_dir()}]"])
    except Exception as e:  # hydra's own errors name the file and the entry
        ld.error(origin, f"cannot compose '{stem}' from {cdir}: {e}")
        return
    finally:
        GlobalHydra.instance().clear()
    ld.layer(node, origin)


def _overrides(ld: _Load, items: list[str]) -> None:
    """Command-line overrides in hydra's grammar (``key=v``, ``+key=v``, ``++key=v``, ``~key``, lists,
    quoted strings, interpolations), each parsed on its own so that one bad item hides no other."""
    parser = OverridesParser.create()
    for item in items:
        try:
            (ov,) = parser.parse_overrides([item])
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            ld.error("command line", f"cannot parse '{item}': {msg}. Use key.sub=value (lists: key=[a,b]).")
            continue
        if ov.is_delete():
            ld.set(ov.key_or_group, None, "command line", delete=True)
            continue
        if ov.is_sweep_override():
            ld.error("command line", f"'{item}' is a hydra sweep (multirun); give one value (a comma list as one value is quoted: key='a,b').")
            continue
        try:
            value = ov.value()
        except Exception as e:
            ld.error("command line", f"cannot parse the value of '{item}': {e}")
            continue
        ld.set(ov.key_or_group, _plain_value(value), "command line")


def _plain_value(v):
    """hydra's parsed values -> plain Python (its lists/dicts are already plain; quoted strings stay str)."""
    if isinstance(v, dict):
        return {k: _plain_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain_value(x) for x in v]
    return v


def parse_overrides(overrides: list[str]) -> DictConfig:
    """``key.sub=value`` strings -> the full config they give on top of the schema's defaults (errors raised)."""
    ld = _Load()
    _overrides(ld, overrides)
    if ld.errors:
        raise ConfigError(error_report(ld.errors))
    return ld.cfg



def resolve(ld: _Load) -> None:
    """The loader's one normalisation, before the checks (which only read): verl's required
    ``actor_rollout_ref.rollout.name`` left unset is reported here and stands in as ``native`` so that every
    other check still runs and reports in the same load (the load fails on the report)."""
    if OmegaConf.is_missing(ld.cfg.actor_rollout_ref.rollout, "name"):
        ld.errors.append("actor_rollout_ref.rollout.name is required (as in verl): native (torch engine, CPU or GPU) "
                         "or sglang (GPU).")
        OmegaConf.update(ld.cfg, "actor_rollout_ref.rollout.name", "native")


LAST_LOAD_NOTES: list[str] = []  # the verl keys the last load accepted with no effect (cli prints them)


def cpu_run_notes(cfg: DictConfig) -> list[str]:
    """The notes a valid CPU run's config gets once, at load: the GPU switches it turns off and the settings
    that do less on gloo (said here once, not by every worker)."""
    notes = []
    off = [k for _, m in megatron_roles(cfg)
           for k in kernels_turned_off(OmegaConf.to_container(m.override_transformer_config, resolve=True))]
    if off:
        notes.append(cpu_note(off))
    off = [k for role in (cfg.actor_rollout_ref.actor, cfg.critic) if role.strategy == "megatron"
           for k in optimizer_turned_off(OmegaConf.to_container(role.optim.override_optimizer_config, resolve=True))]
    if off:
        notes.append(optimizer_cpu_note(off))
    # said here once, not by every worker: megatron_bridge warns per rank (and the workers filter it out)
    sharded = [f"{role}.megatron.use_distributed_optimizer" for role, m in megatron_roles(cfg)
               if role in ("actor_rollout_ref.actor", "critic") and m.get("use_distributed_optimizer")
               and OmegaConf.select(cfg, f"{role}.strategy", default="megatron") == "megatron"
               and (role != "critic" or need_critic(cfg))]
    if sharded:
        notes.append(f"{', '.join(sharded)}=true: the distributed optimizer needs reduce-scatter, which gloo "
                     f"(trainer.device=cpu) lacks, so the plain optimizer runs (same update, state not sharded); "
                     f"set it to false to drop this note; on trainer.device=cuda it applies.")
    return notes


def load_config(argv: Optional[list[str]] = None, *, validate_config: bool = True) -> DictConfig:
    """Build the resolved config from ``[--config FILE.yaml]... [--config-path DIR --config-name NAME]
    key=value ...``. Every problem (unknown keys, types, refused features, cross-field checks) is
    collected and raised together as one ``ConfigError``."""
    files, path, name, overrides, errs = _parse_argv(list(argv or []))
    ld = _Load()
    for e in errs:
        ld.error("command line", e)
    if name:
        _compose(ld, path, name)
        if ld.errors:  # a config that cannot be composed is reported alone, as an unreadable --config file
            raise ConfigError(error_report(ld.errors))
    elif path:
        ld.error("--config-path", "needs --config-name too")
    unreadable = []
    for f in files:
        try:
            data = read_config_file(f)
        except ValueError as e:
            unreadable.append(f"--config: {e}")
            continue
        data.pop("defaults", None)
        try:
            node = OmegaConf.create(data)
        except OmegaConfBaseException as e:  # e.g. a key that is not a string
            unreadable.append(f"--config: file '{f}' cannot be read as a config ({_short(str(getattr(e, 'msg', e)), 100)})")
            continue
        ld.layer(node, f)
    if unreadable:  # reported alone: the "not set" problems that follow from a missing file would only mislead
        raise ConfigError(error_report(ld.errors + unreadable))
    _overrides(ld, overrides)
    LAST_LOAD_NOTES[:] = ld.notes
    if validate_config:
        try:
            resolve(ld)
            ld.errors.extend(validation_errors(ld.cfg))
        except OmegaConfBaseException as e:  # an interpolation that cannot resolve, a missing mandatory value
            ld.errors.append(f"{getattr(e, 'full_key', '') or 'config'}: {getattr(e, 'msg', e)}")
        if not ld.errors:  # every value must resolve, including the ones no check reads
            try:
                OmegaConf.to_container(ld.cfg, resolve=True, throw_on_missing=True)
            except OmegaConfBaseException as e:
                ld.errors.append(f"{getattr(e, 'full_key', '') or 'config'}: {getattr(e, 'msg', e)}")
    if ld.errors:
        raise ConfigError(error_report(ld.errors))
    if validate_config and ld.cfg.trainer.device == "cpu":  # GPU switches a CPU run turns off: one note each
        LAST_LOAD_NOTES.extend(cpu_run_notes(ld.cfg))
    return ld.cfg




def public_container(cfg: DictConfig) -> dict:
    """The resolved config as plain data that is safe to print, write or log: a value taken from the
    environment keeps its interpolation (``${oc.env:NAME}``), not the value (a reloaded config resolves it
    again); a key named like a secret (``api_key``, ``token``, ...) shows ``***``; and a value from the
    environment, or of a secret-looking environment variable, is masked wherever else it appears."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    res = OmegaConf.to_container(cfg, resolve=True)
    hidden = set(secret_values())

    def collect(r, v):  # the resolved values that came from the environment
        if isinstance(v, dict) and isinstance(r, dict):
            for k in v:
                collect(r.get(k), v[k])
        elif isinstance(v, list) and isinstance(r, list):
            for a, b in zip(r, v):
                collect(a, b)
        elif isinstance(r, str) and "oc.env" in r and v not in (None, "") and len(str(v)) >= 4:
            hidden.add(str(v))

    def walk(r, v, key):
        if isinstance(v, dict):
            return {k: walk(r.get(k) if isinstance(r, dict) else None, x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(r[i] if isinstance(r, list) and i < len(r) else None, x, key) for i, x in enumerate(v)]
        if isinstance(r, str) and "oc.env" in r:
            return r
        if SECRET_KEY.search(str(key)) and v not in (None, ""):
            return "***"
        if isinstance(v, str):
            for h in hidden:
                v = v.replace(h, "***")
            v = mask_url_credentials(v)
        return v

    collect(raw, res)
    return walk(raw, res, "")


def to_yaml(cfg: DictConfig) -> str:
    """The config as YAML, resolved, with secrets kept out (:func:`public_container`)."""
    return OmegaConf.to_yaml(OmegaConf.create(public_container(cfg)))


def save_resolved(cfg: DictConfig, run_dir: str) -> str:
    """Write the resolved config to ``run_dir/config.yaml`` atomically; returns the path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(to_yaml(cfg))
    os.replace(tmp, path)
    return path

