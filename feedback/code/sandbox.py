"""Run an untrusted Python program against tests, isolated from the machine that trains on it.

One bubblewrap sandbox per `run_tests` call (one rollout's tests), in which harness.py runs each
test and enforces the limits; without bubblewrap it is *weak* (`isolation()`), which
`require_isolation` refuses unless the user accepts it. The namespaces, the mounts, the uid pool
and what holds and what does not: docs/sandbox.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath

from feedback.code.harness import KEPT_OUTPUT as KEPT, SAFE_PATH, decode_value, encode_value

# Uids the programs run as when we are root, one per concurrent sandbox, so that one program's
# process budget (RLIMIT_NPROC counts per uid) is its own. Uids of real accounts are skipped.
UID_BASE = 62000
UID_COUNT = 256
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
ROOT = "/sandbox"  # the program's writable directory, inside the sandbox
HARNESS_INSIDE = "/opt/sdpo/harness.py"
MIN_BWRAP = (0, 8)  # --size (0.7) and --perms (0.8) for tmpfs mounts
RUNNER_TASKS = 4  # the runner's own threads, counted by RLIMIT_NPROC when it shares the program's uid
INSTALL_BWRAP = ("Install bubblewrap (apt-get install bubblewrap; without root it also needs unprivileged user "
                 "namespaces)")
# bwrap's words when the kernel or a container refuses namespaces (not a problem of our mounts)
NAMESPACES_REFUSED = ("No permissions to creat", "Creating new namespace failed", "setting up uid map",
                      "Operation not permitted")


@dataclass
class Limits:
    cpu_seconds: float = 5.0  # CPU time of all the program's processes together, per test: the budget
    idle_seconds: float = 5.0  # time with no thread of the program running or runnable (sleep, waits)
    max_wall_seconds: float = 120.0  # per test; a backstop that only a badly overloaded machine reaches
    memory_mb: int = 512  # resident memory of all its processes together (and RLIMIT_AS of each)
    max_procs: int = 64  # processes + threads (RLIMIT_NPROC)
    max_file_mb: int = 16  # any one file it writes, stdout and stderr included (RLIMIT_FSIZE)
    disk_mb: int = 64  # its directory, /tmp and /var/tmp together (a tmpfs)
    shm_mb: int = 64  # /dev/shm (a tmpfs)
    max_files: int = 10_000  # inodes on those tmpfs together: each is kernel memory that no size counts
    allow_network: bool = False


@dataclass
class RunResult:
    """One test's run. Which fields are set depends on the test's kind (stdin, call, assert)."""
    index: int  # position of the test in the list given to run_tests
    stdout: str = ""  # its first bytes: as many as the expected output could need (see _job)
    stderr: str = ""  # its last 64 KiB
    stdout_cut: bool = False  # stdout was longer than that: it cannot be the expected output
    returncode: int | None = None  # the program's exit (negative: killed by that signal); None: n/a
    limit: str = ""  # the limit that stopped it: "cpu", "idle", "wall", "memory", "output"; "" none
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    value: object = None  # call tests: the returned value, as plain data
    has_value: bool = False
    exception: dict | None = None  # the program raised: {"type", "message", "traceback"}
    load_error: dict | None = None  # the program raised while being loaded (call and assert tests)
    died: bool = False  # the program's process ended (or was killed) during a call
    passed: bool = False  # assert tests: the test code ran to its end
    failure: dict | None = None  # assert tests: {"line", "message"} of the failed assertion
    last_call: dict = field(default_factory=dict)  # assert tests: {"call", "returned"} of the last call
    error: str = ""  # the sandbox failed (not the program's fault)


class SandboxUnavailable(RuntimeError):
    pass


# -----------------------------------------------------------------------------
# what this machine can enforce


@dataclass(frozen=True)
class Isolation:
    bwrap: str | None  # bubblewrap, when it runs a sandbox here; None: weak sandbox
    root: bool
    problems: tuple[str, ...]  # guarantees that do not hold here (empty when isolated)
    remedy: str = INSTALL_BWRAP  # what to do about the first problem

    @property
    def isolated(self) -> bool:
        return self.bwrap is not None


_probe_lock = threading.Lock()
_isolation: Isolation | None = None
_weak_accepted = False
_announced = False


def isolation() -> Isolation:
    """Probed once per process: whether bubblewrap builds a sandbox here."""
    global _isolation
    with _probe_lock:
        if _isolation is None:
            _isolation = _probe()
        return _isolation


def _probe() -> Isolation:
    root = os.geteuid() == 0
    bwrap = shutil.which("bwrap")
    why, remedy = "bubblewrap is not installed (apt-get install bubblewrap)", INSTALL_BWRAP
    version = _bwrap_version(bwrap) if bwrap else None
    if version is not None and version < MIN_BWRAP:
        why = (f"bubblewrap {'.'.join(map(str, version))} is older than {'.'.join(map(str, MIN_BWRAP))}, "
               "which sizes and modes tmpfs mounts (Ubuntu 22.04 ships 0.6: install a newer one)")
    elif bwrap is not None:
        try:
            job = _job("", [], None, ROOT, 0, sys.executable, Limits())
            out = _run_job(Isolation(bwrap, root, ()), Limits(), job, 60)
            if out.returncode == 0:
                return Isolation(bwrap, root, ())
            said = out.stderr.strip()[-500:] or f"exit {out.returncode}"
        except (OSError, subprocess.SubprocessError) as e:
            said = str(e)
        why = f"bubblewrap ({bwrap}) is installed but could not build the sandbox: {said}"
        remedy = _remedy(said, root)
    problems = [why,
                "programs can read every world-readable file, the dataset included (and print the expected outputs)",
                "programs can leave files in /tmp, /var/tmp and /dev/shm, with no size limit, and see other sandboxes' files",
                "programs are not in a pid namespace (leftover processes are found by process tree and uid)",
                "programs have the machine's network"]
    if not root:
        problems.append("programs run as your own user: they can read your processes' environments (API keys), "
                        "signal them and write your files")
    return Isolation(None, root, tuple(problems), remedy)


def _remedy(said: str, root: bool) -> str:
    """What to do when an installed bubblewrap fails: namespaces refused by the machine, or a
    mount of ours that does not fit this installation (then reinstalling bubblewrap is no help)."""
    if any(words in said for words in NAMESPACES_REFUSED):
        return ("This machine or container refuses the namespaces bubblewrap needs: "
                + ("" if root else "run as root, or allow unprivileged user namespaces (sysctl "
                   "kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 also "
                   "kernel.apparmor_restrict_unprivileged_userns=0); ")
                + "in docker, run the container with --security-opt seccomp=unconfined (or --privileged)")
    return (f"This is the sandbox's own set-up failing for this machine, not a missing package (Python at "
            f"{sys.prefix}, runtime {sys.base_prefix}): please report the message above; a Python installed "
            f"elsewhere may work meanwhile")


def _bwrap_version(bwrap: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30).stdout
        return tuple(int(x) for x in out.split()[-1].split(".")[:2])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def accept_weak_sandbox() -> None:
    """Run programs even where the sandbox cannot isolate them (says so once, loudly)."""
    global _weak_accepted, _announced
    _weak_accepted = True
    iso = isolation()
    if not iso.isolated and not _announced:
        _announced = True
        text = "weak code sandbox, accepted by --data.allow_weak_sandbox:\n  - " + "\n  - ".join(iso.problems)
        print("\n" + "!" * 80 + "\nWARNING: " + text + "\n" + "!" * 80 + "\n", file=sys.stderr, flush=True)
        warnings.warn(text, RuntimeWarning, stacklevel=2)


def require_isolation(allow_weak: bool) -> None:
    """At start-up of a run that executes model-written code: raise SandboxUnavailable, naming
    what cannot be enforced, unless the sandbox is isolated or `allow_weak`."""
    iso = isolation()
    if not iso.isolated:
        if not allow_weak:
            raise SandboxUnavailable(_refusal(iso))
        accept_weak_sandbox()


def _refusal(iso: Isolation) -> str:
    return ("the code sandbox cannot isolate programs here:\n  - " + "\n  - ".join(iso.problems) +
            f"\n{iso.remedy}; or pass --data.allow_weak_sandbox=True to run model-written code anyway.")


# -----------------------------------------------------------------------------
# running tests


def run_tests(code: str, tests: list[dict], limits: Limits | None = None) -> list[RunResult]:
    """Run `code` against `tests`, in order, in one sandbox, stopping after the first test that
    errors or is killed (a wrong answer or a failed assertion does not stop them). A test is
    {"input": str} (stdin; the trainer compares stdout), {"fn", "args", "kwargs"} (a call;
    consecutive ones share one program process) or {"fn", "assert"} (test code calling
    `candidate`). Never raises for problems of the program; a broken sandbox gives a result with
    .error set. Raises SandboxUnavailable if the sandbox is weak and that was not accepted."""
    limits = limits or Limits()
    if not tests:
        return []
    iso = isolation()
    if not iso.isolated and not _weak_accepted:
        raise SandboxUnavailable(_refusal(iso))
    uid, lock_fd, root_dir = None, None, ROOT
    try:
        if iso.root:
            uid, lock_fd = _acquire_uid()
        if not iso.isolated:
            root_dir = tempfile.mkdtemp(prefix="sdpo-sandbox-")
            os.chmod(root_dir, 0o1733 if uid is not None else 0o700)  # the uid may create, not list
        # RLIMIT_NPROC: a uid of its own counts only the program; a shared one, ours too
        nproc_base = 0 if uid is not None else _tasks_of_uid(os.getuid()) + RUNNER_TASKS
        python = sys.executable if iso.isolated or uid is None else _weak_python(uid)
        if python is None:
            return [RunResult(0, error=f"no Python interpreter is executable by the sandbox uid {uid} "
                                       f"({sys.executable!r} is not reachable by it, no python3 in {SAFE_PATH})")]
        job = _job(code, tests, uid, root_dir, nproc_base, python, limits)
        budget = len(tests) * (limits.max_wall_seconds + 10) + 60  # the runner's own limits come first
        out = _run_job(iso, limits, job, budget, cwd=None if iso.isolated else root_dir)
        results = [_result(r) for r in out.results]
        if not results and out.returncode != 0:
            tail = out.stderr.strip()[-1000:]
            return [RunResult(0, error=out.error or f"sandbox runner failed (exit {out.returncode}): {tail}")]
        return results
    finally:
        if root_dir != ROOT:
            _rmtree(root_dir)
        if lock_fd is not None:
            os.close(lock_fd)  # releases the uid


def _job(code: str, tests: list[dict], uid: int | None, root_dir: str, nproc_base: int, python: str,
         limits: Limits) -> dict:
    """The runner's job: the tests grouped by kind (consecutive call tests share a process). What
    the program may send back is sized by what the test expects (its stdout, a call's value), so
    that what reaches the trainer is bounded by the row, not by the program."""
    groups: list[dict] = []
    for i, t in enumerate(tests):
        if "input" in t:
            cap = 2 * len(t["output"].encode()) + KEPT if "output" in t else limits.max_file_mb << 20
            groups.append({"kind": "stdio", "input": t["input"], "stdout_cap": cap, "indices": [i]})
        elif "assert" in t:
            groups.append({"kind": "assert", "fn": t["fn"], "assert": t["assert"], "indices": [i]})
        else:
            call = {"fn": t["fn"], "args": encode_value(list(t.get("args", []))), "kwargs": encode_value(dict(t.get("kwargs") or {}))}
            if "expected" in t:  # 4x: a tuple or a dict takes more JSON than the list or object expected
                expected = json.dumps(encode_value(t["expected"])).encode()
                call["max_bytes"] = 4 * len(expected) + KEPT
                call["max_nodes"] = 4 * sum(expected.count(c) for c in b",[{") + 10_000
            if groups and groups[-1]["kind"] == "calls":
                groups[-1]["calls"].append(call)
                groups[-1]["indices"].append(i)
            else:
                groups.append({"kind": "calls", "calls": [call], "indices": [i]})
    return {"code": code, "tests": groups, "uid": uid, "root_dir": root_dir, "nproc_base": nproc_base,
            "python": python, "harness": HARNESS_INSIDE if root_dir == ROOT else HARNESS, "limits": asdict(limits)}


def _result(r: dict) -> RunResult:
    """A line of the runner's results (RunResult's fields: the runner writes them) with its value decoded."""
    res = RunResult(**{k: v for k, v in r.items() if k != "value"})
    if "value" in r:
        try:
            res.value, res.has_value = decode_value(r["value"]), True
        except (ValueError, TypeError, RecursionError) as e:
            res.exception = {"type": "ValueError", "message": f"unreadable return value: {e}", "traceback": ""}
    return res


@dataclass
class _JobOutput:
    returncode: int | None
    stderr: str
    results: list[dict]
    error: str = ""


def _run_job(iso: Isolation, limits: Limits, job: dict, timeout: float, cwd: str | None = None) -> _JobOutput:
    """Start the runner (inside bwrap when isolated) with the job on one fd and a results fd;
    wait for it, at most `timeout` seconds."""
    job_fd = os.memfd_create("sdpo-job")
    out_fd = os.memfd_create("sdpo-results")
    try:
        os.write(job_fd, json.dumps(job).encode())
        os.lseek(job_fd, 0, os.SEEK_SET)
        # the runner needs only the standard library (-S: no site-packages, a faster start)
        runner = [sys.executable, "-I", "-S", job["harness"], "--job", str(job_fd), "--out", str(out_fd)]
        argv = _bwrap_argv(iso, limits) + runner if iso.isolated else runner
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                pass_fds=(job_fd, out_fd), start_new_session=True, cwd=cwd or "/",
                                env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"})
        error = ""
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, 9)
            _, err = proc.communicate()
            error = f"sandbox runner hung for {timeout:.0f} s"
        os.lseek(out_fd, 0, os.SEEK_SET)
        with os.fdopen(os.dup(out_fd), "rb") as f:
            results = [json.loads(line) for line in f if line.endswith(b"\n")]
        return _JobOutput(proc.returncode, err.decode(errors="replace"), results, error)
    finally:
        os.close(job_fd)
        os.close(out_fd)


def _bwrap_argv(iso: Isolation, limits: Limits) -> list[str]:
    argv = [iso.bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv", "--setenv", "PATH", SAFE_PATH]
    if not limits.allow_network:
        argv.append("--unshare-net")
    if iso.root:  # the runner keeps only what it needs to start the program as another uid and end it
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    # /tmp and /var/tmp first, as relative symlinks (resolved in the new root while bwrap builds it),
    # so that a Python installation under either is mounted through them, into the program's tmpfs
    tmp = ROOT.lstrip("/") + "/.tmp"
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(limits.disk_mb << 20), "--tmpfs", ROOT,
             "--perms", "1777", "--dir", ROOT + "/.tmp",
             "--symlink", tmp, "/tmp", "--perms", "0755", "--dir", "/var", "--symlink", "../" + tmp, "/var/tmp",
             "--perms", "1777", "--size", str(limits.shm_mb << 20), "--tmpfs", "/dev/shm"]
    argv += _runtime_mounts()
    argv += ["--perms", "0755", "--dir", os.path.dirname(os.path.dirname(HARNESS_INSIDE)),
             "--perms", "0755", "--dir", os.path.dirname(HARNESS_INSIDE),
             "--ro-bind", HARNESS, HARNESS_INSIDE, "--chdir", ROOT, "--"]
    return argv


def _runtime_mounts() -> list[str]:
    """Read-only mounts of the system runtime and of this Python installation (and its venv)."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"):
        argv += ["--ro-bind-try", f, f]
    exe_prefix = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                               exe_prefix)}
    venvs = {p for p in (sys.prefix, os.path.dirname(os.path.dirname(sys.executable)))  # reached by symlinks
             if os.path.realpath(p) != p and os.path.isdir(p)}
    made, frozen = set(), []
    for p in sorted(prefixes | venvs):
        if any(p == top or p.startswith(top + "/") for top in ("/usr", "/bin", "/lib", "/lib64")):
            continue
        # bwrap makes missing parents 0700, which the program's uid could not cross (pyenv under /root)
        for d in map(str, reversed(PurePosixPath(p).parents[:-1])):  # /a, /a/b of /a/b/c
            if d in made:
                continue
            made.add(d)
            if os.path.dirname(d) in ("/tmp", "/var/tmp"):
                # in the program's writable /tmp: a small tmpfs, made read-only below, so that the
                # program (the same uid, without root) cannot rename the way to its interpreter
                argv += ["--perms", "0755", "--size", str(1 << 20), "--tmpfs", d]
                frozen.append(d)
            else:
                argv += ["--perms", "0755", "--dir", d]
        argv += ["--ro-bind", p, p]
    for d in frozen:
        argv += ["--remount-ro", d]
    return argv


