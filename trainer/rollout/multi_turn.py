"""Multi-turn agent rollout: the policy and an environment take turns; one token stream per trajectory.

A trajectory is ``prompt_ids`` (the opening messages rendered with the generation prompt) followed by
``response_ids``, the concatenation of two kinds of segments:

* sampled: the tokens the engine drew for one assistant turn, kept exactly as sampled (the stop token
  that ended the turn included), loss mask 1, the sampler's log-probs, step id = the turn's index;
* context: everything the chat template puts between two sampled segments -- the closing glue of the
  assistant message (e.g. ``"\\n"`` after ``<|im_end|>``, or ``<|im_end|>\\n`` when the turn was cut by
  its length cap), the environment's / tools' messages, and the next generation prompt
  (``<|im_start|>assistant\\n``) -- loss mask 0, log-prob 0.0, step id -1.

``response_ids``, ``loss_mask``, ``logprobs`` and ``step_ids`` are appended in lockstep, so their
lengths are equal after every append (checked there). A context segment is the text delta between two
renderings of the conversation, ``render(messages[:k'], add_generation_prompt=True)`` minus the text
so far (``render(messages[:k], add_generation_prompt=True)`` + the sampled text of the assistant message
in between). So the trajectory's text is, by construction, a prefix of ``apply_chat_template(messages)``
and the two differ only by the closing glue of the last assistant message (the stream stops at the
sampled stop token). A template that renders an earlier part of the conversation differently once more
messages follow (e.g. Qwen3 dropping the thinking of earlier turns), or a stop token that is not the
template's end-of-message token, breaks that; the loop then raises :class:`TemplateError` rather than
train on a context the model did not see. Token ids: a context segment is ``encode(delta)``; for a
tokenizer whose encoding of the whole text is the concatenation of the encodings of its pieces (a
character tokenizer; special tokens at the seams in general) the ids equal
``apply_chat_template(messages, tokenize=True)``'s, which the tests check.

Turns and budgets. An assistant message is the sampled text without its stop token. Each assistant
turn samples at most ``params.max_new_tokens`` tokens; a turn cut by that cap is still passed to the
environment (closing glue added by the template). After each assistant turn the environment steps;
the trajectory ends (``finish_reason``) when

    "done"                 the environment says done (or has no observation)
    "max_assistant_turns"  ``budget.max_assistant_turns`` assistant turns were sampled
    "max_user_turns"       ``budget.max_user_turns`` environment turns were already appended
    "length"               the token budget (prompt + response <= ``budget.max_tokens_per_trajectory``,
                           response <= ``budget.max_response_tokens``: the batch's response width) leaves
                           no room for the next observation plus one sampled token, or a turn was cut
                           by the budget or by the engine's sequence limit
    "abort"                the engine aborted the turn

An observation is only appended when another assistant turn follows, so the response always ends with
a sampled segment, and nothing is ever cut inside a segment.

Concurrency and determinism. The loop is ``async`` over ``agenerate(prompt_ids, params) ->
list[GenerationOutput]`` (``Batcher.submit`` in-process, or an HTTP fleet client); up to
``concurrency`` trajectories are in flight (an ``asyncio.Semaphore``) and the engine batches their
turns. Turn ``t`` of trajectory ``index`` (``task_index * n + sample_index``) samples with its own seed
``turn_seed(params.seed, index, t)``; an engine with ``request_keyed_seeds`` keys the random stream by
that seed alone, so a seeded rollout gives the same trajectories whatever the batching (which depends
on thread timing) or ``concurrency``. The environment's ``reset`` gets ``turn_seed(seed, index, "env")``.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Sequence

import torch

from trainer.batch import RolloutBatch
from trainer.envs import Environment, env_factory
from trainer.rollout.engine import GenerationOutput, SamplingParams, extend_routes
from trainer.rollout.single_turn import pad_left, pad_right, routes_grid

AGenerate = Callable[[list[int], SamplingParams], Awaitable[list[GenerationOutput]]]
FINISH_REASONS = ("done", "max_assistant_turns", "max_user_turns", "length", "abort")


class TemplateError(ValueError):
    """The chat template's rendering is not prefix-stable for this conversation (see module docstring)."""


