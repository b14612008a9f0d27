"""The LLM judge of ADCA-GRPO: an OpenAI-compatible chat client, and step flags from its answers.

Two layers.

``ChatClient`` speaks OpenAI-compatible ``POST {base_url}/chat/completions`` (DashScope's
compatible mode, OpenAI, vLLM, SGLang, or our own ``python -m trainer.serve``) with aiohttp:

* **Key.** Read once from the environment variable named by ``api_key_env`` (``DASHSCOPE_API_KEY`` as
  AgentEvolver's recipe sets it) and sent as ``Authorization: Bearer``. It is never logged: headers
  are not logged, and every log line has any occurrence of the key replaced by ``***``. An unset
  variable sends no header (a local server without a key) and is warned about once.
* **Concurrency.** At most ``concurrent`` HTTP requests in flight (an asyncio semaphore held per
  attempt, not during backoff waits).
* **Rate.** A token bucket: ``rate_limit_per_s`` tokens per second, capacity ``rate_limit_burst``
  (default 1: requests start at least ``1/rate`` apart); every attempt, retries included, takes one.
  So ``m`` attempts take at least ``(m - burst) / rate`` seconds.
* **Timeout.** Each attempt has ``request_timeout`` seconds in total (connect, send, wait, read).
* **Retries**, at most ``max_retries`` after the first attempt, on: HTTP 408, 409, 429 and 5xx; a
  timeout; a connection error (refused, reset, disconnected); a 200 whose body is not JSON or has no
  ``choices[0].message``. Any other status (400, 401, 403, 404, 422, ...) fails at once: a retry
  cannot fix it. The wait before retry r (r = 0 for the first retry) is

      b_r   = min(backoff_max, backoff_base * 2^r)
      d_r   = b_r * (1 - jitter * U),  U ~ Uniform[0, 1)          ("equal jitter": d_r in [b_r/2, b_r])
      wait  = max(d_r, min(retry_after, retry_after_max))          when the response had Retry-After
      wait  = d_r                                                   otherwise

  ``Retry-After`` (seconds, or an HTTP date) is honoured as a lower bound, capped by
  ``retry_after_max`` so that a server asking for an hour cannot stall training; so
  ``wait <= max(backoff_max, retry_after_max)`` always.
* **Log.** With ``log_dir`` set, one JSONL file per client (``judge-<time>-<pid>-<id>.jsonl``) gets a
  line per attempt: the request payload, the status, the response (parsed JSON, or the raw text when
  it is not JSON), the error, the latency and the wait before the next attempt; plus one ``parsed``
  line per judge call (the flags or the parse problem).
* **No exceptions.** ``chat`` returns a :class:`ChatResult` whose ``ok`` says whether an answer came
  back; only cancellation propagates.

``JudgeClient`` is the ADCA layer (AgentEvolver's "self-attributing" step judge, Zhai et al. 2025,
arXiv:2511.10395; semantics from modelscope/AgentEvolver ``semantic_attribution.py`` and ``prompt.py``,
the prompt written here independently):

* For a trajectory (query, K steps, outcome score) :func:`build_judge_messages` writes a system message
  with the rules (a step of a successful trajectory is GOOD when it moved the task towards the
  outcome; a step of a failed one is GOOD only when it detected or fixed a problem) and a user
  message with the task, the numbered steps (action, and observation when there is one, each cut at
  ``max_step_chars``) and the outcome score with its polarity (``score > success_threshold``).
* :func:`parse_step_flags` reads one label per step: lines like ``Step 3: GOOD`` (``Step 3 Judgment:
  **BAD**`` and similar markdown too), numbered 1..K (0..K-1 is accepted as well: AgentEvolver's
  prompt numbers from 0). Without numbered labels, exactly K bare upper-case ``GOOD``/``BAD`` words are
  read in order. Anything else -- missing steps, extra steps, a different count of bare words, an
  empty answer -- is a parse failure: no guessing (AgentEvolver truncates extra labels; we do not).
* A parse failure is retried ONCE with a stricter prompt (the same task, plus an instruction to answer
  with exactly K lines ``Step i: GOOD|BAD`` and nothing else, naming what was wrong). If that fails
  too, or the transport failed after its retries, the trajectory falls back to outcome-only credit:
  ``None`` in the result, counted in ``adca/judge_fallbacks`` and ``adca/judge_fallback_fraction``.
* ``judge_many`` returns, per trajectory, a list of K flags (+1 GOOD, -1 BAD), ``[]`` for a
  trajectory without steps (no call is made), or ``None`` (fallback). ``judge_batch`` is the
  synchronous wrapper (safe to call from inside a running event loop too: it then runs in a helper
  thread) and returns ``(flags, metrics)``; no exception escapes it.

Metrics of one ``judge_many`` (floats):
  adca/judge_trajectories    trajectories with >= 1 step (those the judge is asked about)
  adca/judge_calls           judge calls: first prompts plus stricter retries (transport retries excluded)
  adca/judge_http_requests   HTTP attempts
  adca/judge_retries         transport retries (attempts after the first of a call)
  adca/judge_format_retries  stricter-prompt retries after an unparseable answer
  adca/judge_errors          calls that got no answer (retries exhausted, non-retryable status, or a
                             bug caught here)
  adca/judge_fallbacks       trajectories that fell back to outcome-only credit
  adca/judge_fallback_fraction  judge_fallbacks / judge_trajectories (0 when none was asked)
  adca/judge_latency_mean_s, adca/judge_latency_max_s   per call, retries and waits included
  adca/judge_wall_s          wall time of the whole batch
Note: ``trainer.algos.adca.compute_adca_grpo_advantage(num_fallback=...)`` reports its own
``adca/judge_fallback_fraction`` over the whole batch (skipped samples included); pass it
``adca/judge_fallbacks`` when you want that definition.
"""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import json
import logging
import math
import os
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import aiohttp

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 409, 429})  # plus every 5xx


