"""The multi-turn agent loop: token/mask/log-prob alignment, incremental rendering, budgets, seeds.

Property tests drive the loop with a scripted engine (random sampled ids, log-probs and finish reasons)
and a scripted environment (random observations, tool messages, rewards, done flags) over a character
tokenizer with two chat templates built here (ChatML with tools and grouped tool responses, and a
Llama-3-style one). End-to-end tests run the real NativeEngine on a tiny random Qwen2 and check every
sampled log-prob against a transformers forward pass over the final token sequence.
"""

from __future__ import annotations

import asyncio
import functools
import random
import string

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from trainer.envs.base import Environment, StepResult
from trainer.rollout.engine import GenerationOutput, SamplingParams
from trainer.rollout.multi_turn import (EpisodeBudget, TemplateError, Trajectory, rollout_trajectories, run_multi_turn,
                                        trajectories_to_batch, turn_seed)

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]  # printable ASCII, "\t" and "\n"

# ChatML (Qwen-style): a system block that lists the tools, consecutive tool messages grouped into one
# user message of <tool_response> blocks, "\n" after every <|im_end|>.
CHATML = (
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ 'Tools:\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' -%}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and loop.first -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)
# Llama-3 style: BOS, header blocks, <|eot_id|> ends a message with no glue after it.
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{%- for m in messages -%}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif -%}"
)
TEMPLATES = {"chatml": (CHATML, "<|im_end|>"), "llama3": (LLAMA3, "<|eot_id|>")}


