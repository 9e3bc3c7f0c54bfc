"""The engine's processes: where they go, starting them quiet, placing them on CPU cores, ending them with the run.

Before anything loads, check_devices holds the flags against the node's devices: a placement
that cannot run is refused naming the flag to change, and a run that asked for GPUs and finds
none stops with what the GPU build needs. vLLM's engine core and workers (rollout.Engine) start
with torchrun's variables hidden, on their GPUs (engine_gpus), with the plugins importable; the
trainer's threads keep beside their cores (cpu_split, share_cores, pin_threads); a reaper ends
them when the trainer dies without closing the engine.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
from typing import TYPE_CHECKING

import torch

from errors import FlagError, UserError

if TYPE_CHECKING:
    from config import Config

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


ROOT = os.path.dirname(os.path.abspath(__file__))
# vLLM general plugins found on this path run in every process vLLM starts (vllm_plugins/).
PLUGIN_DIR = os.path.join(ROOT, "vllm_plugins")
VLLM_LOGGING = os.path.join(PLUGIN_DIR, "logging.json")
USER_CONFIGURED_VLLM_LOGGING = bool({"VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING"} & set(os.environ)) or \
    os.environ.get("VLLM_LOGGING_CONFIG_PATH", VLLM_LOGGING) != VLLM_LOGGING
if not USER_CONFIGURED_VLLM_LOGGING:
    # vLLM's "Triton is installed, but doesn't include CPU backend" comes at its import, before
    # its logging is configured; here, since the engine's processes import the main script, and
    # this module, before vLLM (docs/loop.md, What the console shows)
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)


@contextlib.contextmanager
def patched_env(set_vars: dict, remove_vars=()):
    saved = {k: os.environ.get(k) for k in list(set_vars) + list(remove_vars)}
    try:
        for k in remove_vars:
            os.environ.pop(k, None)
        os.environ.update(set_vars)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


REAPER = """
import contextlib, shutil, signal, sys, time, psutil
def running(p):
    with contextlib.suppress(psutil.Error):
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    return False
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the trainer decides
processes = []
for pid in sys.argv[1:]:
    with contextlib.suppress(psutil.Error):
        processes.append(psutil.Process(int(pid)))  # remembers its start time: a reused pid is never hit
# each line the trainer writes is a directory of its own to remove at the end (the file sync's,
# in /dev/shm: memory that would outlive a killed run); the loop ends when the pipe closes, i.e.
# when the trainer closed the engine, or died
directories = [line.strip() for line in sys.stdin if line.strip()]
for p in processes:
    with contextlib.suppress(psutil.Error):
        p.terminate()
deadline = time.monotonic() + 3  # an engine has nothing to save: a short grace, then SIGKILL
while processes and time.monotonic() < deadline:
    # a zombie has exited (its parent, the trainer, reaps it): waiting on its pid would last the whole grace
    processes = [p for p in processes if running(p)]
    time.sleep(0.05)
for p in processes:
    with contextlib.suppress(psutil.Error):
        p.kill()
for directory in directories:
    shutil.rmtree(directory, ignore_errors=True)
"""


def reap_directory(reaper, directory: str):
    """Have the engine's reaper (supervise) remove `directory` when the trainer goes, even by SIGKILL."""
    reaper.stdin.write(f"{directory}\n".encode())
    reaper.stdin.flush()


def descendants() -> set[int]:
    import psutil
    return {p.pid for p in psutil.Process().children(recursive=True)}


def pin_threads(pid: int, cores: list[int]):
    """Every thread of process pid that may run outside cores onto them (its later threads
    inherit it): vLLM binds only its CPU worker's OpenMP threads, and the others took the
    trainer's cores beside an asynchronous trainer (docs/async.md, Threads on a CPU)."""
    with contextlib.suppress(OSError):  # a process or thread that has ended meanwhile
        for tid in map(int, os.listdir(f"/proc/{pid}/task")):
            with contextlib.suppress(OSError):
                if not os.sched_getaffinity(tid) <= set(cores):
                    os.sched_setaffinity(tid, cores)


def alive(process) -> bool:
    import psutil
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def quiet_vllm_logging():
    """vLLM's own logging at WARNING, and its warnings that are harmless here hidden
    (vllm_plugins/logging.json; which and why: docs/loop.md, What the console shows). Only where
    the user has not configured vLLM's logging (VLLM_LOGGING_LEVEL=INFO)."""
    if not USER_CONFIGURED_VLLM_LOGGING:
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = VLLM_LOGGING


