"""The inside of the code sandbox: the test runner and the program server. Standard library only.

`--job FD --out FD` is the trusted *runner* (every test in order, one JSON line per result);
`--serve SOLUTION` the *server* it starts for call and assert tests (the program as a module,
calls on fds 3 and 4). The two roles, who can touch what and how each limit is measured:
docs/sandbox.md, How it is built.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import fcntl
import json
import math
import os
import resource
import signal
import sys
import textwrap
import threading
import time
import traceback
import types

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
POLL_SECONDS = 0.01  # limit checks inside the sandbox, where /proc lists only the program
POLL_SECONDS_WEAK = 0.05  # without a pid namespace every check scans the whole machine's /proc
MAX_DEPTH = 100  # nesting of values passed between program and runner
MAX_SHOWN = 4000  # chars of a traceback or exception message kept
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
MAX_FDS = 64  # per process: bounds what pipes and sockets can hold in kernel memory
KEPT_OUTPUT = 64 << 10  # bytes of stdout kept when the test expects none, and of stderr's tail
VALUE_BYTES, VALUE_NODES = 1 << 20, 100_000  # a returned value's JSON, when no expected value sizes it


# -----------------------------------------------------------------------------
# values between the program and the runner / trainer


PLAIN = (bool, int, float, str)  # JSON's own scalars (with None)


def _deeper(depth: int) -> int:
    if depth >= MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
    return depth + 1


def encode_value(x, depth: int = 0):
    """A value of built-in types as JSON-able data that `decode_value` turns back into the same
    types: lists and str/int/float/bool/None as themselves, tuples, sets, frozensets, dicts,
    bytes and complex numbers as one-key objects ({"tuple": [...]}). Subclasses become their base
    type (a Counter a dict); numpy values go through .tolist(); anything else is a TypeError."""
    t = type(x)
    if x is None or t in PLAIN:
        return x
    d = _deeper(depth)
    if isinstance(x, int):  # bool cannot be subclassed; IntEnum and friends
        return int(x)
    if isinstance(x, float):
        return float(x)
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, list):
        return [encode_value(v, d) for v in x]
    for kind in (tuple, frozenset, set):
        if isinstance(x, kind):
            return {kind.__name__: [encode_value(v, d) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[encode_value(k, d), encode_value(v, d)] for k, v in x.items()]}
    if isinstance(x, (bytes, bytearray)):
        return {"bytes": bytes(x).hex()}
    if isinstance(x, complex):
        return {"complex": [x.real, x.imag]}
    if t.__module__.split(".")[0] == "numpy" and hasattr(x, "tolist"):
        return encode_value(x.tolist(), d)
    raise TypeError(f"a value of type {t.__name__} cannot be passed or compared; "
                    "use built-in types (int, float, str, bool, None, list, tuple, dict, set)")


def decode_value(j, depth: int = 0):
    """Inverse of encode_value for trusted code: builds only built-in values; ValueError on
    anything encode_value does not produce."""
    t = type(j)
    if j is None or t in PLAIN:
        return j
    d = _deeper(depth)
    if t is list:
        return [decode_value(v, d) for v in j]
    if t is dict and len(j) == 1:
        (tag, v), = j.items()
        try:
            if tag == "tuple" and type(v) is list:
                return tuple(decode_value(e, d) for e in v)
            if tag in ("set", "frozenset") and type(v) is list:
                return (set if tag == "set" else frozenset)(decode_value(e, d) for e in v)
            if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
                return {decode_value(k, d): decode_value(e, d) for k, e in v}
        except TypeError as e:  # an unhashable set member or dict key
            raise ValueError(f"malformed {tag}: {e}") from None
        if tag == "bytes" and type(v) is str:
            return bytes.fromhex(v)
        if tag == "complex" and type(v) is list and len(v) == 2 and all(type(e) in (int, float) for e in v):
            return complex(v[0], v[1])
    raise ValueError(f"malformed value {str(j)[:100]!r}")


def call_text(fn: str, args: list, kwargs: dict) -> str:
    """The call as Python source, for feedback: f(1, 'a', k=2)."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{fn}({', '.join(parts)})"