@functools.lru_cache(maxsize=None)
def char_tokenizer(template: str = "chatml"):
    """One id per character, plus special tokens matched whole (no hub, built here)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    chat, eos = TEMPLATES[template]
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token=eos, chat_template=chat)


def encode(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


def closing_glue(template: str, stopped: bool) -> str:
    # What the template writes after an assistant message's content, minus the sampled stop token.
    if template == "chatml":
        return "\n" if stopped else "<|im_end|>\n"
    return "" if stopped else "<|eot_id|>"


# --------------------------------------------------------------------------------------------------
# Scripted environment and engine
# --------------------------------------------------------------------------------------------------
class ScriptedEnv(Environment):
    """Answers step k with script[k]; records the actions it was given."""

    def __init__(self, script, tools=None, role="user"):
        self.script, self._tools, self.observation_role, self.actions = script, tools, role, []

    def reset(self, task, seed=None):
        return [dict(m) for m in task["prompt"]]

    def tools(self):
        return self._tools

    def step(self, action_text):
        self.actions.append(action_text)
        return self.script[min(len(self.actions), len(self.script)) - 1]


class ScriptedEngine:
    """``agenerate``: the outputs of request (trajectory, turn) come from ``script[(index, turn)]``, found
    through the request's derived seed; it records every request and yields to the event loop a random
    number of times, so trajectories interleave differently from run to run."""

    def __init__(self, script, seed, n_traj, max_turns, stop_id, shuffle_seed=0):
        self.script, self.stop_id = script, stop_id
        self.by_seed = {turn_seed(seed, i, t): (i, t) for i in range(n_traj) for t in range(max_turns)}
        self.requests: dict[tuple[int, int], tuple[list[int], SamplingParams, GenerationOutput]] = {}
        self.rng = random.Random(shuffle_seed)

    async def __call__(self, prompt_ids, params):
        for _ in range(self.rng.randint(0, 3)):
            await asyncio.sleep(0)
        key = self.by_seed[params.seed]
        ids, lps, stop = self.script[key]
        ids, lps = list(ids), list(lps)
        if stop:
            ids.append(self.stop_id)
            lps.append(-0.25)
        finish = "stop" if stop else "length"
        if not stop:  # like a real engine, sample until the cap (cycling the scripted ids)
            ids, lps = [ids[k % len(ids)] for k in range(params.max_new_tokens)], [lps[k % len(lps)] for k in range(params.max_new_tokens)]
        if len(ids) > params.max_new_tokens:  # the loop's cap (per turn or budget) applies
            ids, lps, finish = ids[: params.max_new_tokens], lps[: params.max_new_tokens], "length"
        out = GenerationOutput(ids, lps, finish)
        self.requests[key] = (list(prompt_ids), params, out)
        return [out]


def check_lockstep(traj: Trajectory):
    n = len(traj.response_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.step_ids) == n
    for m, lp, s in zip(traj.loss_mask, traj.logprobs, traj.step_ids):
        assert m in (0, 1)
        assert (s >= 0) == (m == 1)  # step ids exactly on sampled tokens
        if m == 0:
            assert lp == 0.0


# Random texts avoid "<", the first character of every special token, so no text spells one out
# character by character (the tokenizer would read it as the special token: not a canonical encoding).
ALPHA = [c for c in CHARS if c != "<"]
content_st = st.text(alphabet=st.sampled_from(ALPHA), max_size=10)


@st.composite
def conversations(draw):
    template = draw(st.sampled_from(sorted(TEMPLATES)))
    tok = char_tokenizer(template)
    n_traj = draw(st.integers(1, 3))
    max_a = draw(st.integers(1, 4))
    max_u = draw(st.integers(0, 4))
    per_turn = draw(st.integers(1, 8))
    slack = draw(st.one_of(st.none(), st.integers(1, 120)))  # token budget beyond the prompt
    tools = draw(st.sampled_from([None, [{"type": "function", "function": {"name": "calc", "parameters": {}}}]]))
    scripts, engine_script = [], {}
    # sampled ids: any character but "<", or any special token (a model may emit one mid-message)
    sample_ids = st.lists(st.sampled_from([i for i, x in enumerate(SPECIALS + CHARS) if x != "<"]), min_size=1, max_size=10)
    for i in range(n_traj):
        steps = []
        for _ in range(max_a):
            kind = draw(st.sampled_from(["text", "tools", "done", "none"]))
            reward = draw(st.sampled_from([0.0, 0.5, 1.0]))
            if kind == "text":
                steps.append(StepResult(draw(content_st), reward, False, {}))
            elif kind == "tools":
                msgs = [{"role": "tool", "name": "calc", "content": draw(content_st)} for _ in range(draw(st.integers(1, 3)))]
                steps.append(StepResult(msgs, reward, False, {}))
            elif kind == "done":
                steps.append(StepResult(draw(content_st), reward, True, {"success": reward == 1.0}))
            else:
                steps.append(StepResult(None, reward, False, {}))
        scripts.append(steps)
        for t in range(max_a):
            ids = draw(sample_ids)
            lps = [-draw(st.floats(0.0, 20.0, allow_nan=False)) for _ in ids]
            engine_script[(i, t)] = (ids, lps, draw(st.booleans()))
    opening = [{"role": "system", "content": draw(content_st)}] if draw(st.booleans()) else []
    opening.append({"role": "user", "content": draw(content_st)})
    tools_kw = {"tools": tools} if tools else {}
    prompt_len = len(encode(tok, tok.apply_chat_template(opening, tokenize=False, add_generation_prompt=True, **tools_kw)))
    return dict(template=template, tok=tok, n_traj=n_traj, max_a=max_a, max_u=max_u, per_turn=per_turn,
                budget=None if slack is None else prompt_len + slack, tools=tools, scripts=scripts, engine_script=engine_script, opening=opening,
                role=draw(st.sampled_from(["user", "tool"])), shuffle=draw(st.integers(0, 10**6)))


def run_scripted(c, seed=1234):
    tok = c["tok"]
    stop_id = tok.convert_tokens_to_ids(TEMPLATES[c["template"]][1])
    eng = ScriptedEngine(c["engine_script"], seed, c["n_traj"], c["max_a"], stop_id, c["shuffle"])
    envs = iter([ScriptedEnv(s, c["tools"], c["role"]) for s in c["scripts"]])
    tasks = [{"prompt": c["opening"], "data_source": f"src{i}"} for i in range(c["n_traj"])]
    seen = []
    trajs = asyncio.run(rollout_trajectories(
        eng, tok, lambda: next(envs), tasks, SamplingParams(max_new_tokens=c["per_turn"], seed=seed,
                                                            stop_token_ids=(stop_id,)),
        n=1, budget=EpisodeBudget(max_assistant_turns=c["max_a"], max_user_turns=c["max_u"],
                                  max_tokens_per_trajectory=c["budget"]),
        concurrency=2, on_append=lambda t: (check_lockstep(t), seen.append(len(t.response_ids)))))
    return trajs, eng, seen


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conversations())
def test_random_conversations_stay_aligned(c):
    trajs, eng, seen = run_scripted(c)
    tok, template = c["tok"], c["template"]
    assert seen  # the observer ran at every append (and checked the lockstep invariant there)
    for traj in trajs:
        check_lockstep(traj)
        # budgets
        assert 1 <= traj.num_turns <= c["max_a"] and traj.num_user_turns <= c["max_u"]
        if c["budget"] is not None:
            assert len(traj.prompt_ids) + len(traj.response_ids) <= c["budget"]
        # every assistant segment is exactly what the engine returned for that turn, at the place the
        # engine was given as prompt: environment turns shift nothing
        cursor = 0
        for t, (a, b) in enumerate(traj.turn_spans):
            prompt, params, out = eng.requests[(traj.index, t)]
            assert prompt == traj.prompt_ids + traj.response_ids[:a]
            assert traj.response_ids[a:b] == out.token_ids and traj.logprobs[a:b] == out.logprobs
            assert traj.step_ids[a:b] == [t] * (b - a) and traj.loss_mask[a:b] == [1] * (b - a)
            assert all(m == 0 for m in traj.loss_mask[cursor:a])  # context between turns
            cursor = b
        assert cursor == len(traj.response_ids)  # the response ends with a sampled segment
        # incremental rendering == apply_chat_template of the whole conversation (text), up to the
        # closing glue of the last assistant message
        full = tok.apply_chat_template(traj.messages, tokenize=False, add_generation_prompt=False,
                                       **({"tools": c["tools"]} if c["tools"] else {}))
        stopped = traj.turn_finish[-1] == "stop"
        assert full == traj.text + closing_glue(template, stopped)
        assert tok.decode(traj.token_ids, skip_special_tokens=False) == traj.text
        # tokens too: the char tokenizer's encoding is canonical (see ALPHA)
        ids = tok.apply_chat_template(traj.messages, tokenize=True, add_generation_prompt=False,
                                      **({"tools": c["tools"]} if c["tools"] else {}))["input_ids"]
        assert list(ids) == traj.token_ids + encode(tok, closing_glue(template, stopped))
        # finish reasons and rewards follow the env script
        steps = c["scripts"][traj.index][: len(traj.rewards)]
        assert traj.rewards == [s.reward for s in steps]
        if traj.finish_reason == "done":
            assert steps[-1].done or steps[-1].observation is None
        elif traj.finish_reason == "max_assistant_turns":
            assert traj.num_turns == c["max_a"]
        elif traj.finish_reason == "max_user_turns":
            assert traj.num_user_turns == c["max_u"]
        else:
            assert traj.finish_reason == "length" and c["budget"] is not None


def test_golden_chatml_trajectory():
    # Hand-checked layout of a two-turn tool conversation on the ChatML template. Turn 0 samples
    # "hi" + <|im_end|>; the env answers with two tool messages; turn 1 samples "ok" and is cut by the
    # per-turn cap (2 tokens): finish "length" on the turn, the trajectory ends on max_assistant_turns.
    tok = char_tokenizer("chatml")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    script = {(0, 0): (encode(tok, "hi"), [-1.0, -2.0], True), (0, 1): (encode(tok, "okay"), [-3.0, -4.0, -5.0, -6.0], False)}
    eng = ScriptedEngine(script, 7, 1, 2, im_end)
    env = ScriptedEnv([StepResult([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}], 0.5),
                       StepResult("not shown: no assistant turn is left to answer it", 0.25)])
    (traj,) = asyncio.run(rollout_trajectories(eng, tok, lambda: env, [{"prompt": [{"role": "user", "content": "q"}]}],
                                               SamplingParams(max_new_tokens=3, seed=7), budget=EpisodeBudget(max_assistant_turns=2)))
    assert tok.decode(traj.prompt_ids) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    ctx = "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    want = encode(tok, "hi") + [im_end] + encode(tok, ctx) + encode(tok, "oka")
    assert traj.response_ids == want
    n_ctx = len(encode(tok, ctx))  # "\n" glue + the tool block + the generation prompt: all mask 0
    assert traj.loss_mask == [1, 1, 1] + [0] * n_ctx + [1, 1, 1]
    assert traj.logprobs == [-1.0, -2.0, -0.25] + [0.0] * n_ctx + [-3.0, -4.0, -5.0]
    assert traj.step_ids == [0, 0, 0] + [-1] * n_ctx + [1, 1, 1]
    # the stop token is not part of the action text; the cut last turn is still judged by the env
    assert env.actions == ["hi", "oka"]
    assert traj.finish_reason == "max_assistant_turns" and traj.turn_finish == ["stop", "length"]
    assert traj.messages[-1] == {"role": "assistant", "content": "oka"} and traj.rewards == [0.5, 0.25]


def test_token_budget_truncates_cleanly():
    # Budget 40: prompt "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n" = 1+4+1+1+1+1+1+9+1 = 20 ids.
    # Turn 0 samples 5 chars + stop (26). The observation block "\n" + "<|im_start|>user\n" + "x"*10 +
    # "<|im_end|>\n" + "<|im_start|>assistant\n" is 1+1+5+10+1+1+1+10+1 = 31 ids: 26 + 31 + 1 > 40, so
    # the trajectory ends "length" after turn 0 without the observation.
    tok = char_tokenizer("chatml")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eng = ScriptedEngine({(0, 0): (encode(tok, "abcde"), [-1.0] * 5, True)}, 3, 1, 1, im_end)
    env = ScriptedEnv([StepResult("x" * 10, 0.0)])
    (traj,) = asyncio.run(rollout_trajectories(eng, tok, lambda: env, [{"prompt": [{"role": "user", "content": "q"}]}],
                                               SamplingParams(max_new_tokens=16, seed=3),
                                               budget=EpisodeBudget(max_tokens_per_trajectory=40)))
    assert len(traj.prompt_ids) == 20 and len(traj.response_ids) == 6
    assert traj.finish_reason == "length" and traj.num_user_turns == 0 and traj.loss_mask == [1] * 6
    # the per-turn cap follows the budget: 20 prompt ids leave 20 of max_new_tokens=16 -> 16
    assert eng.requests[(0, 0)][1].max_new_tokens == 16
    # with budget 24 the turn itself is cut at 4 tokens: finish "length" on the trajectory, env not stepped
    eng = ScriptedEngine({(0, 0): (encode(tok, "abcde"), [-1.0] * 5, True)}, 3, 1, 1, im_end)
    env = ScriptedEnv([StepResult("x", 0.0)])
    (traj,) = asyncio.run(rollout_trajectories(eng, tok, lambda: env, [{"prompt": [{"role": "user", "content": "q"}]}],
                                               SamplingParams(max_new_tokens=16, seed=3),
                                               budget=EpisodeBudget(max_tokens_per_trajectory=24)))
    assert traj.response_ids == encode(tok, "abcd") and traj.finish_reason == "length" and env.actions == []


def test_history_rewriting_template_is_refused():
    # A template that drops the content of earlier assistant messages (as Qwen3 drops old thinking)
    # is not prefix-stable: the loop raises instead of training on a context the model never saw.
    tok = char_tokenizer("chatml")
    bad = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' and not loop.last -%}"
           "{{ '<|im_start|>assistant\\n<|im_end|>\\n' }}{%- else -%}"
           "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}"
           "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eng = ScriptedEngine({(0, 0): (encode(tok, "ab"), [-1.0] * 2, True)}, 3, 1, 1, im_end)
    env = ScriptedEnv([StepResult("obs", 0.0)])
    with pytest.raises(TemplateError, match="prefix-stable"):
        asyncio.run(rollout_trajectories(eng, tok, lambda: env, [{"prompt": [{"role": "user", "content": "q"}]}],
                                         SamplingParams(max_new_tokens=4, seed=3), budget=EpisodeBudget(max_assistant_turns=2),
                                         chat_template_kwargs={"chat_template": bad}))


def _reference_batch_rows(trajs, P, T, pad):
    # Per-sample Python reference for trajectories_to_batch.
    rows = []
    for t in trajs:
        p = [pad] * (P - len(t.prompt_ids)) + t.prompt_ids
        k = len(t.response_ids)
        rows.append(dict(prompts=p, responses=t.response_ids + [pad] * (T - k), mask=t.loss_mask + [0] * (T - k),
                         attn=[1] * len(t.prompt_ids) + [1] * k, lps=t.logprobs + [0.0] * (T - k),
                         steps=t.step_ids + [-1] * (T - k)))
    return rows


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conversations())
def test_trajectories_to_batch_matches_reference(c):
    trajs, _, _ = run_scripted(c)
    P = max(len(t.prompt_ids) for t in trajs) + 3
    T = max(len(t.response_ids) for t in trajs) + 2
    b = trajectories_to_batch(trajs, pad_id=0, max_prompt_length=P, max_response_length=T,
                              meta={"ground_truth": [f"gt{i}" for i in range(c["n_traj"])]})
    ref = _reference_batch_rows(trajs, P, T, 0)
    for i, (t, r) in enumerate(zip(trajs, ref)):
        assert b.prompts[i].tolist() == r["prompts"] and b.responses[i].tolist() == r["responses"]
        assert b.response_mask[i].long().tolist() == r["mask"] and b.rollout_log_probs[i].tolist() == pytest.approx(r["lps"])
        assert b.step_ids[i].tolist() == r["steps"] and int(b.attention_mask[i].sum()) == sum(r["attn"])
        assert int(b.group_ids[i]) == t.task_index and float(b.acc[i]) == float(t.success)
    assert list(b.meta["finish_reason"]) == [t.finish_reason for t in trajs]
    assert list(b.meta["env_reward"]) == [t.reward for t in trajs]
    assert list(b.meta["num_turns"]) == [t.num_turns for t in trajs]
    assert list(b.meta["data_source"]) == [f"src{i}" for i in range(c["n_traj"])]
    assert list(b.meta["ground_truth"]) == [f"gt{t.task_index}" for t in trajs]
    longest = T - 2
    if longest > 1:  # a response longer than the width is an error, never silently cut
        with pytest.raises(ValueError, match="max_response_length"):
            trajectories_to_batch(trajs, pad_id=0, max_response_length=longest - 1)


# --------------------------------------------------------------------------------------------------
# The real engine
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A tiny random Qwen2 over the character vocabulary, saved with the ChatML tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = char_tokenizer("chatml")
    cfg = Qwen2Config(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name else 0.1 * torch.randn(p.shape, generator=g))
        # Make <|im_end|> likely (its logit is the hidden state's dot with its embedding row): without
        # this a random model rarely stops, and few turns would end with the stop token.
        model.model.embed_tokens.weight[2] *= 6.0
    path = tmp_path_factory.mktemp("tiny_chat")
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return model, tok, str(path)


def test_native_engine_per_prompt_seeds_are_position_independent(tiny_chat_model):
    from trainer.rollout.native import NativeEngine

    model, tok, path = tiny_chat_model
    eng = NativeEngine(path, max_batch_size=4, max_seq_len=64)
    prompts = [encode(tok, s) for s in ("ab", "hello", "xyz!", "q")]
    sps = [SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=s) for s in (11, 12, 13, 14)]
    solo = [eng.generate([p], sp)[0] for p, sp in zip(prompts, sps)]
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        outs = eng.generate([prompts[k] for k in order], [sps[k] for k in order])
        for pos, k in enumerate(order):
            assert [o.token_ids for o in outs[pos]] == [o.token_ids for o in solo[k]]
    # one params object keeps the positional key (seed, i, j): prompt 1 of a call differs from alone,
    # and equals what the same call gave before this change (the single-params path is untouched)
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=11)
    both = eng.generate([prompts[0], prompts[0]], sp)
    assert both[0][0].token_ids == solo[0][0].token_ids and both[1][0].token_ids != both[0][0].token_ids


def test_batcher_batches_seeded_requests_for_request_keyed_engines(tiny_chat_model):
    from trainer.rollout.async_engine import Batcher
    from trainer.rollout.native import NativeEngine

    model, tok, path = tiny_chat_model
    eng = NativeEngine(path, max_batch_size=4, max_seq_len=64)
    calls = []

    class Recording:
        request_keyed_seeds = True

        def generate(self, prompts, params):
            calls.append([sp.seed for sp in params])
            return eng.generate(prompts, params)

        def abort(self):
            eng.abort()

    items = [(encode(tok, s), SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=k))
             for k, s in enumerate(("ab", "cd", "ef", "gh", "ij"))]

    async def run():
        b = Batcher(Recording(), max_batch_samples=32, wait_s=0.0)
        futs = [asyncio.ensure_future(b.submit(p, sp)) for p, sp in items]
        await asyncio.sleep(0)
        b.start()
        res = await asyncio.gather(*futs)
        await b.stop()
        return res

    res = asyncio.run(run())
    assert calls == [[0, 1, 2, 3, 4]]  # five seeded requests in one engine call, in arrival order
    assert [[o.token_ids for o in r] for r in res] == [[o.token_ids for o in eng.generate([p], sp)[0]] for p, sp in items]


def hf_logprobs(model, ids, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()  # [L, V]
    return torch.log_softmax(logits / temperature, dim=-1)  # [L, V]; row k predicts ids[k + 1]


def test_end_to_end_native_engine_alignment_and_seeded_determinism(tiny_chat_model):
    from trainer.envs.puzzle import make_tasks
    from trainer.rollout.async_engine import EngineStats
    from trainer.rollout.native import NativeEngine

    model, tok, path = tiny_chat_model
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tasks = make_tasks(3, seed=0, max_discs=2)
    params = SamplingParams(temperature=0.9, max_new_tokens=10, stop_token_ids=(im_end,), seed=2024)
    kw = dict(n=2, budget=EpisodeBudget(max_assistant_turns=3, max_user_turns=3, max_tokens_per_trajectory=900))
    stats = EngineStats()
    eng = NativeEngine(path, max_batch_size=8, max_seq_len=1024)
    trajs = run_multi_turn(eng, tok, "hanoi", tasks, params, concurrency=4, stats=stats, **kw)
    assert len(trajs) == 6 and stats.max_batch_prompts > 1  # turns of several trajectories shared a call
    assert max(t.num_turns for t in trajs) >= 2 and any(t.num_user_turns for t in trajs)
    assert any(f == "stop" for t in trajs for f in t.turn_finish)
    for t in trajs:
        check_lockstep(t)
        # the sampler's log-prob of every sampled token == a full forward pass over the final sequence
        lp = hf_logprobs(model, t.token_ids, params.temperature)
        P = len(t.prompt_ids)
        pos = [k for k, m in enumerate(t.loss_mask) if m]
        want = torch.tensor([float(lp[P + k - 1, t.response_ids[k]]) for k in pos], dtype=torch.float64)
        got = torch.tensor([t.logprobs[k] for k in pos], dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        # and the token stream is what the template renders for the conversation
        stopped = t.turn_finish[-1] == "stop"
        full = tok.apply_chat_template(t.messages, tokenize=True, add_generation_prompt=False)["input_ids"]
        assert list(full) == t.token_ids + encode(tok, closing_glue("chatml", stopped))
    # the same seed with another concurrency limit (so other batches) gives the same trajectories
    again = run_multi_turn(NativeEngine(path, max_batch_size=3, max_seq_len=1024), tok, "hanoi", tasks, params,
                           concurrency=1, **kw)
    assert [t.token_ids for t in again] == [t.token_ids for t in trajs]
    assert [t.loss_mask for t in again] == [t.loss_mask for t in trajs]
    for a, b in zip(again, trajs):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    # and another seed gives other samples
    other = run_multi_turn(eng, tok, "hanoi", tasks, SamplingParams(**{**params.__dict__, "seed": 7}), concurrency=4, **kw)
    assert [t.response_ids for t in other] != [t.response_ids for t in trajs]
    b = trajectories_to_batch(trajs, pad_id=0)
    assert b.response_mask.sum().item() == sum(sum(t.loss_mask) for t in trajs)


# --------------------------------------------------------------------------------------------------
# Shipped environments through the loop, played by scripted policies
# --------------------------------------------------------------------------------------------------
def scripted_policy(tok, decide):
    """``agenerate`` that answers ``decide(prompt_text)`` + <|im_end|>, log-prob -1 per token."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    async def agenerate(prompt_ids, params):
        await asyncio.sleep(0)
        ids = encode(tok, decide(tok.decode(prompt_ids, skip_special_tokens=False)))[: params.max_new_tokens - 1] + [im_end]
        return [GenerationOutput(ids, [-1.0] * len(ids), "stop")]

    return agenerate


