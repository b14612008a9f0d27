"""Multi-turn environments: name -> class, and ``"pkg.module:Class"`` for your own.

    calculator   arithmetic with a calculator tool (trainer.envs.calculator)
    hanoi        Tower of Hanoi, moves with feedback (trainer.envs.puzzle)
    towers       Tower of Hanoi from any position, terse, with a rule step judge (trainer.envs.towers)

Each shipped module also has ``make_tasks(num, seed, ...)`` to synthesize a dataset of tasks.
"""

from __future__ import annotations

from typing import Callable

from trainer.algos.utils import load_fn
from trainer.envs.base import Environment, StepResult, Tool, ToolCall, ToolEnvironment, parse_tool_calls
from trainer.envs.calculator import CalculatorEnv
from trainer.envs.puzzle import HanoiEnv
from trainer.envs.towers import TowersEnv

ENVIRONMENTS: dict[str, Callable[[], Environment]] = {
    "calculator": CalculatorEnv,
    "hanoi": HanoiEnv,
    "towers": TowersEnv,
}


def env_factory(spec: str | Callable[[], Environment]) -> Callable[[], Environment]:
    """A zero-argument constructor for ``spec``: a name above, ``"pkg.module:Class"``, or a callable."""
    return load_fn(spec, ENVIRONMENTS, "environment")


def task_maker(name: str) -> Callable[..., list[dict]]:
    """``make_tasks(num, seed, ...)`` of a shipped environment."""
    from trainer.envs import calculator, puzzle, towers

    return load_fn(name, {"calculator": calculator.make_tasks, "hanoi": puzzle.make_tasks, "towers": towers.make_tasks},
                   "environment task maker")


__all__ = ["ENVIRONMENTS", "Environment", "StepResult", "Tool", "ToolCall", "ToolEnvironment", "env_factory",
           "parse_tool_calls", "task_maker", "CalculatorEnv", "HanoiEnv", "TowersEnv"]