def turn_seed(seed: int | None, index: int, turn: int | str) -> int | None:
    """The seed of one request: a 62-bit hash of (step seed, trajectory index, turn); None stays None."""
    if seed is None:
        return None
    h = hashlib.blake2b(f"coxswain-mt:{seed}:{index}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 2


@dataclass(frozen=True)
class EpisodeBudget:
    """When one episode must stop (module docstring, "Turns and budgets"); the same for every episode
    of a call."""

    max_assistant_turns: int = 4  # assistant turns sampled per episode
    max_user_turns: int = 4  # environment/tool turns appended per episode
    max_tokens_per_trajectory: int | None = None  # prompt + response tokens; None = no cap of its own
    max_response_tokens: int | None = None  # response tokens (the batch's response width); None = no cap

    def __post_init__(self):
        if self.max_assistant_turns < 1:
            raise ValueError(f"max_assistant_turns must be >= 1, got {self.max_assistant_turns}")
        if self.max_user_turns < 0:
            raise ValueError(f"max_user_turns must be >= 0, got {self.max_user_turns}")

    @classmethod
    def from_settings(cls, d: dict) -> "EpisodeBudget":
        """From the controller's multi-turn settings dict (keys ``environment``, ``max_assistant_turns``,
        ``max_user_turns``, ``max_tokens_per_trajectory``, ``concurrency``, ``max_response_length``; the
        environment and the concurrency are not part of an episode's budget and are ignored here)."""
        return cls(max_assistant_turns=int(d["max_assistant_turns"]), max_user_turns=int(d["max_user_turns"]),
                   max_tokens_per_trajectory=d["max_tokens_per_trajectory"],
                   max_response_tokens=d["max_response_length"])

    def token_cap(self, prompt_len: int) -> int | None:
        """The most tokens (prompt + response) a trajectory with this prompt may reach; None = no cap."""
        cap = self.max_tokens_per_trajectory
        if self.max_response_tokens is not None:  # the response must fit the batch's response width
            width = prompt_len + int(self.max_response_tokens)
            cap = width if cap is None else min(cap, width)
        return cap


@dataclass
class Trajectory:
    """One episode as tokens, aligned per token, plus its conversation and outcome."""

    index: int  # position in the call: task_index * n + sample_index
    task_index: int  # which task (row of `tasks`)
    sample_index: int  # which of the n samples of that task
    messages: list[dict]  # the conversation: opening messages, assistant texts, observations
    prompt_ids: list[int]  # the opening messages rendered with the generation prompt
    text: str = ""  # decoded form of prompt + response: the rendered conversation so far
    response_ids: list[int] = field(default_factory=list)  # everything after the prompt
    loss_mask: list[int] = field(default_factory=list)  # 1 on sampled tokens, 0 on context tokens
    logprobs: list[float] = field(default_factory=list)  # sampler log-prob of sampled tokens, 0.0 elsewhere
    step_ids: list[int] = field(default_factory=list)  # assistant-turn index of sampled tokens, -1 elsewhere
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of turn t in response_ids
    turn_finish: list[str] = field(default_factory=list)  # engine finish_reason of each turn
    rewards: list[float] = field(default_factory=list)  # reward of each environment step
    num_user_turns: int = 0  # observations appended
    success: bool = False  # the last step's info["success"] (else: total reward > 0)
    finish_reason: str = ""  # one of FINISH_REASONS
    info: dict = field(default_factory=dict)  # the last step's info
    data_source: str = ""  # the task's data_source
    # R3 (params.return_routed_experts): the experts each input token of token_ids was routed to when it was first
    # fed while sampling, [rows, layers, top_k] (trainer.rollout.engine.extend_routes over the turns); None: not asked
    routes: torch.Tensor | None = None

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None, step: int) -> None:
        """Append one segment to the four per-token lists together."""
        ids = list(ids)
        lps = [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]
        if len(lps) != len(ids):
            raise ValueError(f"segment of {len(ids)} tokens with {len(lps)} log-probs")
        self.response_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += lps
        self.step_ids += [step] * len(ids)
        n = len(self.response_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.step_ids) == n):
            raise AssertionError("per-token lists out of lockstep")


