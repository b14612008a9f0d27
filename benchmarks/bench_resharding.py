"""Resharding throughput: a megatron actor (TP=2, and TP=2 x PP=2) -> its rollout engines, in GB/s, against a
plain memcpy of the same bytes in the same run.

What is timed: ``rollout.sync_from(actor, verify=...)`` of the controller's own ``Cluster`` (built from the
config: the actor over ``trainer.n_gpus_per_node`` CPU slots, colocated, so each rank hosts its own native
engine: verl's hybrid engine; a real local Ray cluster, gloo). Two transports, interleaved:

  * ``shared memory`` (the default on one node, trainer/sync/shared_memory.py): the engines of the node hold
    one copy of their weights in a /dev/shm file; each rank writes only the blocks of its own shards
    (megatron_bridge/reshard.py) straight into it (no barrier: engines re-derive at their next pass; the
    driver starts the ranks on a doorbell, trainer/sync/doorbell.py, not a Ray call); verified: each rank compares,
    piece by piece while both are in cache, the bytes now in the engines' memory with the bytes it sent;
  * ``object store`` (the previous path, still used across nodes and for DeepSpeed): every rank walks
    megatron_bridge's bucketed HF iterator (a TP all-gather over gloo per parameter) and loads its
    engine from the gathered tensors; verified: each rank hashes its stream and its engine's weights.

Extra rows: ``gather only`` (the previous path's TP gathers inside the actor processes, nothing loaded)
and ``rollout.verify(actor)`` (both sides recompute their full checksums). ``extra MiB``: memory beyond
the engines' own weights (shared memory: none; the file replaces each engine's private copy).

Baseline, same run, same bytes: ``dst.copy_(src)`` of one flat float32 tensor of the synced byte count (the
model's bytes) in the driver, one thread. Each engine receives the whole model, so with k engines a sync
delivers k times those bytes; the ratio is sync GB/s / memcpy GB/s of the model's bytes.

Model: a random-init Qwen2 built locally with ``transformers`` (nothing is downloaded): hidden 384, 8
layers, vocab 8000 untied, 19M params = 77 MB in float32. ``--quick``: hidden 256, 4 layers, vocab 4000,
5M params = 20 MB. Each measurement is the best of ``--repeats`` (the median is printed too); object-store
bucket sizes default to 8, 64 and 512 MiB (``--quick``: 8 and 512); a shared-memory sync has no buckets.

    python benchmarks/bench_resharding.py [--quick] [--json PATH] [--repeats N] [--buckets 8,64,512]
        [--layouts tp2,tp2pp2] [--driver-zero-copy]

The last line printed is the headline: the verified shared-memory sync of the TP=2 actor / memcpy, the
verification's cost, and the speed-up over the object-store path.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


import torch  # noqa: E402

from _common import ROOT, load_average, machine, summary, table, timed, write_json  # noqa: E402

MiB = 1 << 20


def make_model(path: str, quick: bool) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if quick:
        kw = dict(vocab_size=4000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2)
    else:
        kw = dict(vocab_size=8000, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                  num_attention_heads=6, num_key_value_heads=2)
    cfg = Qwen2Config(max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10000.0,
                      bos_token_id=None, eos_token_id=1, pad_token_id=0, **kw)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


LAYOUTS = {"tp2": (2, 1), "tp2pp2": (2, 2)}  # (tensor, pipeline) parallel sizes; one slot (rank) each


def build_cluster(model_dir: str, run_dir: str, bucket_mib: int, tp: int = 2, pp: int = 1):
    from trainer.config import load_config
    from trainer.workers.cluster import Cluster

    cfg = load_config(["--config", os.path.join(ROOT, "recipes", "cpu", "tiny_grpo.yaml"),
        "--config", os.path.join(ROOT, "recipes", "cpu", "fp32.yaml"),  # the figures are fp32
       
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        f"trainer.n_gpus_per_node={tp * pp}", "trainer.nnodes=1", "trainer.placement=colocated",
        "actor_rollout_ref.rollout.name=native", "actor_rollout_ref.rollout.dtype=float32",
        f"actor_rollout_ref.rollout.update_weights_bucket_megabytes={bucket_mib}",
        f"trainer.default_local_dir={run_dir}", "trainer.logger=[console]",
    ])
    return Cluster(cfg, total_steps=1)


def _gather_in_worker(worker, bucket_bytes: int) -> float:
    import time as _t

    from megatron_bridge.export import iter_hf_weights

    t0 = _t.perf_counter()
    for bucket in iter_hf_weights(worker._module(), bucket_bytes):
        for _, t in bucket:
            t.detach().cpu()  # what weight_buckets does before yielding (no copy on CPU)
    return _t.perf_counter() - t0


def gather_only(cluster) -> int:
    """Every actor rank walks the bucketed HF iterator (TP gathers over gloo, clone) inside its own
    process; nothing leaves the workers. Uses Ray's ``__ray_call__`` to run a function on the actor."""
    import ray

    ray.get([w.__ray_call__.remote(_gather_in_worker, cluster.rollout.bucket_bytes) for w in cluster.actor.group.workers])
    return 0


