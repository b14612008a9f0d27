"""Towers: Tower of Hanoi from any position to any goal peg, in a terse notation a character-level model can
read, with the exact distance to the goal that a rule-based step judge needs.

State: ``n`` discs (1 = smallest) on pegs A, B, C; each peg is written bottom to top as digits, e.g.
``A=31 B=2 C=``. Goal: every disc on the goal peg G. A move ``X->Y`` takes the top disc of X onto Y; it is
legal when X holds a disc and Y is empty or its top disc is larger (Lucas 1883).

Distance. ``d(s)`` is the fewest legal moves from ``s`` to the goal, by breadth-first search over the ``3**n``
states (:func:`distances`; exact, and ``2**n - 1`` from the classic start). Every legal move changes ``d``
by -1, 0 or +1 (a move is reversible, so ``|d(s') - d(s)| <= 1``); a move **makes progress** when it
lowers ``d``. That is the rule of :meth:`TowersEnv.label_steps`: a step is GOOD when its move was legal
and lowered the distance, BAD otherwise (an illegal move, a move that kept or raised the distance, a
message without a move). It is the information an LLM judge is asked for in ADCA-GRPO (Zhai et al. 2025,
arXiv:2511.10395), known here exactly.

Episode. The task message is ``goal G: <state>`` (``goal C: A=21 B= C=``); each assistant message should
hold one move; its first ``X->Y`` is applied (anything after it is ignored). The environment answers
with the new state, or ``bad <state>`` when the move was illegal or missing (the state is unchanged).
Every message uses one of the task's ``max_moves``. The episode ends solved (reward 1, success) or
when the budget is spent (reward 0).

Tasks (:func:`make_tasks`): a start state and a goal peg from the ``(n, start, goal)`` positions of the split
(a fixed hash puts about a quarter of the positions in ``test``; the two splits never share a position),
``max_moves = d(start) + slack``.
"""

from __future__ import annotations

import hashlib
import random
import re
from functools import lru_cache

from trainer.envs.base import Environment, StepResult

DATA_SOURCE = "coxswain/towers"
PEGS = "ABC"
_MOVE_RE = re.compile(r"([ABC])\s*-+>+\s*([ABC])")
_TASK_RE = re.compile(r"goal ([ABC]): A=(\d*) B=(\d*) C=(\d*)")

State = tuple[int, ...]  # peg index (0, 1, 2) of disc 1 (smallest) .. disc n


def render(state: State) -> str:
    """``A=21 B= C=3``: each peg bottom to top."""
    return " ".join(f"{p}=" + "".join(str(d + 1) for d in reversed(range(len(state))) if state[d] == k)
                    for k, p in enumerate(PEGS))


def parse_state(pegs: tuple[str, str, str]) -> State | None:
    """The state written as three pegs' digit strings (bottom to top), or None when it is not a valid
    position (a disc missing or twice, or a larger disc on a smaller one)."""
    where: dict[int, int] = {}
    for k, digits in enumerate(pegs):
        stack = [int(c) for c in digits]
        if stack != sorted(stack, reverse=True):
            return None
        for d in stack:
            if d in where:
                return None
            where[d] = k
    n = len(where)
    if n == 0 or sorted(where) != list(range(1, n + 1)):
        return None
    return tuple(where[d] for d in range(1, n + 1))


def legal_moves(state: State) -> list[tuple[int, int]]:
    out = []
    for src in range(3):
        on_src = [d for d, p in enumerate(state) if p == src]
        if not on_src:
            continue
        for dst in range(3):
            on_dst = [d for d, p in enumerate(state) if p == dst]
            if dst != src and (not on_dst or min(on_dst) > min(on_src)):
                out.append((src, dst))
    return out


def apply_move(state: State, move: tuple[int, int]) -> State | None:
    """The state after ``move``, or None when it is illegal."""
    if move not in legal_moves(state):
        return None
    src, dst = move
    disc = min(d for d, p in enumerate(state) if p == src)
    return tuple(dst if d == disc else p for d, p in enumerate(state))


@lru_cache(maxsize=None)
def distances(n: int, goal: int) -> dict[State, int]:
    """Fewest moves from every state of ``n`` discs to all-on-``goal`` (breadth-first from the goal)."""
    start = (goal,) * n
    dist = {start: 0}
    frontier = [start]
    while frontier:
        nxt = []
        for s in frontier:
            for m in legal_moves(s):
                t = apply_move(s, m)
                if t not in dist:
                    dist[t] = dist[s] + 1
                    nxt.append(t)
        frontier = nxt
    return dist


