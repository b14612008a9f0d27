"""``python -m trainer.rollout.native_server``: the native engine behind SGLang's native HTTP protocol.

A command-line shim (the fleet spawns it); the server is :mod:`trainer.serving.sglang_native` (every
public name re-exported here).
"""

import sys

from trainer.serving.sglang_native import *  # noqa: F401,F403 - the public names, for `from trainer.rollout.native_server import ...`
from trainer.serving.sglang_native import main

if __name__ == "__main__":
    sys.exit(main())