# --------------------------------------------------------------------------------------------------
# pure helpers: backoff, Retry-After, token bucket
# --------------------------------------------------------------------------------------------------
def backoff_delay(retry: int, *, base: float, cap: float, jitter: float = 0.5, u: float = 0.0,
                  retry_after: float | None = None, retry_after_max: float = 60.0) -> float:
    """Seconds to wait before retry number ``retry`` (0-based); formula in the module docstring.
    ``u`` in [0, 1) is the jitter draw."""
    b = min(cap, base * (2.0 ** min(retry, 60)))  # the exponent is capped so 2^r cannot overflow
    d = b * (1.0 - jitter * u)
    if retry_after is not None and retry_after > 0:
        d = max(d, min(retry_after, retry_after_max))
    return max(0.0, d)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds from now: delta-seconds (a float is accepted too) or an HTTP date.
    None when absent or unreadable; never negative."""
    if value is None:
        return None
    value = value.strip()
    try:
        secs = float(value)
        return max(0.0, secs) if math.isfinite(secs) else None
    except ValueError:
        pass
    try:
        dt = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if dt is None:
        return None
    return max(0.0, dt.timestamp() - (time.time() if now is None else now))


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` stored; ``acquire`` waits for one (FIFO)."""

    def __init__(self, rate: float, burst: float = 1.0, clock: Callable[[], float] = time.monotonic):
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.rate, self.burst, self.clock = float(rate), max(1.0, float(burst)), clock
        self.tokens = self.burst
        self.last = clock()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:  # waiters are served in arrival order
            while True:
                now = self.clock()
                self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
                self.last = now
                if self.tokens >= 1.0:
                    self.tokens -= 1.0
                    return
                await asyncio.sleep((1.0 - self.tokens) / self.rate)


# --------------------------------------------------------------------------------------------------
# the transport
# --------------------------------------------------------------------------------------------------
@dataclass
class ChatResult:
    ok: bool  # an answer came back (text may still be empty)
    text: str | None = None
    status: int | None = None  # HTTP status of the last attempt (None: no response)
    attempts: int = 0
    error: str | None = None  # why there is no answer
    latency_s: float = 0.0  # the whole call: attempts, waits and queueing
    body: Any = None  # the last response's JSON


class _Malformed(Exception):
    """A 200 whose body is not a chat completion (retried like a transport error)."""