def importable(env: dict, directory: str):
    """Make directory's modules importable in every process vLLM starts."""
    paths = [p for p in env.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")).split(os.pathsep) if p]
    if directory not in paths:
        env["PYTHONPATH"] = os.pathsep.join([directory] + paths)


def use_plugins(env: dict):
    """Make vllm_plugins/ visible to this process and to every process vLLM starts."""
    if PLUGIN_DIR not in sys.path:
        sys.path.insert(0, PLUGIN_DIR)
    import no_torchvision
    no_torchvision.apply()
    importable(env, PLUGIN_DIR)


def cpu_split(cfg: Config) -> tuple[list[int], int, int]:
    """On CPU: (the cores the engine's worker computes on, each rank's torch threads while the
    engine generates beside the trainer, and while it does not). Taking turns, each gets every
    core; with --train.off_policy_steps 1 they split them (why: docs/async.md, Threads on a CPU).
    A thread count the user set (the flags, OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND) is kept."""
    cores = sorted(os.sched_getaffinity(0))
    ahead = cfg.train.off_policy_steps > 0
    engine = min(len(cores), cfg.rollout.cpu_threads or (max(1, len(cores) // 2) if ahead else len(cores)))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    alone = max(1, len(cores) // ranks)
    beside = max(1, (len(cores) - engine) // ranks) if ahead and engine < len(cores) else alone
    if cfg.train.cpu_threads or "OMP_NUM_THREADS" in os.environ:
        beside = alone = cfg.train.cpu_threads or torch.get_num_threads()
    return cores[:engine], beside, alone


def generation_waits(cfg: Config, device, runs_forwards: bool) -> bool:
    """Whether, generating ahead on a CPU, the next batch starts only once the forwards the
    objective's models run before the update's gradient passes are done (runs_forwards: an EMA
    teacher's): the engine generates on cores those forwards would use, and they gain the most
    from them (docs/async.md)."""
    return cfg.train.off_policy_steps > 0 and device.type == "cpu" and runs_forwards


def share_cores(cfg: Config, engine, models):
    """--train.off_policy_steps 1 on CPU: before each forward of the trainer's models, its
    threads are cpu_split's `beside` while the engine generates the next batch, and `alone`
    once it has finished. A forward pre-hook, because an OpenMP thread count belongs to the
    thread that sets it: the trainer's own thread must switch, between its forwards."""
    if engine is None or cfg.train.off_policy_steps == 0 or torch.cuda.is_available():
        return
    _, beside, alone = cpu_split(cfg)
    if beside == alone:
        return

    def switch(*_):
        want = beside if engine.generating_ahead() else alone
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
    for module in models.networks():  # the policy and the objective's models
        if isinstance(module, torch.nn.Module):
            module.register_forward_pre_hook(switch)


# ----------------------------------------------------------------------------------------
# The node's devices against the flags (before anything loads)

# The NVIDIA driver each CUDA major version's wheels need (NVIDIA's CUDA compatibility table:
# "minor version compatibility" within a major release)
CUDA_DRIVERS = {12: 525, 13: 580}
DRIVER_FILE = "/proc/driver/nvidia/version"


def nvidia_driver() -> str:
    """The loaded NVIDIA kernel driver's version ("580.65.06"), or "" where none is loaded."""
    with contextlib.suppress(OSError):
        with open(DRIVER_FILE) as f:
            found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", f.read())
        return found.group(1) if found else ""
    return ""


def gpu_requirement() -> str:
    """What this torch build needs to see a GPU, and what the node has, for a message."""
    cuda = torch.version.cuda
    if not cuda:
        return f"torch {torch.__version__} is a CPU build: install the GPU pins (README, GPU)"
    need = CUDA_DRIVERS.get(int(cuda.split(".")[0]))
    driver = nvidia_driver()
    return (f"torch {torch.__version__} is built for CUDA {cuda}"
            + (f", which needs an NVIDIA driver >= {need}" if need else "")
            + f"; this node's driver: {driver or 'none loaded (' + DRIVER_FILE + ')'} (README, GPU)")


def gpus_asked(cfg: Config) -> list[str]:
    """What in the flags, the environment or the install asks for GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return ([f"--rollout.placement {cfg.rollout.placement}"] * (cfg.rollout.placement == "separate")
            + [f"--rollout.tensor_parallel {cfg.rollout.tensor_parallel}"] * (cfg.rollout.tensor_parallel > 1)
            + [f"CUDA_VISIBLE_DEVICES={visible}"] * (visible not in ("", "-1"))
            + [f"the GPU build of torch ({torch.__version__})"] * bool(torch.version.cuda))


def engine_in_own_process(cfg: Config, world: int, cuda: bool) -> bool:
    """Where rollout.Engine runs: in this process only for a single colocated rank on a GPU
    that does not generate ahead (on a CPU always in its own: docs/results.md). A choice that
    cannot work is a FlagError."""
    ahead, choice = cfg.train.off_policy_steps > 0, cfg.rollout.engine_process
    own = choice == "own" or (choice == "auto" and (ahead or world > 1 or cfg.rollout.placement == "separate"
                                                    or cfg.rollout.tensor_parallel > 1 or not cuda))
    if not own and ahead:
        raise FlagError("--train.off_policy_steps 1 needs the engine in its own process "
                        "(--rollout.engine_process own or auto)")
    if not own and (world > 1 or cfg.rollout.placement == "separate"):
        # in-process under torchrun, vLLM joins the trainers' process group and waits for rank 1
        raise FlagError("--rollout.engine_process inprocess serves one colocated process only "
                        f"({'torchrun starts several' if world > 1 else '--rollout.placement separate'}): "
                        "use --rollout.engine_process auto")
    return own


def check_devices(cfg: Config):
    """Before anything loads: the node's GPUs can hold the placement the flags ask for, else a
    FlagError naming the flag to change; flags, environment or install that ask for GPUs on a
    node where torch sees none stop with a UserError saying what the GPU build needs (a CPU run
    instead would be silent). Every rank checks its own node."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    own = engine_in_own_process(cfg, world, cuda)
    if not cuda:
        asked = gpus_asked(cfg)
        if asked:
            raise UserError(f"{', '.join(asked)} asked for GPUs, but torch sees none: {gpu_requirement()}")
        return
    if cfg.rollout.engine:  # a served engine (served.py): no engine on this node, its GPUs are the trainers'
        return
    gpus, tp = torch.cuda.device_count(), cfg.rollout.tensor_parallel
    if cfg.rollout.placement == "colocated" and own:
        why = (f"torchrun's {world} ranks" if world > 1 else "--train.off_policy_steps 1" if cfg.train.off_policy_steps
               else f"--rollout.tensor_parallel {tp}" if tp > 1 else "--rollout.engine_process own")
        fix = (f"use --rollout.placement separate (the engine on a GPU of its own, torchrun --nproc_per_node="
               f"{gpus - tp})" if gpus > tp else "on this node's one GPU run one process (python run.py) that does "
               "not generate ahead, or use --rollout.placement separate on a node with more GPUs")
        raise FlagError(f"--rollout.placement colocated with {why} puts the engine in a process of its own on "
                        f"trainer rank 0's GPU, where NCCL cannot reach it from the trainer (two processes, one GPU): "
                        f"{fix}")
    engine = tp if cfg.rollout.placement == "separate" else 0
    if local + engine > gpus:
        fits = gpus - engine
        where = f"the engine's {engine} after the trainers' (--rollout.placement separate" + \
            (f", --rollout.tensor_parallel {tp})" if tp > 1 else ")") if engine else "none for an engine"
        fix = f"use --nproc_per_node={fits}" if fits > 0 else "lower --rollout.tensor_parallel" if tp > 1 else \
            "use --rollout.placement colocated (one GPU)"
        who = f"torchrun --nproc_per_node={local}" if "LOCAL_WORLD_SIZE" in os.environ else "one trainer process"
        raise FlagError(f"{who} with {where} needs {local + engine} GPUs and this node has {gpus}: {fix}")


def engine_gpus(tensor_parallel: int) -> str:
    """CUDA_VISIBLE_DEVICES of a separate engine: the tensor_parallel GPUs after this node's
    trainers' (trainer rank i on GPU i), in the node's own numbering when it is set (Slurm)."""
    first = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return ",".join(ids[first:first + tensor_parallel])


def engine_env(placement: str, own_process: bool, cpu_cores: list[int] | None, tensor_parallel: int = 1) -> tuple:
    """(the environment the engine starts in, the cores its processes keep to on CPU or None)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if own_process else "0"}
    if placement == "separate" and torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = engine_gpus(tensor_parallel)  # checked by check_devices
    bound = None  # the cores the engine's processes keep to, on CPU
    if not torch.cuda.is_available() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # the user's wins
        bound = cpu_cores or sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, bound))
    # Less three warnings that mean nothing to a user (torch's `reduce_op` deprecation, the CPU
    # worker's NUMA note, the resource tracker's leaked shared memory at exit: docs/loop.md, What
    # the console shows), unless the user set PYTHONWARNINGS or TORCH_CPP_LOG_LEVEL.
    if "PYTHONWARNINGS" not in os.environ:
        env["PYTHONWARNINGS"] = ("ignore::FutureWarning:vllm.triton_utils.dispatcher,"
                                 "ignore::UserWarning:multiprocessing.resource_tracker")
    if "TORCH_CPP_LOG_LEVEL" not in os.environ and not torch.cuda.is_available():
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    importable(env, ROOT)  # the project's modules, for what the engine's processes import of it
    return env, bound


def supervise(before: set[int], bound: list[int] | None) -> tuple[dict, object]:
    """The engine's processes started since before (pid -> (psutil.Process, name)), and a reaper
    that ends them when this process ends without closing the engine (kill -9: vLLM's own
    processes outlive their parent); on CPU their threads pinned to bound."""
    import psutil
    started = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            # multiprocessing's resource tracker is not the engine's, and it outlives it
            if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline()):
                started[p.pid] = (p, p.name())
    # REAPER: a small process that terminates them once this process has gone (its stdin closes),
    # then removes the directories written to it (reap_directory)
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, *map(str, started)], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL) if started else None
    for pid in started if bound else ():
        pin_threads(pid, bound)
    return started, reaper
