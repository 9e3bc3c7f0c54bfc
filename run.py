"""Train a causal LM with SDPO, GRPO, GSPO, the λ-hybrid, online DPO / SPIN, GAD or SFT, on rollouts from vLLM.

    python run.py                                          # the default job: tiny model, CPU
    torchrun --nproc_per_node=2 run.py --algo grpo         # FSDP2 over two ranks
    python run.py --model.path /models/Qwen3-8B --data.task /data/train.parquet \
        --data.fields prompt=question,answer=solution --data.reward math --rollout.placement separate

Every knob is a flag (`python run.py --help`, config.py, flags.py). The loop in `train` reads top to
bottom as the algorithm (docs/loop.md); the mechanics live next door (README, Files).
"""
import contextlib
import copy
import dataclasses
import os
import shutil
import sys
import time

import torch

import data
import microbatch
import objectives
import tasks
from checkpoint import (check_out_dir, checkpoint_path, drop_empty_run_dirs, load_checkpoint, run_dir, save_checkpoint,
                        save_hf)
from flags import Config, debugging, describe, parse_config
from data import batch_rows, read_rows, stream_seed
from evaluate import baseline_evaluation, evaluate, evaluate_only, evaluate_start, evaluation_due, success_rate
from logger import Logger, step_time
from distributed import Dist, end_distributed, process_group, rank0_call, setup_distributed
from plan import report_plan
from policy import Trainer, build_trainer, load_tokenizer, pad_token_id
from processes import check_devices, generation_waits, share_cores
from rollout import generate_and_score, start_engine
from sync import sync_engine
from update import prepare_update, take_steps, update_policy  # noqa: F401 (update_policy: the tests')
from warm_start import (gad_teacher_config, sft_rollouts, target_reached, teacher_data, tiny_model_dir,
                        warm_start_checks, warm_start_config, warm_start_estimates)


def load_data(cfg: Config, announce: bool = False):
    """(train rows, held-out rows), with the fields the objective needs (e.g. GAD's
    teacher_response) checked in every training row before any work."""
    train_rows, eval_rows = read_rows(cfg, announce)
    for field_name in objectives.OBJECTIVES[cfg.algo.name].row_fields:
        for row in train_rows:
            if not row.get(field_name):
                raise data.DataError(f"{row['source']}, field '{field_name}': missing or empty, and --algo "
                                     f"{cfg.algo.name} needs it in every training row")
    return train_rows, eval_rows


