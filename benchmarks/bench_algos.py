"""Benchmark: the driver-side RL math (GRPO advantages, rollout-IS weights with every mismatch metric,
the DAPO group filter) at 8192 sequences x 4096 response tokens with ragged lengths, on CPU.

Baselines, measured in the same run:
  * ``loop``: a straightforward per-sample Python loop (one sample's valid tokens at a time, dicts for
    the groups), the way these functions are often first written;
  * ``copy``: a plain tensor copy of the same input bytes (the time to read the inputs once).

And verl 0.9.1's own functions on the same inputs (installed ``--no-deps`` from requirements-peers.txt;
``--no-verl`` skips them), each checked to compute the same values first: GRPO advantages (verl's
``compute_grpo_outcome_advantage``, what ``adv_estimator=grpo`` runs, and its vectorised variant, whose
score sum does not mask the padding), the rollout-IS weights with verl's IS and off-policy metric sets,
the token_k1 rejection mask, and the low_var_kl estimator. verl gets a float mask (its fastest input;
its trainer passes the attention mask's integer slice), ours the bool mask the trainer holds.

Headline (last line): verl's time over ours on the whole set, ours over one copy of the inputs (target
<= 3x), and the vectorised total against the per-sample loop. The verl rows time ours, verl's and the
copy interleaved (best of ``--repeat`` each), so a load on a shared machine hits all three alike.

Measured (full size, 2 torch threads, x86_64, torch 2.13 CPU, verl 0.9.1; 2 cores shared with other work,
so figures move by ~10% between runs): the whole set 11.3x faster than verl's functions and 1.69x a copy
of its inputs; rollout-IS weights + metrics 13.9x, token_k1 rejection 16.1x, low_var_kl 3.3x, GRPO 2.8x
verl's loop GRPO and 1.00x its vectorised GRPO (38.1 vs 38.0 ms; 36.9 vs 37.8 ms median of 15 interleaved
calls). That row is at the memory floor for both: ~31 ms of the ~37 are the page faults of the fresh
[8192, 4096] float32 output (``torch.empty(...).fill_`` alone takes that long), the rest is one read of
the rewards (+ the bool mask for ours: ~3.6 ms compiled; verl sums without the mask, ~3.0 ms) and one
write (verl's multiply reads a float mask, 4x the bytes of our bool one). Before the compiled score sum
and broadcast (trainer/algos/advantages.py) ours took 49-52 ms there (0.71x).

    python benchmarks/bench_algos.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections import defaultdict

import torch

import _common  # noqa: F401,E402  (the repository root on sys.path)
from trainer.algos.advantages import compute_grpo_outcome_advantage
from trainer.algos.filtering import group_filter
from trainer.algos.rollout_is import compute_rollout_is_weights


def make_inputs(B: int, T: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 16, T + 1, (B,), generator=g)  # ragged: 1/16 .. full length
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool
    rollout = -torch.rand(B, T, generator=g) * 3.0  # [B, T] sampler log-probs
    old = rollout + 0.05 * torch.randn(B, T, generator=g)  # [B, T] trainer log-probs, slightly off
    old[0, 0] = rollout[0, 0] - 12.0  # one catastrophic token so the veto path has work
    scores = (torch.rand(B, generator=g) < 0.5).float()  # [B] 0/1 outcome
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = scores  # [B, T] score at the last valid token
    index = torch.arange(B) // group  # [B] group ids
    acc = scores.clone()
    acc[: group * (B // group // 4)].view(-1, group)[:] = 1.0  # a quarter of the groups are constant
    return dict(lengths=lengths, mask=mask, rollout=rollout, old=old, rewards=rewards, index=index, acc=acc)


# ---------------------------------------------------------------------------------------------
# per-sample loop baselines
# ---------------------------------------------------------------------------------------------
def loop_grpo(rewards, lengths, index, eps=1e-6):
    scores = [float(rewards[i, : lengths[i]].sum()) for i in range(rewards.shape[0])]
    groups = defaultdict(list)
    for i, gid in enumerate(index.tolist()):
        groups[gid].append(scores[i])
    stats = {}
    for gid, vals in groups.items():
        m = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 1.0
        stats[gid] = (m if len(vals) > 1 else 0.0, sd)
    adv = torch.zeros_like(rewards)
    for i, gid in enumerate(index.tolist()):
        m, sd = stats[gid]
        adv[i, : lengths[i]] = (scores[i] - m) / (sd + eps)
    return adv


def loop_rollout_is(old, rollout, lengths, upper=2.0, veto=1e-4):
    weights = torch.zeros_like(old)
    all_w, seq_w, vetoed, kl, k3 = [], [], 0, 0.0, 0.0
    n_tok = 0
    for i in range(old.shape[0]):
        L = int(lengths[i])
        lr = (old[i, :L] - rollout[i, :L]).clamp(-20, 20)
        w = lr.exp()
        all_w.append(w)
        seq_w.append(float(lr.sum().clamp(-20, 20).exp()))
        kl += float((rollout[i, :L] - old[i, :L]).sum())
        k3 += float((w - lr - 1).sum())
        n_tok += L
        if bool((w < veto).any()):
            vetoed += 1
            continue
        weights[i, :L] = w.clamp(max=upper)
    flat = torch.cat(all_w)
    srt = flat.sort().values
    q = {p: float(srt[min(int(p / 100 * (len(srt) - 1)), len(srt) - 1)]) for p in (25, 50, 75, 95, 99)}
    metrics = dict(mean=float(flat.mean()), std=float(flat.std()), max=float(flat.max()), min=float(flat.min()),
                   ess=float(1.0 / ((flat / flat.mean()) ** 2).mean()), veto=vetoed / old.shape[0],
                   kl=kl / n_tok, k3=k3 / n_tok, seq_mean=sum(seq_w) / len(seq_w), **{f"p{p}": v for p, v in q.items()})
    return weights, metrics


def loop_filter(acc, index):
    groups = defaultdict(list)
    for i, gid in enumerate(index.tolist()):
        groups[gid].append(i)
    keep = []
    for gid, idx in groups.items():
        vals = [float(acc[i]) for i in idx]
        if max(vals) > min(vals) or len(vals) == 1:
            keep.extend(idx)
    return torch.tensor(sorted(keep))


# ---------------------------------------------------------------------------------------------
# verl's own functions on the same inputs
# ---------------------------------------------------------------------------------------------
def verl_version() -> str:
    from importlib.metadata import version

    return version("verl")


def bench_against_verl(x: dict, repeat: int) -> list[dict]:
    """Each function of ours against verl's that computes the same thing, after checking that the two
    agree on these inputs (a faster function that computes something else proves nothing)."""
    import numpy as np
    from verl.trainer.ppo import core_algos as V
    from verl.trainer.ppo import rollout_corr_helper as RC

    from trainer.algos.kl import kl_penalty
    from trainer.algos.rollout_is import compute_rejection_mask
    from trainer.verl_compat import parse_rejection

    mask, rewards, old, rollout, index = (x[k] for k in ("mask", "rewards", "old", "rollout", "index"))
    fmask = mask.float()  # verl's functions take a float mask
    uid = np.array([str(int(i)) for i in index])  # verl's index: the uid strings of its DataProto
    ref = rollout - 0.02  # a reference policy near the rollout's
    rows = []

    def row(name, ours, verl, inputs, check):
        check(ours(), verl())
        # interleaved (ours, verl, copy, ours, ...), best of each: a load that comes and goes on a shared
        # machine then hits the three alike instead of whichever happened to run during it
        t_o, t_v, t_c = timeit_interleaved([ours, verl, lambda: [torch.empty_like(t).copy_(t) for t in inputs]], repeat)
        rows.append(dict(name=name, ours_s=t_o, verl_s=t_v, copy_s=t_c, verl_over_ours=t_v / t_o, ours_over_copy=t_o / t_c))

    def same(a, b, atol=1e-5):
        assert torch.allclose(a.float(), b.float(), atol=atol), (a - b).abs().max()

    row("grpo_advantages",
        lambda: compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=index)[0],
        lambda: V.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=fmask, index=uid)[0],
        [rewards, mask, index], same)
    row("grpo_advantages (verl vec)",
        lambda: compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=index)[0],
        lambda: V.compute_grpo_vectorized_outcome_advantage(token_level_rewards=rewards, response_mask=fmask,
                                                            index=uid)[0],
        [rewards, mask, index], same)

    def ours_is():  # the weights, verl's IS statistics and the mismatch metrics, as verl's trainer logs them
        w, _, m = compute_rollout_is_weights(old, rollout, mask, rollout_is_level="token", rollout_is_mode="truncate",
                                             rollout_is_threshold=2.0, rollout_is_veto_threshold=None)
        return w, m

    def verl_is():
        proto, _, m = RC.compute_rollout_correction_and_rejection_mask(old, rollout, fmask, rollout_is="token",
                                                                      rollout_is_threshold=2.0)
        m.update(RC.compute_offpolicy_metrics(old, rollout, fmask))
        return proto.batch["rollout_is_weights"], m

    row("rollout_is weights+metrics", ours_is, verl_is, [old, rollout, mask],
        lambda a, b: same(a[0] * mask, b[0] * fmask))
    rej = parse_rejection("token_k1", "0.7_1.3", None)[0]  # verl's option in our units, as the config maps it
    row("rejection token_k1 0.7-1.3",
        lambda: compute_rejection_mask(old, rollout, mask, **{k: rej[k] for k in ("divergence", "agg", "lower", "upper")})[0],
        lambda: RC.compute_rollout_rejection_mask(old - rollout, fmask, rollout_rs="token_k1",
                                                  rollout_rs_threshold="0.7_1.3")[0],
        [old, rollout, mask], lambda a, b: same(a, b, atol=0))
    row("kl low_var_kl", lambda: kl_penalty(old, ref, "low_var_kl"), lambda: V.kl_penalty(old, ref, "low_var_kl"),
        [old, ref], same)
    return rows


def timeit(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def timeit_interleaved(fns, repeat: int) -> list[float]:
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1024 x 1024 instead of 8192 x 4096")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--repeat", type=int, default=3, help="best of N (the first call may compile)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--no-verl", action="store_true", help="skip the comparison with verl's functions")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T = (1024, 1024) if args.quick else (8192, 4096)
    group = 16
    x = make_inputs(B, T, group)
    mask, rewards, old, rollout, index, acc, lengths = (x[k] for k in ("mask", "rewards", "old", "rollout", "index", "acc", "lengths"))
    n_valid = int(mask.sum())
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"

    # correctness of the comparison itself: both paths must agree before their times mean anything
    adv_v, _ = compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=index)
    adv_l = loop_grpo(rewards, lengths, index)
    assert torch.allclose(adv_v, adv_l, atol=1e-5), "GRPO vectorised != loop"
    w_v, _, m_v = compute_rollout_is_weights(old, rollout, mask, rollout_is_level="token", rollout_is_mode="truncate",
                                             rollout_is_threshold=2.0, rollout_is_veto_threshold=1e-4)
    w_l, m_l = loop_rollout_is(old, rollout, lengths)
    assert torch.allclose(w_v, w_l, atol=1e-5), "rollout-IS vectorised != loop"
    keep_v, _ = group_filter(acc, index)
    assert torch.equal(keep_v.sort().values, loop_filter(acc, index)), "filter vectorised != loop"

    rows = []

    def bench(name, vec, loop, inputs):
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        t_vec = timeit(vec, args.repeat)
        t_loop = timeit(loop, 1)
        t_copy = timeit(lambda: [torch.empty_like(t).copy_(t) for t in inputs], args.repeat)
        rows.append(dict(name=name, input_mb=nbytes / 2**20, vectorised_s=t_vec, loop_s=t_loop, copy_s=t_copy,
                         speedup_vs_loop=t_loop / t_vec, ratio_to_copy=t_vec / t_copy))

    bench("grpo_advantages",
          lambda: compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask, index=index),
          lambda: loop_grpo(rewards, lengths, index), [rewards, mask, index])
    bench("rollout_is+metrics",
          lambda: compute_rollout_is_weights(old, rollout, mask, rollout_is_level="token", rollout_is_mode="truncate",
                                             rollout_is_threshold=2.0, rollout_is_veto_threshold=1e-4),
          lambda: loop_rollout_is(old, rollout, lengths), [old, rollout, mask])
    bench("rollout_is(sampled pct)",
          lambda: compute_rollout_is_weights(old, rollout, mask, rollout_is_level="token", rollout_is_mode="truncate",
                                             rollout_is_threshold=2.0, rollout_is_veto_threshold=1e-4,
                                             percentile_sample_size=2**17),
          lambda: loop_rollout_is(old, rollout, lengths), [old, rollout, mask])
    bench("group_filter", lambda: group_filter(acc, index), lambda: loop_filter(acc, index), [acc, index])
    verl_rows = bench_against_verl(x, args.repeat) if not args.no_verl else []

    main_rows = [r for r in rows if "sampled" not in r["name"]]  # the headline is the default (exact) path
    tot = {k: sum(r[k] for r in main_rows) for k in ("vectorised_s", "loop_s", "copy_s")}
    print(f"bench_algos: B={B} sequences x T={T} tokens ({n_valid / (B * T):.0%} valid), groups of {group}; {machine}")
    print(f"{'part':<24}{'input MB':>10}{'vectorised s':>14}{'loop s':>10}{'copy s':>10}{'x vs loop':>11}{'/ copy':>8}")
    for r in rows:
        print(f"{r['name']:<24}{r['input_mb']:>10.1f}{r['vectorised_s']:>14.4f}{r['loop_s']:>10.3f}{r['copy_s']:>10.4f}"
              f"{r['speedup_vs_loop']:>11.1f}{r['ratio_to_copy']:>8.2f}")
    speed = tot["loop_s"] / tot["vectorised_s"]
    to_copy = tot["vectorised_s"] / tot["copy_s"]
    print(f"{'total (exact path)':<24}{'':>10}{tot['vectorised_s']:>14.4f}{tot['loop_s']:>10.3f}{tot['copy_s']:>10.4f}{speed:>11.1f}{to_copy:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(B=B, T=T, machine=machine, rows=rows, total=tot, speedup_vs_loop=speed,
                           ratio_to_copy=to_copy, mismatch_metrics={k: float(v) for k, v in m_v.items()}), f, indent=2)
    if verl_rows:
        print()
        print(f"against verl {verl_version()}'s own functions (installed --no-deps: requirements-peers.txt), same inputs:")
        print(f"{'function':<28}{'ours s':>10}{'verl s':>10}{'copy s':>10}{'verl / ours':>13}{'ours / copy':>13}")
        for r in verl_rows:
            print(f"{r['name']:<28}{r['ours_s']:>10.4f}{r['verl_s']:>10.4f}{r['copy_s']:>10.4f}{r['verl_over_ours']:>13.2f}"
                  f"{r['ours_over_copy']:>13.2f}")
        vt = {k: sum(r[k] for r in verl_rows) for k in ("ours_s", "verl_s", "copy_s")}
        print(f"{'total':<28}{vt['ours_s']:>10.4f}{vt['verl_s']:>10.4f}{vt['copy_s']:>10.4f}{vt['verl_s'] / vt['ours_s']:>13.2f}"
              f"{vt['ours_s'] / vt['copy_s']:>13.2f}")
        if args.json:
            with open(args.json) as f:
                res = json.load(f)
            res["against_verl"] = dict(rows=verl_rows, total=vt)
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        worst = min(verl_rows, key=lambda r: r["verl_over_ours"])
        print(f"headline: verl's functions take {vt['verl_s'] / vt['ours_s']:.2f}x our time on the whole set (slowest of ours "
              f"relative to verl: {worst['name']} at {worst['verl_over_ours']:.2f}x); ours is {vt['ours_s'] / vt['copy_s']:.2f}x "
              f"a copy of the inputs; {speed:.1f}x the per-sample loop")
        return
    print(f"headline: vectorised {speed:.1f}x faster than the per-sample loop; {to_copy:.2f}x the time of one copy of the inputs")


if __name__ == "__main__":
    main()
