"""The native engine: greedy = transformers, log-probs = a full forward, stop/length rules,
continuous batching, seeds, weight updates, abort and sleep."""

import random

import pytest
import torch

from trainer.rollout.engine import SamplingParams, checksum_named_tensors, iter_buckets
from trainer.rollout.native import NativeEngine

from .conftest import ARCHS, VOCAB, make_hf_model, save_model

# Different lengths on purpose, including a 1-token prompt.
PROMPT_LENS = (5, 1, 9, 3, 7)


def prompts_for(seed: int = 0, lens=PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (hf model, checkpoint dir)."""
    out = {}
    for arch in ARCHS:
        hf = make_hf_model(arch)
        out[arch] = (hf, save_model(hf, tmp_path_factory.mktemp(arch)))
    return out


def hf_greedy(hf, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    """transformers' own greedy generate on one unpadded prompt; trimmed after the first eos."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    resp = out[0, len(prompt):].tolist()
    if eos is not None and eos in resp:
        resp = resp[: resp.index(eos) + 1]
    return resp


def hf_logprobs(hf, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, from one full forward of prompt + response."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits[0].double()  # [P+R, V]
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)  # [R, V]
    return lp.gather(1, torch.tensor(response)[:, None]).squeeze(1)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_transformers_generate(tiny, arch):
    # A batch of five prompts of different lengths (max_batch_size 3, so rows also join mid-way),
    # greedy, 12 new tokens, against transformers' generate on each prompt alone.
    # The stop token is picked from prompt 0's free-running greedy output (its 6th token), so that
    # response ends early with "stop", stop token included, exactly where transformers stops.
    hf, path = tiny[arch]
    prompts = prompts_for(1)
    free = hf_greedy(hf, prompts[0], 12)
    eos = free[5]
    engine = NativeEngine(path, max_batch_size=3, max_seq_len=32)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[eos]))
    n_stop = 0
    for p, (o,) in zip(prompts, outs):
        ref = hf_greedy(hf, p, 12, eos=eos)
        assert o.token_ids == ref
        if ref[-1] == eos:
            n_stop += 1
            assert o.finish_reason == "stop"
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == 12
    assert outs[0][0].token_ids[-1] == eos and len(outs[0][0].token_ids) == free.index(eos) + 1
    assert n_stop >= 1


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_full_forward(tiny, arch, temperature):
    hf, path = tiny[arch]
    prompts = prompts_for(2)
    engine = NativeEngine(path, max_batch_size=4, max_seq_len=32)
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=temperature, max_new_tokens=10, seed=7))
    for p, group in zip(prompts, outs):
        for o in group:
            ref = hf_logprobs(hf, p, o.token_ids, temperature)
            assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0)


def test_logprobs_ignore_top_k_top_p_and_draws_respect_them(tiny):
    # With top-k 3 / top-p 0.8 the returned log-probs are still the full-vocabulary
    # log_softmax(logits / T) (what the trainer recomputes), and every drawn token is one of the 3
    # most likely under logits / T.
    hf, path = tiny["llama"]
    prompts = prompts_for(3)
    engine = NativeEngine(path, max_batch_size=8, max_seq_len=32)
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=0.8, top_k=3, top_p=0.8, max_new_tokens=8, seed=1))
    for p, group in zip(prompts, outs):
        for o in group:
            ref = hf_logprobs(hf, p, o.token_ids, 0.8)
            assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0)
            with torch.no_grad():
                logits = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1 : -1]
            top3 = logits.topk(3, dim=-1).indices
            assert all(t in top3[i].tolist() for i, t in enumerate(o.token_ids))


def test_greedy_logprob_is_temperature_one(tiny):
    hf, path = tiny["qwen2"]
    p = prompts_for(4)[2]
    (o,), = NativeEngine(path, max_batch_size=2, max_seq_len=32).generate([p], SamplingParams(temperature=0.0, max_new_tokens=6))
    assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), hf_logprobs(hf, p, o.token_ids, 1.0), atol=1e-5, rtol=0)


