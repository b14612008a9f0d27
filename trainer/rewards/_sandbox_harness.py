"""The candidate's side of ``trainer.rewards.sandbox``: builds the jail, then serves the referee.

Run as ``python -I -B _sandbox_harness.py JAIL_JSON`` inside the namespaces the parent asked
``unshare`` for (mount, network, pid). It imports nothing from ``trainer``. Everything before the
serve loop is trusted code, done in this order:

1. join the run's pids cgroup (a fork limit that holds even for root);
2. **private root** (mount namespace): a fresh tmpfs becomes ``/`` (``pivot_root``), holding read-only
   bind mounts of the system and Python directories only, ``/dev/{null,zero,full,random,urandom}``,
   a fresh ``/proc`` of the pid namespace, and a size-capped tmpfs ``/sandbox`` as the only writable
   directory. The host's other files (datasets, checkpoints, the project, ``/tmp``) are not there;
3. **unprivileged uid**: as host root, the capability bounding set is emptied and the process becomes
   ``nobody`` (65534) with no groups and no capabilities;
4. resource limits (CPU seconds, address space, processes, file size, no core files);
5. **seccomp** (x86_64): ``no_new_privs`` and a filter that answers EPERM to mount, namespaces,
   ptrace and cross-process memory access, module and kexec loading, bpf, perf, keyrings,
   io_uring, ``mknod``, handle-based opens, clock setting, and sockets other than AF_UNIX;
6. a PEP 578 audit hook (defence in depth, and what names a refused action in the result);
7. serve: ``load`` the candidate's code, then answer ``call`` / ``getattr`` / ``getitem`` / ``len`` /
   ``iter`` / ``repr`` / ``io`` requests with values in the wire format (``_sandbox_wire``).

The candidate never sees the tests, the expected values or the result channel: the referee holds
them in another process, and only data crosses. A candidate that takes over this process (it can:
the audit hook's state is reachable from Python frames) can only answer requests with values, which
is no more than its code could do anyway, and the kernel layers above still hold.
"""

import builtins
import io
import json
import os
import sys
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import _sandbox_wire as wire  # noqa: E402

del sys.path[0]

NOBODY = 65534
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
SYS_PIVOT_ROOT_X86_64, SYS_CAPSET_X86_64 = 155, 126


