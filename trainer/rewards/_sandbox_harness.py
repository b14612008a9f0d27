"""The in-sandbox half of ``trainer.rewards.sandbox``: runs untrusted candidate code against tests.

This file is executed as a standalone script (``python -I _sandbox_harness.py``) inside the sandbox
the parent built (network / PID namespaces, a pids cgroup, dropped capabilities where available). It
imports nothing from ``trainer`` on purpose: ``-I`` keeps the project, ``PYTHONPATH`` and the user
site off ``sys.path``.

Order of operations (everything before step 4 is trusted code):
  1. read the job spec (JSON) from stdin; keep the nonce only in a closure;
  2. join the pids cgroup the parent prepared (if any) and lower the resource limits on itself:
     RLIMIT_CPU (soft = hard, so the kernel sends SIGKILL even when we are PID 1 of a namespace),
     RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_CORE = 0;
  3. install an audit hook (PEP 578) that refuses: process creation (fork, exec, spawn, system,
     subprocess), signals to other processes, ctypes library loading / symbol lookup, cffi, raising
     resource limits, creating sockets, and any write / create / delete / rename / chmod outside
     the sandbox's working directory;
  4. run the candidate and the tests, streaming one JSON line per event to the result fd. Each line
     carries the nonce, so a candidate that prints to stdout or exits early cannot forge a pass.

The audit hook is a best-effort Python-level guard, not a security boundary against code that is
*trying* to escape (C extensions already loaded can bypass it); the kernel-level layers set up by the
parent (rlimits, cgroup, namespaces) bound what escapes it. See ``sandbox.py`` for the full list.
"""

import io
import json
import os
import sys