def test_stop_length_and_max_seq_len(tiny):
    hf, path = tiny["qwen3"]
    p = prompts_for(5)[2]  # 9 tokens
    free = hf_greedy(hf, p, 10)
    engine = NativeEngine(path, max_batch_size=4, max_seq_len=16)
    # Two stop ids: the response ends at whichever comes first, and includes it.
    stops = [free[3], free[7]]
    first = min(free.index(s) for s in stops)
    (o,), = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=stops))
    assert o.finish_reason == "stop" and o.token_ids == free[: first + 1] and len(o.logprobs) == first + 1
    # max_new_tokens=4 without stops: exactly 4 tokens, "length".
    (o,), = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert o.finish_reason == "length" and o.token_ids == free[:4]
    # max_seq_len 16 with a 9-token prompt leaves room for 7 tokens, however large max_new_tokens is.
    (o,), = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=50))
    assert o.finish_reason == "length" and len(o.token_ids) == 16 - 9 and o.token_ids == free[:7]
    # max_new_tokens=1 with the stop token as the very first token: "stop" wins over "length".
    (o,), = engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=1, stop_token_ids=[free[0]]))
    assert o.finish_reason == "stop" and o.token_ids == [free[0]]
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([list(range(16))], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[VOCAB]], SamplingParams(max_new_tokens=1))


def test_continuous_batching_equals_one_at_a_time(tiny):
    # 5 prompts x n=2 = 10 requests through 3 slots (rows finish, leave, and waiting ones join, with
    # different stop points) give exactly what one-request-at-a-time generation gives.
    hf, path = tiny["llama"]
    prompts = prompts_for(6)
    eos = hf_greedy(hf, prompts[1], 10)[4]
    sp = SamplingParams(n=2, temperature=0.0, max_new_tokens=10, stop_token_ids=[eos])
    batched = NativeEngine(path, max_batch_size=3, max_seq_len=32)
    out_b = batched.generate(prompts, sp)
    assert batched.stats["max_active"] == 3
    single = NativeEngine(path, max_batch_size=1, max_seq_len=32)
    out_s = [single.generate([p], sp)[0] for p in prompts]
    assert [[o.token_ids for o in g] for g in out_b] == [[o.token_ids for o in g] for g in out_s]
    assert [[o.finish_reason for o in g] for g in out_b] == [[o.finish_reason for o in g] for g in out_s]
    assert {o.finish_reason for g in out_b for o in g} == {"stop", "length"}


def test_sampling_is_seeded_and_independent_of_batching(tiny):
    hf, path = tiny["qwen2"]
    prompts = prompts_for(7)
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=123)
    a = NativeEngine(path, max_batch_size=2, max_seq_len=32).generate(prompts, sp)
    b = NativeEngine(path, max_batch_size=16, max_seq_len=32).generate(prompts, sp)
    tok = lambda out: [[o.token_ids for o in g] for g in out]  # noqa: E731
    assert tok(a) == tok(b)
    for ga, gb in zip(a, b):
        for oa, ob in zip(ga, gb):
            assert torch.allclose(torch.tensor(oa.logprobs), torch.tensor(ob.logprobs), atol=1e-5)
    # The n samples of one prompt differ from each other, and another seed gives other samples.
    assert len({tuple(o.token_ids) for o in a[2]}) == 3
    c = NativeEngine(path, max_batch_size=16, max_seq_len=32).generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=124))
    assert tok(c) != tok(a)


def test_long_response_does_not_stall_the_batch(tiny):
    # 2 slots. Prompt 0 wants 40 tokens, prompts 1-4 want 3 each (per-prompt params). The long one
    # needs 1 prefill draw + 39 decode steps; the 4 short ones (12 tokens) cycle through the other
    # slot meanwhile, so the whole call takes exactly 39 decode steps. A static batch would idle the
    # second slot until the long one ended (39 steps for the first pair, then 2+2+... more).
    hf, path = tiny["llama"]
    prompts = prompts_for(8)
    params = [SamplingParams(temperature=0.0, max_new_tokens=40)] + [SamplingParams(temperature=0.0, max_new_tokens=3)] * 4
    engine = NativeEngine(path, max_batch_size=2, max_seq_len=64)
    outs = engine.generate(prompts, params)
    assert [len(g[0].token_ids) for g in outs] == [40, 3, 3, 3, 3]
    assert engine.stats["decode_steps"] == 39 and engine.stats["max_active"] == 2
    single = NativeEngine(path, max_batch_size=1, max_seq_len=64)
    assert [g[0].token_ids for g in outs] == [single.generate([p], sp)[0][0].token_ids for p, sp in zip(prompts, params)]


