"""distributed.py's collectives' rule, processes.py's device queries and plan.py on a real GPU, at one rank:

    torchrun --nproc_per_node 1 bench/gpu_rules.py      # seconds; PyTorch and transformers, no vLLM

What a CPU cannot show (tests/test_gpu_rules.py mocks the device queries and emulates the GPU
node's group): on the group run.py opens on GPUs, distributed.BACKENDS["cuda"], the loop's host
values (update.reduce_stats' float64 sums, the teacher's forward count, pickled objects) and a GPU
tensor each reach a backend, and rank0_call's barrier accepts a timeout beyond the group's; a
group of NCCL alone (9d53e47's) refuses the host values; the driver processes.nvidia_driver reads
is the one torch runs on, at least the one processes.CUDA_DRIVERS names for this torch's CUDA;
processes.check_devices passes the default placement and refuses `separate` on a node without a
GPU to spare; plan.this_node reports the GPU and the tiny default job plans on it. One line each,
then `RESULT ...` (ok, or what was raised). bench/gpu_check.sh runs it with the GPU benches.
"""
import os
import sys
import traceback

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import distributed  # noqa: E402
import plan  # noqa: E402
import processes  # noqa: E402
from flags import parse_config  # noqa: E402
from errors import FlagError  # noqa: E402


def collectives() -> dict:
    """Each of the loop's kinds of collective on the multi-backend group, and a host value on NCCL alone."""
    checks = {
        "host_float64_sum": lambda: dist.all_reduce(torch.tensor([1.0, 2.0], dtype=torch.float64)),
        "host_int64_max": lambda: dist.all_reduce(torch.tensor([3]), op=dist.ReduceOp.MAX),
        "gpu_sum": lambda: dist.all_reduce(torch.ones(1024, device="cuda")),
        "objects": lambda: dist.broadcast_object_list([{"a": 1}], src=0),
        "long_barrier": lambda: dist.barrier(timeout=distributed.RANK0_WAIT),
    }
    outcomes = {name: attempt(check) for name, check in checks.items()}
    nccl_only = dist.new_group([0], backend="nccl")
    refused = attempt(lambda: dist.all_reduce(torch.tensor([1.0], dtype=torch.float64), group=nccl_only))
    outcomes["nccl_only_host"] = "refused" if refused != "ok" else "accepted (the rule's premise fails)"
    return outcomes


def devices() -> dict:
    driver = processes.nvidia_driver()
    need = processes.CUDA_DRIVERS.get(int(torch.version.cuda.split(".")[0]))
    outcomes = {"driver": driver or "none read", "driver_meets_need": str(bool(driver) and need is not None and
                                                                       int(driver.split(".")[0]) >= need)}
    outcomes["check_colocated"] = attempt(lambda: processes.check_devices(parse_config([])))
    if torch.cuda.device_count() == 1:  # separate needs a second GPU
        refused = attempt(lambda: processes.check_devices(parse_config(["--rollout.placement=separate"])))
        outcomes["check_separate_one_gpu"] = "refused" if "FlagError" in refused else refused
    node = plan.this_node()
    outcomes["node"] = f"{node.gpus}x{node.gpu_name.replace(' ', '_')}:{node.gpu_bytes}"
    outcomes["plan_default"] = attempt(lambda: plan.plan(parse_config([]), plan.read_model(parse_config([])), node))
    return outcomes


def attempt(fn) -> str:
    try:
        fn()
        return "ok"
    except (FlagError, RuntimeError, ValueError, AssertionError) as e:
        return f"{type(e).__name__}:{str(e).splitlines()[0][:120]}".replace(" ", "_")
    except Exception:
        traceback.print_exc()
        return "error"


def main():
    if "RANK" not in os.environ or not torch.cuda.is_available():
        raise SystemExit("on a GPU, under torchrun: torchrun --nproc_per_node 1 bench/gpu_rules.py")
    torch.cuda.set_device(0)
    dist.init_process_group(distributed.BACKENDS["cuda"])
    print(f"device={torch.cuda.get_device_name(0)} torch={torch.__version__} cuda={torch.version.cuda} "
          f"group={distributed.BACKENDS['cuda']}", flush=True)
    outcomes = {**collectives(), **devices()}
    for name, outcome in outcomes.items():
        print(f"{name}: {outcome}")
    dist.destroy_process_group()
    print("RESULT " + " ".join(f"{k}={v}" for k, v in outcomes.items()))


if __name__ == "__main__":
    main()