def _rmtree(path: str) -> None:
    """rmtree that also works when the program chmod-ed its own dirs to 000."""
    def fix(func, p, _exc):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
    shutil.rmtree(path, onerror=fix)


# -----------------------------------------------------------------------------
# uids (root only)


def _scan_proc(tasks: bool = False) -> list[tuple[int, int]]:
    """(pid, real uid) of every process (or every thread, with tasks), zombies included."""
    rows = []
    for path in glob.glob("/proc/[0-9]*/task/[0-9]*/status" if tasks else "/proc/[0-9]*/status"):
        try:
            with open(path, "rb") as f:
                uid = re.search(rb"^Uid:\s+(\d+)", f.read(), re.MULTILINE)
        except OSError:
            continue  # exited meanwhile
        if uid:
            rows.append((int(path.split("/")[2]), int(uid.group(1))))
    return rows


def _tasks_of_uid(uid: int) -> int:
    """Threads of `uid` on the machine: what RLIMIT_NPROC counts."""
    return sum(1 for _p, u in _scan_proc(tasks=True) if u == uid)


def _acquire_uid(timeout: float = 600.0) -> tuple[int, int]:
    """Take an unused uid of the pool: an flock on a per-uid file (held by the returned fd) makes
    it exclusive across threads and processes; a uid that still has processes is skipped."""
    lock_dir = os.path.join(tempfile.gettempdir(), "sdpo-sandbox-uids")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    st = os.lstat(lock_dir)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:  # e.g. pre-created by a weakly sandboxed program
        raise RuntimeError(f"{lock_dir} must be a directory owned by uid {os.geteuid()} with mode 0700")
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        for uid in range(UID_BASE, UID_BASE + UID_COUNT):
            if _is_account(uid):
                continue
            fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if any(u == uid for _p, u in _scan_proc()):
                os.close(fd)
                continue
            return uid, fd
        time.sleep(0.05)  # all busy: wait for a sandbox to finish
    raise RuntimeError(f"no free sandbox uid in {UID_BASE}..{UID_BASE + UID_COUNT - 1} after {timeout:.0f} s")


@functools.lru_cache(maxsize=None)
def _is_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


_python_lock = threading.Lock()
_python_cache: dict[str, str | None] = {}


def _weak_python(uid: int) -> str | None:
    """Weak sandbox as root: the interpreter must be executable by the sandbox uid itself (no
    bind mounts make it reachable): sys.executable if it can, else a python3 in SAFE_PATH."""
    with _python_lock:
        if "found" not in _python_cache:  # probed once: every pool uid has the same access
            candidates = [sys.executable, shutil.which("python3", path=SAFE_PATH)]
            found = next((c for c in candidates if c and _can_run(c, uid)), None)
            if found is not None and found != sys.executable:
                warnings.warn(f"sandbox: {sys.executable} is not executable by the unprivileged sandbox "
                              f"uid; running programs with {found} instead", RuntimeWarning, stacklevel=3)
            _python_cache["found"] = found
        return _python_cache["found"]


def _can_run(python: str, uid: int) -> bool:
    try:
        r = subprocess.run([python, "-I", "-S", "-c", "pass"], user=uid, group=uid, extra_groups=[],
                           cwd="/", env={"PATH": SAFE_PATH}, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