class ChatRenderer:
    """``apply_chat_template`` to text, and the tokenizer's encode/decode, with fixed tools and kwargs."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        if tools:
            self.kwargs["tools"] = tools

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _observation_messages(obs, role: str) -> list[dict]:
    if isinstance(obs, str):
        return [{"role": role, "content": obs}]
    return [dict(m) for m in obs]


async def run_trajectory(
    agenerate: AGenerate,
    tokenizer,
    env: Environment,
    task: dict,
    params: SamplingParams,
    *,
    index: int = 0,
    task_index: int = 0,
    sample_index: int = 0,
    budget: EpisodeBudget = EpisodeBudget(),
    chat_template_kwargs: dict | None = None,
    on_append: Callable[[Trajectory], None] | None = None,
) -> Trajectory:
    """Play one episode of ``env`` on ``task``; see the module docstring for the token layout."""
    seed = params.seed
    messages = list(env.reset(task, seed=turn_seed(seed, index, "env")))
    r = ChatRenderer(tokenizer, env.tools(), chat_template_kwargs)
    text = r.render(messages, add_generation_prompt=True)
    traj = Trajectory(index, task_index, sample_index, messages, r.encode(text), text=text,
                      data_source=str(task.get("data_source", "")))
    max_assistant_turns, max_user_turns = budget.max_assistant_turns, budget.max_user_turns
    token_cap = budget.token_cap(len(traj.prompt_ids))
    if token_cap is not None and len(traj.prompt_ids) >= token_cap:
        raise ValueError(f"task {task_index}: the prompt has {len(traj.prompt_ids)} tokens, no room in the "
                         f"trajectory budget of {token_cap} (raise max_tokens_per_trajectory or filter the task)")

    def append(ids, mask, lps, step):
        traj.append(ids, mask, lps, step)
        if on_append is not None:
            on_append(traj)

    while True:
        turn = traj.num_turns
        if turn >= max_assistant_turns:
            traj.finish_reason = "max_assistant_turns"
            break
        room = params.max_new_tokens if token_cap is None else token_cap - len(traj.prompt_ids) - len(traj.response_ids)
        cap = min(params.max_new_tokens, room)
        if cap < 1:
            traj.finish_reason = "length"
            break
        sp = replace(params, n=1, max_new_tokens=cap, seed=turn_seed(seed, index, turn))
        out = (await agenerate(traj.token_ids, sp))[0]
        if params.return_routed_experts:
            traj.routes = extend_routes(traj.routes, out.routed_experts)
        start = len(traj.response_ids)
        append(out.token_ids, 1, out.logprobs, turn)
        traj.turn_spans.append((start, len(traj.response_ids)))
        traj.turn_finish.append(out.finish_reason)
        stopped = out.finish_reason == "stop" and len(out.token_ids) > 0
        content = r.decode(out.token_ids[:-1] if stopped else out.token_ids)
        traj.messages.append({"role": "assistant", "content": content})
        traj.text += r.decode(out.token_ids)
        if out.finish_reason == "abort":
            traj.finish_reason = "abort"
            break
        if out.finish_reason == "length" and (cap < params.max_new_tokens or len(out.token_ids) < cap):
            traj.finish_reason = "length"  # cut by the trajectory budget or the engine's sequence limit
            break
        result = env.step(content)
        if inspect.isawaitable(result):
            result = await result
        traj.rewards.append(float(result.reward))
        traj.info = dict(result.info or {})
        if result.done or result.observation is None:
            traj.finish_reason = "done"
            break
        if traj.num_turns >= max_assistant_turns:
            traj.finish_reason = "max_assistant_turns"
            break
        if traj.num_user_turns >= max_user_turns:
            traj.finish_reason = "max_user_turns"
            break
        obs = _observation_messages(result.observation, env.observation_role)
        new_text = r.render(traj.messages + obs, add_generation_prompt=True)
        if not new_text.startswith(traj.text):
            raise TemplateError(_mismatch(traj.text, new_text, task_index))
        ids = r.encode(new_text[len(traj.text):])
        if token_cap is not None and len(traj.prompt_ids) + len(traj.response_ids) + len(ids) + 1 > token_cap:
            traj.finish_reason = "length"
            break
        append(ids, 0, None, -1)
        traj.messages += obs
        traj.text = new_text
        traj.num_user_turns += 1
    traj.success = bool(traj.info.get("success", traj.reward > 0))
    return traj


def _mismatch(have: str, new: str, task_index: int) -> str:
    k = next((i for i, (a, b) in enumerate(zip(have, new)) if a != b), min(len(have), len(new)))
    return (f"task {task_index}: the chat template renders the conversation differently once more messages follow "
            f"(at char {k}: had {have[max(0, k - 40):k + 40]!r}, now {new[max(0, k - 40):k + 40]!r}). The agent loop "
            f"keeps the sampled tokens, so it needs a prefix-stable template (no history rewriting such as "
            f"dropping earlier <think> blocks) and stop tokens equal to the template's end-of-message token.")


async def rollout_trajectories(
    agenerate: AGenerate,
    tokenizer,
    env: str | Callable[[], Environment],
    tasks: Sequence[dict],
    params: SamplingParams,
    n: int = 1,
    *,
    budget: EpisodeBudget = EpisodeBudget(),
    concurrency: int = 64,
    chat_template_kwargs: dict | None = None,
    on_append: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """``n`` trajectories per task (one fresh environment each), at most ``concurrency`` in flight.

    Returns them in (task, sample) order whatever order they finish in. ``params.n`` is ignored (each
    request samples one response); ``params.seed`` is the step seed the per-turn seeds derive from.
    """
    make_env = env_factory(env)
    sem = asyncio.Semaphore(max(1, concurrency))

    async def one(i: int, j: int) -> Trajectory:
        async with sem:
            return await run_trajectory(
                agenerate, tokenizer, make_env(), tasks[i], params, index=i * n + j, task_index=i, sample_index=j,
                budget=budget, chat_template_kwargs=chat_template_kwargs, on_append=on_append)

    return list(await asyncio.gather(*(one(i, j) for i in range(len(tasks)) for j in range(n))))


def loop_kwargs(multi_turn: dict) -> dict:
    """The ``budget`` and ``concurrency`` keywords of :func:`rollout_trajectories` / :func:`run_multi_turn`
    from the controller's multi-turn settings dict (see :meth:`EpisodeBudget.from_settings`)."""
    return dict(budget=EpisodeBudget.from_settings(multi_turn), concurrency=int(multi_turn["concurrency"]))


