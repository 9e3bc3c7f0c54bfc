"""The distributed setup: where a process sits (Dist), torchrun's process group, rank 0's calls, FSDP2 helpers.

Under torchrun the ranks train one policy sharded with FSDP2; rank 0 alone holds the engine, and
rank0_call hands what it computes, or its error, to every rank.

The collectives' rule: a collective goes to the backend of its tensor's device. On a CPU the
group is gloo; on GPUs it is "cpu:gloo,cuda:nccl" (torch's backend per device type), so a
collective's tensor is either a host value (a count, a statistic, a pickled object: gloo) or on
the rank's GPU (the model's tensors: NCCL). NCCL alone has no CPU backend: a group of NCCL only
fails at the first host value.

Waiting for rank 0: while rank 0 alone works (generates, evaluates, writes a checkpoint) the
other ranks wait in rank0_call (and policy.broadcast_weights, sync.PolicySource.follow) at a
barrier without a time limit, not in a collective under the group's timeout
(--train.collective_timeout_min), which a long evaluation would exceed: NCCL's watchdog aborts a
job whose collective outlasts it, gloo raises. A rank that dies ends the job
all the same: torchrun stops every rank when one exits.
"""
import contextlib
import gc
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from errors import UserError


@dataclass
class Dist:
    """Where this process sits: its rank, the number of ranks, its device."""
    rank: int
    world: int
    device: torch.device


# The process group's backends by the device a rank trains on (the collectives' rule above)
BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}
# How long the other ranks wait for rank 0's work in rank0_call: no limit in practice
RANK0_WAIT = timedelta(days=7)


def setup_distributed(timeout_min: float = 30.0) -> Dist:
    """Under torchrun: the process group of BACKENDS[device type], whose collectives raise after
    timeout_min minutes (a dead or hung peer surfaces as an error, not an endless wait)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(BACKENDS[device.type], timeout=timedelta(minutes=timeout_min))
    return Dist(dist.get_rank() if world > 1 else 0, world, device)


@contextlib.contextmanager
def process_group(timeout_min: float = 30.0):
    """setup_distributed's Dist for a with block, at whose end the group is destroyed
    (end_distributed), after an error too."""
    d = setup_distributed(timeout_min)
    try:
        yield d
    except BaseException:
        end_distributed(d, finished=False)
        raise
    end_distributed(d)


def end_distributed(d: Dist, finished: bool = True):
    """The end of a torchrun process: every rank here, then the process group destroyed; after
    an error (finished False) destroyed at once, since the other ranks may never arrive (NCCL
    warns of, and may hang on, a group left to the interpreter's exit).

    Called once the models are out of scope: gc first, so that FSDP2's states and the
    collectives' work handles caught in reference cycles are freed while the process group
    is alive, not during interpreter teardown, where gloo's threads can abort the process.
    """
    if d.world > 1 and dist.is_initialized():
        gc.collect()
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def rank0_call(d: Dist, fn, share: bool = True):
    """Run fn on rank 0 and hand its result (when share), or its error, to every rank: as the
    nearest of its classes that says `kept_across_ranks` (rollout.EngineError, errors.UserError),
    else as a RuntimeError.

    Without this, an engine that dies on rank 0 leaves the other ranks waiting forever.
    """
    rank, world = d.rank, d.world
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:  # re-raised below, on every rank
            error = e
            if world > 1:
                # Now, not after unwinding: the other ranks exit first, and torchrun then stops
                # this one while it closes the engine, before Python prints the traceback.
                # A user's mistake: its message alone (run.cli prints no more of it).
                import traceback
                reported = isinstance(e, UserError)
                if reported:
                    e.reported = True
                print(f"error: {e}" if reported else "rank 0 failed: " + "".join(traceback.format_exception(e)),
                      file=sys.stderr, flush=True)
    if world > 1:
        kind = next((c for c in type(error).__mro__ if "kept_across_ranks" in vars(c)), RuntimeError)
        box = [(result if share else None, None if error is None else f"{type(error).__name__}: {error}", kind)]
        dist.barrier(timeout=RANK0_WAIT)  # the other ranks wait for rank 0 here, not in the broadcast
        dist.broadcast_object_list(box, src=0)
        if rank != 0:
            result, message, kind = box[0]
            if message:
                raise kind(f"rank 0 failed: {message}")
    if error is not None:
        raise error
    return result


def from_every_rank(value, world: int) -> list:
    """Every rank's value, in rank order (all_gather_object: every rank calls it)."""
    if world == 1:
        return [value]
    gathered = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) parameter, or the tensor itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def reshard(module):
    """Put an FSDP2 module's parameters back into shards. FSDP2 leaves the root unit
    unsharded after a forward, expecting a backward; a no-grad forward never has one."""
    if hasattr(module, "reshard"):
        module.reshard()


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole of a possibly sharded parameter (a collective under FSDP2: every rank calls it)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p
