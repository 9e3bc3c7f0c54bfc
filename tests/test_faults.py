"""Faults of the run itself (issue 13 item 6): checkpoints that a kill cannot leave half
written, `--train.resume OUT_DIR`, an out_dir that cannot take the run, an engine whose
process dies, a trainer killed mid-run.

The fast tests check the pieces; the slow ones kill real runs: a run stopped with Ctrl-C,
resumed, then SIGKILLed and resumed again ends with the metrics and weights of an
uninterrupted run, and an engine process killed under two-rank torchrun stops both ranks
with an EngineError.
"""
import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

import data
import microbatch
import objectives
import run
from test_run import (ONE_PROCESS, ROOT, SMALL, WALL_CLOCK, _free_port, _metrics, _policy,
                      check_agrees_with_one_rank)
from checkpoint import parameter_count


# ----------------------------------------------------------------------------------------
# checkpoints: written whole or not at all; --train.resume OUT_DIR takes the latest complete one


def _trainer(tiny_dir, lr=1e-2):
    policy = _policy(tiny_dir)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return run.Trainer(microbatch.Models(policy), optimizer, scheduler)


def _step(trainer, seed):
    """One optimizer step that moves every weight, so that checkpoints of two steps differ, on
    seeded random gradients of every sign and of sizes spread over orders of magnitude: on a
    constant gradient AdamW's bias-corrected step is lr·sign(g) whatever its state, so a resume
    that lost the moments or the step count would take the same step."""
    g = torch.Generator().manual_seed(seed)
    for p in trainer.models.policy.parameters():
        p.grad = torch.randn(p.shape, generator=g) * torch.randn(p.shape, generator=g).mul(2).exp()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def _weights(trainer):
    return [p.detach().clone() for p in trainer.models.policy.parameters()]


def _drop_state(optimizer):
    """What a resume that restored the weights alone would hold: a fresh AdamW."""
    optimizer.state.clear()


def _drop_step_count(optimizer):
    """AdamW's moments, but its step count (the bias correction's) back at 1."""
    for state in optimizer.state.values():
        state["step"].fill_(1)


def test_resume_takes_the_latest_complete_checkpoint_of_an_out_dir(tiny_dir, tmp_path):
    cfg = run.parse_config(["--train.off_policy_steps=1"])
    trainer = _trainer(tiny_dir)
    _step(trainer, 1)
    run.save_checkpoint(str(tmp_path / "checkpoint-1"), trainer, 1, None, ONE_PROCESS)
    after_one = _weights(trainer)
    _step(trainer, 2)
    batch = ([microbatch.Rollout(row={"uid": "a"}, prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.5],
                                 text="x", truncated=False, policy_version=1)], {"reward/mean": 0.25})
    run.save_checkpoint(str(tmp_path / "checkpoint-2"), trainer, 2, batch, ONE_PROCESS, first_eval=[0.25, 1.0, 0.0])
    # a run killed while saving step 3 leaves only a partial directory behind
    (tmp_path / "checkpoint-3.partial").mkdir()
    (tmp_path / "checkpoint-3.partial" / "__0_0.distcp").write_bytes(b"half a file")
    assert run.checkpoint_path(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert run.checkpoint_path(str(tmp_path / "checkpoint-1")) == str(tmp_path / "checkpoint-1")

    fresh = _trainer(tiny_dir)
    step, ahead, first_eval = run.load_checkpoint(str(tmp_path / "checkpoint-1"), fresh, cfg, ONE_PROCESS)
    assert step == 1 and ahead is None and first_eval is None  # that checkpoint holds no batch generated ahead
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), after_one))
    step, ahead, first_eval = run.load_checkpoint(str(tmp_path / "checkpoint-2"), fresh, cfg, ONE_PROCESS)
    rollouts, metrics = ahead()
    assert step == 2 and metrics == {"reward/mean": 0.25} and first_eval == [0.25, 1.0, 0.0]
    assert rollouts[0].policy_version == 1 and rollouts[0].rollout_logprobs == [-0.5]
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), _weights(trainer)))
    # the state of the optimizer came back too: the next steps agree, and would not without it
    _step(trainer, 3)
    for lose, agrees in ((None, True), (_drop_state, False), (_drop_step_count, False)):
        again = _trainer(tiny_dir)
        run.load_checkpoint(str(tmp_path / "checkpoint-2"), again, cfg, ONE_PROCESS)
        if lose:
            lose(again.optimizer)
        _step(again, 3)
        assert all(torch.equal(a, b) for a, b in zip(_weights(again), _weights(trainer))) == agrees, lose
    # a synchronous run resuming the same checkpoint generates its batch itself
    assert run.load_checkpoint(str(tmp_path / "checkpoint-2"), fresh, run.parse_config([]), ONE_PROCESS)[1] is None

    with pytest.raises(data.PathError, match="neither a checkpoint"):
        run.checkpoint_path(str(tmp_path / "nowhere"))


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tiny_dir, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    trainer = _trainer(tiny_dir)
    path = str(tmp_path / "checkpoint-1")
    run.save_checkpoint(path, trainer, 1, None, ONE_PROCESS)
    saved = _weights(trainer)
    _step(trainer, 1)
    real_save = dcp.save

    def dies_after_writing(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)
        raise KeyboardInterrupt  # as a kill would stop it: files written, not yet renamed

    monkeypatch.setattr(dcp, "save", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        run.save_checkpoint(str(tmp_path / "checkpoint-2"), trainer, 2, None, ONE_PROCESS)
    with pytest.raises(KeyboardInterrupt):  # the same step again, over the complete checkpoint-1
        run.save_checkpoint(path, trainer, 2, None, ONE_PROCESS)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-1.partial", "checkpoint-2.partial"]
    assert run.checkpoint_path(str(tmp_path)) == path
    fresh = _trainer(tiny_dir)
    assert run.load_checkpoint(path, fresh, run.parse_config([]), ONE_PROCESS)[0] == 1
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), saved))
    monkeypatch.setattr(dcp, "save", real_save)
    run.save_checkpoint(path, trainer, 2, None, ONE_PROCESS)  # replacing a checkpoint works, and cleans up
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2.partial"]
    assert run.load_checkpoint(path, fresh, run.parse_config([]), ONE_PROCESS)[0] == 2