def run_multi_turn(
    engine,
    tokenizer,
    env: str | Callable[[], Environment],
    tasks: Sequence[dict],
    params: SamplingParams,
    n: int = 1,
    *,
    budget: EpisodeBudget = EpisodeBudget(),
    concurrency: int = 64,
    max_batch_samples: int | None = None,
    wait_s: float = 0.0,
    chat_template_kwargs: dict | None = None,
    stats=None,
) -> list[Trajectory]:
    """Synchronous entry: run :func:`rollout_trajectories` over a :class:`~trainer.rollout.async_engine.
    Batcher` on ``engine`` (in a fresh event loop) and return the trajectories.

    ``budget.max_tokens_per_trajectory`` is clamped to the engine's ``max_seq_len`` when it has one.
    ``max_batch_samples`` (default ``concurrency``) caps the requests of one engine call; ``wait_s`` is the batcher's quiet gap
    (0 suffices in-process: every trajectory whose turn came back submits its next one before the
    batcher runs again). ``stats``: an :class:`~trainer.rollout.async_engine.EngineStats` to fill.
    """
    from trainer.rollout.async_engine import Batcher

    limit = getattr(engine, "max_seq_len", None)
    if limit is not None:
        budget = replace(budget, max_tokens_per_trajectory=min(limit, budget.max_tokens_per_trajectory or limit))

    async def main() -> list[Trajectory]:
        batcher = Batcher(engine, max_batch_samples=max_batch_samples or concurrency, wait_s=wait_s, stats=stats)
        batcher.start()
        try:
            return await rollout_trajectories(
                batcher.submit, tokenizer, env, tasks, params, n, budget=budget, concurrency=concurrency,
                chat_template_kwargs=chat_template_kwargs)
        finally:
            await batcher.stop()

    return asyncio.run(main())


