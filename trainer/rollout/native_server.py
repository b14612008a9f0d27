"""``python -m trainer.rollout.native_server``: the native engine behind SGLang's native HTTP protocol.

A command-line alias kept for the commands that name it; the server is :mod:`trainer.serving.sglang_native`
(``python -m trainer.serving.sglang_native``, which the fleet starts). Run as a module, not imported: the
rollout package sits below the servers.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trainer.serving.sglang_native", run_name="__main__", alter_sys=True)