class _JsonlLog:
    """Append-only JSONL with the secret scrubbed from every line."""

    def __init__(self, log_dir: str, secret: str | None):
        os.makedirs(log_dir, exist_ok=True)
        name = f"judge-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}.jsonl"
        self.path = os.path.join(log_dir, name)
        self.secret = secret
        self._lock = threading.Lock()

    def write(self, rec: dict) -> None:
        try:
            line = json.dumps(rec, ensure_ascii=False, default=str)
            if self.secret:
                line = line.replace(self.secret, "***")
            with self._lock, open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except Exception:  # noqa: BLE001 - a full disk must not stop training
            logger.exception("judge: could not write the evaluation log %s", self.path)


class ChatClient:
    """OpenAI-compatible chat completions with bounded concurrency, rate limit, retries and a log.

    Use inside a running event loop: ``async with client: r = await client.chat(messages)``. The
    session, semaphore and bucket belong to the loop that entered the context; a client may be entered
    again (sequentially) from a new loop, as :meth:`JudgeClient.judge_batch` does per batch.
    """

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = "DASHSCOPE_API_KEY",
                 concurrent: int = 8, max_retries: int = 5, request_timeout: float = 60.0,
                 rate_limit_per_s: float | None = None, rate_limit_burst: float = 1.0, log_dir: str | None = None,
                 backoff_base: float = 0.5, backoff_max: float = 30.0, retry_after_max: float = 60.0,
                 jitter: float = 0.5, default_params: Mapping[str, Any] | None = None, seed: int | None = None):
        if concurrent < 1:
            raise ValueError(f"concurrent must be >= 1, got {concurrent}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {jitter}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self._api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not self._api_key:
            logger.warning("judge: $%s is not set; requests to %s carry no API key", api_key_env, self.url)
        self.concurrent, self.max_retries, self.request_timeout = int(concurrent), int(max_retries), float(request_timeout)
        self.rate_limit_per_s, self.rate_limit_burst = rate_limit_per_s, rate_limit_burst
        self.backoff_base, self.backoff_max, self.retry_after_max, self.jitter = backoff_base, backoff_max, retry_after_max, jitter
        self.default_params = dict(default_params or {})
        self.log = _JsonlLog(log_dir, self._api_key) if log_dir else None
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._bucket: TokenBucket | None = None
        self.counters = {"http_requests": 0, "retries": 0}

    async def __aenter__(self) -> "ChatClient":
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        # limit=0: the semaphore, not the connector, bounds concurrency.
        self._session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0))
        self._sem = asyncio.Semaphore(self.concurrent)
        self._bucket = TokenBucket(self.rate_limit_per_s, self.rate_limit_burst) if self.rate_limit_per_s else None
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = self._sem = self._bucket = None

    def _log(self, rec: dict) -> None:
        if self.log is not None:
            self.log.write(rec)

    async def _attempt(self, payload: dict) -> tuple[int, Any, str | None, dict]:
        """One HTTP request: ``(status, json body or None, raw text, headers)``; raises on transport errors."""
        async with self._sem:
            if self._bucket is not None:
                await self._bucket.acquire()
            self.counters["http_requests"] += 1
            timeout = aiohttp.ClientTimeout(total=self.request_timeout)
            async with self._session.post(self.url, json=payload, timeout=timeout) as resp:
                raw = await resp.text(errors="replace")
                try:
                    body = json.loads(raw)
                except json.JSONDecodeError:
                    body = None
                return resp.status, body, raw, dict(resp.headers)

    async def chat(self, messages: list[dict], *, tag: Mapping[str, Any] | None = None, **params) -> ChatResult:
        """One chat completion with retries; never raises except on cancellation."""
        if self._session is None:
            raise RuntimeError("use 'async with ChatClient(...)' before chat()")
        call_id = next(self._ids)
        payload = {"model": self.model, "messages": messages, **self.default_params, **params}
        t0 = time.perf_counter()
        result = ChatResult(ok=False)
        for attempt in range(self.max_retries + 1):
            t_a = time.perf_counter()
            rec: dict[str, Any] = {"event": "request", "ts": time.time(), "call": call_id, "attempt": attempt,
                                   **dict(tag or {}), "url": self.url, "request": payload}
            retry_after = None
            retryable = True
            try:
                status, body, raw, headers = await self._attempt(payload)
                result.status, result.body = status, body
                rec.update(status=status, response=body if body is not None else raw)
                if status == 200:
                    text = _message_text(body)
                    result.ok, result.text, result.error = True, text, None
                elif status in RETRY_STATUSES or status >= 500:
                    retry_after = parse_retry_after(headers.get("Retry-After"))
                    result.error = f"HTTP {status}"
                else:
                    retryable = False
                    result.error = f"HTTP {status}: {_error_message(body, raw)}"
            except _Malformed as e:
                result.ok, result.text, result.error = False, None, f"malformed response: {e}"
            except asyncio.TimeoutError:
                result.error = f"timeout after {self.request_timeout:g}s"
            except aiohttp.ClientError as e:
                result.error = f"{type(e).__name__}: {e}"
            result.attempts = attempt + 1
            rec["latency_s"] = round(time.perf_counter() - t_a, 4)
            if result.ok:
                self._log(rec)
                break
            rec["error"] = result.error
            last = not retryable or attempt == self.max_retries
            if not last:
                wait = backoff_delay(attempt, base=self.backoff_base, cap=self.backoff_max, jitter=self.jitter,
                                     u=self._rng.random(), retry_after=retry_after, retry_after_max=self.retry_after_max)
                rec["retry_in_s"] = round(wait, 4)
                if retry_after is not None:
                    rec["retry_after_s"] = retry_after
            self._log(rec)
            if last:
                break
            self.counters["retries"] += 1
            await asyncio.sleep(wait)
        result.latency_s = time.perf_counter() - t0
        return result


