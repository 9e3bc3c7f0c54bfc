"""Held-out evaluation and what it says about SDPO's prospects.

The metrics: docs/metrics.md (eval/); --eval_only, --teacher_gap, --blind: docs/loop.md (Evaluation only).
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
from typing import TYPE_CHECKING

import torch

import chunked_head
import microbatch
import objectives
import packing
import sdpo
from logger import NOISE_SE, status
from distributed import Dist, rank0_call
from policy import load_policy, pad_token_id
from rollout import generate_and_score

if TYPE_CHECKING:
    from config import Config


def evaluate(engine, tokenizer, rows, cfg: Config, before: list | None = None,
             step: int | None = None) -> tuple[dict, list]:
    """avg@k success and its standard error, mean response length and truncation rate on
    held-out rows; and each row's success. before: each row's success at an earlier
    evaluation of the same rows; then also the gain since and its paired standard error.
    step: a training run's evaluation, whose rows' successes go to <out_dir>/eval_rows.jsonl."""
    rollouts = generate_and_score(engine, tokenizer, rows, cfg, cfg.rollout.eval_seed, cfg.rollout.eval_k,
                                  cfg.rollout.eval_temperature)
    n = max(len(rollouts), 1)
    per_row = row_success(rollouts, cfg.rollout.eval_k, cfg)
    metrics = {
        "eval/success_rate": success_rate(rollouts, cfg),
        "eval/success_stderr": stderr(per_row),  # the rows are the independent draws, not their k samples
        "eval/reward_mean": sum(r.reward for r in rollouts) / n,
        "eval/response_length": sum(len(r.response_ids) for r in rollouts) / n,
        "eval/truncated_frac": sum(r.truncated for r in rollouts) / n,
    }
    if before is not None and len(before) == len(per_row):
        metrics["eval/gain"], metrics["eval/gain_stderr"] = paired_gain(per_row, before)
    if step is not None:
        save_row_success(cfg, step, rows, metrics, per_row)
    return metrics, per_row


EVAL_ROWS_FILE = "eval_rows.jsonl"  # a line per evaluation of a training run: each held-out row's success


def evaluate_start(engine, tokenizer, rows, cfg: Config, baseline: tuple | None, d: Dist) -> tuple[dict, list]:
    """Step 0's metrics and each row's success (every rank): evaluated now on rank 0, or taken from
    baseline (baseline_evaluation's), which then goes into this run's eval_rows.jsonl too, so that a
    later run may take this one as its baseline."""
    if baseline:
        status(d, f"step 0: the evaluation of {cfg.train.eval_baseline} (--train.eval_baseline)")
        rank0_call(d, lambda: save_row_success(cfg, 0, rows, *baseline), share=False)
        return baseline
    status(d, f"step 0: evaluating {len(rows)} held-out rows x {cfg.rollout.eval_k} samples")
    return rank0_call(d, lambda: evaluate(engine, tokenizer, rows, cfg, step=0))


def save_row_success(cfg: Config, step: int, rows, metrics: dict, per_row: list):
    with open(os.path.join(cfg.log.out_dir, EVAL_ROWS_FILE), "a") as f:
        record = {"step": step, **evaluation_key(rows, cfg), "metrics": metrics, "success": per_row}
        f.write(json.dumps(record) + "\n")


def evaluation_key(rows, cfg: Config) -> dict:
    """What two evaluations must share for their rows' successes to pair: the model they start
    from, the rows, and how they are sampled."""
    return {"model": cfg.model.path or f"built for {cfg.data.task}", "uids": [r["uid"] for r in rows],
            "eval_k": cfg.rollout.eval_k, "eval_temperature": cfg.rollout.eval_temperature,
            "eval_seed": cfg.rollout.eval_seed, "max_tokens": cfg.rollout.max_tokens}


def baseline_evaluation(rows, cfg: Config) -> tuple[dict, list]:
    """--train.eval_baseline: the step-0 evaluation of an earlier run of the same model, rows and
    sampling (its out_dir or eval_rows.jsonl), in place of this run's own: its metrics, and each
    row's success to pair this run's gains with. A sweep of runs from one model shares one
    baseline, and its runs' gains are then paired with each other's too."""
    path = cfg.train.eval_baseline
    if os.path.isdir(path):
        path = os.path.join(path, EVAL_ROWS_FILE)
    try:
        with open(path) as f:
            first = next((r for r in map(json.loads, f) if r["step"] == 0), None)
    except OSError as e:
        raise ValueError(f"--train.eval_baseline={cfg.train.eval_baseline}: cannot read {path} ({e})") from e
    if first is None:
        raise ValueError(f"--train.eval_baseline: {path} has no step-0 evaluation")
    key = evaluation_key(rows, cfg)
    for field, value in key.items():
        if first.get(field) != value:
            shown = (lambda v: f"{len(v)} rows from {v[0]!r}" if isinstance(v, list) and v else repr(v))
            raise ValueError(f"--train.eval_baseline: {path} evaluated {field}={shown(first.get(field))}, this run "
                             f"{shown(value)}: the rows' successes would not pair")
    return first["metrics"], first["success"]


def evaluation_due(cfg: Config, step: int) -> bool:
    """At step 0, every --train.eval_every steps and after the last (--train.eval_every 0: never)."""
    return bool(cfg.train.eval_every) and (step % cfg.train.eval_every == 0 or step == cfg.train.steps)


def paired_gain(after: list[float], before: list[float]) -> tuple[float, float]:
    """Mean gain of per-row success between two evaluations of the same rows, and its
    standard error over the rows' differences (a row's difficulty is in both and cancels)."""
    gains = [a - b for a, b in zip(after, before)]
    return sum(gains) / max(len(gains), 1), stderr(gains)


def success_rate(rollouts, cfg: Config) -> float:
    return sum(r.reward >= cfg.sdpo.success_threshold for r in rollouts) / max(len(rollouts), 1)


def row_success(rollouts, k: int, cfg: Config) -> list[float]:
    """Success of each row's k consecutive samples."""
    return [success_rate(rollouts[i:i + k], cfg) for i in range(0, len(rollouts), k)]