def train(cfg: Config, model_dir: str, d: Dist) -> dict:
    """Run cfg.algo on the model in model_dir; returns the last logged metrics."""
    objective = objectives.OBJECTIVES[cfg.algo.name]
    torch.manual_seed(cfg.train.seed)
    resume = rank0_call(d, lambda: checkpoint_path(cfg.train.resume)) if cfg.train.resume else ""
    rank0_call(d, lambda: check_out_dir(cfg, bool(resume), model_dir, objective))  # not after minutes of start-up
    tokenizer = load_tokenizer(model_dir)
    train_rows, eval_rows = load_data(cfg, announce=d.rank == 0)
    # an earlier run's step-0 evaluation of the same model and rows, checked before the engine starts
    baseline = baseline_evaluation(eval_rows, cfg) if cfg.train.eval_baseline and not resume else None
    generates = cfg.eval_only or not objective.references  # the same on every rank; only rank 0 holds the engine
    engine = start_engine(cfg, model_dir, tokenizer, train_rows + eval_rows, d) if generates else None
    logger = Logger(cfg, d.rank)
    try:  # the engine's processes end with the run, also on an error or Ctrl-C
        if cfg.eval_only:
            return evaluate_only(cfg, model_dir, engine, tokenizer, eval_rows, logger, d)
        if cfg.ttt_prompts:
            return test_time_self_distillation(cfg, objective, model_dir, engine, tokenizer, eval_rows, logger, d)
        trainer = build_trainer(cfg, objective, model_dir, d)
        start_step, ahead, first_eval = restore(cfg, resume, trainer, engine, tokenizer, logger, d)
        evaluate_now = lambda step: generates and evaluation_due(cfg, step)
        metrics = {}  # first_eval: each held-out row's success at step 0; later gains are paired with it
        if evaluate_now(0) and start_step == 0:
            metrics, first_eval = evaluate_start(engine, tokenizer, eval_rows, cfg, baseline, d)
            logger.log(0, metrics)
        batches = Batches(cfg, objective, engine, tokenizer, train_rows, d, ahead, trainer.models)
        logger.progress(start_step, cfg.train.steps)
        checks = warm_start_checks(cfg, objective, tokenizer)  # rows and prompts, where a target may stop it
        for step in range(start_step, cfg.train.steps):
            t_step = time.perf_counter()
            # 1-4. sample prompts; generate, score, write what the objective needs (advantages, teacher
            # contexts). With --train.off_policy_steps 1 this batch was generated during the last
            # update, and the engine starts on the next one now (on a CPU, when the objective's own
            # models run forwards before the update's gradient passes: once those are done, in learn)
            rollouts, metrics = batches.take(step)
            # 5-7. update the policy (mini-batches of micro-batches), the objective's models; sync the
            # engine, with proof
            learned = learn(cfg, objective, trainer, engine, tokenizer, rollouts, step, d, batches.generate_next)
            metrics["time/wait_rollout_s"] += learned.pop("time/wait_rollout_s", 0.0)  # generating ahead: at the sync
            metrics.update(learned)
            metrics.update(step_time(rollouts, t_step))
            # 8. evaluate, log, checkpoint
            if evaluate_now(step + 1):
                evaluated = rank0_call(d, lambda: evaluate(engine, tokenizer, eval_rows, cfg, first_eval, step + 1))
                metrics.update(evaluated[0])
            metrics.update(warm_start_estimates(cfg, trainer.models.policy, tokenizer, checks, step + 1, d))
            logger.log(step + 1, metrics)
            logger.log_samples(step + 1, rollouts)
            if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0:
                save_checkpoint(os.path.join(cfg.log.out_dir, f"checkpoint-{step + 1}"), trainer, step + 1,
                                batches.next_batch(), d, first_eval)
            if checks and target_reached(cfg, metrics, step + 1, d):
                break
        save_hf(os.path.join(cfg.log.out_dir, "final"), trainer.models.policy, tokenizer, d)
        return metrics
    finally:
        logger.close()
        if engine is not None:
            engine.close()


def restore(cfg: Config, resume: str, trainer: Trainer, engine, tokenizer, logger: Logger, d: Dist):
    """(the step to continue from, the batch generated ahead, each held-out row's success at
    step 0) from the checkpoint in resume (none: a fresh start); the engine gets its weights (a
    served engine's hold whatever it last had, docs/sync.md: a fresh start's too)."""
    if not resume and not cfg.rollout.engine:
        return 0, None, None
    start_step, ahead, first_eval = 0, None, None
    if resume:
        start_step, ahead, first_eval = load_checkpoint(resume, trainer, cfg, d)
        logger.truncate(start_step)  # a killed run logged steps past its checkpoint
    if not objectives.OBJECTIVES[cfg.algo.name].references:  # not `engine is not None`: every rank syncs
        sync_engine(cfg, engine, trainer.models.policy, tokenizer, d, version=start_step)
    return start_step, ahead, first_eval