def test_calculator_env_through_the_loop():
    import json
    import re

    tok = char_tokenizer("chatml")

    def decide(prompt):
        last = prompt.rsplit("<|im_start|>", 2)[-2]  # the last message before the generation prompt
        if "<tool_response>" in last:
            return "<answer>" + re.search(r"<tool_response>\n(.*?)\n</tool_response>", last).group(1) + "</answer>"
        expr = re.search(r"Compute (.*)\.<\|im_end\|>", last).group(1)
        return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "\n</tool_call>"

    from trainer.envs.calculator import make_tasks

    tasks = make_tasks(4, seed=5)
    trajs = asyncio.run(rollout_trajectories(scripted_policy(tok, decide), tok, "calculator", tasks,
                                             SamplingParams(max_new_tokens=200, seed=1), n=2, concurrency=3))
    for t in trajs:
        assert t.success and t.reward == 1.0 and t.finish_reason == "done" and (t.num_turns, t.num_user_turns) == (2, 1)
        assert t.messages[-2]["role"] == "tool" and t.messages[-2]["content"] == tasks[t.task_index]["reward_model"]["ground_truth"]
        ids = tok.apply_chat_template(t.messages, tokenize=True, tools=[CALC_SCHEMA()], add_generation_prompt=False)["input_ids"]
        assert list(ids) == t.token_ids + encode(tok, "\n")
        assert '"name": "calculator"' in tok.decode(t.prompt_ids)  # the tool list reached the template
    b = trajectories_to_batch(trajs, pad_id=0)
    assert b.acc.tolist() == [1.0] * 8 and b.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(b.meta["data_source"]) == ["coxswain/calculator"] * 8