def _message_text(body: Any) -> str:
    """``choices[0].message.content`` of a chat completion; raises _Malformed when it is not one."""
    if not isinstance(body, dict):
        raise _Malformed("the body is not a JSON object")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _Malformed("no choices")
    msg = choices[0].get("message")
    if not isinstance(msg, dict):
        raise _Malformed("choices[0] has no message")
    content = msg.get("content")
    if content is None:
        return ""
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _error_message(body: Any, raw: str | None) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))[:500]
    return (raw or "")[:500]


# --------------------------------------------------------------------------------------------------
# the ADCA layer: prompt and parse
# --------------------------------------------------------------------------------------------------
@dataclass
class Trajectory:
    """What the judge sees: the task, the assistant steps in order, the outcome score.

    A step is a string (the assistant's action) or a mapping with ``action`` (or ``content``) and an
    optional ``observation`` (what the environment answered)."""

    query: str
    steps: Sequence[str | Mapping[str, Any]]
    score: float


def _as_trajectory(t: Any) -> Trajectory:
    if isinstance(t, Trajectory):
        return t
    if isinstance(t, Mapping):
        score = t.get("score", t.get("outcome_score"))
        return Trajectory(str(t.get("query", "")), list(t["steps"]), float(score))
    raise TypeError(f"a trajectory must be a Trajectory or a mapping, got {type(t).__name__}")


def _step_parts(step: str | Mapping[str, Any]) -> tuple[str, str]:
    if isinstance(step, str):
        return step, ""
    if isinstance(step, Mapping):
        act = step.get("action", step.get("content", ""))
        return str(act or ""), str(step.get("observation") or "")
    return str(step), ""


def _cut(s: str, n: int) -> str:
    s = s.strip()
    return s if len(s) <= n else s[:n] + f"\n[... {len(s) - n} more characters cut]"


JUDGE_SYSTEM = """You assess an AI agent's work step by step. You will see a task, the agent's numbered steps \
(what it did and, when there is one, what it observed afterwards) and the outcome score of the whole attempt.

Label every step GOOD or BAD by what it contributed to that outcome.
- Successful outcome (score above {threshold:g}): a step is GOOD when it moved the task forward - it did a \
needed part correctly, made real progress, or kept earlier correct work intact. It is BAD when it was useless, \
off-task, redundant, or harmful, even though the attempt succeeded in the end.
- Failed outcome (score {threshold:g} or below): a step is GOOD only when it noticed or repaired a problem - it \
fixed an earlier mistake, steered the attempt back towards a correct solution, or stopped things from getting \
worse. It is BAD when it made a mistake, repeated a failing approach, was useless, or left an error standing.

Judge what the step did and caused, not its tone or formatting.
End your answer with exactly one line per step, in order, in this form:
Step 1: GOOD
Step 2: BAD
(one line for each of the {k} steps, labels GOOD or BAD)."""