# ----------------------------------------------------------------------------------------------
# jail set-up (trusted)
# ----------------------------------------------------------------------------------------------
def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _mount(libc, ctypes, src, tgt, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if libc.mount(enc(src), enc(tgt), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} on {tgt}: {os.strerror(e)}")


def _keep_flags(path):
    """The mount flags a read-only remount must keep (the kernel refuses to clear locked ones)."""
    f = os.statvfs(path).f_flag
    keep = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        if f & st:
            keep |= ms
    return keep


def _private_root(jail, notes):
    """Build the new root on a tmpfs and pivot into it. Raises OSError when the kernel refuses."""
    ctypes, libc = _libc()
    root = jail["root"]
    _mount(libc, ctypes, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, ctypes, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for src in jail["binds"]:
        dst = root + src
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "a").close()
        try:
            _mount(libc, ctypes, src, dst, None, MS_BIND)
        except OSError:
            _mount(libc, ctypes, src, dst, None, MS_BIND | MS_REC)  # a user namespace may need the whole tree
        _mount(libc, ctypes, None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _keep_flags(dst))
    for link, target in jail["links"]:
        os.makedirs(os.path.dirname(root + link), exist_ok=True)
        os.symlink(target, root + link)
    work = root + "/sandbox"
    os.makedirs(work)
    size = f"size={int(jail['limits']['fsize_mb'])}m,nr_inodes=4096,mode=1777"
    _mount(libc, ctypes, "tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, size)
    os.makedirs(root + "/tmp", mode=0o755, exist_ok=True)  # may exist: a venv under /tmp is bound below it
    os.makedirs(root + "/proc", exist_ok=True)
    try:
        _mount(libc, ctypes, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as e:  # e.g. a container that masks parts of /proc: the jail then has no /proc
        notes.append(f"no private /proc: {e}")
    os.chdir(root)
    os.mkdir(".old")
    if libc.syscall(SYS_PIVOT_ROOT_X86_64, b".", b".old") != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"pivot_root: {os.strerror(e)}")
    os.chdir("/")
    if libc.umount2(b"/.old", MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"detaching the old root: {os.strerror(e)}")
    os.rmdir("/.old")
    _mount(libc, ctypes, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return "/sandbox"


def _drop_privileges(enforced, notes):
    """Empty the bounding set, become nobody (as host root), and clear every capability."""
    ctypes, libc = _libc()
    if os.getuid() == 0:
        for cap in range(64):
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP; stops at the first unknown cap
                break
        if not os.environ.get("COXSWAIN_SBX_USERNS"):
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
    # capset(header v3, all zero): a namespace root also ends with no capabilities
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    if libc.syscall(SYS_CAPSET_X86_64, hdr, data) == 0:
        enforced.append("caps_dropped")
    if os.getuid() != 0 or os.environ.get("COXSWAIN_SBX_USERNS"):
        enforced.append("unprivileged_uid")
    else:
        notes.append("still uid 0")


def _seccomp(notes):
    """Install the syscall filter described in the module docstring. True when installed."""
    import platform
    import struct

    if platform.machine() != "x86_64":
        notes.append(f"no seccomp filter for {platform.machine()}")
        return False
    ctypes, libc = _libc()
    ALLOW, KILL = 0x7FFF0000, 0x80000000
    EPERM, ENOSYS = 0x00050000 | 1, 0x00050000 | 38
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    deny = [
        101, 165, 166, 155, 161, 163, 167, 168, 169, 170, 171, 175, 176, 313,  # ptrace, mount..., modules
        246, 320, 272, 308, 248, 249, 250, 321, 298, 310, 311, 323,  # kexec, (un)share ns, keys, bpf, perf, vm rw, uffd
        425, 426, 427, 133, 259, 303, 304, 300, 212, 179, 103, 153, 135, 172, 173,  # io_uring, mknod, handles, ...
        227, 164, 159, 305, 428, 429, 430, 431, 432, 433, 442, 438, 434, 424,  # clocks, new mount API, pidfd
    ]
    ns_flags = 0x10000000 | 0x00020000 | 0x20000000 | 0x40000000 | 0x04000000 | 0x08000000 | 0x02000000
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, 0xC000003E), (RET, 0, 0, KILL), (LD, 0, 0, 0),
            (JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM)]  # foreign arch: kill; x32 ABI: refused
    for nr in deny:
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, EPERM)]
    prog += [(JEQ, 0, 1, 435), (RET, 0, 0, ENOSYS)]  # clone3: libc falls back to clone, whose flags we can see
    prog += [(JEQ, 0, 4, 56), (LD, 0, 0, 16), (JSET, 0, 1, ns_flags), (RET, 0, 0, EPERM), (LD, 0, 0, 0)]
    prog += [(JEQ, 0, 3, 41), (LD, 0, 0, 16), (JEQ, 1, 0, 1), (RET, 0, 0, EPERM)]  # socket(): AF_UNIX only
    prog += [(RET, 0, 0, ALLOW)]
    raw = b"".join(struct.pack("=HBBI", c, jt, jf, k) for c, jt, jf, k in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fp = Fprog(len(prog), ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        notes.append(f"no_new_privs failed: {os.strerror(ctypes.get_errno())}")
        return False
    if libc.prctl(22, 2, ctypes.byref(fp), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        notes.append(f"seccomp failed: {os.strerror(ctypes.get_errno())}")
        return False
    return True


def _set_limits(lim, enforced, notes):
    import resource

    def setlim(which, value, layer=None):
        try:
            resource.setrlimit(which, (value, value))
            if layer:
                enforced.append(layer)
        except (ValueError, OSError) as e:
            notes.append(f"setrlimit {layer or which}: {e}")

    setlim(resource.RLIMIT_CPU, int(lim["cpu_s"]), "rlimit_cpu")  # soft = hard: SIGKILL even as pid 1
    setlim(resource.RLIMIT_AS, int(lim["mem_mb"]) << 20, "rlimit_as")
    setlim(resource.RLIMIT_NPROC, int(lim["nproc"]), "rlimit_nproc" if os.getuid() != 0 else None)
    setlim(resource.RLIMIT_FSIZE, int(lim["fsize_mb"]) << 20, "rlimit_fsize")
    setlim(resource.RLIMIT_CORE, 0)


def _parent_death_signal(parent_pid, enforced):
    ctypes, libc = _libc()
    if libc.prctl(1, 9, 0, 0, 0) == 0:  # PR_SET_PDEATHSIG = SIGKILL
        if parent_pid and os.getppid() != parent_pid:
            os._exit(1)  # the parent died before the prctl
        enforced.append("parent_death_signal")


# ----------------------------------------------------------------------------------------------
# the audit hook (defence in depth; the kernel layers are the boundary)
# ----------------------------------------------------------------------------------------------
def _install_audit_hook(workdir, violations):
    my_pid = os.getpid()
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    deny_always = {
        "os.fork": "process creation (os.fork)", "os.forkpty": "process creation (os.forkpty)",
        "os.posix_spawn": "process creation (os.posix_spawn)", "os.spawn": "process creation (os.spawn*)",
        "os.exec": "process creation (os.exec*)", "os.system": "process creation (os.system)",
        "subprocess.Popen": "process creation (subprocess)", "pty.spawn": "process creation (pty.spawn)",
        "ctypes.dlopen": "ctypes", "ctypes.dlsym": "ctypes", "ctypes.cdata": "ctypes", "ctypes.call_function": "ctypes",
        "resource.setrlimit": "changing resource limits", "resource.prlimit": "changing resource limits",
        "socket.__new__": "network (socket creation)", "socket.connect": "network (socket.connect)",
        "socket.bind": "network (socket.bind)", "socket.getaddrinfo": "network (name lookup)",
        "socket.gethostbyname": "network (name lookup)", "socket.sendto": "network (sendto)",
        "sys.addaudithook": "adding audit hooks", "os.chroot": "chroot", "os.setuid": "changing ids",
        "os.setgid": "changing ids", "os.mkfifo": "creating FIFOs", "os.mknod": "creating device nodes",
    }
    blocked_imports = {"cffi", "_cffi_backend", "_xxsubinterpreters", "_xxinterpchannels"}
    path_events = {
        "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
        "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
        "os.setxattr": (0,), "os.removexattr": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,),
        "shutil.copytree": (1,), "shutil.move": (0, 1),
    }

    class SandboxViolation(PermissionError):
        pass

    def inside(path):
        if isinstance(path, int):  # an fd: chmod / utime / truncate on whatever it names
            return False
        try:
            path = os.fsdecode(os.fspath(path))
        except TypeError:
            return False
        real = os.path.realpath(path)
        return real == workdir or real.startswith(workdir + os.sep) or real == "/dev/null"

    def refuse(what, detail=""):
        msg = f"sandbox: {what} is not allowed" + (f" ({detail})" if detail else "")
        if len(violations) < 20:
            violations.append(msg)
        raise SandboxViolation(msg)

    def hook(event, args):
        if event in deny_always:
            refuse(deny_always[event])
        elif event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & write_flags)
            if writing and not isinstance(path, int) and not inside(path):
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

    sys.addaudithook(hook)
    return SandboxViolation


# ----------------------------------------------------------------------------------------------
# serving the referee
# ----------------------------------------------------------------------------------------------
def _object_op(op, obj, req, enc, from_handle) -> dict:
    """One request on a handle the referee holds (a call, attribute, item, length, iteration or conversion):
    the answer encoded as data; new objects in it become handles."""
    if op == "call":
        args = [wire.decode(a, from_handle) for a in req.get("args", [])]
        kwargs = {k: wire.decode(a, from_handle) for k, a in req.get("kwargs", {}).items()}
        v = obj(*args, **kwargs)
        # the state of mutable arguments after the call: the referee mirrors in-place changes
        after = [enc(a) if type(a) in (list, dict, set, bytearray) else None for a in args]
        return {"v": enc(v), "after": after}
    if op == "getattr":
        return {"v": enc(getattr(obj, str(req["name"])))}
    if op == "getitem":
        return {"v": enc(obj[wire.decode(req["key"], from_handle)])}
    if op == "len":
        return {"v": int(len(obj))}
    if op == "iter":
        out = []
        for i, v in enumerate(obj):
            if i >= wire.MAX_ITEMS:
                raise wire.WireError("iterator too long")
            out.append(enc(v))
        return {"v": {"l": out}}
    if op == "bool":
        return {"v": bool(obj)}
    if op == "int":
        return {"v": int(obj)}
    if op == "float":
        return {"v": float(obj)}
    if op == "str":
        return {"v": str(obj)}
    if op == "repr":
        return {"v": str(repr(obj))[:2000]}
    raise wire.WireError(f"unknown request {op!r}")


def _serve(req_fd, resp_fd, violations, Violation):
    handles, ids = {}, {}
    g = {"__name__": "__main__", "__builtins__": builtins}
    compiled = [None]
    real_stdin, real_stdout = sys.stdin, sys.stdout
    reported = [0]

    def to_handle(obj):
        k = id(obj)
        if k not in ids:
            ids[k] = len(handles) + 1
            handles[ids[k]] = obj
        return ids[k]

    def from_handle(h):
        if h not in handles:
            raise wire.WireError(f"unknown handle {h}")
        return handles[h]

    def enc(x):
        return wire.encode(x, to_handle)

    def error(e):
        if isinstance(e, MemoryError):
            return {"status": "memory_limit", "msg": "MemoryError"}
        if isinstance(e, Violation):
            return {"status": "blocked", "msg": str(e)}
        if isinstance(e, SystemExit):
            return {"status": "error", "msg": "SystemExit"}
        return {"status": "error", "msg": "".join(traceback.format_exception_only(type(e), e)).strip()[-500:]}

    def handle(req):
        op = req.get("op")
        if op == "load":
            exec(compile(req["code"], "solution.py", "exec"), g)
            names = {}
            for k, v in list(g.items()):
                if not k.startswith("__"):
                    names[k] = enc(v)
            return {"names": names}
        if op == "compile":
            compiled[0] = compile(req["code"], "solution.py", "exec")
            return {}
        if op == "io":
            buf = io.StringIO()
            sys.stdin, sys.stdout = io.StringIO(req["input"]), buf
            try:
                exec(compiled[0], {"__name__": "__main__", "__builtins__": builtins})
            except SystemExit:
                pass
            finally:
                sys.stdin, sys.stdout = real_stdin, real_stdout
            return {"out": buf.getvalue()}
        return _object_op(op, from_handle(req["h"]), req, enc, from_handle)

    while True:
        try:
            req = wire.recv(req_fd)
        except (EOFError, OSError):
            return
        try:
            resp = handle(req)
        except BaseException as e:  # noqa: BLE001 - untrusted code may raise anything
            resp = {"err": error(e)}
        if len(violations) > reported[0]:
            resp["viol"] = violations[reported[0]:]
            reported[0] = len(violations)
        try:
            wire.send(resp_fd, resp)
        except wire.WireError as e:
            wire.send(resp_fd, {"err": {"status": "error", "msg": str(e)}})
        except (OSError, ValueError, TypeError) as e:
            try:
                wire.send(resp_fd, {"err": {"status": "error", "msg": f"unsendable value: {e}"[:300]}})
            except OSError:
                return


def main():
    jail = json.loads(sys.argv[1])
    req_fd, resp_fd = int(jail["req_fd"]), int(jail["resp_fd"])
    enforced, notes = [], []
    import resource  # noqa: F401  (pre-imported: nothing is importable from outside the jail later)
    import ctypes  # noqa: F401  (numpy and friends import it; later dlopen calls are refused)

    if jail.get("parent_pid"):
        _parent_death_signal(int(jail["parent_pid"]), enforced)
    if jail.get("cgroup_procs"):
        try:
            with open(jail["cgroup_procs"], "w") as f:
                f.write("0")
            enforced.append("pids_cgroup")
        except OSError as e:
            notes.append(f"could not join the pids cgroup: {e}")
    workdir = jail["workdir"]
    if jail.get("private_root"):
        try:
            workdir = _private_root(jail, notes)
            enforced.append("mount_namespace")
        except OSError as e:
            notes.append(f"no private root: {e}")
            wire.send(resp_fd, {"hello": 1, "enforced": enforced, "notes": notes, "fatal": str(e)})
            return
    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    if jail.get("drop_privileges"):
        _drop_privileges(enforced, notes)
        # the kernel clears the parent-death signal when the uid changes: set it again (our parent is
        # the unshare wrapper, which the reward worker's death kills; if the worker died in between,
        # the referee dies too and closes our request pipe, so we exit at the next read)
        ctypes_, libc_ = _libc()
        libc_.prctl(1, 9, 0, 0, 0)
    _set_limits(jail["limits"], enforced, notes)
    if jail.get("seccomp") and _seccomp(notes):
        enforced.append("seccomp")
    violations = []

    class Violation(Exception):  # raised by nothing while the audit hook is off
        pass

    if not jail.get("disable_guard"):
        Violation = _install_audit_hook(workdir, violations)
        enforced.append("audit_hook")
    sys.path.insert(0, workdir)
    wire.send(resp_fd, {"hello": 1, "enforced": enforced, "notes": notes, "workdir": workdir})
    _serve(req_fd, resp_fd, violations, Violation)


if __name__ == "__main__":
    main()
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the candidate may have replaced stdout
        pass
    os._exit(0)  # skip interpreter teardown (atexit handlers the candidate may have registered)