def stderr(values: list[float]) -> float:
    """Standard error of the mean of independent values (nan for fewer than two)."""
    if len(values) < 2:
        return float("nan")
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def teacher_gap(engine, tokenizer, rows, cfg: Config) -> dict:
    """What SDPO relies on (the paper: it needs in-context ability): eval success of the
    model shown the reference as a demonstration, and shown a wrong attempt's feedback,
    next to eval/success_rate on the bare prompts. Sampled with --rollout.eval_seed."""
    seed = cfg.rollout.eval_seed
    rng, out = random.Random(seed), {}
    for kind in ("demonstration", "feedback"):
        pairs = [(row, sdpo.teacher_context_ids(tokenizer, row, kind, rng, cfg)) for row in rows if row.get("reference")]
        pairs = [(row, ids) for row, ids in pairs if ids is not None]
        if pairs:
            rollouts = generate_and_score(engine, tokenizer, [r for r, _ in pairs], cfg, seed, cfg.rollout.eval_k,
                                          cfg.rollout.eval_temperature, prompts=[ids for _, ids in pairs])
            out[f"eval/success_rate_with_{kind}"] = success_rate(rollouts, cfg)
            out[f"eval/rows_with_{kind}"] = len(pairs)
    return out


@torch.no_grad()
def context_entropies(engine, tokenizer, rows, cfg: Config, model_dir: str, device) -> dict:
    """SDPO's teacher on the model's own samples: --rollout.n responses per row at the training
    temperature, their teacher contexts built as a training step would, the same response tokens
    scored under the bare prompt (the student) and each context by the model in model_dir. Per
    kind of context: mean token entropies and teacher-minus-student log-prob (docs/loop.md,
    Evaluation only)."""
    rollouts = generate_and_score(engine, tokenizer, rows, cfg, cfg.rollout.eval_seed, cfg.rollout.n,
                                  cfg.rollout.temperature)
    coverage = objectives.sdpo.prepare_teacher_contexts(rollouts, tokenizer, cfg)["sdpo/teacher_coverage"]
    model = load_policy(model_dir, cfg, 1, device).eval()
    pad_id = pad_token_id(tokenizer)

    def score(seqs: list, response_lens: list) -> list:
        """(log-probs, entropies) of each sequence's response tokens."""
        out, size = [], cfg.train.micro_batch
        for i in range(0, len(seqs), size):
            packed = packing.pack(seqs[i:i + size], response_lens[i:i + size], pad_id, device)
            lp, ent = microbatch.forward(model, packed, lambda h, w: chunked_head.logprobs_and_entropy_from_hidden(
                h, w, packed.targets, cfg.rollout.temperature, cfg.sdpo.chunk_size))
            ends = torch.tensor(response_lens[i:i + size]).cumsum(0).tolist()
            out += [(lp[e - n:e], ent[e - n:e]) for n, e in zip(response_lens[i:i + size], ends)]
        return out

    rollouts = [r for r in rollouts if r.response_ids]
    student = score([r.prompt_ids + r.response_ids for r in rollouts], [len(r.response_ids) for r in rollouts])
    cat = lambda pairs, k: torch.cat([p[k] for p in pairs])
    out = {"eval/entropy_student": float(cat(student, 1).mean()) if student else 0.0}
    used = [j for j, r in enumerate(rollouts) if r.fields.sdpo_mask > 0]
    teacher = dict(zip(used, score([rollouts[j].fields.teacher_ids for j in used],
                                   [len(rollouts[j].response_ids) for j in used])))
    for kind in ("demonstration", "feedback", "any"):
        chosen = [j for j in used if kind in ("any", rollouts[j].fields.teacher_context)]
        if not chosen:
            continue
        s_pairs, t_pairs = [student[j] for j in chosen], [teacher[j] for j in chosen]
        suffix = "" if kind == "any" else f"_{kind}"
        if kind != "any":
            out[f"eval/entropy_student_on{suffix}"] = float(cat(s_pairs, 1).mean())
            out[f"eval/entropy_teacher{suffix}"] = float(cat(t_pairs, 1).mean())
        out[f"eval/teacher_minus_student_entropy{suffix}"] = float((cat(t_pairs, 1) - cat(s_pairs, 1)).mean())
        out[f"eval/teacher_minus_student_logprob{suffix}"] = float((cat(t_pairs, 0) - cat(s_pairs, 0)).mean())
    shown = [j for j in used if rollouts[j].fields.teacher_context == "demonstration"]
    right = lambda j: rollouts[j].reward >= cfg.sdpo.success_threshold
    sample_gap = lambda j: float((teacher[j][0] - student[j][0]).mean())
    out.update(right_minus_wrong([sample_gap(j) for j in shown if right(j)],
                                 [sample_gap(j) for j in shown if not right(j)]))
    out["eval/teacher_coverage"] = coverage
    return out


