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
import json
import os
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


def main():
    spec = json.loads(sys.stdin.read())
    out_fd, req_fd, resp_fd = int(spec["result_fd"]), int(spec["req_fd"]), int(spec["resp_fd"])
    import resource

    lim = spec["limits"]
    mem = max(2 * int(lim["mem_mb"]), 2048) << 20  # decoded values may be larger than their frames
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = 2 * int(lim["cpu_s"]) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))

    if spec.get("parent_pid"):  # a killed reward worker takes its referee with it
        import ctypes

        if ctypes.CDLL(None).prctl(1, 9, 0, 0, 0) == 0 and os.getppid() != int(spec["parent_pid"]):
            os._exit(1)

    def emit(kind, **kw):
        kw["kind"] = kind
        try:
            os.write(out_fd, (json.dumps(kw, default=str) + "\n").encode("utf-8", "replace"))
        except OSError:
            pass

    state = {"dead": False}

    def rpc(req):
        if state["dead"]:
            raise CandidateDied()
        try:
            wire.send(req_fd, req)
            r = wire.recv(resp_fd)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            state["dead"] = True
            raise CandidateDied() from None
        if not isinstance(r, dict):
            raise CandidateError("error", "the candidate answered out of protocol")
        for msg in r.get("viol") or []:
            emit("violation", msg=str(msg)[:500])
        if "err" in r:
            err = r["err"] if isinstance(r["err"], dict) else {}
            raise CandidateError(str(err.get("status", "error")), str(err.get("msg", ""))[:500])
        return r

    class Remote:
        """A handle on an object in the candidate's process."""

        __slots__ = ("_h",)

        def __init__(self, h):
            object.__setattr__(self, "_h", h)

        def __call__(self, *args, **kwargs):
            r = rpc({"op": "call", "h": self._h, "args": [enc(a) for a in args],
                     "kwargs": {str(k): enc(v) for k, v in kwargs.items()}})
            for a, after in zip(args, r.get("after") or []):
                if after is not None and type(a) in (list, dict, set, bytearray):
                    _mirror(a, dec(after))
            return dec(r.get("v"))

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return dec(rpc({"op": "getattr", "h": self._h, "name": name}).get("v"))

        def __getitem__(self, key):
            return dec(rpc({"op": "getitem", "h": self._h, "key": enc(key)}).get("v"))

        def __len__(self):
            try:
                return int(rpc({"op": "len", "h": self._h}).get("v"))
            except CandidateError as e:  # len() of a generator: list() must still work
                raise TypeError(e.msg) from None

        def _plain(self, op, want):
            v = rpc({"op": op, "h": self._h}).get("v")
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
            return iter(dec(rpc({"op": "iter", "h": self._h}).get("v")))

        def __bool__(self):
            return bool(rpc({"op": "bool", "h": self._h}).get("v"))

        def __repr__(self):
            try:
                return f"<candidate object {rpc({'op': 'repr', 'h': self._h}).get('v')}>"
            except (CandidateError, CandidateDied):
                return "<candidate object>"

        def _refuse(self, *_):
            raise TypeError("the candidate's value is not plain data (int, str, list, dict, ...), so the "
                            "test cannot compare it; return builtins")

        __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __contains__ = _refuse
        __hash__ = object.__hash__

    def to_handle(obj):
        if isinstance(obj, Remote):
            return object.__getattribute__(obj, "_h")
        raise TypeError(f"a test cannot pass a {type(obj).__name__} to the candidate's code (only data)")

    def enc(x):
        return wire.encode(x, to_handle)

    def dec(v):
        try:
            return wire.decode(v, Remote)
        except (wire.WireError, TypeError, ValueError) as e:
            raise CandidateError("error", f"the candidate's answer is not a value: {e}") from None

    def describe(e):
        if isinstance(e, CandidateError):
            return e.status, e.msg
        return "error", "".join(traceback.format_exception_only(type(e), e)).strip()[-500:]

    try:
        hello = wire.recv(resp_fd)
    except (EOFError, OSError, wire.WireError) as e:
        emit("candidate_died", msg=f"the sandbox did not start: {e}")
        return
    emit("hello", enforced=list(hello.get("enforced", [])), notes=list(hello.get("notes", [])))
    if hello.get("fatal"):
        emit("setup_failed", msg=str(hello["fatal"]))
        return

    mode = spec["mode"]
    emit("start")
    try:
        if mode == "io":
            rpc({"op": "compile", "code": spec["code"]})
            names = {}
        else:
            names = {k: dec(v) for k, v in rpc({"op": "load", "code": spec["code"]})["names"].items()}
    except CandidateError as e:
        emit("compile_or_run_error", status=e.status, msg=e.msg)
        emit("done")
        return
    except CandidateDied:
        emit("candidate_died", msg="the candidate's process ended while loading its code")
        return

    cases = spec["tests"] if mode == "assert" else list(zip(spec["inputs"], spec["outputs"]))
    fn = None
    if mode == "assert":
        g = {"__name__": "__main__", "__builtins__": builtins, **names}
        if spec.get("setup"):
            try:
                exec(compile(spec["setup"], "setup.py", "exec"), g)
            except BaseException as e:  # noqa: BLE001 - the dataset's setup code
                emit("compile_or_run_error", status="error", msg="test setup: " + describe(e)[1])
                emit("done")
                return
    elif mode == "call":
        try:
            fn = names.get(spec["fn_name"])
            if fn is None and isinstance(names.get("Solution"), Remote):  # LeetCode style
                fn = getattr(names["Solution"](), spec["fn_name"])
            if fn is None:
                raise CandidateError("error", f"NameError: function {spec['fn_name']!r} is not defined")
        except CandidateError as e:
            emit("compile_or_run_error", status=e.status, msg=e.msg)
            emit("done")
            return
        except CandidateDied:
            emit("candidate_died", msg="the candidate's process ended")
            return

    for i, case in enumerate(cases):
        ok, status, msg = False, "error", ""
        try:
            if mode == "assert":
                exec(compile(case, f"test_{i}.py", "exec"), g)
                ok, status = True, "ok"
            elif mode == "io":
                inp, expected = case
                got = rpc({"op": "io", "input": str(inp)}).get("out", "")
                ok = wire.same_output(got, expected)
                status, msg = ("ok", "") if ok else ("wrong_answer", str(got)[-200:])
            else:
                args, expected = case
                got = fn(*(args if isinstance(args, list) else [args]))
                ok = wire.same_value(got, expected)
                status, msg = ("ok", "") if ok else ("wrong_answer", repr(got)[:200])
        except CandidateDied:
            state["dead"] = True
        except BaseException as e:  # noqa: BLE001 - a failing test raises anything
            status, msg = describe(e)
        if state["dead"]:  # also when a test swallowed CandidateDied with a bare except
            emit("test", i=i, ok=False, status="crashed", msg="the candidate's process ended")
            emit("candidate_died", msg=f"the candidate's process ended during test {i}")
            return
        emit("test", i=i, ok=ok, status=status, msg=msg)
    emit("done")


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
