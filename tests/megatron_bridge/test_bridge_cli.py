"""`python -m megatron_bridge.logprobs` recomputes a dumped rollout's response log-probs through
megatron-core at PP=2 with two virtual stages per rank (a 4-layer model: 4 chunks of 1 layer), TP=2 + SP
with context parallelism 2 (4 ranks), and a Qwen3-MoE model with its experts split over 2 ranks, launching
its own gloo ranks; checked against transformers. (TP=2 + SP alone and the uneven PP=2 split are the bridge's
own parity tests, test_bridge_parity.py and test_sequence_parallel.py: here the CLI's launch and I/O, on the
layouts that exercise the most of it, three runs where there were five.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

from bridge_tiny import CASES, hf_reference, make_hf, random_seqs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.parametrize("par", [["--pp", "2", "--vpp", "2"], ["--tp", "2", "--sp", "--cp", "2"], ["--ep", "2"]])
def test_cli_recomputes_response_logprobs(tmp_path, par):
    src = str(tmp_path / "m")
    kind, kw = CASES["qwen3_qknorm_gqa1_untied"]  # 3 layers; 4 for two virtual stages on each of 2 ranks
    kw = {**kw, "num_hidden_layers": 4 if "--vpp" in par else kw["num_hidden_layers"]}
    if "--ep" in par:  # its mixture-of-experts twin, experts split over 2 ranks
        kind, kw = "qwen3_moe", {**kw, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "norm_topk_prob": True}
    model = make_hf(kind, src, **kw)
    seqs = random_seqs([7, 12, 4], seed=9)
    prompts = [3, 5, 1]  # the first p tokens are the prompt
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(inp, "w") as f:
        for s, p in zip(seqs, prompts):
            f.write(json.dumps({"prompt_ids": s[:p], "response_ids": s[p:], "uid": f"x{p}"}) + "\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "megatron_bridge.logprobs", "--model", src, *par, "--input", str(inp),
           "--out", str(out), "--temperature", "0.8", "--max-tokens", "16"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in open(out)]
    ref = hf_reference(model, seqs, temperature=0.8)
    assert len(lines) == len(seqs)
    for line, s, p, (rlp, _) in zip(lines, seqs, prompts, ref):
        assert line["uid"] == f"x{p}" and line["response_ids"] == s[p:]  # input fields kept
        assert len(line["logprobs"]) == len(s) - p
        # rlp[t-1] scores token t; response tokens are t = p .. L-1
        assert torch.allclose(torch.tensor(line["logprobs"]), rlp[p - 1:], atol=1e-4)