def CALC_SCHEMA():
    from trainer.envs.calculator import CALCULATOR_TOOL

    return CALCULATOR_TOOL.schema


def test_hanoi_env_through_the_loop_optimal_policy():
    import re

    from trainer.envs.puzzle import make_tasks, optimal_moves

    tok = char_tokenizer("chatml")

    def decide(prompt):
        discs = int(re.search(r"with (\d+) discs", prompt).group(1))
        return f"Move {optimal_moves(discs)[prompt.count('<|im_start|>assistant') - 1]}"

    tasks = make_tasks(6, seed=1, min_discs=1, max_discs=3)
    trajs = asyncio.run(rollout_trajectories(scripted_policy(tok, decide), tok, "hanoi", tasks,
                                             SamplingParams(max_new_tokens=20),
                                             budget=EpisodeBudget(max_assistant_turns=7, max_user_turns=6)))
    for t in trajs:
        d = tasks[t.task_index]["extra_info"]["discs"]
        assert t.success and t.rewards[-1] == 1.0 and t.num_turns == 2**d - 1 == t.num_user_turns + 1
        assert t.finish_reason == "done" and t.step_ids[-1] == 2**d - 2
    # a budget of one assistant turn fewer than the optimum: unsolved, ends on the turn budget
    trajs = asyncio.run(rollout_trajectories(scripted_policy(tok, decide), tok, "hanoi", [next(r for r in tasks if r["extra_info"]["discs"] >= 2)],
                                             SamplingParams(max_new_tokens=20),
                                             budget=EpisodeBudget(max_assistant_turns=2, max_user_turns=6)))
    assert not trajs[0].success and trajs[0].finish_reason == "max_assistant_turns" and trajs[0].reward == 0.0