def test_compaction_moves_rows_and_keeps_outputs(tiny):
    # 4 slots, requests with staggered lengths: when the early ones finish and no request waits,
    # the survivors in high slots are moved down (row_moves > 0); outputs stay those of single runs.
    hf, path = tiny["qwen3"]
    prompts = prompts_for(9, lens=(4, 6, 2, 8))
    params = [SamplingParams(temperature=0.0, max_new_tokens=m) for m in (2, 3, 12, 14)]
    engine = NativeEngine(path, max_batch_size=4, max_seq_len=32)
    outs = engine.generate(prompts, params)
    assert engine.stats["row_moves"] >= 1
    single = NativeEngine(path, max_batch_size=1, max_seq_len=32)
    assert [g[0].token_ids for g in outs] == [single.generate([p], sp)[0][0].token_ids for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.float32), ("qwen3", torch.bfloat16)])
def test_update_weights_equals_fresh_engine(tiny, tmp_path, arch, dtype):
    # Engine A starts from model 1 and receives model 2's HF state dict, shuffled and in ~20 KB
    # buckets; then it generates what a fresh engine on model 2 generates (greedy and seeded
    # sampling), and the checksums agree: A's, the fresh engine's, and the trainer-side function over
    # the fp32 stream cast to the engine dtype. bf16 exercises the re-packing of packed weights.
    _, path1 = tiny[arch]
    hf2 = make_hf_model(arch, seed=11)
    path2 = save_model(hf2, tmp_path / "m2")
    a = NativeEngine(path1, max_batch_size=4, max_seq_len=32, dtype=dtype)
    b = NativeEngine(path2, max_batch_size=4, max_seq_len=32, dtype=dtype)
    assert a.weights_checksum() != b.weights_checksum()
    items = list(hf2.state_dict().items())
    random.Random(0).shuffle(items)
    written = []
    for bucket in iter_buckets(items, bucket_bytes=20_000):
        written += a.update_weights(bucket)
    tied = hf2.config.tie_word_embeddings
    ignore = {"lm_head.weight"} if tied else set()
    assert sorted(written) == sorted(n for n, _ in items if n not in ignore)
    assert a.weights_checksum() == b.weights_checksum()
    assert a.weights_checksum() == checksum_named_tensors(items, dtype=dtype, ignore=ignore)
    prompts = prompts_for(10)
    for sp in (SamplingParams(temperature=0.0, max_new_tokens=8), SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)):
        oa, ob = a.generate(prompts, sp), b.generate(prompts, sp)
        assert [[o.token_ids for o in g] for g in oa] == [[o.token_ids for o in g] for g in ob]
        assert [[o.logprobs for o in g] for g in oa] == [[o.logprobs for o in g] for g in ob]


