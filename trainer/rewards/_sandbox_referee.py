"""The trusted side of ``trainer.rewards.sandbox``: runs the tests and writes the results.

Run as ``python -I -B _sandbox_referee.py`` with the job spec (code, tests, expected values, fds) on
stdin. It never runs candidate code. The candidate lives in another process (the jailed
``_sandbox_harness.py``); every name the candidate's code defines appears here as either a plain
value (data copied over the wire) or a ``Remote`` handle whose calls, attribute reads, indexing,
``len`` and iteration are requests to the candidate, answered with data (``_sandbox_wire``).

So a test such as ``assert f(2) == 4`` runs *here*: ``f(2)`` is a request, its answer decodes to a
fresh builtin ``int``, and ``== 4`` and the ``assert`` are evaluated by this process. A candidate
cannot forge a pass: it never holds the tests, the expected values or the result channel (an fd
only this process has), and what it returns cannot carry behaviour (a handle refuses ``==``).

Differences from running the tests in the candidate's own namespace, stated: arguments are copied,
and in-place changes to list / dict / set / bytearray arguments are copied back after the call; a
test may not pass its own functions or objects to the candidate (only data and the candidate's
handles); comparing a candidate object that is not plain data fails the test with a clear message.
"""

import builtins
import ctypes
import json
import os
import resource
import sys
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import _sandbox_wire as wire  # noqa: E402

del sys.path[0]


class CandidateDied(BaseException):
    """The candidate's process is gone (killed by a limit, or it exited)."""


class CandidateError(Exception):
    def __init__(self, status, msg):
        super().__init__(msg)
        self.status, self.msg = status, msg


class _Channel:
    """The referee's ends of the candidate's request / answer pipes, and the result stream (an fd only this
    process holds). ``dead`` turns true once the candidate's process is gone; every later request fails fast."""

    def __init__(self, out_fd: int, req_fd: int, resp_fd: int):
        self.out_fd, self.req_fd, self.resp_fd = out_fd, req_fd, resp_fd
        self.dead = False

    def emit(self, kind, **kw):
        kw["kind"] = kind
        try:
            os.write(self.out_fd, (json.dumps(kw, default=str) + "\n").encode("utf-8", "replace"))
        except OSError:
            pass

    def rpc(self, req):
        if self.dead:
            raise CandidateDied()
        try:
            wire.send(self.req_fd, req)
            r = wire.recv(self.resp_fd)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.dead = True
            raise CandidateDied() from None
        if not isinstance(r, dict):
            raise CandidateError("error", "the candidate answered out of protocol")
        for msg in r.get("viol") or []:
            self.emit("violation", msg=str(msg)[:500])
        if "err" in r:
            err = r["err"] if isinstance(r["err"], dict) else {}
            raise CandidateError(str(err.get("status", "error")), str(err.get("msg", ""))[:500])
        return r


_CHANNEL: _Channel  # set once by main(): the one candidate this process referees


def _to_handle(obj):
    if isinstance(obj, Remote):
        return object.__getattribute__(obj, "_h")
    raise TypeError(f"a test cannot pass a {type(obj).__name__} to the candidate's code (only data)")


def _enc(x):
    return wire.encode(x, _to_handle)


def _dec(v):
    try:
        return wire.decode(v, Remote)
    except (wire.WireError, TypeError, ValueError) as e:
        raise CandidateError("error", f"the candidate's answer is not a value: {e}") from None


def _rpc(req):
    return _CHANNEL.rpc(req)


class Remote:
    """A handle on an object in the candidate's process."""

    __slots__ = ("_h",)

    def __init__(self, h):
        object.__setattr__(self, "_h", h)

    def __call__(self, *args, **kwargs):
        r = _rpc({"op": "call", "h": self._h, "args": [_enc(a) for a in args],
                  "kwargs": {str(k): _enc(v) for k, v in kwargs.items()}})
        for a, after in zip(args, r.get("after") or []):
            if after is not None and type(a) in (list, dict, set, bytearray):
                _mirror(a, _dec(after))
        return _dec(r.get("v"))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _dec(_rpc({"op": "getattr", "h": self._h, "name": name}).get("v"))

    def __getitem__(self, key):
        return _dec(_rpc({"op": "getitem", "h": self._h, "key": _enc(key)}).get("v"))

    def __len__(self):
        try:
            return int(_rpc({"op": "len", "h": self._h}).get("v"))
        except CandidateError as e:  # len() of a generator: list() must still work
            raise TypeError(e.msg) from None

    def _plain(self, op, want):
        v = _rpc({"op": op, "h": self._h}).get("v")
        if type(v) is not want:
            raise CandidateError("error", f"the candidate's {op}() answer is not a {want.__name__}")
        return v

    def __int__(self):
        return self._plain("int", int)

    __index__ = __int__

    def __float__(self):
        return self._plain("float", float)

    def __str__(self):
        return self._plain("str", str)

    def __iter__(self):
        return iter(_dec(_rpc({"op": "iter", "h": self._h}).get("v")))

    def __bool__(self):
        return bool(_rpc({"op": "bool", "h": self._h}).get("v"))

    def __repr__(self):
        try:
            return f"<candidate object {_rpc({'op': 'repr', 'h': self._h}).get('v')}>"
        except (CandidateError, CandidateDied):
            return "<candidate object>"

    def _refuse(self, *_):
        raise TypeError("the candidate's value is not plain data (int, str, list, dict, ...), so the "
                        "test cannot compare it; return builtins")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __contains__ = _refuse
    __hash__ = object.__hash__


