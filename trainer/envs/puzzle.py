"""Tower of Hanoi: a multi-step puzzle with a verifiable end.

State: three pegs A, B, C; ``discs`` discs (1 = smallest) start on A, largest at the bottom. Goal:
all discs on C. A move ``X->Y`` takes the top disc of peg X onto peg Y; it is legal when X is not empty
and Y is empty or its top disc is larger. The optimum takes ``2**discs - 1`` moves (Lucas 1883).

Each assistant message may hold one or more moves, written ``A->C`` (``A -> C``, ``A->>C`` also
parse); they are applied in order until one is illegal. The environment answers with what happened and
the pegs, e.g. ``"Moved disc 1 from A to C. Pegs: A=[3, 2] B=[] C=[1]"``. A message without a move is
answered with the move syntax. Every move tried (illegal ones too) and every message without a move
uses one unit of ``max_moves``. The episode ends when the puzzle is solved (reward 1, success) or the
budget is spent (reward 0).
"""

from __future__ import annotations

import math
import random
import re

from trainer.envs.base import Environment, StepResult

DATA_SOURCE = "coxswain/hanoi"
PEGS = "ABC"
_MOVE_RE = re.compile(r"([ABC])\s*-+>+\s*([ABC])")


def render_pegs(pegs: dict[str, list[int]]) -> str:
    return " ".join(f"{p}={pegs[p]}" for p in PEGS)


def optimal_moves(discs: int, src: str = "A", dst: str = "C", via: str = "B") -> list[str]:
    """The optimal solution, ``2**discs - 1`` moves, as ``"X->Y"`` strings."""
    if discs == 0:
        return []
    return optimal_moves(discs - 1, src, via, dst) + [f"{src}->{dst}"] + optimal_moves(discs - 1, via, dst, src)


class HanoiEnv(Environment):
    """One Tower of Hanoi episode; see the module docstring."""

    def reset(self, task: dict, seed: int | None = None) -> list[dict]:
        info = task["extra_info"]
        self.discs = int(info["discs"])
        self.max_moves = int(info["max_moves"])
        self.pegs = {"A": list(range(self.discs, 0, -1)), "B": [], "C": []}
        self.used = 0
        if task.get("prompt"):
            return [dict(m) for m in task["prompt"]]
        return [{"role": "user", "content": prompt_text(self.discs, self.max_moves)}]

    @property
    def solved(self) -> bool:
        return len(self.pegs["C"]) == self.discs

    def _apply(self, src: str, dst: str) -> str | None:
        """Make the move; an error text when it is illegal (the state is then unchanged)."""
        if src == dst:
            return f"Illegal move {src}->{dst}: source and target are the same peg."
        if not self.pegs[src]:
            return f"Illegal move {src}->{dst}: peg {src} is empty."
        disc = self.pegs[src][-1]
        if self.pegs[dst] and self.pegs[dst][-1] < disc:
            return f"Illegal move {src}->{dst}: disc {disc} cannot go on the smaller disc {self.pegs[dst][-1]}."
        self.pegs[dst].append(self.pegs[src].pop())
        return None

    def step(self, action_text: str) -> StepResult:
        moves = _MOVE_RE.findall(action_text)
        lines = []
        if not moves:
            self.used += 1
            lines.append("No move found. Write a move as X->Y, for example A->C.")
        for src, dst in moves:
            if self.used >= self.max_moves:
                break
            self.used += 1
            err = self._apply(src, dst)
            if err:
                lines.append(err)
                break
            lines.append(f"Moved disc {self.pegs[dst][-1]} from {src} to {dst}.")
            if self.solved:
                break
        info = {"moves_used": self.used, "optimal": 2**self.discs - 1, "success": self.solved}
        if self.solved:
            return StepResult(None, 1.0, True, info)
        left = self.max_moves - self.used
        if left <= 0:
            return StepResult(None, 0.0, True, info)
        lines.append(f"Pegs: {render_pegs(self.pegs)}. Moves left: {left}.")
        return StepResult(" ".join(lines), 0.0, False, info)


def prompt_text(discs: int, max_moves: int) -> str:
    return (f"Tower of Hanoi with {discs} discs (1 is the smallest) on pegs A, B, C. "
            f"Pegs: A={list(range(discs, 0, -1))} B=[] C=[]. Move all discs to C; never put a disc on a "
            f"smaller one. Write moves as X->Y (for example A->C); you may write several per message. "
            f"You have {max_moves} moves.")


def make_tasks(num: int, seed: int = 0, *, min_discs: int = 1, max_discs: int = 3, slack: float = 2.0,
               split: str = "train") -> list[dict]:
    """``num`` Hanoi tasks (dataset rows); ``max_moves = ceil(slack * optimum)``."""
    rng = random.Random(f"hanoi:{seed}:{split}")
    rows = []
    for i in range(num):
        d = rng.randint(min_discs, max_discs)
        opt = 2**d - 1
        budget = max(opt, math.ceil(slack * opt))
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt_text(d, budget)}],
            "ability": "puzzle",
            "reward_model": {"style": "rule", "ground_truth": str(opt)},
            "extra_info": {"split": split, "index": i, "discs": d, "max_moves": budget},
        })
    return rows
