"""The model a run trains: --model.path, or the tiny model after its cached SFT warm start.

The warm start is `--algo sft` on the task's references (--train.warm_start_*), a share of its
prompts SDPO teacher contexts, cached under a hash of what it reads and runs; it may stop at
--train.warm_start_target (reference_success). GAD's self-made teacher is a warm start too,
whose sampled answers become a data file (teacher_data).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
from typing import TYPE_CHECKING

import data
import microbatch
import tasks
import tiny_models
from config import OptimConfig, RolloutConfig, TrainConfig
from data import read_rows, stream_seed
from evaluate import success_rate
from sdpo import teacher_context_ids
from distributed import Dist, rank0_call
from microbatch import Rollout
from policy import load_tokenizer, pad_token_id
from objectives import AlgoConfig
from rollout import generate_and_score, start_engine

if TYPE_CHECKING:
    from config import Config

# The code a warm start runs beyond tiny_models.TINY_SOURCES: part of its cache key, so that an edit
# to a checker, a template, the SFT loss or the loop builds it anew (tiny_models.source_hash).
WARM_START_SOURCES = ("run.py", "warm_start.py", "config.py", "flags.py", "policy.py", "update.py", "microbatch.py",
                      "objectives/__init__.py", "objectives/sft.py", "losses.py", "chunked_head.py", "sdpo.py",
                      "evaluate.py", *tiny_models.TINY_SOURCES, "feedback/math.py")  # the tasks' checkers


def tiny_model_dir(cfg: Config) -> str:
    """The tiny model the project builds for cfg's task (a vision-language one for a picture task)."""
    if cfg.data.task in tasks.IMAGE_TASKS:
        return tiny_models.tiny_vlm_dir(tiny_models.TinyVLMConfig(**dataclasses.asdict(cfg.model.tiny)))
    return tiny_models.tiny_model_dir(cfg.model.tiny)


def warm_start_config(cfg: Config, tiny: str) -> Config:
    """The warm start's run: `--algo sft` with the train.warm_start_* values, one optimizer step
    per batch, its out_dir a cache entry under a hash of what it reads. Runs that differ in
    RL-only flags (the RL lr, seed, prompts per step, mini-batches, eval rows, ...) share it."""
    warm_train = dict(steps=cfg.train.warm_start_steps, prompts_per_step=cfg.train.warm_start_batch,
                      micro_batch=cfg.train.micro_batch, micro_batch_tokens=cfg.train.warm_start_micro_batch_tokens,
                      seed=cfg.train.warm_start_seed, mini_batches=1, eval_every=0, save_every=0, resume="",
                      **{f.name: getattr(cfg.train, f.name) for f in dataclasses.fields(TrainConfig)
                         if f.name.startswith("warm_start")})
    warm_questions = cfg.data.shapes_warm_start_questions or cfg.data.shapes_questions
    warm = dataclasses.replace(
        cfg, algo=AlgoConfig(name="sft"), rollout=RolloutConfig(),
        data=dataclasses.replace(cfg.data, shapes_questions=warm_questions, shapes_warm_start_questions=""),
        # decayed towards 0 at its last step (a target may stop it sooner): its last weights are all that is kept
        optim=dataclasses.replace(cfg.optim, lr=cfg.train.warm_start_lr, decay="linear", eps=OptimConfig.eps),
        train=dataclasses.replace(cfg.train, **warm_train),
        # a cache entry without its final model is an interrupted build: rebuilt from scratch
        log=dataclasses.replace(cfg.log, wandb_mode="disabled", overwrite=True),
        eval_only=False, ttt_prompts=0)  # those modes are for the RL run, not its warm start
    key = json.dumps([tiny, tiny_models.source_hash(WARM_START_SOURCES), *warm_start_key(cfg, warm, warm_train)],
                     sort_keys=True)
    path = tiny + "-sft-" + hashlib.sha1(key.encode()).hexdigest()[:10]
    return dataclasses.replace(warm, log=dataclasses.replace(warm.log, out_dir=path))