STRICT_SUFFIX = """Your previous answer could not be used: {problem}.
Answer again with EXACTLY {k} lines and nothing else - no reasoning, no blank lines, no other text:
{lines}
where each label is the single word GOOD or the single word BAD."""


def build_judge_messages(query: str, steps: Sequence[str | Mapping[str, Any]], score: float, *,
                         strict: bool = False, problem: str | None = None, success_threshold: float = 0.0,
                         max_step_chars: int = 4000) -> list[dict]:
    """The judge's chat messages for one trajectory (system rules + user task/steps/outcome).

    ``strict``: the retry prompt after an unusable answer; ``problem`` says what was wrong with it."""
    k = len(steps)
    success = score > success_threshold
    parts = ["## Task", _cut(str(query), max_step_chars), "", f"## The agent's steps ({k} in total)"]
    for i, st in enumerate(steps, start=1):
        action, obs = _step_parts(st)
        parts += [f"### Step {i}", "Action:", _cut(action, max_step_chars)]
        if obs:
            parts += ["Observation:", _cut(obs, max_step_chars)]
        parts.append("")
    parts += ["## Outcome", f"Outcome score: {score:+.4f} ({'successful' if success else 'failed'})", ""]
    if strict:
        lines = "\n".join(f"Step {i}: <GOOD or BAD>" for i in range(1, k + 1))
        parts.append(STRICT_SUFFIX.format(problem=problem or "it did not give one label per step", k=k, lines=lines))
    else:
        parts.append(f"Label each of the {k} steps. Finish with the {k} lines 'Step i: GOOD' or 'Step i: BAD'.")
    return [{"role": "system", "content": JUDGE_SYSTEM.format(threshold=success_threshold, k=k)},
            {"role": "user", "content": "\n".join(parts)}]


def parse_judge_prompt(text: str) -> tuple[str, list[str]] | None:
    """``(query, actions)`` back from the user message :func:`build_judge_messages` wrote (a step's action as
    shown, so possibly cut), or None when ``text`` is not in that form. For a rule-based judge behind the
    same chat interface (:mod:`trainer.rewards.rule_judge`). The steps are found from the last one back,
    each as the last ``### Step i`` header before step i+1's, so a header that a sampled action itself
    contains cannot take a later step's place."""
    head = re.match(r"## Task\n(.*?)\n\n## The agent's steps \((\d+) in total\)\n", text, re.DOTALL)
    if not head:
        return None
    k, actions = int(head.group(2)), []
    stop = text.rfind("\n## Outcome\n")
    if stop < head.end():
        return None
    for i in range(k, 0, -1):
        marker = f"### Step {i}\nAction:\n"
        start = text.rfind(marker, head.end(), stop)
        if start < 0:
            return None
        body = text[start + len(marker):stop]
        obs = body.rfind("\nObservation:\n")
        actions.append((body[:obs] if obs >= 0 else body).strip())
        stop = start
    return head.group(1), actions[::-1]


# "Step 3: GOOD", "**Step 3** - BAD", "Step 3 Judgment: **GOOD**", "step #3 = good"
_NUMBERED = re.compile(
    r"step\s*#?\s*(\d+)[\s*_`]*(?:(?:judge?ment|label|verdict|rating)[\s*_`]*)?[:=\-\u2013\u2014][\s*_`\[(]*(GOOD|BAD)\b",
    re.IGNORECASE,
)
_BARE = re.compile(r"\b(GOOD|BAD)\b")  # upper case only: "a good step" in prose is not a label


