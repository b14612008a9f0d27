"""SGLang weight intake: the distributed update (``rollout.weight_sync=distributed_group``: the trainer's rank 0
broadcasts flat buckets over a gloo group, ``trainer/sync/broadcast.py``) against the tensor update
that the object-store path ends in (``SGLangEngine.update_weights``: ``update_weights_from_tensor`` with
flattened buckets, one serialized payload per TP rank), into the same real SGLang 0.5.21 engine on CPU.

What is timed, per sync of the whole model (fp32 engine):
  * ``tensor``: ``SGLangEngine.update_weights(all tensors)``: cast + flatten each bucket, serialize, hand
    it to the scheduler, load; digests of what was sent. The Ray object-store hop in front of it (actor
    rank 0 -> engine worker) is NOT included, so this baseline is the tensor path's best case;
  * ``broadcast``: per bucket ``weight_broadcast.pack`` (flatten, digests, probe rows) on the sender, a gloo
    broadcast from this process (the sender, rank 0) to SGLang's scheduler (rank 1), which receives it
    through ``update_weights_from_distributed`` and loads it; bucket ``b + 1`` is packed while ``b`` is
    received (a sender thread), as the trainer's streaming generator does;
  * ``memcpy``: one ``copy_`` of the same number of bytes (the machine's floor).
Both syncs are checked after timing: the engine's checksum equals the pushed model's, and the probe rows
read back from SGLang (Llama) equal what was sent.

The model: a random Llama built here (hidden 512, 8 layers, 8 / 4 heads, MLP 1536, vocab 8192: 33.6M
params, 134 MB in fp32; ``--quick``: 4 layers, vocab 4096). sglang imports only in the SGLang CPU venv
(``python -m trainer.rollout.sglang_cpu install``), so from the project's interpreter this script re-runs
itself there.

    python benchmarks/bench_sglang_sync.py [--quick] [--json PATH] [--repeats N] [--bucket-mib M]

The last line is the headline: the broadcast's speed relative to the tensor update (tensor time / broadcast time).

Measured (2026-11-27, AMD EPYC 2 cores, load 1.5, 134 MB, 32 MiB buckets): broadcast 163 ms, tensor update
159 ms (0.98x), memcpy 7 ms. Both are dominated by SGLang's own ``load_weights`` on CPU; the broadcast's point is
engines on other nodes or GPUs (NCCL), where the tensor path would first go through Ray's object store.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def make_model(path: str, quick: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4 if quick else 8,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=4096 if quick else 8192,
                      max_position_embeddings=512, tie_word_embeddings=False, rope_scaling=None,
                      bos_token_id=None, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).float().save_pretrained(path)


def run(a) -> dict:
    import torch

    from _common import machine, summary, table, write_json
    from trainer.rollout import sglang_engine as se
    from trainer.rollout import weights as wf
    from trainer.rollout.engine import checksum_named_tensors
    from trainer.sync import broadcast as wb

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench_sglang_sync_")
    path = os.path.join(tmp, "model")
    make_model(path, a.quick)
    from safetensors.torch import load_file

    base = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    models = [base, {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in base.items()}]  # alternate
    nbytes = sum(t.numel() * 4 for t in base.values())
    bucket = a.bucket_mib << 20
    eng = se.SGLangEngine(path, device="cpu", dtype="float32", bucket_bytes=bucket)
    store = wb.host_store("127.0.0.1")
    world, name = 1 + eng.tp_size, "bench_weights"
    joined = {}
    t = threading.Thread(target=lambda: joined.update(pg=wb.join(store, world, name, "gloo")))
    t.start()
    eng.init_weight_sync_group("127.0.0.1", store.port, 1, world, group_name=name, backend="gloo")
    t.join()
    pg = joined["pg"]

    def tensor_sync(w):
        eng.update_weights(list(w.items()))

    def broadcast_sync(w):
        buckets = list(wf.iter_cast_buckets(list(w.items()), torch.float32, bucket))
        packed = [None] * len(buckets)

        def sender():  # packs bucket b + 1 while the engine receives b
            for i, b in enumerate(buckets):
                packed[i] = wb.pack(b, torch.float32, digests=True)
                ready[i].set()
                wb.send(pg, packed[i][0])
                packed[i] = (None, packed[i][1])  # the buffer is free once sent

        ready = [threading.Event() for _ in buckets]
        th = threading.Thread(target=sender)
        th.start()
        for i in range(len(buckets)):
            ready[i].wait()
            d = packed[i][1]
            eng.update_weights_broadcast(d["specs"], group_name=name, digests=d["digests"], probes=d["probes"])
        th.join()
        return len(buckets)

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = {"memcpy": [], "tensor": [], "broadcast": []}
    checks = {}
    try:
        n_buckets = broadcast_sync(models[1])  # warm-up of both paths, untimed
        tensor_sync(models[0])
        for r in range(a.repeats):  # interleaved, alternating models so every sync changes every byte
            w = models[r % 2]
            t0 = time.perf_counter()
            dst.copy_(src)
            times["memcpy"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tensor_sync(w)
            times["tensor"].append(time.perf_counter() - t0)
            w = models[(r + 1) % 2]
            t0 = time.perf_counter()
            broadcast_sync(w)
            times["broadcast"].append(time.perf_counter() - t0)
            want = checksum_named_tensors(w.items(), dtype=torch.float32)
            got = eng.weights_checksum()
            probes = eng.verify_weights_on_gpu()
            if got != want or not probes or set(probes.values()) != {0.0}:
                raise SystemExit(f"broadcast sync left the engine with other weights: checksum {got} != {want} "
                                 f"or probes {probes}")
            checks["broadcast"] = "checksum and probe read-back equal"
        tensor_sync(models[0])
        if eng.weights_checksum() != checksum_named_tensors(models[0].items(), dtype=torch.float32):
            raise SystemExit("tensor sync left the engine with other weights")
        checks["tensor"] = "checksum equal"
    finally:
        eng.destroy_weight_sync_group(name)
        wb.leave(pg)
        eng.shutdown()

    s = {k: summary(v) for k, v in times.items()}
    base_t = s["memcpy"]["best"]
    print(f"machine: {machine()} (shared machine: wall times are noisy; best of {a.repeats}, variants interleaved)")
    print(f"model: random Llama, {nbytes / 1e6:.1f} MB in fp32, {n_buckets} buckets of <= {a.bucket_mib} MiB; "
          f"engine: SGLang 0.5.21 CPU, TP 1, fp32; sender: this process (rank 0), gloo over loopback")
    rows = []
    labels = {"memcpy": "memcpy (copy_, 1 thread)", "tensor": "tensor update (object-store path's last hop)",
              "broadcast": "broadcast (weight_sync=distributed_group)"}
    for k in ("memcpy", "tensor", "broadcast"):
        rows.append([labels[k], s[k]["best"] * 1e3, s[k]["median"] * 1e3, nbytes / s[k]["best"] / 1e9,
                     f"{base_t / s[k]['best']:.3f}x"])
    print(table(["path", "best ms", "median ms", "GB/s", "vs memcpy"], rows, "{:.2f}"))
    ratio = s["tensor"]["best"] / s["broadcast"]["best"]
    result = {"bytes": nbytes, "buckets": n_buckets, "bucket_mib": a.bucket_mib, "times_s": times, "summary": s,
              "checks": checks, "machine": machine(), "broadcast_vs_tensor_speedup": ratio}
    write_json(a.json, result)
    print(f"headline: SGLang intake, {nbytes / 1e6:.0f} MB: broadcast {s['broadcast']['best'] * 1e3:.1f} ms vs "
          f"tensor update {s['tensor']['best'] * 1e3:.1f} ms: {ratio:.2f}x its speed "
          f"({nbytes / s['broadcast']['best'] / 1e9:.2f} GB/s, {base_t / s['broadcast']['best']:.3f}x memcpy)")
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, vocab 4096, 3 repeats")
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=None, help="default 5; quick 3")
    ap.add_argument("--bucket-mib", type=int, default=32)
    a = ap.parse_args(argv)
    a.repeats = a.repeats or (3 if a.quick else 5)
    from trainer.rollout import sglang_cpu

    if sglang_cpu.missing_reason() is not None:  # sglang lives in its own venv: run there
        py = sglang_cpu.server_python()
        if py is None:
            raise SystemExit(f"bench_sglang_sync needs the SGLang CPU install ({sglang_cpu.INSTALL_COMMAND})")
        raise SystemExit(subprocess.call([py, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]))
    return run(a)


if __name__ == "__main__":
    main()