class Batches:
    """The rollout batch of each step, in step order: generated when taken, or with
    --train.off_policy_steps 1 in the background on rank 0 while every rank learns from the
    batch before it, one update stale (docs/async.md).
    """

    def __init__(self, cfg: Config, objective, engine, tokenizer, train_rows: list, d: Dist, ahead=None,
                 models: microbatch.Models | None = None):
        self.cfg, self.objective, self.engine, self.train_rows, self.d = cfg, objective, engine, train_rows, d
        self.generates_ahead = cfg.train.off_policy_steps > 0 and not objective.references
        if self.generates_ahead and models is not None:
            share_cores(cfg, engine, models)  # on a CPU: the trainer's threads beside a generation and after it
        # the background thread's own copy: a fast tokenizer used by two threads at once can
        # fail ("Already borrowed") while the trainer's thread encodes the sync's probe
        self.tokenizer = copy.deepcopy(tokenizer) if self.generates_ahead else tokenizer
        # the next batch, being generated: a callable that returns it on rank 0 (waiting for the
        # background job), or ignored on the other ranks; None: nothing ahead
        self.ahead = ahead
        self.next_step = None  # the step whose batch generate_next starts; None: started, or none
        # the objective's models' forwards before the update (an EMA teacher's) first, on a CPU
        self.after_forwards = (self.generates_ahead and models is not None
                               and generation_waits(cfg, d.device, objective.forwards_first(models)))

    def take(self, step: int):
        """Batch `step` (rollouts on every rank, and its metrics); starts the next one ahead,
        unless that waits for the objective's forwards (after_forwards)."""
        t0 = time.perf_counter()
        if self.ahead is None:
            rollouts, metrics = self.collect(step, self.d)
        else:
            rollouts, metrics = rank0_call(self.d, self.ahead)
        self.ahead, self.next_step = None, step + 1
        if not self.after_forwards:
            self.generate_next()
        metrics["time/wait_rollout_s"] = time.perf_counter() - t0
        generated = [r for r in rollouts if r.generated]  # a reference answer (SFT, SPIN) has no weights to be stale
        if generated:
            metrics["async/staleness"] = sum(step - r.policy_version for r in generated) / len(generated)
        return rollouts, metrics

    def generate_next(self):
        """Start generating the batch after the one taken last, once, when this run generates
        ahead (called by take, or by learn once the objective's forwards are done). A batch
        never started is generated when it is taken."""
        step, self.next_step = self.next_step, None
        if self.generates_ahead and step is not None and step < self.cfg.train.steps:
            # rank 0 alone (world 1): the other ranks get the batch when it is taken
            self.ahead = (self.engine.in_background(lambda: self.collect(step, dataclasses.replace(self.d, world=1)),
                                                    name=f"generation of batch {step}").result
                          if self.d.rank == 0 else lambda: None)

    def collect(self, step: int, d: Dist):
        rows = batch_rows(self.train_rows, step, self.cfg.train.prompts_per_step, self.cfg.train.seed)
        return collect(self.cfg, self.objective, self.engine, self.tokenizer, rows, step, d)

    def next_batch(self):
        """Rank 0: the batch generated ahead (finished after a sync), for a checkpoint; else None."""
        return self.ahead() if self.ahead is not None and self.d.rank == 0 else None


def collect(cfg: Config, objective, engine, tokenizer, rows: list, step: int, d: Dist):
    """Rank 0 generates and scores n responses per row (or takes the rows' references) and the
    objective writes what its loss needs onto them; every rank gets the rollouts."""
    t0 = time.perf_counter()
    if objective.references:
        rollouts, metrics = sft_rollouts(tokenizer, rows, cfg, step), {}
    else:
        rollouts, metrics = rank0_call(d, lambda: prepare_rollouts(engine, tokenizer, rows, cfg, objective, step))
    metrics["time/rollout_s"] = time.perf_counter() - t0
    return rollouts, metrics


def prepare_rollouts(engine, tokenizer, rows, cfg: Config, objective, step: int):
    """Rank 0's part of a step: generate, score, the objective's prepare; and their metrics."""
    rollouts = generate_and_score(engine, tokenizer, rows, cfg, stream_seed("generation", cfg.train.seed, step),
                                  cfg.rollout.n, cfg.rollout.temperature)
    n = len(rollouts)
    errors = [r for r in rollouts if r.reward_error]
    metrics = {
        "reward/mean": sum(r.reward for r in rollouts) / n,
        "reward/success_rate": success_rate(rollouts, cfg),
        "reward/errors": len(errors),
        "response/length_mean": sum(len(r.response_ids) for r in rollouts) / n,
        "response/truncated_frac": sum(r.truncated for r in rollouts) / n,
    }
    if errors and len(errors) == n:  # nothing was scored: training on zeros would only hide it
        first, name = errors[0], cfg.data.reward or errors[0].row["reward"]
        raise data.UserError(f"step {step + 1}: all {n} rewards raised, so nothing was scored; the reward {name!r} "
                             f"on {first.row['source']}: {first.reward_error}")
    if errors:
        print(f"[step {step + 1}] {len(errors)} reward errors, e.g. {errors[0].row['source']}: {errors[0].reward_error}",
              file=sys.stderr)
    metrics.update(objective.prepare(rollouts, tokenizer, cfg))
    return rollouts, metrics