def _exception_info(e: BaseException, filename: str) -> dict:
    """type, message and the traceback from the first frame in `filename` on (the harness's own
    frames would only confuse the reader)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(e), e, tb))
    return {"type": type(e).__name__, "message": str(e)[:MAX_SHOWN], "traceback": text[-MAX_SHOWN:]}


# -----------------------------------------------------------------------------
# the server: runs the program, answers calls (as the program's uid; nothing here is trusted)


def serve(solution: str) -> None:
    requests, replies = os.fdopen(3, "rb"), os.fdopen(4, "wb")

    def send(msg: dict) -> None:
        try:
            line = json.dumps(msg)
        except (TypeError, ValueError) as e:  # e.g. an int too long to print
            line = json.dumps({"exception": {"type": type(e).__name__, "message": str(e)[:MAX_SHOWN],
                                             "traceback": ""}})
        replies.write(line.encode() + b"\n")
        replies.flush()

    module = types.ModuleType("solution")
    module.__file__ = "solution.py"
    sys.modules["solution"] = module  # so that pickling, dataclasses and the like find it
    try:
        with open(solution, encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), module.__dict__)
    except BaseException as e:  # noqa: BLE001 - SystemExit included: exit() while loading is an error
        send({"load_error": _exception_info(e, "solution.py")})
        return
    send({"ready": True})
    for line in requests:
        req = json.loads(line)
        try:
            target = _resolve(module, req["fn"])
            value = target(*decode_value(req["args"]), **decode_value(req["kwargs"]))
            send({"value": encode_value(value)})
        except BaseException as e:  # noqa: BLE001 - report anything the call raised, SystemExit too
            send({"exception": _exception_info(e, "solution.py")})


def _resolve(module, name: str):
    """`f`, or `Solution.twoSum` (a class on the way is instantiated with no arguments, afresh
    for every call, as LeetCode does)."""
    parts = name.split(".")
    if parts[0] not in module.__dict__:
        raise NameError(f"the program does not define {parts[0]!r}")
    obj = module.__dict__[parts[0]]
    for part in parts[1:]:
        if isinstance(obj, type):
            obj = obj()
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{name!r} is a {type(obj).__name__}, not a function")
    return obj


# -----------------------------------------------------------------------------
# the seccomp filter: the few system calls that would take a program around the limits


PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# name: (x86_64, aarch64) numbers
SYSCALLS = {"rt_sigaction": (13, 134), "clone": (56, 220), "unshare": (272, 97), "clone3": (435, 435),
            "memfd_create": (319, 279), "memfd_secret": (447, 447), "shmget": (29, 194), "semget": (64, 190),
            "msgget": (68, 186), "io_uring_setup": (425, 425)}
# memory that no process's RSS shows and no tmpfs bounds
DENIED = ("memfd_create", "memfd_secret", "shmget", "semget", "msgget", "io_uring_setup")
NEW_NAMESPACES = 0x10000000 | 0x20000000  # CLONE_NEWUSER | CLONE_NEWPID


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_filter():
    """The filter (a sock_fprog, its instructions kept alive on it), None on an unknown architecture.
    No SIGCHLD disposition and no pid namespace (either makes the kernel discard a reaped child's
    CPU time), no memfd, SysV IPC or io_uring (memory no RSS shows), no other ABI (i386's int 0x80,
    x32: other numbers). Why each: docs/sandbox.md, How the limits are measured."""
    arch = os.uname().machine
    if arch not in AUDIT_ARCH:
        return None
    nr = {name: nums[arch == "aarch64"] for name, nums in SYSCALLS.items()}
    ld = lambda offset: (0x20, 0, 0, offset)  # BPF_LD|BPF_W|BPF_ABS: seccomp_data at offset
    jeq = lambda k, jt, jf: (0x15, jt, jf, k)
    ret = lambda k: (0x06, 0, 0, k)
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog = [ld(4), jeq(AUDIT_ARCH[arch], 1, 0), ret(eperm), ld(0)]
    if arch == "x86_64":
        prog += [(0x35, 0, 1, 0x40000000), ret(eperm)]  # BPF_JGE: the x32 ABI
    for name in DENIED:
        prog += [jeq(nr[name], 0, 1), ret(eperm)]
    prog += [jeq(nr["clone3"], 0, 1), ret(enosys)]  # its flags are out of a filter's reach; libc falls back to clone
    for name in ("clone", "unshare"):  # flags in the first argument
        prog += [jeq(nr[name], 0, 4), ld(16), (0x45, 0, 1, NEW_NAMESPACES), ret(eperm), ret(allow)]  # BPF_JSET
    # rt_sigaction(SIGCHLD, act, ...) with act != NULL; reading the disposition stays allowed
    prog += [jeq(nr["rt_sigaction"], 0, 7), ld(16), jeq(signal.SIGCHLD, 0, 5), ld(24), jeq(0, 0, 2), ld(28),
             jeq(0, 1, 0), ret(eperm), ret(allow)]
    code = (ctypes.c_uint64 * len(prog))(*(c | jt << 16 | jf << 24 | k << 32 for c, jt, jf, k in prog))
    fprog = _SockFprog(len(prog), ctypes.addressof(code))
    fprog.code = code
    return fprog


# -----------------------------------------------------------------------------
# the runner


class ProgramGone(BaseException):
    """The program died or was killed during a call. A BaseException, so that test code with an
    `except Exception:` cannot swallow it and pass."""


class ProgramError(Exception):
    """The program raised an exception that is not a built-in one (for assert tests; built-in
    exception types are re-raised as themselves, so tests that expect a ValueError work)."""


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


class SandboxError(Exception):
    """The sandbox itself failed (not the program's fault)."""


class TestCodeError(Exception):
    """The test code cannot run as written (not the program's fault)."""


class Runner:
    """Runs a job's tests one after the other, each in fresh program processes."""

    def __init__(self, job: dict):
        self.job = job
        self.limits = job["limits"]
        self.pid1 = os.getpid() == 1  # in bubblewrap's pid namespace: the kernel ends every process with us
        self.uid = job["uid"]
        self.solution = os.path.join(job["root_dir"], "solution.py")
        self.libc = _libc()
        self.seccomp = seccomp_filter()
        self.n_spawned = 0

    # --- processes

    def spawn(self, argv: list[str], fds: dict[int, int], cpu_budget: float) -> int:
        """Fork the program: its own session, rlimits, the sandbox uid, a fresh working directory
        (also its HOME), `fds` as its fds 0..n and nothing else. Only called while the runner has
        a single thread (Python code runs between fork and exec)."""
        lim = self.limits
        cwd = os.path.join(self.job["root_dir"], f"t{self.n_spawned}")
        self.n_spawned += 1
        cpu = math.ceil(cpu_budget) + 1  # the runner's sum fires first; this is the kernel's backstop
        nproc = lim["max_procs"] + self.job["nproc_base"]
        status_r, status_w = os.pipe()  # close-on-exec: EOF without data = exec succeeded
        pid = os.fork()
        if pid == 0:
            try:
                os.close(status_r)
                os.setsid()
                status_w = fcntl.fcntl(status_w, fcntl.F_DUPFD_CLOEXEC, 200)  # above every target and copy
                high = {target: fcntl.fcntl(src, fcntl.F_DUPFD, 100) for target, src in fds.items()}
                for target, src in high.items():
                    os.dup2(src, target)
                os.closerange(max(fds) + 1, status_w)
                os.closerange(status_w + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
                resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
                resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] << 20,) * 2)
                resource.setrlimit(resource.RLIMIT_FSIZE, (lim["max_file_mb"] << 20,) * 2)
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
                resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_FDS, MAX_FDS))
                if self.uid is not None:
                    os.setgroups([])
                    os.setgid(self.uid)
                    os.setuid(self.uid)  # real, effective and saved: no way back
                    if os.getuid() != self.uid or os.geteuid() != self.uid:
                        raise OSError("uid switch did not take effect")
                if self.libc is not None:
                    self.libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
                    if not self.pid1:  # in a pid namespace the kernel kills everything when we go
                        self.libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                    if self.seccomp is not None and self.libc.prctl(
                            PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self.seccomp), 0, 0) != 0:
                        raise OSError(ctypes.get_errno(), "cannot install the seccomp filter")
                os.mkdir(cwd, 0o700)
                os.chdir(cwd)
                os.execve(argv[0], argv, {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "HOME": cwd})
            except BaseException as e:  # noqa: BLE001 - report anything, never return into the runner
                try:
                    os.write(status_w, f"{type(e).__name__}: {e}".encode()[:2000])
                finally:
                    os._exit(127)
        os.close(status_w)
        status = b""
        while chunk := os.read(status_r, 4096):
            status += chunk
        os.close(status_r)
        if status:
            os.waitpid(pid, 0)
            raise SandboxError("could not start the program: " + status.decode(errors="replace"))
        return pid

    def program_procs(self) -> list[tuple[int, list[str]]]:
        """(pid, /proc stat fields) of every process of the program, zombies included."""
        if self.pid1:  # /proc shows only the sandbox: everything but us is the program
            procs = [(int(p), _stat(int(p))) for p in os.listdir("/proc") if p.isdigit() and p != "1"]
            return [(p, st) for p, st in procs if st is not None]
        stats, children = {}, {}
        for name in os.listdir("/proc"):
            if name.isdigit() and (st := _stat(int(name))) is not None:
                stats[int(name)] = st
                children.setdefault(int(st[1]), []).append(int(name))
        found, frontier = [], [os.getpid()]  # our descendants (orphans re-parent to us, a subreaper)
        while frontier:
            kids = children.get(frontier.pop(), [])
            found += kids
            frontier += kids
        return [(p, stats[p]) for p in found]

    def end_program(self, pid: int | None = None) -> int | None:
        """SIGKILL and reap every process of the program; the exit code of `pid` (the main
        process, if not yet waited for). In the pid namespace one kill(-1) reaches all of them
        atomically; outside it, repeat until none is left."""
        code = None
        if pid is not None:
            _kill(pid)
            code = os.waitstatus_to_exitcode(os.wait4(pid, 0)[1])
        self.kill_program(reap=True)
        return code

    def kill_program(self, reap: bool = False) -> None:
        """SIGKILL every process of the program, reaping them with reap (the main thread only:
        the watch's thread must not reap the main process the main thread waits for)."""
        if self.pid1:
            _kill(-1)
        else:
            for _ in range(1000):  # outside a pid namespace: until no process is left
                live = [p for p, st in self.program_procs() if st[0] != "Z"]
                for p in live:
                    _kill(p)
                if reap:
                    _reap()
                if not live:
                    break
                time.sleep(0.002)
        if reap:
            _reap(block=self.pid1)

    # --- tests

    def run(self, out) -> None:
        with open(self.solution, "w", encoding="utf-8") as f:
            f.write(self.job["code"])
        os.chmod(self.solution, 0o644)
        for test in self.job["tests"]:
            run = {"stdio": self.run_stdio, "calls": self.run_calls, "assert": self.run_assert}[test["kind"]]
            try:
                results = run(test)
            except SandboxError as e:
                results = [{"error": str(e)}]
            for index, r in zip(test["indices"], results):
                out.write(json.dumps({"index": index, **r}) + "\n")
                out.flush()
            if any(_failed(r) for r in results):
                return

    def _output_fds(self, stdin: str) -> list[int]:
        fds = [os.memfd_create(name, 0) for name in ("stdin", "stdout", "stderr")]
        os.write(fds[0], stdin.encode())
        os.lseek(fds[0], 0, os.SEEK_SET)
        return fds

    def _outputs(self, fds: list[int], stdout_cap: int = KEPT_OUTPUT) -> dict:
        """The first `stdout_cap` bytes of the program's stdout (`stdout_cut`: there was more) and
        the last KEPT_OUTPUT of its stderr (where the error is); closes the fds. What reaches the
        trainer is what it can use, not what the program wrote (up to RLIMIT_FSIZE each)."""
        out_size, err_size = os.fstat(fds[1]).st_size, os.fstat(fds[2]).st_size
        err = os.pread(fds[2], KEPT_OUTPUT, max(0, err_size - KEPT_OUTPUT)).decode("utf-8", errors="replace")
        texts = {"stdout": os.pread(fds[1], stdout_cap, 0).decode("utf-8", errors="replace"),
                 "stdout_cut": out_size > stdout_cap,
                 # tracebacks name the program by its path in the sandbox: make it the plain "solution.py"
                 "stderr": err.replace(self.solution, "solution.py")}
        for fd in fds:
            os.close(fd)
        return texts

    def run_stdio(self, test: dict) -> list[dict]:
        fds = self._output_fds(test["input"])
        t0 = time.monotonic()
        try:
            pid = self.spawn([self.job["python"], "-I", self.solution], dict(enumerate(fds)), self.limits["cpu_seconds"])
        except SandboxError:
            self._outputs(fds)
            raise
        watch = Watch(self, pid)
        status = os.wait4(pid, 0)[1]
        watch.stop()
        self.end_program()
        return [{"returncode": os.waitstatus_to_exitcode(status), "limit": watch.fired, "cpu_seconds": watch.cpu(),
                 "wall_seconds": time.monotonic() - t0, **self._outputs(fds, test["stdout_cap"])}]

    def run_calls(self, test: dict) -> list[dict]:
        """All function-call tests of a group in one program process, in order, each with the
        per-test budgets. One result per call; after an exception or a death no more calls run."""
        session = Session(self, len(test["calls"]))
        results = []
        if session.start():
            for call in test["calls"]:
                session.watch.new_budget()
                reply = session.call(call)
                if reply is None:
                    break
                results.append({"exception": reply["exception"]} if "exception" in reply else
                               {"value": encode_value(reply["value"])})  # plain data again, for the trainer
                results[-1]["cpu_seconds"] = session.watch.cpu() - session.watch.budget_cpu0
                if "exception" in reply:
                    break
        # the call that raised or died gets how the program ended; a clean session adds nothing
        ended = session.end(results.pop() if results and "exception" in results[-1] else {})
        if "exception" in ended or "died" in ended or "load_error" in ended:
            results.append(ended)
        return results

    def run_assert(self, test: dict) -> list[dict]:
        """The test code runs here, in the runner, with `candidate` and the function's own name
        bound to a proxy that calls the program in its process and returns plain values."""
        session = Session(self, 1)
        result: dict = {}
        if session.start():
            fn, last = test["fn"], session.last

            def proxy(*args, **kwargs):
                try:
                    req = {"fn": fn, "args": encode_value(list(args)), "kwargs": encode_value(kwargs)}
                except (TypeError, ValueError) as e:
                    raise TestCodeError(f"the test passes an argument the program cannot receive: {e}") from None
                last.clear()
                last["call"] = call_text(fn.rsplit(".", 1)[-1], list(args), kwargs)
                reply = session.call(req)
                if reply is None:
                    raise ProgramGone()
                if "exception" in reply:
                    info = last["exception"] = reply["exception"]
                    cls = getattr(builtins, str(info.get("type")), None)
                    if isinstance(cls, type) and issubclass(cls, Exception) and cls is not AssertionError:
                        raise cls(info.get("message", ""))  # a test may expect a ValueError
                    raise ProgramError(f"{info.get('type')}: {info.get('message', '')}")
                last["returned"] = repr(reply["value"])[:MAX_SHOWN]
                return reply["value"]

            namespace = {"__name__": "__test__", "candidate": proxy, fn.split(".")[0]: proxy}
            try:
                exec(compile(test["assert"], "<test>", "exec"), namespace)
                result["passed"] = True
            except ProgramGone:
                pass  # session.end says how it died
            except TestCodeError as e:
                result["error"] = str(e)
            except BaseException as e:  # noqa: BLE001 - any other failure of the test code fails the test
                if "exception" in last:  # the program raised and the test did not catch it
                    result["exception"] = last["exception"]
                else:
                    result["failure"] = _test_failure(e, test["assert"])
            result["last_call"] = dict(last)
        return [session.end(result)]