def test_abort_returns_partial_outputs(tiny):
    # abort() (normally from another thread) ends the call at the next step: every unfinished
    # request, running or still waiting, comes back with finish_reason "abort" and what it has.
    _, path = tiny["llama"]
    engine = NativeEngine(path, max_batch_size=2, max_seq_len=64)
    real_decode = engine.model.decode
    calls = {"n": 0}

    def decode_then_abort(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            engine.abort()
        return real_decode(*args, **kw)

    engine.model.decode = decode_then_abort
    outs = engine.generate(prompts_for(11), SamplingParams(temperature=0.0, max_new_tokens=30))
    reasons = [g[0].finish_reason for g in outs]
    assert reasons == ["abort"] * 5
    assert [len(g[0].token_ids) for g in outs] == [6, 6, 0, 0, 0]  # 1 prefill draw + 5 decode steps
    assert all(len(g[0].token_ids) == len(g[0].logprobs) for g in outs)
    engine.model.decode = real_decode
    # The abort flag does not leak into the next call.
    assert all(g[0].finish_reason == "length" for g in engine.generate(prompts_for(11), SamplingParams(temperature=0.0, max_new_tokens=3)))


def test_sleep_and_wake(tiny):
    _, path = tiny["qwen2"]
    engine = NativeEngine(path, max_batch_size=2, max_seq_len=32)
    sp = SamplingParams(temperature=0.0, max_new_tokens=5)
    before = engine.generate(prompts_for(12), sp)
    assert engine.cache is not None
    engine.sleep()
    assert engine.cache is None
    engine.wake()  # lazy: the next generate sizes the cache to its requests
    assert [g[0].token_ids for g in engine.generate(prompts_for(12), sp)] == [g[0].token_ids for g in before]
    ps = prompts_for(12)
    c = engine.cache  # all requests through the 2 slots; the longest prompt + 5 new tokens
    assert len(ps) > 2 and (c.max_batch, c.max_len) == (2, max(map(len, ps)) + 5)
    engine.sleep()
    short = min(range(len(ps)), key=lambda i: len(ps[i]))
    one = engine.generate([ps[short]], sp)  # one short request: a small cache, the same answer
    assert (engine.cache.max_batch, engine.cache.max_len) == (1, len(ps[short]) + 5)
    assert one[0][0].token_ids == before[short][0].token_ids
    engine.generate(ps, sp)  # a bigger call grows it
    assert (engine.cache.max_batch, engine.cache.max_len) == (2, max(map(len, ps)) + 5)
    full = engine.reserve()  # servers: the whole cache up front
    assert (full.max_batch, full.max_len) == (2, 32) and full.nbytes > 0


@pytest.mark.slow
def test_compiled_decode_equals_eager(tiny):
    # compile_decode=True (torch.compile of the static decode step) against the eager engine, on the
    # Qwen3 model (q/k norm, GQA 4:1): nine requests (five prompts, 1-2 samples) through 4 slots, each prompt with its
    # own max_new_tokens, so rows join and finish at different steps and the batch bucket shrinks
    # (3 or 4 rows run as a bucket of 4 with padding rows, the last request alone as 1: one graph each). Same seeded samples, log-probs to float rounding.
    _, path = tiny["qwen3"]
    prompts = prompts_for(7)
    params = [SamplingParams(temperature=1.0, n=1 if i == 4 else 2, max_new_tokens=m, seed=100 + i)
              for i, m in enumerate((9, 3, 11, 6, 16))]  # the last request outlives the others
    out = {}
    for compiled in (False, True):
        eng = NativeEngine(path, max_batch_size=4, max_seq_len=32, compile_decode=compiled)
        out[compiled] = eng.generate(prompts, params)
        if compiled:
            assert {1, 4} <= eng.stats["decode_buckets"], eng.stats["decode_buckets"]
            assert (eng.cache.max_batch, eng.cache.max_len) == (4, 32)  # static: power-of-two slots, full length
    for a_list, b_list in zip(out[False], out[True]):
        for a, b in zip(a_list, b_list):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.slow
def test_compiled_engines_each_have_their_own_recompile_budget(tiny):
    # Dynamo's recompile limit counts graphs per code object. Engines compiling one shared function
    # (a functools.partial of decode_step) shared it: with the limit at 2, the third engine's graph
    # raised FailOnRecompileLimitHit (the limit is 8; a test process, or a server hosting several
    # engines, reached it). Each engine now has its own code object, so three engines with a limit
    # of 2 all run, and each still gives the eager engine's samples. (Whether the shared budget
    # overflows depends on what the process compiled before, so the code objects are checked too.)
    import torch._dynamo

    _, path = tiny["qwen2"]
    prompts = prompts_for(2)[:2]
    sp = SamplingParams(temperature=1.0, n=2, max_new_tokens=3, seed=11)
    eager = NativeEngine(path, max_batch_size=4, max_seq_len=32).generate(prompts, sp)
    codes = []  # the code objects themselves, kept alive so that ids cannot be reused
    # config.patch, not monkeypatch: undoing a monkeypatch deletes the key from dynamo's config module
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(3):
            eng = NativeEngine(path, max_batch_size=4, max_seq_len=32, compile_decode=True)
            out = eng.generate(prompts, sp)
            assert [[o.token_ids for o in g] for g in out] == [[o.token_ids for o in g] for g in eager]
            codes.append(eng._decode_fn._torchdynamo_orig_callable.__code__)
    assert len({id(c) for c in codes}) == 3


@pytest.mark.slow
def test_compiled_decode_with_a_cpp_wrapper_equals_eager(tiny):
    # compile_options={"cpp_wrapper": True}: inductor launches the step's kernels from generated C++;
    # the samples must not change. Two prompts x 2 samples (one bucket of 4), staggered lengths.
    _, path = tiny["qwen2"]
    prompts = prompts_for(2)[:2]
    params = [SamplingParams(temperature=1.0, n=2, max_new_tokens=m, seed=7 + m) for m in (5, 3)]
    eager = NativeEngine(path, max_batch_size=4, max_seq_len=32).generate(prompts, params)
    eng = NativeEngine(path, max_batch_size=4, max_seq_len=32, compile_decode=True, compile_options={"cpp_wrapper": True})
    comp = eng.generate(prompts, params)
    assert 4 in eng.stats["decode_buckets"]
    for a_list, b_list in zip(eager, comp):
        for a, b in zip(a_list, b_list):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    with pytest.raises(ValueError, match="compile_decode=true"):
        NativeEngine(path, max_batch_size=4, max_seq_len=32, compile_options={"cpp_wrapper": True})


@pytest.mark.slow
def test_compiled_decode_with_cpp_gemm_templates_equals_eager(tiny):
    # decode_gemm="cpp": inductor's C++ GEMM template for the compiled step's matmuls (keys cached
    # transposed). fp32 Qwen3 (q/k norm, GQA), one bucket of 4 rows (autotuning each graph's shapes
    # takes a while, so one graph; the bucket logic is the aten test's): the seeded samples of the
    # eager engine, log-probs to float rounding. The CPP backend alone, so that every matmul of the
    # step runs on a template kernel (autotuning against ATEN may pick torch's for some shapes).
    _, path = tiny["qwen3"]
    prompts = prompts_for(2)[:2]
    params = [SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=40 + i) for i in range(2)]
    eager = NativeEngine(path, max_batch_size=4, max_seq_len=32).generate(prompts, params)
    eng = NativeEngine(path, max_batch_size=4, max_seq_len=32, compile_decode=True, decode_gemm="cpp",
                       compile_options={"max_autotune_gemm_backends": "CPP"})
    comp = eng.generate(prompts, params)
    assert eng.cache.keys_transposed and eng.cache.k[0].shape[-1] == 32  # [slots, K, D, max_len]
    assert eng.stats["decode_buckets"] == {4}, eng.stats["decode_buckets"]
    for a_list, b_list in zip(eager, comp):
        for a, b in zip(a_list, b_list):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    with pytest.raises(ValueError, match="compile_decode=true"):
        NativeEngine(path, decode_gemm="cpp")
    with pytest.raises(ValueError, match="'aten' or 'cpp'"):
        NativeEngine(path, compile_decode=True, decode_gemm="onednn")


