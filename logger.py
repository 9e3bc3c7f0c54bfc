"""What a run reports: metrics.jsonl, wandb (offline unless asked), samples.jsonl, the
progress bar, and early warnings, on rank 0."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING

from config import save_config
from errors import disk_full, no_space

if TYPE_CHECKING:
    from config import Config

# A teacher flatter than its student pulls the student towards a flatter distribution: one step
# above 0.1 nats, or a mean above 0 over 5 steps, warns (the thresholds' measurements: docs/loop.md)
FLAT_TEACHER_METRIC, FLAT_TEACHER_NATS = "sdpo/teacher_minus_student_entropy", 0.1
FLAT_TEACHER_WINDOW = 5

# The demonstration teacher's signal is how much more it likes the student's right answers than its
# wrong ones (per token). The sign of either side says nothing: the tokens are the student's own
# samples, so over all of them E[log T - log S] = -KL(S || T) <= 0 for any teacher that differs from
# the student. Right minus wrong, each step's, over the last 5 steps that had both kinds of sample,
# is logged with its standard error over those steps; within 2 of them of 0, or below, warns.
DEMO_RIGHT = "sdpo/teacher_minus_student_logprob_demo_right"
DEMO_WRONG = "sdpo/teacher_minus_student_logprob_demo_wrong"
RIGHT_MINUS_WRONG = "sdpo/teacher_gap_right_minus_wrong"
NOISE_SE = 2.0

# The metrics the progress bar shows, by their short names
SHOWN = {"reward/mean": "reward", "reward/success_rate": "success", "eval/success_rate": "eval",
         "sdpo/teacher_coverage": "coverage", "sdpo/divergence": "div", "dpo/accuracy": "pref_acc",
         "gad/d_acc": "d_acc", "time/step_s": "s/step"}


def last_steps(window: list, value: float) -> list:
    """window with value appended, its last FLAT_TEACHER_WINDOW values: what a warning reads."""
    return (window + [value])[-FLAT_TEACHER_WINDOW:]


def samples_table(records: list[dict]):
    """log_samples' records as a wandb Table. A cell holds text (wandb cannot type a list of
    parts): a prompt with pictures becomes its text parts with each picture as "<image>"."""
    import wandb
    text = lambda v: v if isinstance(v, str) else \
        "".join(p.get("text", "") if p.get("type") == "text" else f"<{p.get('type')}>" for p in v)
    columns = list(records[0])
    return wandb.Table(columns=columns, data=[[text(rec[c]) if c == "prompt" else rec[c] for c in columns]
                                              for rec in records])


class Logger:
    """metrics.jsonl, wandb (offline unless asked) and a progress bar, on rank 0."""

    def __init__(self, cfg: Config, rank: int):
        self.rank, self.cfg, self.run, self.samples, self.warned = rank, cfg, None, None, set()
        self.bar = None  # the progress bar, once progress() starts it
        self.recent_gaps = []  # the last FLAT_TEACHER_WINDOW steps' teacher-minus-student entropy
        self.recent_demo = []  # right minus wrong of the last FLAT_TEACHER_WINDOW steps that had both
        if rank != 0:
            return
        save_config(cfg, cfg.log.out_dir)
        self.file = open(os.path.join(cfg.log.out_dir, "metrics.jsonl"), "ab", buffering=0)
        if cfg.log.wandb_mode != "disabled":
            import wandb
            # its banner (integrations it detected, product hints) means nothing here: one line instead
            os.environ.setdefault("WANDB_SILENT", "true")
            name = cfg.log.run_name or os.path.basename(cfg.log.out_dir.rstrip(os.sep))  # the run's folder
            self.run = wandb.init(project=cfg.log.wandb_project, name=name, mode=cfg.log.wandb_mode,
                                  dir=cfg.log.out_dir, config=dataclasses.asdict(cfg), reinit="finish_previous")
            print(f"wandb ({cfg.log.wandb_mode}): {os.path.dirname(self.run.dir)}", flush=True)

    def log(self, step: int, metrics: dict):
        if self.rank != 0:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        record.update(self.right_minus_wrong(record))
        self.append(self.file, json.dumps(record) + "\n")
        if self.run is not None:
            self.run.log(record, step=step)
        # early warnings on stderr, each once, the first time its metric crosses its threshold
        self.warn_flat_teacher(step, record)
        self.warn_undiscerning_teacher(step, record)
        if self.bar is not None:
            self.bar.set_postfix({short: f"{metrics[k]:.3g}" for k, short in SHOWN.items() if k in metrics})
            self.bar.update(1)

    def warn_flat_teacher(self, step: int, record: dict):
        """A teacher flatter than the student by more than FLAT_TEACHER_NATS in one step, or by any
        margin on average over FLAT_TEACHER_WINDOW steps."""
        gap = record.get(FLAT_TEACHER_METRIC)
        if gap is None or FLAT_TEACHER_METRIC in self.warned:
            return
        self.recent_gaps = last_steps(self.recent_gaps, gap)
        window_mean = sum(self.recent_gaps) / len(self.recent_gaps)
        if gap > FLAT_TEACHER_NATS:
            why = f"{gap:+.3f} nats (> {FLAT_TEACHER_NATS})"
        elif len(self.recent_gaps) == FLAT_TEACHER_WINDOW and window_mean > 0:
            why = f"{window_mean:+.3f} nats on average over the last {FLAT_TEACHER_WINDOW} steps (> 0)"
        else:
            return
        self.warn(FLAT_TEACHER_METRIC, step,
                  f"{FLAT_TEACHER_METRIC}={why}: the teacher is flatter than the student on the student's own "
                  f"tokens, so self-distillation will raise the policy's entropy instead of sharpening it. The "
                  f"model likely cannot use its teacher contexts in-context, or they add nothing to what it already "
                  f"solves (docs/results.md: the real pretrained model; docs/LOG.md: near the ceiling); check "
                  f"--eval_only --teacher_gap, and compare with --algo grpo.")

    def right_minus_wrong(self, record: dict) -> dict:
        """RIGHT_MINUS_WRONG and its standard error: the mean of right minus wrong over the last
        FLAT_TEACHER_WINDOW steps that logged both (a step without a right or a wrong sample shown a
        demonstration logs neither: update.reduce_stats), the SE over those steps (from 2 on)."""
        right, wrong = record.get(DEMO_RIGHT), record.get(DEMO_WRONG)
        if right is None or wrong is None:
            return {}
        self.recent_demo = last_steps(self.recent_demo, right - wrong)
        k = len(self.recent_demo)
        mean = sum(self.recent_demo) / k
        if k < 2:
            return {RIGHT_MINUS_WRONG: mean}
        se = math.sqrt(sum((d - mean) ** 2 for d in self.recent_demo) / (k - 1) / k)
        return {RIGHT_MINUS_WRONG: mean, f"{RIGHT_MINUS_WRONG}_stderr": se}

    def warn_undiscerning_teacher(self, step: int, record: dict):
        """A demonstration teacher that does not tell the student's right answers from its wrong
        ones: over FLAT_TEACHER_WINDOW steps, right minus wrong within NOISE_SE standard errors of 0,
        or below (not the sign of either side, which the student's own samples pull below 0)."""
        mean, se = record.get(RIGHT_MINUS_WRONG), record.get(f"{RIGHT_MINUS_WRONG}_stderr")
        if se is None or len(self.recent_demo) < FLAT_TEACHER_WINDOW or RIGHT_MINUS_WRONG in self.warned \
                or mean > NOISE_SE * se:
            return
        self.warn(RIGHT_MINUS_WRONG, step,
                  f"{RIGHT_MINUS_WRONG}={mean:+.3f} ± {se:.3f} nats a token over the last {FLAT_TEACHER_WINDOW} "
                  f"steps that had right and wrong samples shown a demonstration: within {NOISE_SE:g} standard "
                  f"errors of 0, or below, so the teacher does not tell the student's right answers from its wrong "
                  f"ones, and distilling its whole distribution moves both alike (docs/results.md, the real "
                  f"pretrained model). Compare with --algo grpo or --algo hybrid.")

    def warn(self, key: str, step: int, message: str):
        self.warned.add(key)
        from tqdm import tqdm
        tqdm.write(f"WARNING step {step}: {message} (Shown once.)", file=sys.stderr)  # above the bar, not in it

    def log_samples(self, step: int, rollouts: list):
        """The first sample of each of the first --log.samples_per_step prompts of a step."""
        if self.rank != 0 or not self.cfg.log.samples_per_step or not any(r.generated for r in rollouts):
            return  # reference answers (SFT) are the data's, not samples
        firsts = rollouts[::self.cfg.rollout.n][:self.cfg.log.samples_per_step]  # rollouts come n per prompt
        records = [{"step": step, "prompt": r.row["messages"][-1]["content"], "response": r.text, "reward": r.reward,
                    "feedback": r.feedback, "truncated": r.truncated, "uid": r.row["uid"]} for r in firsts]
        if self.samples is None:
            self.samples = open(os.path.join(self.cfg.log.out_dir, "samples.jsonl"), "ab", buffering=0)
        self.append(self.samples, "".join(json.dumps(rec) + "\n" for rec in records))
        if self.run is not None and records:
            self.run.log({"samples": samples_table(records)}, step=step)

    def append(self, file, text: str):
        """Append text to file (opened unbuffered), whole or not at all: a write a full disk cuts
        short is undone, so that metrics.jsonl never holds a partial line, and the run stops with
        one message naming the folder (errors.no_space)."""
        data, start = memoryview(text.encode()), os.lseek(file.fileno(), 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(file.fileno(), data):]
        except OSError as e:
            os.ftruncate(file.fileno(), start)
            out = self.cfg.log.out_dir
            if not disk_full(e, out):
                raise
            raise no_space(out, os.path.basename(file.name), f"it keeps its whole lines; free space there and continue "
                           f"from the run's last checkpoint with --train.resume {out} (none: start the run again)") from e

    def progress(self, start: int, total: int):
        """A progress bar at step start of total, which each log() from here on advances."""
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=start, desc=self.cfg.algo.name, dynamic_ncols=True,
                        disable=self.rank != 0 or not self.cfg.log.progress)

    def truncate(self, step: int):
        """Drop the records after step (a resumed run logs them again), and take the windows of the
        records kept back, so that a resumed run logs what the uninterrupted one does."""
        if self.rank != 0:
            return
        path = self.file.name
        self.file.close()
        with open(path) as f:
            kept = [(line, record) for line in f if line.strip() and (record := json.loads(line))["step"] <= step]
        with open(path + ".partial", "w") as f:
            f.writelines(line for line, _ in kept)
        os.replace(path + ".partial", path)
        self.file = open(path, "ab", buffering=0)
        for _, record in kept:
            self.right_minus_wrong(record)
            if FLAT_TEACHER_METRIC in record:
                self.recent_gaps = last_steps(self.recent_gaps, record[FLAT_TEACHER_METRIC])

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.rank == 0 and not self.file.closed:
            self.file.close()
            if self.samples is not None:
                self.samples.close()
            if self.run is not None:
                self.run.finish()


def step_time(rollouts: list, started: float) -> dict:
    """The step's seconds since started (a perf_counter reading) and its rollouts' tokens a second."""
    seconds = time.perf_counter() - started
    tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    return {"time/step_s": seconds, "throughput/tokens_per_s": tokens / seconds}


def status(d, text: str):
    """One line on rank 0 for what takes a while before the progress bar shows (empty: none)."""
    if text and d.rank == 0:
        print(text, flush=True)
