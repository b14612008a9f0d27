"""The driver's data plane: bytes through the driver process and driver time per training step, the
by-reference data plane (``trainer.workers.dataplane`` + the role groups) against the previous
driver-relay dispatch, in the same run.

Step shape (GRPO with a KL loss and token-level truncated rollout IS, several mini-batches, so the
old-log-prob and reference passes both run): ``B`` sequences of at most ``P + T`` tokens (default
1024 x (1024 + 3072) = 4096), 4 data-parallel ranks on a real local Ray cluster (the slots may
oversubscribe the cores: what is measured is the driver), 4 mini-batches. Prompt and response lengths
are drawn as in RL runs: prompts uniform in [64, P], responses log-normal around T/4 with 5% at the
cap ``T``.

Workers do no model compute (``NullWorker``: the product's worker methods returning zeros of the
right shapes), so what is timed is what the driver does outside worker compute: splitting, packing,
(de)serialising, shipping and gathering, plus the driver's own math (rollout IS, GRPO advantages),
which is the same in both paths. Per step we report:

* ``driver MB``: bytes of arrays that pass through the driver process: out (puts and call
  arguments) + in (results it receives);
* ``overhead CPU s``: ``time.process_time()`` of the driver process (all its threads, Ray's transfer
  threads included) over the step, minus what its own math took (``driver_math``: rollout IS and
  advantages, identical in both paths, printed on its own line);
* ``wall s``: the step's wall time (with 4 workers on 2 cores this includes the workers' own
  deserialisation, so it is noisier; reported, not the headline).

Baseline ("previous"): the pre-#14 dispatch, kept here for comparison (NOT the product): the batch
padded to the config maxima, every present tensor field shipped to every phase as a numpy dict, per
token results returned at full width and re-padded on the driver, and every update field shipped per
mini-batch. The product path ("by reference"): one put per shard of the model inputs at the shard's
own width, old / reference log-probs left in the object store and passed to the update by reference
(the driver fetches the old log-probs once: rollout IS runs on it), driver-computed fields put once
per shard.

    python benchmarks/bench_dataplane.py [--quick] [--json PATH] [--repeats N]

The last line is the headline: previous / by-reference driver overhead per step (and bytes).
"""

from __future__ import annotations

import argparse
import time


import numpy as np  # noqa: E402
import torch  # noqa: E402

from _common import load_average, machine, summary, table, write_json  # noqa: E402
from trainer.plan import ForwardSettings  # noqa: E402
from trainer.step import loss_fields  # noqa: E402  (imported here, not in the timed step: ~3 s the first time)
from trainer.workers.dataplane import StepData  # noqa: E402
from trainer.workers.metrics import MEAN  # noqa: E402


class NullWorker:
    """One DP rank that answers the product's worker methods (and the previous ones) with zeros."""

    def __init__(self, *, rank: int, dp: int):
        self.rank, self.dp = rank, dp

    def layout(self) -> dict:
        return {"rank": self.rank, "dp_rank": self.rank, "dp_size": self.dp, "tp_rank": 0, "pp_rank": 0, "pp_size": 1}

    # the product's methods ------------------------------------------------------------------
    def log_probs(self, shard, *, settings, entropy=False, key="log_probs"):
        b, t = shard["responses"].shape
        return {key: np.zeros((b, t), np.float32)}, ({"sum": 0.0, "count": 1.0} if entropy else {})

    def update_actor(self, shard, mini_batches, *extras, settings, counts, on_policy=False, rollout_is=None,
                     return_log_probs=False, bypass=None):
        assert all(e is None or all(v.shape[0] == shard["responses"].shape[0] for v in e.values()) for e in extras)
        # the metrics partials format (trainer.workers.metrics): (kind, numerator, denominator)
        return {"metrics": [{"actor/pg_loss": (MEAN, 0.0, 1.0)}] * len(mini_batches), "log_probs": None, "entropy": None}

    # the previous methods (baseline) --------------------------------------------------------------
    def compute_log_prob(self, batch_np, *, temperature, micro_batch_size, with_entropy=False):
        b, t = batch_np["fields"]["responses"].shape
        out = {"log_probs": np.zeros((b, t), np.float32)}
        if with_entropy:
            out["entropy"] = np.zeros((b, t), np.float32)
        return out

    def update_actor_previous(self, mini_batches, *, loss, temperature, micro_batch_size):
        return {"metrics": [{"actor/pg_loss": 0.0}] * len(mini_batches), "outputs": None}