def test_resumed_metrics_file_drops_the_steps_after_the_checkpoint(tmp_path):
    cfg = run.parse_config([f"--log.out_dir={tmp_path}", "--log.wandb_mode=disabled"])
    logger = run.Logger(cfg, 0)
    for step in range(5):
        logger.log(step, {"reward/mean": step / 10})
    logger.close()
    logger = run.Logger(cfg, 0)
    logger.truncate(2)
    logger.log(3, {"reward/mean": 0.9})
    logger.close()
    assert [(r["step"], r["reward/mean"]) for r in _metrics(str(tmp_path))] == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.9)]


# ----------------------------------------------------------------------------------------
# a full disk: the run stops naming it, loses nothing, and --train.resume continues


FULL_DISK_RUN = ["--algo=sft", "--train.steps=2", "--train.save_every=1", "--train.prompts_per_step=2",
                 "--train.mini_batches=1", "--train.eval_every=0", "--log.wandb_mode=disabled", "--log.progress=False"]


class FullDisk:
    """The disk of a run's out_dir fills at its first write into `where` (a checkpoint, a line of
    metrics.jsonl after `lines` whole ones, or the final model): that write fails part-way as on
    a full disk, and from then on the disk reads 0 bytes free. A checkpoint's shard fails as on a
    2 MiB tmpfs (measured): torch.save turns the ENOSPC into a RuntimeError, "unexpected pos"."""

    def __init__(self, monkeypatch, out, where, lines=1):
        import collections
        import shutil
        import transformers
        from torch.distributed.checkpoint import filesystem
        self.full, self.out = False, out
        usage, real_usage = collections.namedtuple("usage", "total used free"), shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2 ** 30, 2 ** 30, 0) if self.full else real_usage(p))
        if where == "metrics.jsonl":
            real_write, written = os.write, []

            def write(fd, data):
                if self.metrics_fd(fd) and (written.append(1) or len(written) > lines):
                    if not self.full:
                        self.full = True
                        return real_write(fd, bytes(data)[:len(data) // 2])
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_write(fd, data)
            monkeypatch.setattr(os, "write", write)
        elif where == "final":
            real_save = transformers.PreTrainedModel.save_pretrained

            def save_pretrained(model, directory, *args, **kwargs):
                if os.path.basename(directory) != "final.partial":
                    return real_save(model, directory, *args, **kwargs)
                os.makedirs(directory, exist_ok=True)
                with open(os.path.join(directory, "model.safetensors"), "wb") as f:
                    f.write(b"half a model")
                self.full = True
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_pretrained)
        else:
            real_stream = filesystem.FileSystem.create_stream
            disk = self

            class Stream:  # a shard file that takes 1,000 bytes, then none
                def __init__(self, f):
                    self.f, self.n = f, 0

                def write(self, b):
                    if self.n + len(b) > 1000:
                        disk.full = True
                        raise OSError(errno.ENOSPC, "No space left on device")
                    self.n += len(b)
                    return self.f.write(b)

                def __getattr__(self, name):
                    return getattr(self.f, name)

            @contextlib.contextmanager
            def create_stream(fs, path, mode):
                with real_stream(fs, path, mode) as f:
                    yield Stream(f) if f"{where}.partial" in str(path) and "w" in mode else f
            monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)

    def metrics_fd(self, fd):
        path = self.out / "metrics.jsonl"
        with contextlib.suppress(OSError):
            return os.path.samestat(os.fstat(fd), os.stat(path))
        return False