def parse_move(text: str) -> tuple[int, int] | None:
    m = _MOVE_RE.search(text)
    return (PEGS.index(m.group(1)), PEGS.index(m.group(2))) if m else None


def task_text(state: State, goal: int) -> str:
    return f"goal {PEGS[goal]}: {render(state)}"


def parse_task(text: str) -> tuple[State, int] | None:
    """``(state, goal)`` from a task message (the first ``goal G: A=.. B=.. C=..`` in ``text``), or None."""
    m = _TASK_RE.search(text)
    if not m:
        return None
    state = parse_state((m.group(2), m.group(3), m.group(4)))
    return None if state is None else (state, PEGS.index(m.group(1)))


def optimal_moves(state: State, goal: int) -> list[tuple[int, int]]:
    """Every legal move that lowers the distance to the goal (empty when solved)."""
    dist = distances(len(state), goal)
    return [m for m in legal_moves(state) if dist[apply_move(state, m)] < dist[state]]


class TowersEnv(Environment):
    """One Towers episode; see the module docstring."""

    def reset(self, task: dict, seed: int | None = None) -> list[dict]:
        info = task["extra_info"]
        self.state: State = tuple(int(p) for p in info["start"])
        self.goal = int(info["goal"])
        self.max_moves = int(info["max_moves"])
        self.used = 0
        return [{"role": "user", "content": task_text(self.state, self.goal)}]

    @property
    def solved(self) -> bool:
        return all(p == self.goal for p in self.state)

    def step(self, action_text: str) -> StepResult:
        self.used += 1
        move = parse_move(action_text)
        after = apply_move(self.state, move) if move else None
        if after is not None:
            self.state = after
        info = {"moves_used": self.used, "success": self.solved, "legal": after is not None}
        if self.solved:
            return StepResult(None, 1.0, True, info)
        if self.used >= self.max_moves:
            return StepResult(None, 0.0, True, info)
        return StepResult(("" if after is not None else "bad ") + render(self.state), 0.0, False, info)

    @classmethod
    def label_steps(cls, query: str, actions: list[str]) -> list[int] | None:
        """+1 (GOOD) for a step whose move was legal and lowered the distance to the goal, -1 (BAD) for any
        other step, replayed from the task in ``query``; None when ``query`` holds no task."""
        task = parse_task(query)
        if task is None:
            return None
        state, goal = task
        dist = distances(len(state), goal)
        flags = []
        for text in actions:
            move = parse_move(text)
            after = apply_move(state, move) if move else None
            flags.append(1 if after is not None and dist[after] < dist[state] else -1)
            state = after if after is not None else state
        return flags


def split_of(n: int, state: State, goal: int) -> str:
    """``test`` for about a quarter of the positions (a fixed hash of the position), ``train`` for the rest."""
    h = hashlib.sha256(f"towers:{n}:{state}:{goal}".encode()).digest()
    return "test" if h[0] < 64 else "train"


def positions(n: int, split: str) -> list[tuple[State, int]]:
    """Every unsolved ``(start, goal)`` of ``n`` discs in ``split``."""
    out = []
    for goal in range(3):
        for state, d in sorted(distances(n, goal).items()):
            if d > 0 and split_of(n, state, goal) == split:
                out.append((state, goal))
    return out


def make_tasks(num: int, seed: int = 0, *, min_discs: int = 2, max_discs: int = 3, slack: int = 3,
               split: str = "train") -> list[dict]:
    """``num`` tasks (dataset rows) from ``split``'s positions of ``min_discs..max_discs`` discs, in passes over
    them (each pass a seeded permutation, so any ``len(positions)`` consecutive rows from a pass's start are
    every position once); ``max_moves = d(start) + slack``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"towers:{seed}:{split}")
    pool = [(n, s, g) for n in range(min_discs, max_discs + 1) for s, g in positions(n, split)]
    order: list[int] = []
    rows = []
    for i in range(num):
        if not order:  # passes over the pool, each in a new seeded order: every position once per pass
            order = rng.sample(range(len(pool)), len(pool))
        n, state, goal = pool[order.pop()]
        d = distances(n, goal)[state]
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": task_text(state, goal)}],
            "ability": "puzzle",
            "reward_model": {"style": "rule", "ground_truth": str(d)},
            "extra_info": {"split": split, "index": i, "discs": n, "start": list(state), "goal": goal,
                           "max_moves": d + slack},
        })
    return rows