def learn(cfg: Config, objective, trainer: Trainer, engine, tokenizer, rollouts: list, step: int, d: Dist,
          generate_next=None) -> dict:
    """Update the policy on the rollouts, then the objective's models (an EMA teacher's move, a
    reference's refresh), sync the engine's weights (the weights of step + 1 updates; the engine
    first finishes a batch it generates ahead). generate_next: called once the objective's own
    forwards before the gradient passes are done (Batches.generate_next)."""
    t0, pad_id = time.perf_counter(), pad_token_id(tokenizer)
    prepared = prepare_update(cfg, objective, trainer, rollouts, step, pad_id, d)
    if generate_next is not None:
        generate_next()
    metrics, stepped = take_steps(cfg, prepared, trainer, rollouts, step, pad_id, d)
    # the policy's own forward and backward: the objective's models' forwards are timed apart
    metrics["time/train_s"] = time.perf_counter() - t0 - sum(v for k, v in metrics.items() if k.startswith("time/"))
    metrics.update(objective.after_update(trainer.models, stepped, step + 1))
    if not objective.references:  # not `engine is not None`: only rank 0 holds the engine, all ranks sync
        metrics.update(sync_engine(cfg, engine, trainer.models.policy, tokenizer, d, version=step + 1))
    return metrics


def test_time_self_distillation(cfg: Config, objective, model_dir: str, engine, tokenizer, rows: list, logger,
                                d: Dist) -> dict:
    """Paper section 5 (docs/loop.md, Test-time self-distillation): SDPO steps on one hard
    question alone against best-of-k; logs each question's generations until its first success
    (-1: none) and discovery@k, the fraction solved within k = n, 2n, ..., train.steps * n."""
    n, steps, k = cfg.rollout.n, cfg.train.steps, cfg.rollout.eval_k
    first_success = lambda rollouts: next((i + 1 for i, r in enumerate(rollouts)
                                           if r.reward >= cfg.sdpo.success_threshold), None)
    screen = rank0_call(d, lambda: generate_and_score(
        engine, tokenizer, rows, cfg, stream_seed("generation", cfg.train.seed, 999_999), k, cfg.rollout.temperature))
    hard = [row for i, row in enumerate(rows) if first_success(screen[i * k:(i + 1) * k]) is None][:cfg.ttt_prompts]
    if d.rank == 0 and len(hard) < cfg.ttt_prompts:
        print(f"ttt: only {len(hard)} of {len(rows)} held-out prompts have no success in {k} samples", file=sys.stderr)
    found = {"ttt": [], "best_of_k": []}
    for i, row in enumerate(hard):
        trainer = build_trainer(cfg, objective, model_dir, d)
        metrics = sync_engine(cfg, engine, trainer.models.policy, tokenizer, d, version=0)  # the initial weights again
        best = rank0_call(d, lambda: generate_and_score(
            engine, tokenizer, [row], cfg, stream_seed("generation", cfg.train.seed, 500_000 + i), n * steps,
            cfg.rollout.temperature))
        found["best_of_k"].append(first_success(best))
        found["ttt"].append(None)
        for step in range(steps):
            rollouts, _ = collect(cfg, objective, engine, tokenizer, [row], (i + 1) * 1000 + step, d)
            at = first_success(rollouts)
            if at is not None:
                found["ttt"][-1] = step * n + at
                break
            metrics.update(learn(cfg, objective, trainer, engine, tokenizer, rollouts, step, d))
        logger.log(i + 1, {"ttt/prompt": i, "ttt/discovered_at": found["ttt"][-1] or -1,
                           "best_of_k/discovered_at": found["best_of_k"][-1] or -1,
                           "sync/probe_max_abs_diff": metrics["sync/probe_max_abs_diff"]})
    summary = {"ttt/prompts": len(hard)}
    for kind, ats in found.items():
        for j in range(1, steps + 1):
            summary[f"{kind}/discovery@{j * n}"] = sum(a is not None and a <= j * n for a in ats) / max(len(ats), 1)
    logger.log(len(hard) + 1, summary)
    return summary


# ----------------------------------------------------------------------------------------
# Entry point