@pytest.fixture(scope="module")
def never_full(tmp_path_factory):
    """FULL_DISK_RUN with room to the end: what a stopped run must resume to."""
    out = tmp_path_factory.mktemp("never_full") / "run"
    assert run.cli(FULL_DISK_RUN + [f"--log.out_dir={out}"]) == 0
    return out


@pytest.mark.parametrize("where,resumes_from", [("checkpoint-2", "checkpoint-1"), ("metrics.jsonl", "checkpoint-1"),
                                                ("final", "checkpoint-2")])
def test_a_full_disk_stops_the_run_naming_the_folder_and_resume_continues_it(where, resumes_from, never_full,
                                                                            tiny_dir, tmp_path, monkeypatch, capsys):
    """ENOSPC while the run writes a checkpoint, a line of metrics.jsonl or the final model: one
    message naming the folder and its free space, no traceback; the partial files gone, the
    checkpoint before it whole, metrics.jsonl whole lines; --train.resume from the folder ends
    with the metrics and weights of the run that had room."""
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        disk = FullDisk(m, out, where)
        assert run.cli(FULL_DISK_RUN + [f"--log.out_dir={out}"]) == 1
        assert disk.full
    err = capsys.readouterr().err
    assert err == (f"error: no space left on the disk of {out} while writing {where} (0 GiB free now): "
                   + (f"free space there and continue from {resumes_from} with --train.resume {out}\n"
                      if where != "metrics.jsonl" else
                      f"it keeps its whole lines; free space there and continue from the run's last checkpoint "
                      f"with --train.resume {out} (none: start the run again)\n")), err
    assert not [name for name in os.listdir(out) if name.endswith(".partial")]
    assert run.checkpoint_path(str(out)) == str(out / resumes_from)
    assert run.load_checkpoint(str(out / resumes_from), _trainer(tiny_dir), run.parse_config(FULL_DISK_RUN),
                               ONE_PROCESS)[0] == int(resumes_from.split("-")[1])
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == \
        ([1] if where == "metrics.jsonl" else [1, 2])

    assert run.cli(FULL_DISK_RUN + [f"--log.out_dir={out}", f"--train.resume={out}"]) == 0
    want, got = ([{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in _metrics(d)]
                 for d in (never_full, out))
    assert got == want and [r["step"] for r in got] == [1, 2]
    resumed = _final_weights(out)
    for name, tensor in _final_weights(never_full).items():
        assert torch.equal(tensor, resumed[name]), name


# ----------------------------------------------------------------------------------------
# an out_dir that cannot take the run fails at the start, naming the path


def test_out_dir_that_cannot_be_written_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = run.parse_config([f"--log.out_dir={blocker / 'run'}"])
    with pytest.raises(OSError, match=f"--log.out_dir {blocker / 'run'} is not writable"):
        run.check_out_dir(cfg, resuming=False)
    if os.geteuid() != 0:  # root writes into a read-only directory anyway
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(OSError, match="is not writable: Permission denied"):
            run.check_out_dir(run.parse_config([f"--log.out_dir={locked}"]), resuming=False)


def test_out_dir_without_room_for_the_run_is_named(tiny_dir, tmp_path, monkeypatch, capsys):
    import collections
    import shutil
    objective = objectives.OBJECTIVES["sdpo"]
    model = 4 * parameter_count(tiny_dir)
    assert model > 1e6  # float32 bytes of the tiny model's ~1.2M parameters
    cfg = run.parse_config([f"--log.out_dir={tmp_path}", "--train.save_every=10", "--train.steps=40"])
    usage = collections.namedtuple("usage", "total used free")
    # the final model and one checkpoint (policy, AdamW's two moments, the EMA teacher): 5 copies
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 5 * model - 1))
    with pytest.raises(OSError, match=f"--log.out_dir {tmp_path} has .* GiB free; the run writes at least"):
        run.check_out_dir(cfg, False, tiny_dir, objective)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 5 * model))
    capsys.readouterr()
    run.check_out_dir(cfg, False, tiny_dir, objective)  # enough to start; 4 checkpoints will not fit: a warning
    assert re.search(f"warning: --log.out_dir {tmp_path} has .* GiB free; the run's 4 checkpoints and final model "
                     "take .* GiB", capsys.readouterr().err)
    # all 4 checkpoints and the final model: 1 + 4 * 4 copies fit, no warning
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 17 * model))
    run.check_out_dir(cfg, False, tiny_dir, objective)
    assert "warning" not in capsys.readouterr().err
    run.check_out_dir(run.parse_config([f"--log.out_dir={tmp_path}"]), False, tiny_dir, objective)