def _main():
    spec = json.loads(sys.stdin.read())
    nonce = spec.pop("nonce")
    out_fd = int(spec["result_fd"])
    workdir = os.path.realpath(spec["workdir"])

    def emit(kind, **kw):
        kw["kind"] = kind
        kw["nonce"] = nonce
        line = (json.dumps(kw, default=str) + "\n").encode()
        try:
            os.write(out_fd, line)
        except OSError:
            pass

    # ---- 2. cgroup and resource limits -------------------------------------------------------
    import resource

    cg = spec.get("cgroup_procs")
    if cg:
        try:
            with open(cg, "w") as f:
                f.write("0")  # "0" = the writing task itself
            emit("enforced", layer="pids_cgroup")
        except OSError as e:
            emit("note", msg=f"could not join pids cgroup: {e}")

    lim = spec["limits"]

    def setlim(which, value):
        try:
            resource.setrlimit(which, (value, value))
            return True
        except (ValueError, OSError) as e:
            emit("note", msg=f"setrlimit({which}) failed: {e}")
            return False

    if setlim(resource.RLIMIT_CPU, int(lim["cpu_s"])):
        emit("enforced", layer="rlimit_cpu")
    if setlim(resource.RLIMIT_AS, int(lim["mem_mb"]) * 1024 * 1024):
        emit("enforced", layer="rlimit_as")
    if setlim(resource.RLIMIT_NPROC, int(lim["nproc"])):
        # The kernel ignores RLIMIT_NPROC for uid 0; the parent reports that.
        emit("enforced", layer="rlimit_nproc")
    setlim(resource.RLIMIT_FSIZE, int(lim["fsize_mb"]) * 1024 * 1024)
    setlim(resource.RLIMIT_CORE, 0)

    # Pre-import what the harness itself needs, before the guard can refuse anything. ctypes is
    # imported here (trusted) because numpy and others import it, and its import dlopen()s the
    # interpreter; afterwards the guard refuses ctypes dlopen / dlsym / from_address (CPython 3.11
    # does not audit every foreign call, e.g. ctypes.memmove: a stated limit of this layer).
    import builtins
    import traceback

    try:
        import ctypes
    except ImportError:
        ctypes = None

    if spec.get("parent_pid") and ctypes is not None:
        # No setpriv wrapper here: ask the kernel ourselves to SIGKILL us if our parent (the reward
        # worker) dies, so a killed worker cannot leave a sleeping candidate behind.
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(1, 9, 0, 0, 0) == 0:  # PR_SET_PDEATHSIG = 1, SIGKILL = 9
                if os.getppid() != int(spec["parent_pid"]):  # the parent died before the prctl
                    os._exit(1)
                emit("enforced", layer="parent_death_signal")
        except (OSError, AttributeError):
            pass

    # ---- 3. audit hook -----------------------------------------------------------------------
    violations = []
    my_pid = os.getpid()
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    allowed_write = {"/dev/null"}
    deny_always = {
        "os.fork": "process creation (os.fork)",
        "os.forkpty": "process creation (os.forkpty)",
        "os.posix_spawn": "process creation (os.posix_spawn)",
        "os.spawn": "process creation (os.spawn*)",
        "os.exec": "process creation (os.exec*)",
        "os.system": "process creation (os.system)",
        "os.startfile": "process creation (os.startfile)",
        "subprocess.Popen": "process creation (subprocess)",
        "pty.spawn": "process creation (pty.spawn)",
        "ctypes.dlopen": "ctypes",
        "ctypes.dlsym": "ctypes",
        "ctypes.cdata": "ctypes",
        "ctypes.call_function": "ctypes",
        "resource.setrlimit": "changing resource limits",
        "resource.prlimit": "changing resource limits",
        "socket.__new__": "network (socket creation)",
        "socket.connect": "network (socket.connect)",
        "socket.bind": "network (socket.bind)",
        "socket.getaddrinfo": "network (name lookup)",
        "socket.gethostbyname": "network (name lookup)",
        "socket.sendto": "network (sendto)",
        "sys.addaudithook": "adding audit hooks",
        "sys.remote_exec": "remote exec",
        "os.chroot": "chroot",
        "os.setuid": "changing ids",
        "os.setgid": "changing ids",
        "os.mount": "mount",
    }
    blocked_imports = {"cffi", "_cffi_backend", "_xxsubinterpreters", "_xxinterpchannels"}
    path_events = {  # event -> indices of the path arguments that must stay inside workdir
        "os.remove": (0,),
        "os.rmdir": (0,),
        "os.mkdir": (0,),
        "os.rename": (0, 1),
        "os.link": (0, 1),
        "os.symlink": (1,),
        "os.chmod": (0,),
        "os.chown": (0,),
        "os.chflags": (0,),
        "os.lchflags": (0,),
        "os.truncate": (0,),
        "os.utime": (0,),
        "os.setxattr": (0,),
        "os.removexattr": (0,),
        "shutil.rmtree": (0,),
        "shutil.copyfile": (1,),
        "shutil.copymode": (1,),
        "shutil.copystat": (1,),
        "shutil.copytree": (1,),
        "shutil.move": (0, 1),
        "shutil.chown": (0,),
    }

    class SandboxViolation(PermissionError):
        pass

    def inside(path):
        if isinstance(path, int):  # an already-open fd: nothing to resolve
            return True
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            try:
                path = os.fspath(path)
            except TypeError:
                return False
        real = os.path.realpath(path)
        return real == workdir or real.startswith(workdir + os.sep) or real in allowed_write

    def refuse(what, detail=""):
        msg = f"sandbox: {what} is not allowed" + (f" ({detail})" if detail else "")
        if len(violations) < 20:
            violations.append(msg)
            emit("violation", msg=msg)
        raise SandboxViolation(msg)

    def hook(event, args):
        if event in deny_always:
            refuse(deny_always[event])
        elif event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writing and not inside(path):
                refuse("writing outside the sandbox directory", str(path))
        elif event in path_events:
            for i in path_events[event]:
                if i < len(args) and not inside(args[i]):
                    refuse(f"{event} outside the sandbox directory", str(args[i]))
        elif event == "import":
            if args and args[0] in blocked_imports:
                refuse(f"importing {args[0]}")
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            if event == "os.kill" and args and args[0] == my_pid:
                return
            refuse("signalling other processes")

    if not spec.get("disable_guard"):  # only the containment tests turn the guard off
        sys.addaudithook(hook)
        emit("enforced", layer="audit_hook")

    # ---- 4. run the tests --------------------------------------------------------------------
    os.chdir(workdir)
    sys.path.insert(0, workdir)
    mode = spec["mode"]
    code = spec["code"]
    real_stdout, real_stdin = sys.stdout, sys.stdin

    def describe(exc):
        if isinstance(exc, MemoryError):
            return "memory_limit", "MemoryError"
        if isinstance(exc, SandboxViolation):
            return "blocked", str(exc)
        tb = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return "error", tb[-500:]

    def fresh_globals():
        return {"__name__": "__main__", "__builtins__": builtins}

    emit("start")
    if mode == "assert":
        # Candidate first, then each test snippet in the same namespace (MBPP / HumanEval style).
        g = fresh_globals()
        try:
            exec(compile(code, "solution.py", "exec"), g)
        except BaseException as e:  # noqa: BLE001 - untrusted code may raise anything
            kind, msg = describe(e) if not isinstance(e, SystemExit) else ("error", "SystemExit")
            emit("compile_or_run_error", status=kind, msg=msg)
            emit("done", ran=0)
            return
        setup = spec.get("setup") or ""
        if setup:
            try:
                exec(compile(setup, "setup.py", "exec"), g)
            except BaseException as e:  # noqa: BLE001
                kind, msg = describe(e)
                emit("compile_or_run_error", status=kind, msg=msg)
                emit("done", ran=0)
                return
        for i, test in enumerate(spec["tests"]):
            try:
                exec(compile(test, f"test_{i}.py", "exec"), g)
                emit("test", i=i, ok=True)
            except BaseException as e:  # noqa: BLE001
                kind, msg = describe(e) if not isinstance(e, SystemExit) else ("error", "SystemExit")
                emit("test", i=i, ok=False, status=kind, msg=msg)
    elif mode == "io":
        # stdin/stdout tests (APPS / CodeContests style): the program runs afresh per case.
        compiled = None
        try:
            compiled = compile(code, "solution.py", "exec")
        except BaseException as e:  # noqa: BLE001
            kind, msg = describe(e)
            emit("compile_or_run_error", status=kind, msg=msg)
            emit("done", ran=0)
            return
        for i, (inp, expected) in enumerate(zip(spec["inputs"], spec["outputs"])):
            buf = io.StringIO()
            sys.stdin, sys.stdout = io.StringIO(inp), buf
            err = None
            try:
                exec(compiled, fresh_globals())
            except SystemExit:
                pass
            except BaseException as e:  # noqa: BLE001
                err = e
            finally:
                sys.stdin, sys.stdout = real_stdin, real_stdout
            if err is not None:
                kind, msg = describe(err)
                emit("test", i=i, ok=False, status=kind, msg=msg)
                continue
            got = buf.getvalue()
            ok = _same_output(got, expected)
            emit("test", i=i, ok=ok, status="ok" if ok else "wrong_answer", msg="" if ok else got[-200:])
    elif mode == "call":
        # Function-call tests (TACO / LeetCode style): fn_name(*args) == expected.
        g = fresh_globals()
        try:
            exec(compile(code, "solution.py", "exec"), g)
            fn = g.get(spec["fn_name"])
            if fn is None and "Solution" in g:  # LeetCode-style class Solution
                fn = getattr(g["Solution"](), spec["fn_name"])
            if fn is None:
                raise NameError(f"function {spec['fn_name']!r} is not defined")
        except BaseException as e:  # noqa: BLE001
            kind, msg = describe(e)
            emit("compile_or_run_error", status=kind, msg=msg)
            emit("done", ran=0)
            return
        for i, (args, expected) in enumerate(zip(spec["inputs"], spec["outputs"])):
            try:
                if not isinstance(args, list):
                    args = [args]
                got = fn(*args)
                ok = _same_value(got, expected)
                emit("test", i=i, ok=ok, status="ok" if ok else "wrong_answer", msg="" if ok else repr(got)[:200])
            except BaseException as e:  # noqa: BLE001
                kind, msg = describe(e)
                emit("test", i=i, ok=False, status=kind, msg=msg)
    emit("done", ran=1)


def _same_output(got, expected):
    """Whitespace-insensitive comparison of program output (token by token)."""
    if isinstance(expected, list):
        expected = "\n".join(str(x) for x in expected)
    return str(got).split() == str(expected).split()


def _same_value(got, expected):
    if got == expected:
        return True
    # JSON round-trips tuples as lists; a single expected value is sometimes wrapped in a list.
    if isinstance(got, tuple):
        got = list(got)
    if got == expected:
        return True
    if isinstance(expected, list) and len(expected) == 1 and got == expected[0]:
        return True
    return False


if __name__ == "__main__":
    _main()
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the candidate may have closed or replaced stdout
        pass
    os._exit(0)  # skip interpreter teardown (atexit handlers the candidate may have registered)