def warm_start_key(cfg: Config, warm: Config, warm_train: dict) -> list:
    """What the warm start reads. Flags added after a cache entry was written stay out of the key
    at their old behaviour's values, so that older entries keep their names."""
    templates = {k: getattr(cfg.sdpo, k) for k in ("reprompt_template", "solution_template", "feedback_template",
                                                     "max_reprompt_len")}
    train_data = {k: v for k, v in dataclasses.asdict(warm.data).items() if k not in ("eval_rows", "eval_path")}
    if cfg.data.task != "quiz" or cfg.data.quiz_feedback == "values":  # only the quiz's warm start shows it
        train_data.pop("quiz_feedback")
    if cfg.data.task != "manners":  # only the manners task reads them
        train_data.pop("manners")
    if cfg.data.task != "manners" or cfg.data.manner_per == "answer":
        train_data.pop("manner_per")
    train_data.pop("shapes_warm_start_questions")  # in effect as shapes_questions
    if "quiz" not in warm.data.shapes_questions.split(","):
        train_data.pop("shapes_quiz_questions")
        train_data.pop("shapes_quiz_kinds")
    # --optim.eps is RL-only (the warm start keeps AdamW's default)
    warm_optim = {k: v for k, v in dataclasses.asdict(warm.optim).items() if k != "eps"}
    warm_key = {k: v for k, v in warm_train.items()
                if cfg.train.warm_start_target or k not in ("warm_start_target", "warm_start_check_every")}
    if not cfg.train.warm_start_context_steps:
        warm_key.pop("warm_start_context_steps")
    return [templates, train_data, warm_key, warm_optim]


def warm_start_checks(cfg: Config, objective, tokenizer) -> tuple[list, list] | None:
    """For an SFT run with --train.warm_start_target on a synthetic task: the held-out rows its
    target is checked on, 256 after the first 2,048 that measure the RL run (they overlap only where
    the split has fewer rows), and the same rows shown their reference (whether copying a
    demonstration has formed). None otherwise."""
    if not (objective.references and cfg.train.warm_start_target and cfg.data.task in tasks.TASKS):
        return None
    rows = tasks.task_rows(cfg.data.task, "test", 2048 + 256, cfg=cfg.data, at_most=True)[-256:]
    return rows, [teacher_context_ids(tokenizer, row, "demonstration", None, cfg) for row in rows]


def warm_start_estimates(cfg: Config, policy, tokenizer, checks: tuple[list, list] | None, step: int, d: Dist) -> dict:
    """At every --train.warm_start_check_every-th step of a warm start with checks: the bare
    student's estimated held-out success, and the same shown the reference; else nothing."""
    if checks is None or step % cfg.train.warm_start_check_every:
        return {}
    rows, demonstrations = checks
    return {"warm_start/reference_success": reference_success(cfg, policy, tokenizer, rows, d),
            "warm_start/reference_success_with_demonstration":
                reference_success(cfg, policy, tokenizer, rows, d, demonstrations)}


def target_reached(cfg: Config, metrics: dict, step: int, d: Dist) -> bool:
    """Whether the bare student's estimate at this step reached --train.warm_start_target."""
    estimate = metrics.get("warm_start/reference_success")
    if estimate is None or estimate < cfg.train.warm_start_target:
        return False
    if d.rank == 0:
        print(f"warm start: the student's estimated held-out success {estimate:.3f} reached "
              f"--train.warm_start_target={cfg.train.warm_start_target} at step {step}; stopping there")
    return True


def reference_success(cfg: Config, policy, tokenizer, rows: list[dict], d: Dist, prompts: list | None = None) -> float:
    """The bare student's expected success on rows, without sampling: the mean over rows of the
    probability that sampling at --rollout.eval_temperature writes the reference exactly,
    exp(sum_t log softmax(z_t / T)[reference_t]), EOS included (a lower bound where other texts
    also pass). prompts: each row's prompt ids (a teacher context), else its bare prompt. Every
    rank runs it (FSDP2's collectives)."""
    prompts = prompts or [data.chat_prompt_ids(tokenizer, row["messages"], cfg.data.max_prompt_len) for row in rows]
    rollouts = [Rollout(row=row, prompt_ids=prompt,
                        response_ids=data.reference_response_ids(tokenizer, row, tokenizer.eos_token_id,
                                                                 "--train.warm_start_target"),
                        rollout_logprobs=[], text=row["reference"], truncated=False, generated=False)
                for row, prompt in zip(rows, prompts)]
    logprobs = microbatch.response_logprobs(policy, rollouts, pad_token_id(tokenizer), d, cfg.train.micro_batch,
                                            cfg.rollout.eval_temperature)
    return sum(math.exp(sum(values)) for values in logprobs) / max(len(logprobs), 1)