def right_minus_wrong(right: list[float], wrong: list[float]) -> dict:
    """eval/teacher_gap_right_minus_wrong: of the samples shown a demonstration, the mean over the right
    ones of each one's per-token teacher-minus-student log-prob, minus the same over the wrong ones,
    and its standard error (the two means' in quadrature); nothing where either has under 2 samples.
    What the teacher knows is this difference: over all the model's own samples the gap is
    -KL(student || teacher) <= 0 for any teacher that differs from the student (docs/loop.md)."""
    if min(len(right), len(wrong)) < 2:
        return {}
    return {"eval/teacher_gap_right_minus_wrong": sum(right) / len(right) - sum(wrong) / len(wrong),
            "eval/teacher_gap_right_minus_wrong_stderr": math.sqrt(stderr(right) ** 2 + stderr(wrong) ** 2)}


def evaluate_only(cfg: Config, model_dir: str, engine, tokenizer, eval_rows: list, logger, d: Dist) -> dict:
    """--eval_only: avg@k on the held-out rows (and, with --teacher_gap, what SDPO's teacher can do)."""
    metrics, seeing = rank0_call(d, lambda: evaluate(engine, tokenizer, eval_rows, cfg, step=0))
    if cfg.blind:
        metrics.update(rank0_call(d, lambda: blind_check(engine, tokenizer, eval_rows, cfg, seeing)))
    if cfg.teacher_gap:
        metrics.update(rank0_call(d, lambda: teacher_gap(engine, tokenizer, eval_rows, cfg)))
        metrics.update(rank0_call(d, lambda: context_entropies(engine, tokenizer, eval_rows, cfg, model_dir, d.device)))
        if d.rank == 0:
            for warning in teacher_gap_warnings(metrics):
                print(f"WARNING: {warning}", file=sys.stderr)
    logger.log(0, metrics)
    return metrics