def resolve_model(cfg: Config, d: Dist) -> str:
    """The model to train: --model.path, or the tiny model after its cached SFT warm start
    (warm_start.py: itself a run of this loop, --algo sft)."""
    if cfg.model.path:
        return cfg.model.path
    tiny = rank0_call(d, lambda: tiny_model_dir(cfg))
    if not cfg.train.warm_start_steps or objectives.OBJECTIVES[cfg.algo.name].references:
        return tiny
    warm = warm_start_config(cfg, tiny)
    final = os.path.join(warm.log.out_dir, "final")
    if not os.path.exists(os.path.join(final, "config.json")):
        if d.rank == 0:
            print(f"warm start: {warm.train.steps} SFT steps on the task's references -> {warm.log.out_dir}")
        try:
            train(warm, tiny, d)
        except BaseException:  # no half-built cache entry: the next run builds it anew
            if d.rank == 0:
                shutil.rmtree(warm.log.out_dir, ignore_errors=True)
            raise
    return final


def teacher_model(cfg: Config, d: Dist) -> tuple[Config, str]:
    """GAD's self-made black-box teacher: its run's config and its model (a warm start of its own)."""
    teacher_cfg = gad_teacher_config(cfg)
    return teacher_cfg, resolve_model(teacher_cfg, d)


def with_teacher_data(cfg: Config, d: Dist) -> Config:
    """cfg reading a teacher's responses when the objective needs them (GAD) and the task is
    synthetic: the self-made teacher's answers, written once to a data file (warm_start.teacher_data)."""
    if "teacher_response" not in objectives.OBJECTIVES[cfg.algo.name].row_fields or cfg.data.task not in tasks.TASKS:
        return cfg
    teacher_cfg, teacher_dir = teacher_model(cfg, d)
    return teacher_data(cfg, teacher_cfg, teacher_dir, d)


@contextlib.contextmanager
def ctrl_c_wins():
    """Ctrl-C reaches the engine's processes too (one process group), and the engine may die
    of it before the trainer's KeyboardInterrupt surfaces: its EngineDeadError would then
    be what the run stops with. After a SIGINT, whatever the run raises is reported as the
    KeyboardInterrupt it is."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():  # signal handlers: main thread only
        yield
        return
    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(signum)
        signal.default_int_handler(signum, frame)
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except Exception as error:
        if interrupted:
            raise KeyboardInterrupt("Ctrl-C (the engine stopped with it)") from error
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv=None):
    cfg = parse_config(argv)
    check_devices(cfg)  # the placement against this node's GPUs, before anything loads
    if cfg.plan:  # what each GPU (or process) would hold, from the model's config.json alone
        return report_plan(cfg)
    with process_group(cfg.train.collective_timeout_min) as d:  # destroyed at the end, also after an error
        cfg.log.out_dir = rank0_call(d, lambda: run_dir(cfg))  # named once, on rank 0
        if d.rank == 0:
            print(describe(cfg), flush=True)
            print(f"out_dir: {cfg.log.out_dir}", flush=True)
        rank0_call(d, lambda: check_out_dir(cfg, resuming=bool(cfg.train.resume)))  # not after the warm start
        if cfg.data.task not in tasks.TASKS and not cfg.model.path:  # a file's rows, before a warm start's minutes
            rank0_call(d, lambda: load_data(cfg), share=False)
        t0 = time.perf_counter()
        model_dir = resolve_model(cfg, d)
        cfg = with_teacher_data(cfg, d)
        with ctrl_c_wins():
            metrics = train(cfg, model_dir, d)
        if d.rank == 0:
            shown = {k: round(v, 4) for k, v in metrics.items() if k.startswith(("eval/", "reward/"))}
            print(f"done in {time.perf_counter() - t0:.0f}s: {shown} -> {cfg.log.out_dir}")
    return metrics


def cli(argv=None) -> int:
    """main() for the command line. A user's mistake (a data.UserError: a flag, a data file, a
    path, a checkpoint, a reward's setup; a code sandbox that cannot isolate) prints its message
    alone, once, and the exit status is non-zero (2 for a flag); --debug or SDPO_DEBUG=1 show the
    traceback. Any other exception is a bug and keeps its traceback."""
    from feedback.code.sandbox import SandboxUnavailable
    try:
        main(argv)
    except (data.UserError, SandboxUnavailable) as e:
        drop_empty_run_dirs()
        if debugging(argv):
            raise
        if os.environ.get("RANK", "0") == "0" and not getattr(e, "reported", False):  # once, under torchrun too
            print(f"error: {e}", file=sys.stderr, flush=True)
        return getattr(e, "exit_code", 1)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
