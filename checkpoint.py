"""Checkpoints (torch.distributed.checkpoint: every rank writes its shards; --train.save_every,
--train.resume), the final model as an ordinary HF directory, and the out_dir's checks at the
start. Every directory is written under a .partial name and renamed when complete, so that a
killed run never leaves a half-written one under a name that is read later."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from errors import PathError, disk_full, no_space
from distributed import Dist, rank0_call
from sync import full_state_dict

if TYPE_CHECKING:
    from config import Config
    from policy import Trainer

# What a run writes into its out_dir that a second run there would mix with its own
RUN_RECORDS = ("metrics.jsonl", "samples.jsonl", "final", "eval_rows.jsonl")
FIRST_EVAL = "first_eval.json"  # in a checkpoint: the held-out rows' success at step 0
NEXT_BATCH = "next_batch.pt"  # in a checkpoint of a run generating ahead: the batch of its next step
RUNS_DIR = "runs"  # the folders of runs without --log.out_dir, under the working directory


def run_dir(cfg: Config) -> str:
    """The run's folder: --log.out_dir; without it, the resumed run's folder (--train.resume),
    else a new one, runs/<date>-<time>-<algo>-<task> (sorting by start, saying what ran; a
    suffix where two start in the same second), created here, with runs/latest linked to it."""
    if cfg.log.out_dir:
        return cfg.log.out_dir
    if cfg.train.resume:
        return os.path.dirname(checkpoint_path(cfg.train.resume).rstrip(os.sep))
    task = re.sub(r"[^\w-]+", "_", os.path.basename(cfg.data.task.rstrip(os.sep)).split(".")[0])  # a file: its name
    stem = os.path.join(RUNS_DIR, f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.algo.name}-{task}")
    path, n = stem, 1
    while True:
        try:
            os.makedirs(path)  # not exist_ok: the folder is this run's alone
            break
        except FileExistsError:
            n += 1
            path = f"{stem}-{n}"
        except OSError as e:
            raise PathError(f"cannot create the run folder {path} ({e.strerror}): run from a writable "
                            f"directory or pass --log.out_dir") from None
    link = os.path.join(RUNS_DIR, "latest")
    with contextlib.suppress(OSError):  # a file system without links: only the link is missing
        os.symlink(os.path.basename(path), link + f".{os.getpid()}")
        os.replace(link + f".{os.getpid()}", link)
    MADE_RUN_DIRS.append(path)
    return path


MADE_RUN_DIRS = []  # the folders run_dir made in this process


def drop_empty_run_dirs():
    """The folders run_dir made for a run that stopped before writing anything (a user's
    mistake found at the start) are removed, and runs/latest with the newest."""
    while MADE_RUN_DIRS:
        path = MADE_RUN_DIRS.pop()
        link = os.path.join(os.path.dirname(path), "latest")
        with contextlib.suppress(OSError):  # not empty: a run's records stay
            os.rmdir(path)
            if os.path.islink(link) and os.readlink(link) == os.path.basename(path):
                os.remove(link)
            os.rmdir(os.path.dirname(path))  # runs/ itself, where this was its first run


def check_out_dir(cfg: Config, resuming: bool, model_dir: str = "", objective=None):
    """Fail at the start, naming the path, when --log.out_dir cannot be written, holds an
    earlier run (its metrics would mix with this one's, and `--train.resume OUT_DIR` would take
    its checkpoints for this run's) unless resuming or --log.overwrite, or (given the model)
    lacks the space for the final model and a first checkpoint."""
    out = cfg.log.out_dir
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise PathError(f"--log.out_dir {out} is not writable: {e.strerror}") from e
    if not resuming:
        check_no_earlier_run(out, cfg.log.overwrite)
    if not model_dir:
        return
    model = 4 * parameter_count(model_dir)  # float32, as the trainer holds and saves it
    # + AdamW's two moments, the objective's copies of the policy (a teacher, a reference)
    copies = 3 + sum(kind == "copy" for kind in objective.held(cfg).values())
    saves = cfg.train.steps // cfg.train.save_every if cfg.train.save_every else 0
    need, total = model + min(saves, 1) * copies * model, model + saves * copies * model
    free = shutil.disk_usage(out).free
    if free < need:
        raise PathError(f"--log.out_dir {out} has {free / 2**30:.3g} GiB free; the run writes at least "
                        f"{need / 2**30:.3g} GiB (the final model and a checkpoint)")
    if free < total:
        print(f"warning: --log.out_dir {out} has {free / 2**30:.3g} GiB free; the run's {saves} checkpoints "
              f"and final model take {total / 2**30:.3g} GiB", file=sys.stderr)


def check_no_earlier_run(out: str, overwrite: bool):
    """An out_dir with an earlier run's records is refused, or with overwrite emptied of them."""
    earlier = sorted(name for name in os.listdir(out) if name.startswith("checkpoint-") or name in RUN_RECORDS)
    if earlier and not overwrite:
        raise PathError(f"--log.out_dir {out} holds an earlier run ({', '.join(earlier[-3:])}): continue it "
                        f"with --train.resume {out}, replace it with --log.overwrite=True, or choose another "
                        f"--log.out_dir")
    for name in earlier:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def parameter_count(model_dir: str) -> int:
    from safetensors import safe_open
    count = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                count += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return count


def save_checkpoint(path: str, trainer: Trainer, step: int, next_batch, d: Dist, first_eval: list | None = None):
    """Policy, optimizer, the optional models and the RNG state (every rank its shards) and, generating
    ahead, rank 0's next_batch (generated with the weights before this update, which a resumed run no
    longer has), and first_eval (the held-out rows' success at step 0, which later gains pair with);
    written as path.partial and renamed when complete (the module's docstring). A full disk stops
    the run naming it, the checkpoints before this one whole (whole_or_named)."""
    import torch.distributed.checkpoint as dcp
    partial = path + ".partial"
    if d.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
    barrier(d)
    state = checkpoint_state(trainer, step)
    with whole_or_named(partial, os.path.basename(path), d):  # dcp raises a rank's failure on every rank
        dcp.save(state, checkpoint_id=partial)  # fsyncs its files

    def finish():  # rank 0's files, then the rename; its error reaches every rank (rank0_call)
        with whole_or_named(partial, os.path.basename(path), dataclasses.replace(d, world=1)):
            if first_eval is not None:
                with open(os.path.join(partial, FIRST_EVAL), "w") as f:
                    json.dump(first_eval, f)
            if next_batch is not None:
                with open(os.path.join(partial, NEXT_BATCH), "wb") as f:
                    torch.save(next_batch, f)
                    f.flush()
                    os.fsync(f.fileno())
        replace_dir(partial, path)
    rank0_call(d, finish, share=False)


def load_checkpoint(path: str, trainer: Trainer, cfg: Config, d: Dist):
    """Restore what save_checkpoint wrote into trainer. Returns the step to continue from,
    when generating ahead and the checkpoint holds it, the next batch for Batches (else None),
    and the held-out rows' success at step 0 (None if the checkpoint has none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.state_dict import set_state_dict
    state = checkpoint_state(trainer, 0)
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # torch names neither the directory nor the file
        raise PathError(f"--train.resume: the checkpoint {path} cannot be read ({type(e).__name__}: "
                        f"{str(e).splitlines()[-1][:300] if str(e) else ''}); its files: "
                        f"{', '.join(sorted(os.listdir(path)))}. Resume from an earlier checkpoint-N "
                        f"of the run") from e
    set_state_dict(trainer.models.policy, trainer.optimizer, model_state_dict=state["policy"],
                   optim_state_dict=state["optimizer"])
    for name, model in trainer.models.extra.items():  # kept under its name: teacher, reference, discriminator
        if name in state:
            model.load_state_dict(state[name])
    torch.set_rng_state(state["meta"]["torch_rng"])
    random.setstate(state["meta"]["python_rng"])
    first_eval = None
    with contextlib.suppress(FileNotFoundError), open(os.path.join(path, FIRST_EVAL)) as f:
        first_eval = json.load(f)
    file = os.path.join(path, NEXT_BATCH)
    if not (cfg.train.off_policy_steps and rank0_call(d, lambda: os.path.exists(file))):
        return int(state["meta"]["step"]), None, first_eval
    batch = torch.load(file, weights_only=False) if d.rank == 0 else None
    return int(state["meta"]["step"]), lambda: batch, first_eval


def checkpoint_path(resume: str) -> str:
    """--train.resume: a checkpoint directory, or a run's out_dir (its latest complete checkpoint)."""
    if os.path.exists(os.path.join(resume, ".metadata")):  # torch.distributed.checkpoint's index
        return resume
    steps = [int(m.group(1)) for m in map(re.compile(r"checkpoint-(\d+)").fullmatch,
                                           os.listdir(resume) if os.path.isdir(resume) else []) if m]
    if not steps:
        raise PathError(f"--train.resume {resume}: neither a checkpoint nor a run directory holding one "
                        "(checkpoint-N, written by --train.save_every)")
    return os.path.join(resume, f"checkpoint-{max(steps)}")


def checkpoint_state(trainer: Trainer, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(trainer.models.policy, trainer.optimizer)
    state = {"policy": model_state, "optimizer": optim_state,
             "meta": {"step": step, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}}
    for name, model in trainer.models.extra.items():  # the objective's models (a discriminator with its optimizer)
        if (model_state := model.state_dict()) is not None:
            state[name] = model_state
    return state


def save_hf(path: str, policy, tokenizer, d: Dist):
    """An ordinary HF directory (transformers and vLLM load it), written whole or not at all
    (the warm-start cache takes a directory with a config.json as complete); a full disk stops
    the run naming it (whole_or_named)."""
    state = full_state_dict(policy, d.world)

    def write():
        partial = path + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        with whole_or_named(partial, os.path.basename(path), dataclasses.replace(d, world=1)):
            policy.hf.save_pretrained(partial, state_dict=state)
            tokenizer.save_pretrained(partial)
            if policy.vision is not None:
                policy.vision.processor.save_pretrained(partial)
        replace_dir(partial, path)
    rank0_call(d, write, share=False)


@contextlib.contextmanager
def whole_or_named(partial: str, what: str, d: Dist):
    """Writing `partial`, a directory renamed into place once complete, on every rank of d (all
    of them raise what one raised): an error of a full disk (errors.disk_full) removes it on
    rank 0, so that the space and every directory written before stay, and stops the run with
    one message naming the folder, its free space and the checkpoint to resume from; any other
    error is left as it is."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    try:
        yield
    except (Exception, CheckpointException) as e:
        folder = os.path.dirname(os.path.abspath(partial))
        full = disk_full(e, folder)
        barrier(d)  # every rank has looked at the disk before rank 0 frees the partial's space
        if not full:
            raise
        if d.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise no_space(folder, what, resume_hint(folder)) from e


def resume_hint(out_dir: str) -> str:
    """What a run stopped by a full disk in out_dir continues from, and how."""
    try:
        latest = checkpoint_path(out_dir)
    except PathError:
        return "free space there and start the run again (it wrote no checkpoint)"
    return f"free space there and continue from {os.path.basename(latest)} with --train.resume {out_dir}"


def replace_dir(src: str, dst: str):
    """Rename the directory src to dst, replacing dst; durable once it returns."""
    old = dst + ".old"
    if os.path.exists(dst):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(os.path.dirname(os.path.abspath(dst)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def barrier(d: Dist):
    if d.world > 1:
        dist.barrier()