def test_episode_budget_from_settings_and_loop_kwargs():
    import dataclasses

    from trainer.rollout.multi_turn import loop_kwargs

    mt = dict(environment="hanoi", max_assistant_turns=3, max_user_turns=2, max_tokens_per_trajectory=512,
              concurrency=4, max_response_length=160)
    b = EpisodeBudget.from_settings(mt)
    assert b == EpisodeBudget(max_assistant_turns=3, max_user_turns=2, max_tokens_per_trajectory=512,
                              max_response_tokens=160)
    assert loop_kwargs(mt) == {"budget": b, "concurrency": 4}
    assert b.token_cap(100) == 260 and b.token_cap(400) == 512 and EpisodeBudget().token_cap(5) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.max_user_turns = 9
    with pytest.raises(ValueError, match="max_assistant_turns"):
        EpisodeBudget(max_assistant_turns=0)


def test_routed_experts_of_every_turn_cover_the_whole_episode(tmp_path):
    """R3 with multi-turn: each turn's request re-feeds the episode so far; the trajectory keeps every input
    token's experts from the turn that first fed it (trainer.rollout.engine.extend_routes), tool tokens included,
    and the batch lays them on the prompt/response grid. Against transformers' own routing of the final token
    stream (one weight version here, so every turn routes alike: this checks coverage and alignment; which turn's
    rows are kept is checked in tests/rollout/test_engine.py and, across a weight push, tests/test_async_fully.py)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trainer.envs.puzzle import make_tasks
    from trainer.rollout.native import NativeEngine

    tok = char_tokenizer("chatml")
    cfg = Qwen3MoeConfig(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(1)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[2] *= 6.0  # <|im_end|> likely: turns end with the stop token
    model.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(temperature=0.9, max_new_tokens=10, stop_token_ids=(im_end,), seed=5, return_routed_experts=True)
    trajs = run_multi_turn(NativeEngine(str(tmp_path), max_batch_size=8, max_seq_len=1024), tok, "hanoi",
                           make_tasks(3, seed=0, max_discs=2), params, n=2, concurrency=4,
                           budget=EpisodeBudget(max_assistant_turns=3, max_user_turns=3, max_tokens_per_trajectory=900))
    assert max(t.num_turns for t in trajs) >= 2 and any(t.num_user_turns for t in trajs)
    batch = trajectories_to_batch(trajs, pad_id=0)
    P = batch.prompt_width
    for i, t in enumerate(trajs):
        ids = t.token_ids
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_router_logits=True)
        want = torch.stack([r.reshape(len(ids), -1) for r in out.router_logits], 1).topk(2, -1).indices.sort(-1).values
        # every token up to the last turn's last sampled one was fed, except that one (tool tokens appended
        # after the last turn, cut by a budget, were never fed either)
        last_fed = len(t.prompt_ids) + t.turn_spans[-1][1] - 1
        assert t.routes.shape == (last_fed, 2, 2), (t.routes.shape, len(ids), t.finish_reason)
        assert torch.equal(t.routes.long().sort(-1).values, want[:last_fed])
        grid = batch.routed_experts[i][P - len(t.prompt_ids):]  # the episode's tokens, then padding
        assert torch.equal(grid[:last_fed], t.routes) and (grid[last_fed:] == -1).all()
