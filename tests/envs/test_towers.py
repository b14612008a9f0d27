"""Towers (trainer.envs.towers): the distance oracle against an independent count, the episode rules, the
splits, and the rule step labels."""

from __future__ import annotations

import itertools
import random

import pytest

from trainer.envs import ENVIRONMENTS, Environment, env_factory, task_maker
from trainer.envs import towers as T


def brute_distance(state, goal) -> int:
    """Fewest moves by iterative deepening over move sequences (independent of the BFS table)."""
    for depth in range(0, 2 ** len(state)):
        frontier = {state}
        for _ in range(depth):
            frontier = {T.apply_move(s, m) for s in frontier for m in T.legal_moves(s)}
        if (goal,) * len(state) in frontier:
            return depth
    raise AssertionError("unreachable")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_distances_match_a_brute_force_count_and_lucas(n):
    for goal in range(3):
        dist = T.distances(n, goal)
        assert len(dist) == 3 ** n  # every position reaches every goal
        for state in itertools.product(range(3), repeat=n):
            if n < 3 or random.Random(str(state)).random() < 0.3:
                assert dist[state] == brute_distance(state, goal), (state, goal)
        # the classic start (all on another peg) needs 2^n - 1 moves
        assert dist[((goal + 1) % 3,) * n] == 2 ** n - 1
        # a legal move changes the distance by at most one
        for s in dist:
            assert all(abs(dist[T.apply_move(s, m)] - dist[s]) <= 1 for m in T.legal_moves(s))


def test_render_and_parse_round_trip():
    for n in (1, 2, 3, 4):
        for state in itertools.product(range(3), repeat=n):
            text = T.task_text(state, 2)
            assert T.parse_task(text) == (state, 2)
    assert T.render((0, 0, 1)) == "A=21 B=3 C="
    # impossible positions are not states
    assert T.parse_state(("12", "", "")) is None  # a larger disc on a smaller one
    assert T.parse_state(("1", "1", "")) is None and T.parse_state(("2", "", "")) is None


def test_episode_rules():
    env = T.TowersEnv()
    task = {"extra_info": {"start": [0, 0], "goal": 2, "max_moves": 5}}
    assert env.reset(task) == [{"role": "user", "content": "goal C: A=21 B= C="}]
    r = env.step("A->C")  # disc 1 to C: legal, not progress (the optimum starts A->B)
    assert r.observation == "A=2 B= C=1" and not r.done and r.info["legal"]
    r = env.step("A->C")  # disc 2 onto disc 1: illegal, state unchanged
    assert r.observation == "bad A=2 B= C=1" and not r.info["legal"]
    r = env.step("nothing")
    assert r.observation == "bad A=2 B= C=1"
    r = env.step("C->B then more")  # only the first move counts
    assert r.observation == "A=2 B=1 C="
    r = env.step("A->C")  # the 5th message: budget spent, not solved
    assert r.done and r.reward == 0.0 and r.observation is None and not r.info["success"]
    env.reset(task)
    for move in ("A->B", "A->C"):
        assert not env.step(move).done
    r = env.step("B->C")
    assert r.done and r.reward == 1.0 and r.info["success"]


def test_tasks_come_from_disjoint_splits_with_the_stated_budget():
    train, test = T.make_tasks(500, seed=3, split="train"), T.make_tasks(200, seed=3, split="test")
    key = lambda r: (r["extra_info"]["discs"], tuple(r["extra_info"]["start"]), r["extra_info"]["goal"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    pool = len(T.positions(2, "test")) + len(T.positions(3, "test"))
    assert pool >= 20 and len({key(r) for r in test[:pool]}) == pool  # a pass covers every position once
    for r in train + test:
        n, state, goal = key(r)
        d = T.distances(n, goal)[state]
        assert d >= 1 and r["extra_info"]["max_moves"] == d + 3 and r["reward_model"]["ground_truth"] == str(d)
        assert r["prompt"][0]["content"] == T.task_text(state, goal)
    assert T.make_tasks(5, seed=3, split="test") == test[:5]  # deterministic
    assert task_maker("towers") is T.make_tasks and ENVIRONMENTS["towers"] is T.TowersEnv
    with pytest.raises(ValueError, match="split"):
        T.make_tasks(1, split="val")


def test_rule_labels_say_which_steps_made_progress():
    q = "goal C: A=21 B= C="
    assert T.TowersEnv.label_steps(q, ["A->B", "A->C", "B->C"]) == [1, 1, 1]
    # A->C keeps the distance at 3 (disc 1 must still pass by B), going back keeps it too; from C=1 the
    # way on is C->B, A->C, B->C
    assert T.TowersEnv.label_steps(q, ["A->C", "C->A"]) == [-1, -1]
    assert T.TowersEnv.label_steps(q, ["A->C", "C->B", "A->C", "B->C"]) == [-1, 1, 1, 1]
    # illegal and missing moves are BAD and change nothing
    assert T.TowersEnv.label_steps(q, ["B->C", "hello", "A->B"]) == [-1, -1, 1]
    assert T.TowersEnv.label_steps("no task here", ["A->B"]) is None
    # the labels are exactly 'distance went down', on random play from random positions
    rng = random.Random(0)
    for _ in range(200):
        n, goal = rng.randint(1, 3), rng.randrange(3)
        state = tuple(rng.randrange(3) for _ in range(n))
        moves = [f"{rng.choice('ABC')}->{rng.choice('ABC')}" for _ in range(6)]
        dist, s, want = T.distances(n, goal), state, []
        for mv in moves:
            after = T.apply_move(s, (ord(mv[0]) - 65, ord(mv[3]) - 65))
            want.append(1 if after is not None and dist[after] == dist[s] - 1 else -1)
            s = after or s
        assert T.TowersEnv.label_steps(T.task_text(state, goal), moves) == want
    # environments without a rule say so
    assert Environment.label_steps("goal C: A=1 B= C=", ["A->C"]) is None
    assert env_factory("hanoi").label_steps("goal C: A=1 B= C=", ["A->C"]) is None
