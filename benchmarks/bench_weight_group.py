"""Weight sync through a torch.distributed group: a TP=2 megatron actor -> two separate rollout engine workers,
in GB/s, against a plain memcpy of the same bytes in the same run.

What is timed: ``rollout.sync_from(actor, verify=...)`` of the controller's own ``Cluster`` (built from the
config: the actor over 2 CPU slots, split placement, so the 2 native engines run in workers of their own; a
real local Ray cluster). Shared memory is turned off on the rollout (``rollout.use(...)`` without ``shared_memory``: what a
sync to engines on another node sees), so two transports remain, interleaved:

  * ``group`` (trainer/sync/dist_group.py, ``rollout.use("dist_group", ...)``): one gloo group of the
    2 actor ranks and the 2 engines; each rank packs only its own blocks (megatron_bridge/reshard.py) into
    buckets cast to the engine dtype and sends each to every engine point to point, packing the next while
    the last goes out; each engine places every bucket into its weights as it arrives. Verified: each rank
    hashes the blocks it sent (XXH3-128), each engine the blocks it placed, read back from its weights, and
    the driver compares them;
  * ``object store`` (the previous cross-node path): rank 0 all-gathers every TP parameter (gloo), yields
    HF-named buckets into Ray's object store and every engine loads them; verified: rank 0 hashes its
    stream and every engine its whole weights.

Baseline, same run, same bytes: ``dst.copy_(src)`` of one flat float32 tensor of the synced byte count (the
model's bytes) in the driver, one thread. Each engine receives the whole model, so a sync delivers 2x those
bytes; the ratio is (model bytes / sync time) / memcpy GB/s.

Model: ``bench_resharding.make_model`` (random-init Qwen2 built locally, nothing downloaded): 19M params =
77 MB in float32; ``--quick``: 5M params = 20 MB. Each measurement is the best of ``--repeats`` (the median
is printed too); bucket sizes (both paths) default to 8, 64 and 512 MiB (``--quick``: 8 and 512).
``--dtype bfloat16``: bf16 engines from the fp32 actor (the senders cast while packing).

    python benchmarks/bench_weight_group.py [--quick] [--json PATH] [--repeats N] [--buckets 8,64,512]
        [--dtype float32|bfloat16]

The last line printed is the headline: the verified group sync / memcpy, the verification's cost, and the
speed-up over the verified object-store path.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch  # noqa: E402

from _common import ROOT, load_average, machine, summary, table, timed, write_json  # noqa: E402
from bench_resharding import make_model  # noqa: E402

MiB = 1 << 20


def build_cluster(model_dir: str, run_dir: str, bucket_mib: int, dtype: str):
    from trainer.config import load_config
    from trainer.workers.cluster import Cluster

    cfg = load_config(["--config", os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml"),
        "--config", os.path.join(ROOT, "recipes", "cpu", "fp32.yaml"),  # the figures are fp32
       
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.placement=split",
        "actor_rollout_ref.rollout.num_engines=2",
        "actor_rollout_ref.rollout.name=native", f"actor_rollout_ref.rollout.dtype={dtype}",
        f"actor_rollout_ref.rollout.update_weights_bucket_megabytes={bucket_mib}",
        f"trainer.default_local_dir={run_dir}", "trainer.logger=[console]",
    ])
    return Cluster(cfg, total_steps=1)


def measure(model_dir: str, run_dir: str, buckets: list[int], repeats: int, dtype: str) -> dict:
    """Every variant, interleaved; returns the times and sizes."""
    t0 = time.perf_counter()
    cluster = build_cluster(model_dir, run_dir, buckets[-1], dtype)
    t_cluster = time.perf_counter() - t0
    res = cluster.rollout
    try:
        def sync(group: bool, verify: bool):  # no shared memory: as for engines on another node
            res.use(*(("dist_group", "object_store") if group else ("object_store",)))
            m = res.sync_from(cluster.actor, verify=verify)
            assert res.transport.startswith("distributed_group" if group else "object_store"), res.transport
            return m

        # First group sync, verified (and, after set-up, checked end to end against the actor's full
        # checksum): proves the engines end up with exactly the actor's weights.
        t0 = time.perf_counter()
        first = sync(True, True)
        t_setup = time.perf_counter() - t0
        nbytes = int(first["sync/bytes"])  # the model in the engine dtype, each element once
        src = torch.randn(nbytes // 4)  # same bytes, float32
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in once

        def memcpy():
            dst.copy_(src)

        times: dict[str, list[float]] = {"memcpy": []}
        for b in buckets:
            for k in ("group", "group verified", "object store", "object store verified"):
                times[f"{k} {b} MiB"] = []
        n_buckets: dict[str, int] = {}
        hash_s: dict[int, list[float]] = {b: [] for b in buckets}
        for b in buckets:
            res.bucket_bytes = b * MiB
            sync(True, False)  # first touch of this bucket size (buffers), untimed
            sync(False, False)
            for _ in range(repeats):  # interleaved: every variant sees the same machine load
                times["memcpy"].append(timed(memcpy)[0])
                for k, group, verify in (("group", True, False), ("group verified", True, True),
                                         ("object store", False, False), ("object store verified", False, True)):
                    t, m = timed(lambda: sync(group, verify))
                    times[f"{k} {b} MiB"].append(t)
                    n_buckets[f"{k} {b}"] = int(m["sync/buckets"])
                    if k == "group verified":
                        hash_s[b].append(m["sync/verify_seconds"])
        sync(True, True)
        want = cluster.actor.weights_checksum(dtype)
        assert res.engine_checksums() == [want] * res.size  # the last sync left exactly the actor's weights
    finally:
        cluster.shutdown()
    return dict(bytes=nbytes, cluster_start_s=t_cluster, setup_s=t_setup, times=times, n_buckets=n_buckets,
                hash_s=hash_s)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5M-param model, 3 repeats, buckets 8 and 512 MiB")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--repeats", type=int, default=None, help="default 5; quick 3")
    ap.add_argument("--buckets", default=None, help="bucket sizes in MiB, comma list (default 8,64,512; quick 8,512)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the engines' dtype")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    repeats = a.repeats or (3 if a.quick else 5)
    buckets = [int(x) for x in (a.buckets or ("8,512" if a.quick else "8,64,512")).split(",")]
    tmp = tempfile.mkdtemp(prefix="bench_weight_group_")
    model_dir = os.path.join(tmp, "model")
    n_params = make_model(model_dir, a.quick)
    import ray  # noqa: E402

    try:
        r = measure(model_dir, os.path.join(tmp, "run"), buckets, repeats, a.dtype)
    finally:
        ray.shutdown()  # stops worker log forwarding, so the headline stays the last line

    labels = {"group": "distributed group (gloo), verify off", "group verified": "distributed group (gloo), verified",
              "object store": "object store (previous path), verify off",
              "object store verified": "object store (previous path), verified"}
    mach = machine(f"ray {ray.__version__}")
    print(f"machine: {mach} (shared machine: wall times are noisy; best of {repeats}, variants interleaved)")
    nbytes = r["bytes"]
    summ = {k: summary(v) for k, v in r["times"].items()}
    gbps = {k: nbytes / s["best"] / 1e9 for k, s in summ.items()}
    base = gbps["memcpy"]
    rows = [["memcpy (driver, torch copy_, 1 thread)", "-", summ["memcpy"]["best"] * 1e3, summ["memcpy"]["median"] * 1e3,
             base, "1.000x (baseline)"]]
    for b in buckets:
        for kind in ("group", "group verified", "object store", "object store verified"):
            k = f"{kind} {b} MiB"
            rows.append([f"{labels[kind]}, {b} MiB buckets", r["n_buckets"][f"{kind} {b}"], summ[k]["best"] * 1e3,
                         summ[k]["median"] * 1e3, gbps[k], f"{gbps[k] / base:.3f}x"])
    print(f"\nactor TP=2 (2 Ray CPU slots), split placement: 2 native {a.dtype} engine workers, shared memory off; "
          f"random Qwen2, {n_params / 1e6:.1f}M params, {nbytes / 1e6:.1f} MB per sync in {a.dtype} (each engine "
          f"receives all of it); cluster start {r['cluster_start_s']:.1f}s, group set-up + first (end-to-end "
          f"checked) sync {r['setup_s']:.2f}s")
    print(table(["measure", "buckets", "best ms", "median ms", "GB/s", "vs memcpy"], rows, "{:.3f}"))
    result = dict(machine=mach, quick=a.quick, params=n_params, repeats=repeats, buckets_mib=buckets, dtype=a.dtype,
                  bytes=nbytes, cluster_start_s=r["cluster_start_s"], setup_s=r["setup_s"], times_s=summ, gbps=gbps,
                  n_buckets=r["n_buckets"], ratios={k: g / base for k, g in gbps.items()}, per_bucket={})
    for b in buckets:
        g, gv, ov = summ[f"group {b} MiB"], summ[f"group verified {b} MiB"], summ[f"object store verified {b} MiB"]
        overhead = gv["best"] / g["best"] - 1
        hs = summary(r["hash_s"][b])
        print(f"{b} MiB buckets: verification adds {overhead * 100:.0f}% to the group sync (best of {repeats}; medians: "
              f"{(gv['median'] / g['median'] - 1) * 100:.0f}%); the slowest process hashed for {hs['best'] * 1e3:.1f} ms "
              f"(best); verified group sync {ov['best'] / gv['best']:.2f}x faster than the verified object-store path")
        result["per_bucket"][b] = dict(verify_overhead=overhead, hash_s=hs, vs_object_store=ov["best"] / gv["best"])
    result["load_average_end"] = load_average()
    best_b = min(buckets, key=lambda b: summ[f"group verified {b} MiB"]["best"])
    best_o = min(buckets, key=lambda b: summ[f"object store verified {b} MiB"]["best"])
    kg, ko = f"group verified {best_b} MiB", f"object store verified {best_o} MiB"
    vs = summ[ko]["best"] / summ[kg]["best"]
    overhead = result["per_bucket"][best_b]["verify_overhead"]
    result["headline"] = {"bucket_mib": best_b, "ratio": gbps[kg] / base, "verify_overhead": overhead,
                          "vs_object_store": vs, "object_store_bucket_mib": best_o}
    write_json(a.json, result)
    print(f"headline: TP=2 actor -> 2 engine workers, verified distributed-group sync ({best_b} MiB buckets): "
          f"{gbps[kg]:.2f} GB/s = {gbps[kg] / base:.3f}x memcpy ({base:.2f} GB/s), verification +{overhead * 100:.0f}%, "
          f"{vs:.2f}x faster than the verified object-store path (its best, {best_o} MiB buckets)")
    return result


if __name__ == "__main__":
    main()