def parse_step_flags(text: str | None, num_steps: int) -> tuple[list[int] | None, str | None]:
    """``(flags, None)`` with one +1 (GOOD) / -1 (BAD) per step, or ``(None, problem)``.

    Numbered labels win: they must name exactly the steps 1..K (or 0..K-1); a step labelled twice keeps
    its last label (a model that restates its list at the end). Without any numbered label, exactly K
    bare GOOD/BAD words are read in order."""
    if not text or not text.strip():
        return None, "the answer was empty"
    numbered: dict[int, int] = {}
    for m in _NUMBERED.finditer(text):
        numbered[int(m.group(1))] = 1 if m.group(2).upper() == "GOOD" else -1
    if numbered:
        keys = set(numbered)
        for first in (1, 0):
            if keys == set(range(first, first + num_steps)):
                return [numbered[i] for i in range(first, first + num_steps)], None
        got = sorted(keys)
        return None, (f"it labelled steps {got[:20]}{' ...' if len(got) > 20 else ''} but there are "
                      f"{num_steps} steps, numbered 1 to {num_steps}")
    bare = _BARE.findall(text)
    if len(bare) == num_steps:
        return [1 if w == "GOOD" else -1 for w in bare], None
    if not bare:
        return None, "it contained no GOOD/BAD labels"
    return None, f"it contained {len(bare)} GOOD/BAD labels for {num_steps} steps"


# --------------------------------------------------------------------------------------------------
# the judge
# --------------------------------------------------------------------------------------------------
@dataclass
class _Counts:
    trajectories: int = 0
    calls: int = 0
    format_retries: int = 0
    errors: int = 0
    fallbacks: int = 0
    latencies: list[float] = field(default_factory=list)