def measure(model_dir: str, run_dir: str, tp: int, pp: int, buckets: list[int], repeats: int) -> dict:
    """Every variant for one actor layout, interleaved; returns the times and sizes."""
    t0 = time.perf_counter()
    cluster = build_cluster(model_dir, run_dir, buckets[-1], tp, pp)
    t_cluster = time.perf_counter() - t0
    res = cluster.rollout
    chosen = res.transports  # shared memory, then the path it falls back to
    try:
        # First sync, verified (and, after set-up, checked end to end against the actor's full checksum):
        # proves the engines end up with exactly the actor's weights.
        first = res.sync_from(cluster.actor, verify=True)
        assert res.transport == "shared_memory", res.transport
        nbytes = int(first["sync/bytes"])
        src = torch.randn(nbytes // 4)  # same bytes, float32
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in once

        def memcpy():
            dst.copy_(src)

        times: dict[str, list[float]] = {"memcpy": [], "shm": [], "shm verified": []}
        for b in buckets:
            for k in ("object store", "object store verified", "gather only"):
                times[f"{k} {b} MiB"] = []
        n_buckets: dict[int, int] = {}
        verify_t: list[float] = []

        def sync(shared: bool, verify: bool):
            res.use(*(chosen if shared else chosen[1:]))
            m = res.sync_from(cluster.actor, verify=verify)
            assert int(m["sync/bytes"]) == nbytes and res.transport.startswith("shared_memory" if shared else "object_store")
            return m

        sync(True, True)
        for b in buckets:  # one object-store bucket size at a time; the shared-memory rows every round
            res.bucket_bytes = b * MiB
            sync(False, False)  # first-touch of this bucket size, untimed
            for _ in range(repeats):  # interleaved: every variant sees the same machine load
                times["memcpy"].append(timed(memcpy)[0])
                for k, verify in (("shm", False), ("shm verified", True)):
                    times[k].append(timed(lambda: sync(True, verify))[0])
                for k, verify in (("object store", False), ("object store verified", True)):
                    t, m = timed(lambda: sync(False, verify))
                    times[f"{k} {b} MiB"].append(t)
                    n_buckets[b] = int(m["sync/buckets"])
                times[f"gather only {b} MiB"].append(timed(lambda: gather_only(cluster))[0])
                verify_t.append(timed(lambda: res.verify(cluster.actor))[0])  # raises on a mismatch
        res.use(*chosen)
        res.sync_from(cluster.actor, verify=True)
        file_mib = res.link("shared_memory").buffer_bytes() / MiB
    finally:
        cluster.shutdown()
    return dict(tp=tp, pp=pp, ranks=tp * pp, bytes=nbytes, cluster_start_s=t_cluster, times=times,
                n_buckets=n_buckets, verify_t=verify_t, file_mib=file_mib)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5M-param model, 3 repeats, TP=2 only (well under a minute)")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--repeats", type=int, default=None, help="default 5; quick 3")
    ap.add_argument("--buckets", default=None, help="object-store bucket sizes in MiB, comma list (default 8,64,512; quick 8,512)")
    ap.add_argument("--layouts", default=None, help="actor layouts, comma list of tp2, tp2pp2 (default both; quick tp2)")
    ap.add_argument("--driver-zero-copy", action="store_true",
                    help="RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1 in the driver as well as the workers")
    a = ap.parse_args(argv)
    if a.driver_zero_copy:
        os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1"  # read when ray is first imported
    torch.set_num_threads(1)
    repeats = a.repeats or (3 if a.quick else 5)
    buckets = [int(x) for x in (a.buckets or ("8,512" if a.quick else "8,64,512")).split(",")]
    layouts = (a.layouts or ("tp2" if a.quick else "tp2,tp2pp2")).split(",")
    tmp = tempfile.mkdtemp(prefix="bench_resharding_")
    model_dir = os.path.join(tmp, "model")
    n_params = make_model(model_dir, a.quick)
    runs = {}
    import ray  # noqa: E402

    try:
        for name in layouts:
            tp, pp = LAYOUTS[name]
            runs[name] = measure(model_dir, os.path.join(tmp, f"run_{name}"), tp, pp, buckets, repeats)
    finally:
        zero_copy_driver = ray._private.ray_constants.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS
        ray.shutdown()  # stops worker log forwarding, so the headline stays the last line

    labels = {"shm": "shared memory, verify off", "shm verified": "shared memory, verified (the trainer's sync)",
              "object store": "object store (previous path), verify off",
              "object store verified": "object store (previous path), verified",
              "gather only": "actor-side TP gather only (previous path's share)"}
    from trainer.sync import shared_memory as weight_shm

    copy = (f"C kernel, {weight_shm.KERNEL_PIECE >> 10} KiB pieces" if weight_shm.KERNEL is not None
            else f"Python fallback (no C kernel built), {weight_shm.PIECE >> 10} KiB pieces")
    mach = machine(f"ray {ray.__version__}, driver zero-copy tensors {'on' if zero_copy_driver else 'off'}, "
                   f"checked copy: {copy}")
    print(f"machine: {mach} (shared machine: wall times are noisy; best of {repeats}, variants interleaved)")
    result = dict(machine=mach, quick=a.quick, params=n_params, repeats=repeats, buckets_mib=buckets, layouts={})
    hb = buckets[-1]
    for name, r in runs.items():
        nbytes = r["bytes"]
        summ = {k: summary(v) for k, v in r["times"].items()}
        gbps = {k: nbytes / s["best"] / 1e9 for k, s in summ.items()}
        base = gbps["memcpy"]
        rows = [["memcpy (driver, torch copy_, 1 thread)", "-", "-", summ["memcpy"]["best"] * 1e3,
                 summ["memcpy"]["median"] * 1e3, base, "1.000x (baseline)"]]
        for k in ("shm", "shm verified"):
            rows.append([labels[k], "-", "0", summ[k]["best"] * 1e3, summ[k]["median"] * 1e3, gbps[k], f"{gbps[k] / base:.3f}x"])
        for b in buckets:
            for kind in ("object store", "object store verified", "gather only"):
                k = f"{kind} {b} MiB"
                rows.append([f"{labels[kind]}, {b} MiB buckets", r["n_buckets"][b], "-", summ[k]["best"] * 1e3,
                             summ[k]["median"] * 1e3, gbps[k], f"{gbps[k] / base:.3f}x"])
        v = summary(r["verify_t"])
        rows.append(["rollout.verify(actor) (both sides recompute)", "-", "-", v["best"] * 1e3, v["median"] * 1e3,
                     nbytes / v["best"] / 1e9, "-"])
        overhead = summ["shm verified"]["best"] / summ["shm"]["best"] - 1
        print(f"\nactor TP={r['tp']} x PP={r['pp']} ({r['ranks']} Ray CPU slots, gloo), colocated: {r['ranks']} native "
              f"engines sharing one {r['file_mib']:.1f} MiB weight file; random Qwen2, {n_params / 1e6:.1f}M params, "
              f"float32 = {nbytes / 1e6:.1f} MB per sync; cluster start {r['cluster_start_s']:.1f}s")
        print(table(["measure", "buckets", "extra MiB", "best ms", "median ms", "GB/s", "vs memcpy"], rows, "{:.3f}"))
        print(f"verification adds {overhead * 100:+.0f}% to the shared-memory sync (best of {repeats}; medians: "
              f"{(summ['shm verified']['median'] / summ['shm']['median'] - 1) * 100:+.0f}%)")
        result["layouts"][name] = dict(
            tp=r["tp"], pp=r["pp"], bytes=nbytes, cluster_start_s=r["cluster_start_s"], times_s=summ, gbps=gbps,
            n_buckets=r["n_buckets"], verify_s=v, ratios={k: g / base for k, g in gbps.items()},
            verify_overhead=overhead, file_mib=r["file_mib"],
            vs_object_store=summ[f"object store verified {hb} MiB"]["best"] / summ["shm verified"]["best"])
    result["load_average_end"] = load_average()
    head = result["layouts"][layouts[0]]
    result["headline"] = {"layout": layouts[0], "ratio": head["ratios"]["shm verified"],
                          "verify_overhead": head["verify_overhead"], "vs_object_store": head["vs_object_store"]}
    write_json(a.json, result)
    others = "; ".join(f"{n}: {x['ratios']['shm verified']:.3f}x memcpy, verification {x['verify_overhead'] * 100:+.0f}%"
                       for n, x in result["layouts"].items() if n != layouts[0])
    print(f"headline: {layouts[0]} actor -> engines, verified shared-memory sync: {head['gbps']['shm verified']:.2f} GB/s "
          f"= {head['ratios']['shm verified']:.3f}x memcpy ({head['gbps']['memcpy']:.2f} GB/s), verification "
          f"{head['verify_overhead'] * 100:+.0f}%, {head['vs_object_store']:.2f}x faster than the object-store path"
          + (f" ({others})" if others else ""))
    return result


if __name__ == "__main__":
    main()