@pytest.mark.slow
def test_compiled_decode_bf16_runs_on_a_bf16_cache(tiny):
    # bf16 weights + compiled decode: keys/values in bf16 (the model's dtype, as the eager engine),
    # attention as HF's eager order (bf16 scores and value product, fp32 softmax). Against the eager
    # bf16 engine: the prefill token and the first decode step agree (to bf16 rounding; later greedy
    # steps may part at a bf16 near-tie, as any two bf16 kernels' can). An fp32 cache stays available.
    _, path = tiny["qwen2"]
    prompts = prompts_for(3)
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    comp = NativeEngine(path, max_batch_size=8, max_seq_len=32, dtype=torch.bfloat16, compile_decode=True)
    ref = NativeEngine(path, max_batch_size=8, max_seq_len=32, dtype=torch.bfloat16)
    a, b = comp.generate(prompts, sp), ref.generate(prompts, sp)
    assert comp.cache.k[0].dtype == torch.bfloat16 and ref.cache.k[0].dtype == torch.bfloat16
    c = NativeEngine(path, max_batch_size=8, max_seq_len=32, dtype=torch.bfloat16, compile_decode=True,
                     kv_dtype="float32").generate(prompts, sp)
    for x, y, z in zip(a, b, c):
        assert x[0].token_ids[:2] == y[0].token_ids[:2] == z[0].token_ids[:2]
        # bf16 logits of a few units carry ~1e-2 rounding each: a tolerance that still flags a wrong cache
        assert max(abs(p - q) for p, q in zip(x[0].logprobs[:2], y[0].logprobs[:2])) < 0.1
        assert max(abs(p - q) for p, q in zip(z[0].logprobs[:2], y[0].logprobs[:2])) < 0.1


