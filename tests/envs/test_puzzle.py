"""Tower of Hanoi environment: an optimal scripted policy solves every size in exactly 2**d - 1 moves
with reward 1; illegal moves, move parsing, the move budget and random play against an independent
simulation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from trainer.envs import env_factory, task_maker
from trainer.envs.puzzle import HanoiEnv, make_tasks, optimal_moves


def task(discs, max_moves):
    return {"extra_info": {"discs": discs, "max_moves": max_moves}}


@pytest.mark.parametrize("discs", [1, 2, 3, 4, 5])
def test_optimal_policy_solves_in_the_minimum(discs):
    env = HanoiEnv()
    env.reset(task(discs, 2**discs - 1))  # a budget of exactly the optimum
    moves = optimal_moves(discs)
    assert len(moves) == 2**discs - 1  # Lucas: 1, 3, 7, 15, 31
    for k, m in enumerate(moves):
        r = env.step(f"I move {m}.")
        last = k == len(moves) - 1
        assert r.done is last and r.reward == (1.0 if last else 0.0) and r.info["success"] is last
        assert (r.observation is None) is last
    assert env.pegs == {"A": [], "B": [], "C": list(range(discs, 0, -1))}


def test_all_moves_in_one_message():
    env = HanoiEnv()
    env.reset(task(3, 7))
    r = env.step("Plan: " + ", then ".join(optimal_moves(3)) + ". Done!")
    assert r.done and r.reward == 1.0 and r.info["moves_used"] == 7


def test_illegal_moves_and_feedback():
    env = HanoiEnv()
    env.reset(task(2, 10))
    r = env.step("B->C")
    assert "peg B is empty" in r.observation and r.info["moves_used"] == 1 and not r.done
    r = env.step("A -> B")
    assert r.observation.startswith("Moved disc 1 from A to B.") and "Pegs: A=[2] B=[1] C=[]. Moves left: 8." in r.observation
    r = env.step("A->B then A->C")  # disc 2 onto disc 1 is illegal: the rest of the message is not played
    assert "disc 2 cannot go on the smaller disc 1" in r.observation and env.pegs == {"A": [2], "B": [1], "C": []}
    assert r.info["moves_used"] == 3
    r = env.step("A->A")
    assert "same peg" in r.observation
    r = env.step("I am not sure.")
    assert r.observation.startswith("No move found") and r.info["moves_used"] == 5
    r = env.step("A->>C, B-->C")  # arrow variants parse
    assert r.done and r.reward == 1.0


def test_budget_ends_the_episode_unsolved():
    env = HanoiEnv()
    env.reset(task(2, 3))
    assert not env.step("hmm").done and not env.step("A->C").done
    r = env.step("C->B A->C B->C")  # only one move is left in the budget: C->B is played, then it ends
    assert r.done and r.reward == 0.0 and not r.info["success"] and env.pegs == {"A": [2], "B": [1], "C": []}


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 20), st.lists(st.lists(st.tuples(st.sampled_from("ABC"), st.sampled_from("ABC")), max_size=4), max_size=25))
def test_random_play_matches_a_simulation(discs, budget, messages):
    env = HanoiEnv()
    env.reset(task(discs, budget))
    pegs = {"A": list(range(discs, 0, -1)), "B": [], "C": []}
    used, total = 0, 0.0
    for msg in messages:
        r = env.step(" ".join(f"{a}->{b}" for a, b in msg) or "nothing")
        total += r.reward
        # independent simulation of the same rules
        if not msg:
            used += 1
        for a, b in msg:
            if used >= budget:
                break
            used += 1
            if a == b or not pegs[a] or (pegs[b] and pegs[b][-1] < pegs[a][-1]):
                break
            pegs[b].append(pegs[a].pop())
            if len(pegs["C"]) == discs:
                break
        solved = len(pegs["C"]) == discs
        assert env.pegs == pegs and r.info["moves_used"] == used
        assert all(p == sorted(p, reverse=True) for p in env.pegs.values())  # never a disc on a smaller one
        assert r.done == (solved or used >= budget) and r.reward == (1.0 if solved else 0.0)
        if r.done:
            break
    assert total in (0.0, 1.0)


def test_make_tasks_seeded():
    a, b = make_tasks(10, seed=3), make_tasks(10, seed=3)
    assert a == b and a != make_tasks(10, seed=4)
    for row in a:
        d, m = row["extra_info"]["discs"], row["extra_info"]["max_moves"]
        assert 1 <= d <= 3 and m >= 2**d - 1 and row["reward_model"]["ground_truth"] == str(2**d - 1)
        msgs = HanoiEnv().reset(row)
        assert msgs == row["prompt"] and f"{d} discs" in msgs[0]["content"]
    assert env_factory("hanoi") is HanoiEnv and task_maker("hanoi") is make_tasks
