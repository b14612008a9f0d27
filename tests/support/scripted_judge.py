"""A scripted OpenAI-compatible chat server on 127.0.0.1 for the judge tests: it stands in for the paid
judge API (DashScope / qwen-max), which CI cannot reach. Real aiohttp, real sockets; the client under
test cannot tell it from the real endpoint. Each test scripts what it answers."""

import asyncio
import re
import threading
import time

from aiohttp import web


def _completion(text: str) -> dict:
    return {"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


def _num_steps(body: dict) -> int:
    return int(re.search(r"\((\d+) in total\)", body["messages"][-1]["content"]).group(1))


def correct_answer(body: dict) -> str:
    # Step i is GOOD when i is odd: a pattern the tests can predict.
    k = _num_steps(body)
    return "Some reasoning first.\n" + "\n".join(f"Step {i}: {'GOOD' if i % 2 else 'BAD'}" for i in range(1, k + 1))


def expected_flags(k: int) -> list[int]:
    return [1 if i % 2 else -1 for i in range(1, k + 1)]


class ScriptedServer:
    """aiohttp on 127.0.0.1:<free port> in a thread. ``script(index, body)`` returns one action:
    ("json", status, body, headers) | ("raw", status, text) | ("hang", seconds) | ("reply", text, delay_s)."""

    def __init__(self, script):
        self.script = script
        self.requests: list[dict] = []  # {"t": arrival (monotonic), "headers": ..., "body": ...}
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "scripted server did not start"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        t = time.monotonic()
        body = await request.json()
        with self._lock:
            idx = len(self.requests)
            self.requests.append({"t": t, "headers": dict(request.headers), "body": body})
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            action = self.script(idx, body)
            kind = action[0]
            if kind == "json":
                _, status, payload, headers = action
                return web.json_response(payload, status=status, headers=headers or {})
            if kind == "raw":
                return web.Response(status=action[1], text=action[2], content_type="application/json")
            if kind == "hang":
                await asyncio.sleep(action[1])
                return web.json_response(_completion("too late"))
            if kind == "reply":
                if action[2]:
                    await asyncio.sleep(action[2])
                return web.json_response(_completion(action[1]))
            raise AssertionError(f"unknown action {action!r}")
        finally:
            with self._lock:
                self.in_flight -= 1

    def _serve(self):
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._ready.set()
        self._loop.run_forever()

    def close(self):
        async def _stop():
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def gaps(self) -> list[float]:
        ts = [r["t"] for r in self.requests]
        return [b - a for a, b in zip(ts, ts[1:])]
