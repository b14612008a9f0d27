"""``python -m trainer.serve``: the OpenAI-compatible server over the native engine.

A command-line shim; the server is :mod:`trainer.serving.openai` (every public name re-exported here).
"""

import sys

from trainer.serving.openai import *  # noqa: F401,F403 - the public names, for `from trainer.serve import ...`
from trainer.serving.openai import main

if __name__ == "__main__":
    sys.exit(main())