def trajectories_to_batch(
    trajs: Sequence[Trajectory],
    *,
    pad_id: int,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    group_ids: Sequence[int] | None = None,
    meta: dict[str, Sequence] | None = None,
) -> RolloutBatch:
    """A :class:`RolloutBatch` with one row per trajectory.

    prompts = the opening prompt (left-padded to ``max_prompt_length``, default the longest);
    responses = everything after it (right-padded to ``max_response_length``, default the longest; a
    longer response is an error, never silently cut); ``response_mask`` = the loss mask (sampled tokens),
    the attention mask covers context tokens too; ``rollout_log_probs`` (0 on context and padding);
    ``step_ids`` (-1 on context and padding); ``group_ids`` = ``group_ids[task_index]`` (default the task
    index); ``acc`` = success. ``meta`` holds ``env_reward`` (episode return), ``num_turns``,
    ``num_user_turns``, ``finish_reason``, ``data_source``, and ``meta[k][task_index]`` for each given key.
    """
    P = max_prompt_length or max((len(t.prompt_ids) for t in trajs), default=1)
    T = max_response_length or max((len(t.response_ids) for t in trajs), default=1)
    T = max(T, 1)
    for t in trajs:
        if len(t.response_ids) > T:
            raise ValueError(f"trajectory {t.index} has {len(t.response_ids)} response tokens, more than "
                             f"max_response_length {T} (make the token budget fit the response width)")
    p_ids, p_mask = pad_left([t.prompt_ids for t in trajs], P, pad_id)  # [B, P]
    r_ids, r_attn = pad_right([t.response_ids for t in trajs], T, pad_id, torch.long)  # [B, T]
    loss, _ = pad_right([t.loss_mask for t in trajs], T, 0, torch.bool)  # [B, T]
    lps, _ = pad_right([t.logprobs for t in trajs], T, 0.0, torch.float32)  # [B, T]
    steps, _ = pad_right([t.step_ids for t in trajs], T, -1, torch.long)  # [B, T]
    gids = [t.task_index if group_ids is None else group_ids[t.task_index] for t in trajs]
    rows: dict[str, list[Any]] = {
        "env_reward": [t.reward for t in trajs],
        "num_turns": [t.num_turns for t in trajs],
        "num_user_turns": [t.num_user_turns for t in trajs],
        "finish_reason": [t.finish_reason for t in trajs],
        "data_source": [t.data_source for t in trajs],
    }
    for k, vals in (meta or {}).items():
        rows[k] = [vals[t.task_index] for t in trajs]
    extra = {"routed_experts": routes_grid([t.routes for t in trajs], [len(t.prompt_ids) for t in trajs], P, T)} \
        if any(t.routes is not None for t in trajs) else {}
    return RolloutBatch.from_tokens(
        p_ids, r_ids, p_mask, r_attn, response_mask=loss, meta=rows,
        rollout_log_probs=lps, step_ids=steps, group_ids=torch.as_tensor(gids, dtype=torch.long),
        acc=torch.tensor([float(t.success) for t in trajs], dtype=torch.float32), **extra)
