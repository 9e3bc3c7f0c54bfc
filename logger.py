"""What a run reports: metrics.jsonl, wandb (offline unless asked), samples.jsonl, the
progress bar, and early warnings, on rank 0."""
import dataclasses
import json
import os
import sys
import time

from config import Config, save_config
from errors import disk_full, no_space

# A teacher flatter than its student pulls the student towards a flatter distribution: one step
# above 0.1 nats, or a mean above 0 over 5 steps, warns (the thresholds' measurements: docs/loop.md)
FLAT_TEACHER_METRIC, FLAT_TEACHER_NATS = "sdpo/teacher_minus_student_entropy", 0.1
FLAT_TEACHER_WINDOW = 5

# A demonstration teacher that lowers the student's right answers, and by about as much as its
# wrong ones, cannot tell them apart: distilling it pulls the policy off what it gets right.
# Means over 5 steps that had both kinds of sample (nats a token): right below -0.1 and right
# minus wrong below 0.1 warns (the measured cases the thresholds sit between: docs/loop.md)
DEMO_RIGHT = "sdpo/teacher_minus_student_logprob_demo_right"
DEMO_WRONG = "sdpo/teacher_minus_student_logprob_demo_wrong"
LOWERED_RIGHT_NATS, RIGHT_OVER_WRONG_NATS = -0.1, 0.1

# The metrics the progress bar shows, by their short names
SHOWN = {"reward/mean": "reward", "reward/success_rate": "success", "eval/success_rate": "eval",
         "sdpo/teacher_coverage": "coverage", "sdpo/divergence": "div", "dpo/accuracy": "pref_acc",
         "gad/d_acc": "d_acc", "time/step_s": "s/step"}


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
        self.recent_demo = []  # (right, wrong) of the last FLAT_TEACHER_WINDOW steps that had both
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
        self.recent_gaps = (self.recent_gaps + [gap])[-FLAT_TEACHER_WINDOW:]
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

    def warn_undiscerning_teacher(self, step: int, record: dict):
        """A demonstration teacher that does not tell the student's right answers from its wrong ones."""
        right, wrong = record.get(DEMO_RIGHT), record.get(DEMO_WRONG)
        # logged only in steps that had a right (and a wrong) sample shown a demonstration
        if right is None or wrong is None or DEMO_RIGHT in self.warned:
            return
        self.recent_demo = (self.recent_demo + [(right, wrong)])[-FLAT_TEACHER_WINDOW:]
        if len(self.recent_demo) < FLAT_TEACHER_WINDOW:
            return
        right, wrong = (sum(values) / FLAT_TEACHER_WINDOW for values in zip(*self.recent_demo))
        if right >= LOWERED_RIGHT_NATS or right - wrong >= RIGHT_OVER_WRONG_NATS:
            return
        self.warn(DEMO_RIGHT, step,
                  f"shown a successful sibling, the teacher lowers the student's right answers ({right:+.3f} nats a "
                  f"token over the last {FLAT_TEACHER_WINDOW} steps that had them) about as much as its wrong ones "
                  f"({wrong:+.3f}): it does not tell them apart, so distilling it pulls the policy off what it gets "
                  f"right (docs/results.md, the real pretrained model). Compare "
                  f"with --algo grpo or --algo hybrid.")

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
        """Drop the records after step (a resumed run logs them again)."""
        if self.rank != 0:
            return
        path = self.file.name
        self.file.close()
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with open(path + ".partial", "w") as f:
            f.writelines(kept)
        os.replace(path + ".partial", path)
        self.file = open(path, "ab", buffering=0)

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