def blind_check(engine, tokenizer, rows: list, cfg: Config, seeing: list) -> dict:
    """Held-out success with every picture a blank white one of the same size, and the
    seeing-minus-blind gap paired row by row with `seeing` (each row's success with the pictures).
    White, the picture task's empty canvas: a black one scores below a guess (docs/data.md, The
    blind check)."""
    from PIL import Image
    if not any(r.get("images") for r in rows):
        raise ValueError("--blind: the held-out rows have no pictures")
    blank = [dict(r, images=[Image.new("RGB", im.size, "white") for im in r["images"]]) if r.get("images") else r
             for r in rows]
    blind, _ = evaluate(engine, tokenizer, blank, cfg, seeing)
    return {"eval/success_rate_blind": blind["eval/success_rate"], "eval/seeing_minus_blind": -blind["eval/gain"],
            "eval/seeing_minus_blind_stderr": blind["eval/gain_stderr"]}


def teacher_gap_warnings(metrics: dict) -> list[str]:
    """What --eval_only --teacher_gap says about SDPO's prospects, in words: a teacher context
    that does no better than the bare student (by two of its standard errors) gives SDPO
    nothing to teach in the groups that use it, a teacher that likes the model's right answers no
    more than its wrong ones (right minus wrong within noise of 0) cannot tell them apart, and a
    teacher flatter than the student on the student's own tokens raises the policy's entropy
    (measured cases: docs/loop.md)."""
    bare, margin = metrics["eval/success_rate"], 2 * metrics.get("eval/success_stderr", 0.0)
    out = []
    for kind, groups in (("demonstration", "groups with a successful sibling"),
                         ("feedback", "groups where every sample failed")):
        shown = metrics.get(f"eval/success_rate_with_{kind}")
        if shown is not None and shown <= bare + margin:
            out.append(f"the model shown a {kind} solves {shown:.1%} of held-out rows, no better than the bare "
                       f"student's {bare:.1%} (+- {margin:.1%}): SDPO's teacher has nothing to teach in {groups} "
                       f"(docs/LOG.md, 'Near the ceiling'); GRPO or --algo hybrid may do better here.")
    gap, se = metrics.get("eval/teacher_gap_right_minus_wrong"), metrics.get("eval/teacher_gap_right_minus_wrong_stderr")
    if gap is not None and gap <= NOISE_SE * se:
        out.append(f"eval/teacher_gap_right_minus_wrong={gap:+.3f} ± {se:.3f} nats a token: shown a demonstration, "
                   f"the teacher does not tell the model's right answers from its wrong ones (within {NOISE_SE:g} "
                   f"standard errors of 0, or below), so SDPO's distillation moves both alike (docs/results.md, "
                   f"the real pretrained model); GRPO or --algo hybrid may do better here.")
    flatter = metrics.get("eval/teacher_minus_student_entropy")
    if flatter is not None and flatter > 0:
        out.append(f"eval/teacher_minus_student_entropy={flatter:+.3f} nats: the teacher is flatter than the "
                   f"student on its own tokens, so self-distillation will raise the policy's entropy "
                   f"(docs/results.md, the real pretrained model).")
    return out