class JudgeClient:
    """Step flags for ADCA from an OpenAI-compatible judge. See the module docstring.

    ``temperature`` (default 0: the same answer for the same prompt where the server allows) and
    ``max_tokens`` (default: the server's) go into every request, as does ``extra_body`` (e.g.
    ``{"enable_thinking": False}`` for DashScope). Transport keywords (``backoff_base``, ``backoff_max``,
    ``retry_after_max``, ``rate_limit_burst``, ``jitter``, ``seed``) go to :class:`ChatClient`.
    """

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = "DASHSCOPE_API_KEY",
                 concurrent: int = 8, api_max_retries: int = 5, request_timeout: float = 60.0,
                 rate_limit_per_s: float | None = None, llm_evaluation_log_dir: str | None = None,
                 temperature: float | None = 0.0, max_tokens: int | None = None,
                 extra_body: Mapping[str, Any] | None = None, success_threshold: float = 0.0,
                 max_step_chars: int = 4000, **transport):
        params: dict[str, Any] = dict(extra_body or {})
        if temperature is not None:
            params["temperature"] = temperature
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        self.client = ChatClient(base_url, model, api_key_env=api_key_env, concurrent=concurrent,
                                 max_retries=api_max_retries, request_timeout=request_timeout,
                                 rate_limit_per_s=rate_limit_per_s, log_dir=llm_evaluation_log_dir,
                                 default_params=params, **transport)
        self.success_threshold = success_threshold
        self.max_step_chars = max_step_chars
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg: Any, **overrides) -> "JudgeClient":
        """From the ``attribution_driven_credit_assignment`` config section (an object or a mapping)."""
        get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
        kw = dict(base_url=get("base_url"), model=get("model"), api_key_env=get("api_key_env", "DASHSCOPE_API_KEY"),
                  concurrent=get("concurrent", 8), api_max_retries=get("api_max_retries", 200),
                  request_timeout=get("request_timeout", 60.0), rate_limit_per_s=get("rate_limit_per_s"),
                  llm_evaluation_log_dir=get("llm_evaluation_log_dir"))
        kw.update(overrides)
        return cls(**kw)

    @property
    def log_path(self) -> str | None:
        return self.client.log.path if self.client.log is not None else None

    async def _ask(self, msgs: list[dict], counts: _Counts, tag: dict) -> ChatResult:
        counts.calls += 1
        r = await self.client.chat(msgs, tag=tag)
        counts.latencies.append(r.latency_s)
        if not r.ok:
            counts.errors += 1
        return r

    async def _judge_one(self, i: int, traj: Any, counts: _Counts, global_step: int | None) -> list[int] | None:
        counted = False
        try:
            t = _as_trajectory(traj)
            k = len(t.steps)
            if k == 0:
                return []
            counts.trajectories += 1
            counted = True
            tag = {"trajectory": i, "global_step": global_step, "kind": "judge"}
            kw = dict(success_threshold=self.success_threshold, max_step_chars=self.max_step_chars)
            problem = None
            for strict in (False, True):  # a badly formatted answer gets one retry with a stricter prompt
                if strict:
                    counts.format_retries += 1
                    tag = dict(tag, kind="judge_strict")
                msgs = build_judge_messages(t.query, t.steps, t.score, **kw) if not strict else \
                    build_judge_messages(t.query, t.steps, t.score, strict=True, problem=problem, **kw)
                r = await self._ask(msgs, counts, tag)
                if not r.ok:  # transport failure after its own retries: no format retry
                    break
                flags, problem = parse_step_flags(r.text, k)
                self.client._log({"event": "parsed", "ts": time.time(), **tag, "num_steps": k, "flags": flags,
                                  "problem": problem})
                if flags is not None:
                    return flags
            counts.fallbacks += 1
            return None
        except Exception as e:  # noqa: BLE001 - a bad trajectory or a bug here must not stop training
            logger.warning("judge: trajectory %d failed (%s: %s); outcome-only credit", i, type(e).__name__, e)
            counts.errors += 1
            counts.fallbacks += 1
            counts.trajectories += 0 if counted else 1  # an unreadable trajectory was meant to be judged
            return None

    async def judge_many(self, trajectories: Sequence[Any], *, global_step: int | None = None) -> list[list[int] | None]:
        """Flags for every trajectory (concurrently, within the client's limits). Sets ``last_metrics``."""
        t0 = time.perf_counter()
        counts = _Counts()
        self.client.counters = {"http_requests": 0, "retries": 0}
        async with self.client:
            flags = await asyncio.gather(*(self._judge_one(i, t, counts, global_step) for i, t in enumerate(trajectories)))
        self.last_metrics = self._metrics(counts, time.perf_counter() - t0)
        return list(flags)

    def _metrics(self, c: _Counts, wall: float) -> dict[str, float]:
        lat = c.latencies
        return {
            "adca/judge_trajectories": float(c.trajectories),
            "adca/judge_calls": float(c.calls),
            "adca/judge_http_requests": float(self.client.counters["http_requests"]),
            "adca/judge_retries": float(self.client.counters["retries"]),
            "adca/judge_format_retries": float(c.format_retries),
            "adca/judge_errors": float(c.errors),
            "adca/judge_fallbacks": float(c.fallbacks),
            "adca/judge_fallback_fraction": c.fallbacks / c.trajectories if c.trajectories else 0.0,
            "adca/judge_latency_mean_s": sum(lat) / len(lat) if lat else 0.0,
            "adca/judge_latency_max_s": max(lat) if lat else 0.0,
            "adca/judge_wall_s": wall,
        }

    def judge_batch(self, trajectories: Sequence[Any], *, global_step: int | None = None
                    ) -> tuple[list[list[int] | None], dict[str, float]]:
        """Synchronous :meth:`judge_many`: ``(flags, metrics)``. Never raises (except KeyboardInterrupt):
        anything unexpected makes every trajectory fall back, counted in ``adca/judge_errors``."""
        t0 = time.perf_counter()
        trajectories = list(trajectories)
        try:
            try:
                asyncio.get_running_loop()
                in_loop = True
            except RuntimeError:
                in_loop = False
            if not in_loop:
                flags = asyncio.run(self.judge_many(trajectories, global_step=global_step))
            else:  # called from async code: a fresh loop in a helper thread
                box: dict[str, Any] = {}

                def _run():
                    try:
                        box["flags"] = asyncio.run(self.judge_many(trajectories, global_step=global_step))
                    except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                        box["error"] = e

                th = threading.Thread(target=_run, name="coxswain-judge", daemon=True)
                th.start()
                th.join()
                if "error" in box:
                    raise box["error"]
                flags = box["flags"]
            return flags, dict(self.last_metrics)
        except Exception as e:  # noqa: BLE001
            logger.exception("judge: the batch failed (%s); every trajectory gets outcome-only credit", e)
            n = len(trajectories)
            c = _Counts(trajectories=n, errors=n, fallbacks=n)
            self.client.counters = {"http_requests": self.client.counters.get("http_requests", 0),
                                    "retries": self.client.counters.get("retries", 0)}
            self.last_metrics = self._metrics(c, time.perf_counter() - t0)
            return [None] * n, dict(self.last_metrics)