def test_out_dir_holding_an_earlier_runs_checkpoints_is_refused_unless_resuming(tmp_path):
    (tmp_path / "checkpoint-40").mkdir()
    cfg = run.parse_config([f"--log.out_dir={tmp_path}"])
    with pytest.raises(data.PathError, match=f"continue it with --train.resume {tmp_path}"):
        run.check_out_dir(cfg, resuming=False)
    run.check_out_dir(cfg, resuming=True)


def test_out_dir_holding_an_earlier_run_is_refused_unless_resuming_or_overwriting(tmp_path):
    """A run's records without checkpoints: a second run there would append its metrics to the
    first's (steps 0, 1, 0, 1) and replace its final model."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "final").mkdir()
    cfg = run.parse_config([f"--log.out_dir={tmp_path}"])
    with pytest.raises(data.PathError, match="holds an earlier run .*--log.overwrite=True"):
        run.check_out_dir(cfg, resuming=False)
    assert (tmp_path / "metrics.jsonl").exists()  # refusing loses nothing
    run.check_out_dir(cfg, resuming=True)
    run.check_out_dir(run.parse_config([f"--log.out_dir={tmp_path}", "--log.overwrite=True"]), resuming=False)
    assert os.listdir(tmp_path) == []
    run.check_out_dir(cfg, resuming=False)  # empty now


def test_a_checkpoint_with_a_truncated_shard_is_named(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir)
    path = tmp_path / "checkpoint-1"
    run.save_checkpoint(str(path), trainer, 1, None, ONE_PROCESS)
    shard = next(f for f in path.iterdir() if f.name.endswith(".distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(data.PathError, match=f"checkpoint {path} cannot be read .*{shard.name}"):
        run.load_checkpoint(str(path), _trainer(tiny_dir), run.parse_config([]), ONE_PROCESS)


def test_run_with_an_unwritable_out_dir_stops_before_starting_anything(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), f"--log.out_dir={blocker}/run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"--log.out_dir {blocker}/run is not writable" in proc.stderr
    assert "warm start" not in proc.stdout and "LLM engine" not in proc.stderr  # neither was started


# ----------------------------------------------------------------------------------------
# the reaper: what a trainer killed by SIGKILL leaves behind


TRAINER_KILLED = """
import subprocess, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
from processes import descendants, reap_directory, supervise
before = descendants()
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
_, reaper = supervise(before, None)
directory = tempfile.mkdtemp(prefix="sdpo-sync-", dir=sys.argv[2])
reap_directory(reaper, directory)
print(engine.pid, directory, flush=True)
time.sleep(600)
"""


def test_a_trainer_killed_by_sigkill_leaves_no_engine_and_no_sync_directory(tmp_path):
    """The reaper ends the engine's processes and removes the file sync's directory (in
    /dev/shm: memory that outlives the run) when the trainer dies without a word."""
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_KILLED, ROOT, str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)
    engine_pid, directory = trainer.stdout.readline().split()
    engine = psutil.Process(int(engine_pid))
    assert os.path.isdir(directory) and engine.is_running()
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 30
    while (os.path.exists(directory) or _running(engine)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(engine), "the engine outlived its killed trainer"
    assert not os.path.exists(directory), "the sync directory outlived its killed trainer"


def _running(p):
    with contextlib.suppress(psutil.Error):
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    return False


# ----------------------------------------------------------------------------------------
# real runs, killed


# A run that learns: about half of each group succeeds (tests/parity_reward.py), so successes,
# demonstrations, feedback contexts and held-out success at step 0 are all in what a resume restores.
KILLED_RUN = SMALL + ["--algo=sdpo", "--train.steps=4", "--train.save_every=1", "--train.eval_every=4",
                      "--train.off_policy_steps=1", f"--data.reward={ROOT}/tests/parity_reward.py:parity"]


def _start(args, nproc=1):
    """run.py (or torchrun of it) in its own session, so that a test can signal all of it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "run.py")] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
         os.path.join(ROOT, "run.py")]
    return subprocess.Popen(cmd + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _wait_for(condition, proc, what, timeout=400):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{proc.stdout.read()[-5000:]}")
        if time.monotonic() > deadline:
            _kill_session(proc)
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.2)