def sft_rollouts(tokenizer, rows, cfg: Config, step: int) -> list[Rollout]:
    """Reference responses as rollouts, for --algo sft and the tiny model's warm start.

    A share of the prompts (--train.warm_start_*_frac) are SDPO teacher contexts: the
    reference shown as the correct solution, or the feedback on a wrong attempt.
    """
    rng = random.Random(stream_seed("references", cfg.train.seed, step))
    demo_frac, feedback_frac = cfg.train.warm_start_demo_frac, cfg.train.warm_start_feedback_frac
    if step < cfg.train.warm_start_context_steps and demo_frac + feedback_frac > 0:  # contexts only, in their ratio
        demo_frac, feedback_frac = demo_frac / (demo_frac + feedback_frac), feedback_frac / (demo_frac + feedback_frac)
    out = []
    for row in rows:
        response = data.reference_response_ids(tokenizer, row, tokenizer.eos_token_id, "--algo sft")
        draw = rng.random()
        kind = ("demonstration" if draw < demo_frac else
                "feedback" if draw < demo_frac + feedback_frac else None)
        prompt = teacher_context_ids(tokenizer, row, kind, rng, cfg) if kind else None
        if prompt is None:  # no context drawn, or the row has none of that kind
            prompt = data.chat_prompt_ids(tokenizer, row["messages"], cfg.data.max_prompt_len)
        out.append(Rollout(row=row, prompt_ids=prompt, response_ids=response, rollout_logprobs=[0.0] * len(response),
                           text=row["reference"], truncated=False, reward=1.0, generated=False))
    return out


def gad_teacher_config(cfg: Config) -> Config:
    """The self-made black-box teacher's run: the tiny model after --gad.teacher_steps SFT steps on
    the task's references, plain prompts only, no early stop (the target is the student's)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=""), train=dataclasses.replace(
        cfg.train, warm_start_steps=cfg.gad.teacher_steps, warm_start_demo_frac=0.0, warm_start_feedback_frac=0.0,
        warm_start_target=0.0, warm_start_context_steps=0))


def teacher_data(cfg: Config, teacher_cfg: Config, teacher_dir: str, d: Dist) -> Config:
    """cfg reading the black-box teacher's responses (the teacher in teacher_dir): each training
    prompt answered once at --gad.teacher_temperature, unfinished or empty answers dropped, in
    <teacher>-data-<hash>/train.jsonl (the file a user brings) beside heldout.jsonl (docs/gad.md)."""
    recipe = json.dumps([teacher_dir, dataclasses.asdict(cfg.data), cfg.train.seed, cfg.gad.teacher_temperature,
                         cfg.rollout.max_tokens], sort_keys=True)
    out = os.path.dirname(teacher_dir) + "-data-" + hashlib.sha1(recipe.encode()).hexdigest()[:10]
    paths = {"train": os.path.join(out, "train.jsonl"), "heldout": os.path.join(out, "heldout.jsonl")}
    if not os.path.exists(paths["heldout"]):  # written last
        train_rows, eval_rows = read_rows(cfg)
        tokenizer = load_tokenizer(teacher_dir)
        engine = start_engine(teacher_cfg, teacher_dir, tokenizer, train_rows, d)
        rank0_call(d, lambda: write_teacher_data(engine, tokenizer, train_rows, eval_rows, teacher_cfg, out, paths),
                   share=False)
        if engine is not None:
            engine.close()
    return dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, task=paths["train"], eval_path=paths["heldout"], fields="",
        reward=cfg.data.reward or tasks.task_rows(cfg.data.task, "test", 1, cfg=cfg.data)[0]["reward"]))


TASK_ROW_KEYS = {"uid", "messages", "answer", "tests", "reference", "reward", "images", "source", "columns",
                 "teacher_response"}  # what every row has; the rest is the task's own


def write_teacher_data(engine, tokenizer, train_rows: list, eval_rows: list, cfg: Config, out: str, paths: dict):
    rollouts = generate_and_score(engine, tokenizer, train_rows, cfg, stream_seed("generation", cfg.train.seed, 0), 1,
                                  cfg.gad.teacher_temperature)
    tmp = out + f".tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    # a task's own fields (the manners a row accepts, ...) become the file's columns: a reward reads
    # them from row["columns"], as from any data file's
    record = lambda row, **extra: json.dumps({**{k: v for k, v in row.items() if k not in TASK_ROW_KEYS},
                                              "uid": row["uid"], "prompt": row["messages"], "answer": row["answer"],
                                              "tests": row["tests"], **extra})
    finished = [r for r in rollouts if not r.truncated and r.text.strip()]
    with open(os.path.join(tmp, "train.jsonl"), "w") as f:
        f.writelines(record(r.row, teacher_response=r.text) + "\n" for r in finished)
    with open(os.path.join(tmp, "heldout.jsonl"), "w") as f:
        f.writelines(record(row) + "\n" for row in eval_rows)
    print(f"teacher data: {len(finished)} of {len(rollouts)} answers finished and not empty, success "
          f"{success_rate(finished, cfg):.3f} on the training prompts -> {out}")
    if os.path.exists(out):  # another process won the race
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, out)