def _start_during_decode(engine, at: int, call):
    """Run ``call`` in a thread once the engine's running loop reaches decode step ``at``, and hold that
    step until the thread's requests are queued (or it has started its own wait), so the order of
    events does not depend on the machine's speed."""
    import threading
    import time

    real = engine.model.decode
    state = {"n": 0, "thread": None, "done_at": None, "out": None}

    def run():
        state["out"] = call()
        state["done_at"] = time.perf_counter()

    def hooked(*args, **kw):
        state["n"] += 1
        if state["n"] == at:
            queued = len(engine._queue)
            state["thread"] = threading.Thread(target=run)
            state["thread"].start()
            t0 = time.perf_counter()
            while len(engine._queue) == queued and state["done_at"] is None and time.perf_counter() - t0 < 0.5:
                time.sleep(0.001)  # the joiner queues its requests, or (cannot join) waits the 0.5 s out
        return real(*args, **kw)

    engine.model.decode = hooked
    return state


def test_a_concurrent_call_joins_the_running_loop(tiny):
    # Streaming admission: call A = one 40-token and one 2-token request on a 2-slot cache. When A's
    # loop is at decode step 3 its short request is done, and call B (3 prompts x 3 tokens) arrives from
    # another thread: B's requests take the free slot one after another while A's long one runs, so A's
    # loop still makes exactly 39 decode steps, and B returns before A. Both equal standalone calls.
    import time

    _, path = tiny["llama"]
    engine = NativeEngine(path, max_batch_size=2, max_seq_len=64)
    pa, pb = prompts_for(21, (5, 3)), prompts_for(22, (4, 6, 2))
    sa = [SamplingParams(temperature=0.0, max_new_tokens=40), SamplingParams(temperature=0.0, max_new_tokens=2)]
    sb = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=100 + i) for i in range(3)]
    state = _start_during_decode(engine, 3, lambda: engine.generate(pb, sb))
    outs_a = engine.generate(pa, sa)
    a_done = time.perf_counter()
    state["thread"].join()
    assert engine.stats["decode_steps"] == 39 and engine.stats["generated_tokens"] == 40 + 2 + 9
    assert state["done_at"] < a_done
    solo = NativeEngine(path, max_batch_size=2, max_seq_len=64)
    assert [g[0].token_ids for g in state["out"]] == [g[0].token_ids for g in solo.generate(pb, sb)]
    got = [lp for g in state["out"] for lp in g[0].logprobs]
    assert got == pytest.approx([lp for g in solo.generate(pb, sb) for lp in g[0].logprobs], abs=1e-5)
    assert [g[0].token_ids for g in outs_a] == [g[0].token_ids for g in solo.generate(pa, sa)]
    assert engine._queue is None  # the loop is over; the next call starts its own


def test_a_call_that_does_not_fit_waits_for_the_loop_and_an_abort_ends_both(tiny):
    _, path = tiny["llama"]
    engine = NativeEngine(path, max_batch_size=2, max_seq_len=64)
    pa, pb = prompts_for(23, (5, 3)), prompts_for(24, (4,))
    sa = SamplingParams(temperature=0.0, max_new_tokens=10)
    # B's prompt + budget (4 + 30) exceeds A's cache length (5 + 10): it waits, then runs its own loop
    state = _start_during_decode(engine, 2, lambda: engine.generate(pb, SamplingParams(temperature=0.0, max_new_tokens=30)))
    outs_a = engine.generate(pa, sa)
    state["thread"].join()
    assert engine.stats["decode_steps"] == 29  # B's own loop: 1 prefill draw + 29 decode steps
    assert [len(g[0].token_ids) for g in outs_a] == [10, 10] and len(state["out"][0][0].token_ids) == 30
    # an abort ends the running loop: the joined call's requests come back "abort" as well
    engine2 = NativeEngine(path, max_batch_size=1, max_seq_len=64)
    joiner = _start_during_decode(engine2, 2, lambda: engine2.generate(pb, SamplingParams(temperature=0.0, max_new_tokens=3)))
    hooked, n = engine2.model.decode, {"k": 0}

    def abort_at_5(*a, **kw):
        n["k"] += 1
        if n["k"] == 5:
            engine2.abort()
        return hooked(*a, **kw)
    engine2.model.decode = abort_at_5
    outs = engine2.generate(prompts_for(25, (5,)), SamplingParams(temperature=0.0, max_new_tokens=20))
    joiner["thread"].join()
    assert outs[0][0].finish_reason == "abort" and len(outs[0][0].token_ids) == 6
    assert joiner["out"][0][0].finish_reason == "abort" and joiner["out"][0][0].token_ids == []  # never got the slot