def _steps_logged(out):
    path = os.path.join(out, "metrics.jsonl")
    return [json.loads(line)["step"] for line in open(path)] if os.path.exists(path) else []


def _kill_session(proc):
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _session_processes(proc):
    return [p for p in psutil.process_iter(["pid"]) if _sid(p) == proc.pid]


def _sid(p):
    with contextlib.suppress(psutil.Error, OSError):
        return os.getsid(p.pid)
    return None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """KILLED_RUN never stopped: what the stopped runs must resume to."""
    whole = str(tmp_path_factory.mktemp("uninterrupted") / "whole")
    proc = _start(KILLED_RUN + [f"--log.out_dir={whole}"])
    assert proc.wait(timeout=600) == 0, proc.stdout.read()[-5000:]
    return whole


def _resumes_to_the_uninterrupted_run(stopped, whole):
    """--train.resume of the stopped run's out_dir: every step's metrics but wall-clock
    figures, and the final weights, are the uninterrupted run's (same batches, including the
    one generated ahead before the stop)."""
    latest = run.checkpoint_path(stopped)
    assert os.path.basename(latest) in ("checkpoint-1", "checkpoint-2", "checkpoint-3"), latest  # steps left to run
    proc = _start(KILLED_RUN + [f"--log.out_dir={stopped}", f"--train.resume={stopped}"])
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-5000:]
    want, got = _metrics(whole), _metrics(stopped)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3, 4]
    for w, g in zip(want, got):
        compared = {k: v for k, v in w.items() if not k.startswith(WALL_CLOCK)}
        assert {k: g.get(k) for k in compared} == compared, w["step"]
    assert [r["async/staleness"] for r in got[1:]] == [0, 1, 1, 1]
    # what was resumed learns: successes, demonstrations and feedback, a gradient at every step
    assert all(0 < r["reward/success_rate"] < 1 and r["sdpo/samples_with_successful_sibling"] > 0
               and "sdpo/teacher_minus_student_logprob_demo" in r and r["actor/grad_norm"] > 0 for r in got[1:])
    assert any(r["sdpo/feedback_used"] > 0 for r in got[1:]) and 0 < got[0]["eval/success_rate"] < 1
    resumed = _final_weights(stopped)
    for name, tensor in _final_weights(whole).items():
        assert torch.equal(tensor, resumed[name]), name


def _final_weights(out):
    from safetensors.torch import load_file
    return load_file(os.path.join(out, "final", "model.safetensors"))


def _engine_core(proc):
    """The vLLM engine-core process started by the run (rank 0's)."""
    for p in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.name().startswith("VLLM::EngineCor"):
                return p
    return None