def _describe(e):
    if isinstance(e, CandidateError):
        return e.status, e.msg
    return "error", "".join(traceback.format_exception_only(type(e), e)).strip()[-500:]


def _limit_self(spec: dict) -> None:
    """The referee's own limits: address space and CPU time (each twice the candidate's), and death with the
    reward worker that started it."""
    lim = spec["limits"]
    mem = max(2 * int(lim["mem_mb"]), 2048) << 20  # decoded values may be larger than their frames
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = 2 * int(lim["cpu_s"]) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    if spec.get("parent_pid"):  # a killed reward worker takes its referee with it
        if ctypes.CDLL(None).prctl(1, 9, 0, 0, 0) == 0 and os.getppid() != int(spec["parent_pid"]):
            os._exit(1)


def _load(chan: _Channel, spec: dict):
    """The candidate's names (values or handles) after its code ran; None when it could not (reported)."""
    try:
        hello = wire.recv(chan.resp_fd)
    except (EOFError, OSError, wire.WireError) as e:
        chan.emit("candidate_died", msg=f"the sandbox did not start: {e}")
        return None
    chan.emit("hello", enforced=list(hello.get("enforced", [])), notes=list(hello.get("notes", [])))
    if hello.get("fatal"):
        chan.emit("setup_failed", msg=str(hello["fatal"]))
        return None
    chan.emit("start")
    try:
        if spec["mode"] == "io":
            chan.rpc({"op": "compile", "code": spec["code"]})
            return {}
        return {k: _dec(v) for k, v in chan.rpc({"op": "load", "code": spec["code"]})["names"].items()}
    except CandidateError as e:
        chan.emit("compile_or_run_error", status=e.status, msg=e.msg)
        chan.emit("done")
    except CandidateDied:
        chan.emit("candidate_died", msg="the candidate's process ended while loading its code")
    return None


def _prepare(chan: _Channel, spec: dict, names: dict):
    """The tests' namespace (assert mode, after the trusted set-up) or the function under test (call mode);
    None when that failed (reported)."""
    mode = spec["mode"]
    if mode == "assert":
        g = {"__name__": "__main__", "__builtins__": builtins, **names}
        if spec.get("setup"):
            try:
                exec(compile(spec["setup"], "setup.py", "exec"), g)
            except BaseException as e:  # noqa: BLE001 - the dataset's setup code
                chan.emit("compile_or_run_error", status="error", msg="test setup: " + _describe(e)[1])
                chan.emit("done")
                return None
        return g
    if mode == "io":
        return {}
    try:
        fn = names.get(spec["fn_name"])
        if fn is None and isinstance(names.get("Solution"), Remote):  # LeetCode style
            fn = getattr(names["Solution"](), spec["fn_name"])
        if fn is None:
            raise CandidateError("error", f"NameError: function {spec['fn_name']!r} is not defined")
        return fn
    except CandidateError as e:
        chan.emit("compile_or_run_error", status=e.status, msg=e.msg)
        chan.emit("done")
    except CandidateDied:
        chan.emit("candidate_died", msg="the candidate's process ended")
    return None


def _run_case(chan: _Channel, mode: str, i: int, case, target) -> tuple[bool, str, str]:
    """One test: (ok, status, message). ``target``: the tests' namespace (assert) or the function (call)."""
    try:
        if mode == "assert":
            exec(compile(case, f"test_{i}.py", "exec"), target)
            return True, "ok", ""
        if mode == "io":
            inp, expected = case
            got = chan.rpc({"op": "io", "input": str(inp)}).get("out", "")
            ok = wire.same_output(got, expected)
            return (True, "ok", "") if ok else (False, "wrong_answer", str(got)[-200:])
        args, expected = case
        got = target(*(args if isinstance(args, list) else [args]))
        ok = wire.same_value(got, expected)
        return (True, "ok", "") if ok else (False, "wrong_answer", repr(got)[:200])
    except CandidateDied:
        chan.dead = True
    except BaseException as e:  # noqa: BLE001 - a failing test raises anything
        return (False, *_describe(e))
    return False, "error", ""


def main():
    global _CHANNEL
    spec = json.loads(sys.stdin.read())
    chan = _CHANNEL = _Channel(int(spec["result_fd"]), int(spec["req_fd"]), int(spec["resp_fd"]))
    _limit_self(spec)
    names = _load(chan, spec)
    if names is None:
        return
    target = _prepare(chan, spec, names)
    if target is None:
        return
    mode = spec["mode"]
    cases = spec["tests"] if mode == "assert" else list(zip(spec["inputs"], spec["outputs"]))
    for i, case in enumerate(cases):
        ok, status, msg = _run_case(chan, mode, i, case, target)
        if chan.dead:  # also when a test swallowed CandidateDied with a bare except
            chan.emit("test", i=i, ok=False, status="crashed", msg="the candidate's process ended")
            chan.emit("candidate_died", msg=f"the candidate's process ended during test {i}")
            return
        chan.emit("test", i=i, ok=ok, status=status, msg=msg)
    chan.emit("done")


def _mirror(dst, src):
    """Copy the candidate's in-place change of an argument back into the test's object."""
    if type(src) is not type(dst):
        return
    if isinstance(dst, (list, bytearray)):
        dst[:] = src
    else:
        dst.clear()
        dst.update(src)


if __name__ == "__main__":
    main()
    os._exit(0)