def make_batch(B: int, P: int, T: int, seed: int = 0):
    """A scored GRPO batch at the config maxima (the previous layout), as the rollout left it."""
    from trainer.rollout.single_turn import pad_left, pad_right

    from trainer.batch import RolloutBatch

    g = np.random.default_rng(seed)
    plen = g.integers(64, P + 1, B)
    rlen = np.minimum(np.exp(g.normal(np.log(T / 4), 0.6, B)).astype(int) + 1, T)
    rlen[g.random(B) < 0.05] = T
    prompts = [g.integers(2, 30000, n).tolist() for n in plen]
    resp = [g.integers(2, 30000, n).tolist() for n in rlen]
    p_ids, p_mask = pad_left(prompts, P, 0)
    r_ids, r_mask = pad_right(resp, T, 0, torch.long)
    lps, _ = pad_right([(-g.random(n)).tolist() for n in rlen], T, 0.0, torch.float32)
    b = RolloutBatch.from_tokens(p_ids, r_ids, p_mask, r_mask, rollout_log_probs=lps,
                                 group_ids=torch.arange(B) // 8)
    tls = torch.zeros(B, T)
    tls[torch.arange(B), torch.as_tensor(rlen - 1)] = torch.as_tensor(g.integers(0, 2, B), dtype=torch.float32)
    b.token_level_scores, b.scores, b.acc = tls, tls.sum(1), tls.sum(1)
    return b


def _nbytes(x) -> int:
    if isinstance(x, np.ndarray):
        return x.nbytes
    if isinstance(x, dict):
        return sum(_nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


IS_KW = dict(rollout_is_level="token", rollout_is_mode="truncate", rollout_is_threshold=2.0,
             rollout_is_threshold_lower=None, rollout_is_veto_threshold=1e-4, rollout_is=True)


MATH_CPU = []  # driver CPU seconds spent in driver_math, per call


def driver_math(batch):
    """The driver's own compute (the same in both paths): rollout IS and GRPO advantages."""
    from trainer.algos.advantages import compute_advantage
    from trainer.algos.rollout_is import compute_rollout_is_weights

    c0 = time.process_time()
    batch.rollout_is_weights = compute_rollout_is_weights(batch.old_log_probs, batch.rollout_log_probs,
                                                          batch.response_mask, **IS_KW)[0]
    batch.token_level_rewards = batch.token_level_scores
    batch.advantages, batch.returns, _ = compute_advantage("grpo", token_level_rewards=batch.token_level_rewards,
                                                           response_mask=batch.response_mask, index=batch.group_ids)
    MATH_CPU.append(time.process_time() - c0)


def previous_step(group, batch, mini_batch_size: int) -> int:
    """The pre-#14 dispatch (``phases.dp_dispatch`` / ``update_group``), bytes through the driver."""
    from trainer.algos.losses import batch_norm_counts
    from trainer.batch import restore_order

    layouts = group.call("layout")
    dp = layouts[0]["dp_size"]
    moved = 0

    def dispatch(b, method, **kw):
        nonlocal moved
        t = b.copy()
        t.meta = None
        parts, index_lists, _ = t.balanced_split(dp)
        payload = [p.to_numpy_dict() for p in parts]
        moved += _nbytes([p["fields"] for p in payload])
        res = group.call(method, [(payload[l["dp_rank"]],) for l in layouts], **kw)
        moved += _nbytes(res)
        return {k: restore_order([torch.from_numpy(np.array(r[k])) for r in res], index_lists) for k in res[0]}

    out = dispatch(batch, "compute_log_prob", temperature=1.0, micro_batch_size=8, with_entropy=True)
    batch.old_log_probs = out["log_probs"]
    batch.ref_log_probs = dispatch(batch, "compute_log_prob", temperature=1.0, micro_batch_size=8)["log_probs"]
    driver_math(batch)
    t = batch.copy()
    t.meta = None
    per_rank, counts = [[] for _ in range(dp)], []
    B = t.num_samples
    for s in range(0, B, mini_batch_size):
        mb = t[torch.arange(s, min(B, s + mini_batch_size))]
        counts.append(tuple(float(c) for c in batch_norm_counts(mb.response_mask, "token-mean")))
        parts, _, _ = mb.balanced_split(dp)
        for d in range(dp):
            per_rank[d].append(parts[d].to_numpy_dict())
    moved += _nbytes([[m["fields"] for m in r] for r in per_rank])
    group.call("update_actor_previous", [(per_rank[l["dp_rank"]],) for l in layouts], loss={"global_counts": counts},
               temperature=1.0, micro_batch_size=8)
    return moved


def by_reference_step(actor, ref, transport, batch, settings) -> int:
    """The product's step: ``StepData`` + the role groups' typed calls, as ``trainer/main.py`` runs them."""
    transport.take_metrics()
    data = StepData(batch, transport)
    fwd = ForwardSettings(micro_batch_size=8)
    old, _ = actor.log_probs_with_entropy(data, fwd)
    ref_lp = ref.log_probs(data, fwd)
    batch.old_log_probs = old.fetch()["old_log_probs"]  # rollout IS reads them on the driver
    driver_math(batch)

    class _P:  # loss_fields reads only whether rejection sampling and bypass mode are on
        rejection = None
        bypass = None

    actor.update(data, settings, [old, ref_lp, data.scatter(actor.dp, loss_fields(batch, _P))], seed=1)
    m = transport.take_metrics()
    return int(m["dataplane/driver_bytes_out"] + m["dataplane/driver_bytes_in"])


def own_width(batch):
    """The batch as the product builds it: at its own width (the trimmed columns no row uses)."""
    return batch.trim_padding()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 x (256 + 768) tokens, 2 repeats")
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    B, P, T = (256, 256, 768) if args.quick else (1024, 1024, 3072)
    repeats = args.repeats or (2 if args.quick else 3)
    dp, n_mb = 4, 4

    import ray

    from trainer.plan import PolicyLoss, UpdateSettings
    from trainer.workers.dataplane import Transport
    from trainer.workers.group import WorkerGroup, init_ray
    from trainer.workers.roles import ActorGroup, RefGroup

    init_ray(num_cpus=dp)
    transport = Transport(in_process=False)
    groups = {name: WorkerGroup(name, NullWorker, [dict(rank=i, dp=dp) for i in range(dp)], share=0.5)
              for name in ("actor", "ref")}
    actor, ref = ActorGroup(groups["actor"], transport), RefGroup(groups["ref"], transport)
    pl = PolicyLoss(loss_mode="vanilla", agg_mode="token-mean", norm_constant=float(T), clip_ratio=0.2,
                    clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=True,
                    kl_loss_coef=0.001, kl_loss_type="low_var_kl")
    settings = UpdateSettings(mini_batch_size=B // n_mb, epochs=1, shuffle=False, micro_batch_size=8, policy=pl)
    base = make_batch(B, P, T)
    print(f"machine: {machine(f'{dp} DP ranks (NullWorker) on a local Ray cluster')}")
    print(f"step: {B} sequences x {P} + {T} tokens, {n_mb} mini-batches, GRPO + KL loss + token TIS\n")
    res = {name: {"cpu": [], "overhead": [], "wall": [], "bytes": []} for name in ("previous", "by reference")}
    # one untimed round first: the workers' first data call imports the dataplane's modules (about 6 s at the
    # first by-reference call here, once per worker process)
    previous_step(groups["actor"], base.clone(), B // n_mb)
    by_reference_step(actor, ref, transport, own_width(base.clone()), settings)
    for _ in range(repeats):  # interleaved: both paths see the same machine load
        for name in res:
            batch = base.clone()
            c0, w0 = time.process_time(), time.perf_counter()
            if name == "previous":
                nbytes = previous_step(groups["actor"], batch, B // n_mb)
                groups["ref"].call("layout")
            else:
                nbytes = by_reference_step(actor, ref, transport, own_width(batch), settings)
            res[name]["cpu"].append(time.process_time() - c0)
            res[name]["overhead"].append(res[name]["cpu"][-1] - MATH_CPU[-1])
            res[name]["wall"].append(time.perf_counter() - w0)
            res[name]["bytes"].append(nbytes)
    rows = []
    for name, r in res.items():
        rows.append([name, r["bytes"][0] / 1e6, summary(r["overhead"])["best"], summary(r["overhead"])["median"],
                     summary(r["cpu"])["best"], summary(r["wall"])["best"], summary(r["wall"])["median"]])
    print(table(["path", "driver MB/step", "overhead CPU s best", "median", "CPU s incl. math", "wall s best",
                 "median"], rows))
    print(f"driver math (rollout IS + GRPO advantages, both paths): {min(MATH_CPU):.3f} s CPU best")
    cpu_ratio = summary(res["previous"]["overhead"])["best"] / summary(res["by reference"]["overhead"])["best"]
    byte_ratio = res["previous"]["bytes"][0] / max(1, res["by reference"]["bytes"][0])
    wall_ratio = summary(res["previous"]["wall"])["best"] / summary(res["by reference"]["wall"])["best"]
    write_json(args.json, {"machine": machine(), "B": B, "P": P, "T": T, "dp": dp, "results": res,
                           "cpu_ratio": cpu_ratio, "bytes_ratio": byte_ratio, "wall_ratio": wall_ratio,
                           "load_average_end": load_average()})
    for g in groups.values():
        g.shutdown()
    ray.shutdown()
    print(f"\nwall time per step: previous / by reference = {wall_ratio:.2f}x")
    print(f"headline: driver overhead CPU per step (outside its own math), previous / by reference = "
          f"{cpu_ratio:.2f}x; "
          f"bytes through the driver = {byte_ratio:.1f}x fewer")


if __name__ == "__main__":
    main()