@pytest.mark.slow
def test_engine_killed_mid_step_stops_both_ranks_with_an_engine_error(uninterrupted, tmp_path):
    """Two-rank torchrun of KILLED_RUN (SDPO, asynchronous; the suite's two-rank asynchronous
    run): the steps before the kill generate ahead as they should (tests/test_async.py
    check_generated_ahead) and give the one-rank run's figures (check_agrees_with_one_rank).
    Then kill -9 of the engine core once step 2 is logged (the engine is then generating batch
    3 in the background, or loading weights): both ranks stop with an EngineError well within
    the RPC timeout, and the checkpoint of the last finished step is complete."""
    from test_async import check_generated_ahead
    out = str(tmp_path / "run")
    proc = _start(KILLED_RUN + ["--train.steps=8", "--rollout.rpc_timeout_s=300", f"--log.out_dir={out}"], nproc=2)
    _wait_for(lambda: 2 in _steps_logged(out), proc, "step 2")
    engine = _engine_core(proc)
    assert engine is not None
    engine.kill()
    t0 = time.monotonic()
    try:
        output = proc.communicate(timeout=240)[0]
    finally:
        _kill_session(proc)
    assert time.monotonic() - t0 < 120  # detected by watching the engine's processes, not by a timeout
    assert proc.returncode != 0
    assert "rollout.EngineError: vLLM engine" in output, output[-8000:]  # rank 0
    assert "rollout.EngineError: rank 0 failed: EngineError: vLLM engine" in output, output[-8000:]  # rank 1
    assert 8 not in _steps_logged(out)
    resume_from = run.checkpoint_path(out)
    assert os.path.exists(os.path.join(resume_from, ".metadata"))
    check_generated_ahead(_metrics(out), 2)
    check_agrees_with_one_rank(_metrics(out), _metrics(uninterrupted), 2)


@pytest.mark.slow
def test_a_run_stopped_by_ctrl_c_then_killed_resumes_each_time_to_the_uninterrupted_run(uninterrupted, tmp_path):
    """One asynchronous run (its engine generating ahead) stopped twice, each stop resumed
    with --train.resume OUT_DIR:
    1. SIGINT to the run's process group (what Ctrl-C in a terminal sends) after checkpoint
       1: the run stops with KeyboardInterrupt, leaves no process behind, and the checkpoints
       it finished are complete (one it was writing stays a .partial directory);
    2. the resumed run, SIGKILLed (the trainer alone; its engine's processes are left to the
       reaper) once it has saved the next checkpoint;
    3. resumed again, to the end: every step's metrics and the final weights are those of the
       run never stopped, the step each resume wrote included."""
    out = str(tmp_path / "run")
    proc = _start(KILLED_RUN + [f"--log.out_dir={out}"])
    _wait_for(lambda: os.path.isdir(os.path.join(out, "checkpoint-1")), proc, "checkpoint-1")
    os.killpg(proc.pid, signal.SIGINT)
    try:
        output = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        raise
    assert proc.returncode != 0, output[-5000:]
    assert "KeyboardInterrupt" in output, output[-5000:]
    _no_process_left(proc)
    assert os.path.exists(os.path.join(run.checkpoint_path(out), ".metadata"))
    assert not os.path.exists(os.path.join(out, "final"))

    stopped_at = int(os.path.basename(run.checkpoint_path(out)).split("-")[1])
    assert stopped_at <= 2, stopped_at  # two steps left: one for the resumed run, one after its kill
    proc = _start(KILLED_RUN + [f"--log.out_dir={out}", f"--train.resume={out}"])
    _wait_for(lambda: os.path.isdir(os.path.join(out, f"checkpoint-{stopped_at + 1}")), proc,
              f"checkpoint-{stopped_at + 1}")
    psutil.Process(proc.pid).kill()
    proc.wait()
    assert 4 not in _steps_logged(out) and not os.path.exists(os.path.join(out, "final"))
    _no_process_left(proc)
    _resumes_to_the_uninterrupted_run(out, uninterrupted)


def _no_process_left(proc):
    deadline = time.monotonic() + 60
    while _session_processes(proc) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _session_processes(proc), "the stopped run's processes outlived it"


def test_after_ctrl_c_the_run_stops_with_keyboard_interrupt_whatever_else_failed():
    """The engine dies of the same Ctrl-C, and its error may reach the loop first (here: the
    interrupt is swallowed where it landed, then the engine's error is raised)."""
    with pytest.raises(KeyboardInterrupt) as caught:
        with run.ctrl_c_wins():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except KeyboardInterrupt:
                pass
            raise RuntimeError("EngineCore encountered an issue")
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError):  # without a Ctrl-C an error stays what it is
        with run.ctrl_c_wins():
            raise RuntimeError("a real failure")