class Session:
    """One program server process: start, calls, end. `watch` guards it throughout."""

    def __init__(self, runner: Runner, n_calls: int):
        self.runner, self.n_calls = runner, n_calls
        self.last: dict = {}
        self.gone = False  # the server died (or was killed by a limit) before the end
        self.oversize = False
        self.caps = (VALUE_BYTES, VALUE_NODES)  # of the current reply

    def start(self) -> bool:
        """Spawn the server and wait until the program is loaded; False if that failed (end()
        then reports why)."""
        r = self.runner
        self.t0 = time.monotonic()
        self.fds = r._output_fds("")
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        argv = [r.job["python"], "-I", r.job["harness"], "--serve", r.solution]
        try:
            self.pid = r.spawn(argv, {0: self.fds[0], 1: self.fds[1], 2: self.fds[2], 3: req_r, 4: rep_w},
                               r.limits["cpu_seconds"] * (self.n_calls + 1))
        except SandboxError:
            for fd in (req_w, rep_r, *self.fds):
                os.close(fd)
            raise
        finally:
            os.close(req_r)
            os.close(rep_w)
        self.requests, self.replies = os.fdopen(req_w, "wb"), os.fdopen(rep_r, "rb")
        self.watch = Watch(r, self.pid)  # loading the program is budgeted like a call
        self.loaded = self._reply()
        if self.loaded is not None and not self.loaded.keys() & {"ready", "load_error"}:
            # the program itself wrote on the reply channel while loading: no call may read that
            self.loaded = {"load_error": {"type": "ProtocolError", "traceback": "",
                                          "message": "the program wrote on the call channel (fd 4) while loading"}}
        return self.loaded is not None and "ready" in self.loaded

    def call(self, request: dict) -> dict | None:
        """Send one call; the reply with its value decoded, or None if the program is gone (or
        replied with more than the request's max_bytes or max_nodes: it is then stopped)."""
        # the caps come from the expected value's size, which the program must not learn
        self.caps = request.get("max_bytes", VALUE_BYTES), request.get("max_nodes", VALUE_NODES)
        try:
            sent = {k: request[k] for k in ("fn", "args", "kwargs")}
            self.requests.write(json.dumps(sent).encode() + b"\n")
            self.requests.flush()
        except (BrokenPipeError, ValueError):
            self.gone = True
            return None
        reply = self._reply()
        if reply is None or not ("value" in reply or "exception" in reply):
            self.gone = True
            return None
        if "value" in reply:
            try:
                reply["value"] = decode_value(reply["value"])
            except (ValueError, TypeError, RecursionError) as e:
                reply = {"exception": {"type": "ValueError", "message": f"unreadable return value: {e}",
                                       "traceback": ""}}
        if "exception" in reply and not isinstance(reply["exception"], dict):
            reply["exception"] = {"type": "ProtocolError", "message": "malformed reply", "traceback": ""}
        return reply

    def _reply(self) -> dict | None:
        max_bytes, max_nodes = self.caps
        line = self.replies.readline(max_bytes + 1)
        # a bound on the values json.loads would build (commas in strings aside): a reply of
        # [[]] * 10**6 is 4 MB of text but 64 MB of lists, here and again in the trainer
        if not line.endswith(b"\n") or line.count(b",") + line.count(b"[") + line.count(b"{") > max_nodes:
            if line:  # a reply over the cap: stop the program rather than parse it
                self.oversize = True
                _kill(self.pid)
            return None
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            reply = None
        if not isinstance(reply, dict):
            return {"exception": {"type": "ProtocolError", "traceback": "",
                                  "message": "the program wrote something that is not a reply on the call channel"}}
        return reply

    def end(self, result: dict) -> dict:
        """Stop the watch, end every process, and complete `result` with how the program ended
        when that matters (it failed to load, died, or raised)."""
        self.watch.stop()
        for f in (self.requests, self.replies):
            with contextlib.suppress(OSError):
                f.close()
        code = self.runner.end_program(self.pid)
        outputs = self.runner._outputs(self.fds)
        if self.loaded is not None and "load_error" in self.loaded:
            result["load_error"] = self.loaded["load_error"]
        elif self.loaded is None or self.gone:
            result["died"] = True
        if "died" in result or "load_error" in result:
            result.update(returncode=code, limit=self.watch.fired or ("output" if self.oversize else ""))
        result.update(cpu_seconds=self.watch.cpu(), wall_seconds=time.monotonic() - self.t0, **outputs)
        return result


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _reap(block: bool = False) -> None:
    """Reap finished children (orphans of the program re-parent to us)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _test_failure(e: BaseException, source: str) -> dict:
    """Where the test code failed: the whole statement (asserts span lines), and the exception
    unless it is a bare assert."""
    lineno = None
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<test>":
            lineno = tb.tb_lineno
        tb = tb.tb_next
    line = ""
    if lineno is not None:
        import ast
        innermost = None
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.stmt) and node.lineno <= lineno <= node.end_lineno and (
                    innermost is None or node.lineno >= innermost.lineno and node.end_lineno <= innermost.end_lineno):
                innermost = node
        if innermost is not None and not isinstance(innermost, (ast.FunctionDef, ast.ClassDef, ast.For, ast.While,
                                                                 ast.If, ast.With, ast.Try)):
            line = textwrap.dedent(ast.get_source_segment(source, innermost, padded=True) or "").strip()
        else:
            line = source.splitlines()[lineno - 1].strip()
    message = "" if isinstance(e, AssertionError) and not str(e) else f"{type(e).__name__}: {e}"[:MAX_SHOWN]
    return {"line": line[:MAX_SHOWN], "message": message}


def _failed(r: dict) -> bool:
    """Did the program end this test badly (then no further test runs)? A
    wrong answer, a failed assertion included, is not such an end."""
    return bool(r.get("error") or r.get("limit") or r.get("died") or "load_error" in r or "exception" in r
                or r.get("returncode") not in (0, None))


def _stat(pid: int, tid: int | None = None) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), None if it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(b")") + 2:].decode().split()


class Watch:
    """Polls the program's processes from a thread and kills them all when a limit fires;
    `fired` names it: "cpu", "idle", "wall" or "memory". CPU time is that of every process of
    the program, reaped ones included (ours via RUSAGE_CHILDREN, others' via cutime/cstime)."""

    def __init__(self, runner: Runner, main_pid: int):
        self.runner, self.limits, self.main_pid = runner, runner.limits, main_pid
        self.fired = ""
        self.budget_cpu0 = self._cpu = 0.0
        self._rss = self._files = 0
        self._idle = self._disk = 0.0  # time idle; time only waiting for the disk (idle beyond a grace)
        self._t_budget = time.monotonic()
        self._reaped0 = _children_cpu()
        self._runner_tid = threading.get_native_id()  # test code running in the runner is activity
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def new_budget(self) -> None:
        """Start the next call's budgets (function-call tests share one program process)."""
        with self._lock:
            self.budget_cpu0 = self._cpu
            self._idle = self._disk = 0.0
            self._t_budget = time.monotonic()

    def cpu(self) -> float:
        self._sample()
        return self._cpu

    def _sample(self) -> str:
        """Update CPU time, resident memory and files; return the program's activity: "R" if some
        thread of it (or the runner's main thread, running test code) is running or runnable,
        else "D" if one waits for the disk, else ""."""
        states, cpu, rss = set(), 0.0, 0
        reaped = _children_cpu()  # before the scan: a process we reap meanwhile is counted once
        for pid, st in self.runner.program_procs():
            cpu += sum(int(x) for x in st[11:15]) / CLK_TCK  # utime stime cutime cstime
            rss += int(st[21]) * PAGE
            if "R" not in states and st[0] != "Z":
                states |= _thread_states(pid, st)
        states.add((_stat(os.getpid(), self._runner_tid) or ["S"])[0])
        files = sum(_inodes(d) for d in (self.runner.job["root_dir"], "/dev/shm")) if self.runner.pid1 else 0
        with self._lock:
            self._cpu = max(self._cpu, reaped - self._reaped0 + cpu)  # never backwards
            self._rss, self._files = rss, files
        return "R" if "R" in states else "D" if "D" in states else ""

    def _loop(self) -> None:
        lim = self.limits
        poll = POLL_SECONDS if self.runner.pid1 else POLL_SECONDS_WEAK
        last = time.monotonic()
        while not self._stop.wait(poll):
            activity = self._sample()
            now = time.monotonic()
            with self._lock:
                if activity == "D" and self._disk < lim["idle_seconds"]:
                    self._disk += now - last
                elif activity != "R":
                    self._idle += now - last
                last = now
                if self._cpu - self.budget_cpu0 > lim["cpu_seconds"]:
                    self.fired = "cpu"
                elif self._rss > lim["memory_mb"] << 20:
                    self.fired = "memory"
                elif self._files > lim["max_files"]:
                    self.fired = "files"
                elif self._idle > lim["idle_seconds"]:
                    self.fired = "idle"
                elif now - self._t_budget > lim["max_wall_seconds"]:
                    self.fired = "wall"
            if self.fired:
                self.runner.kill_program()
                return
            self._reap_orphans()

    def _reap_orphans(self) -> None:
        """Reap zombies re-parented to us, except the main process (the main thread waits for it)."""
        me = str(os.getpid())
        for pid, st in self.runner.program_procs():
            if st[0] == "Z" and st[1] == me and pid != self.main_pid:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)


def _thread_states(pid: int, st: list[str]) -> set[str]:
    if int(st[17]) == 1:  # one thread: the process state is its state
        return {st[0]}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return set()
    return {(_stat(pid, int(t)) or ["S"])[0] for t in tids}


def _inodes(path: str) -> int:
    """Inodes in use on the filesystem at `path` (files, directories, links of every name)."""
    st = os.statvfs(path)
    return st.f_files - st.f_ffree


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[1] == "--serve":
        serve(argv[2])
        return
    job_fd, out_fd = int(argv[argv.index("--job") + 1]), int(argv[argv.index("--out") + 1])
    with os.fdopen(job_fd, "rb") as f:
        job = json.loads(f.read())
    libc = _libc()
    if libc is not None:
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, no /proc/<us>/mem or fd, even for our uid
        if os.getpid() != 1:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    with os.fdopen(out_fd, "w") as out:
        Runner(job).run(out)


if __name__ == "__main__":
    main(sys.argv)
