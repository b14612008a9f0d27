"""Coxswain's entry point: ``python -m trainer.main [--config FILE.yaml] key.sub=value ...``.

Parses and validates the config (trainer/config.py), prints the resolved config as YAML, writes it to
the run directory, then runs the training loop.
"""

from __future__ import annotations

import sys

from trainer.config import ConfigError, all_keys, load_config, save_resolved, to_yaml


def cli(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help-keys" in argv:
        print("\n".join(all_keys()))
        return 0
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print("All keys: python -m trainer.main --help-keys")
        return 0
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg))
    path = save_resolved(cfg, cfg.trainer.default_local_dir)
    print(f"resolved config written to {path}")
    print("not yet implemented: the training loop lands with the controller issue (see `issues list`).")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
