"""Step time of SDPO and DPO against GRPO on the default job, same seeds and steps, back to back.

    python bench/step.py [--steps 8] [--algos grpo,sdpo,dpo] [extra run.py flags ...]

Each algorithm runs as its own `run.py` process (the warm start is built once and cached
before any is timed). The first step of each run is dropped as warm-up; the figures are
means of time/*_s over the remaining steps, and each algorithm's step time is divided by
the first's (GRPO). The paper measured SDPO at 1.058x GRPO's step time without a code
environment; the target here is <= 1.10. DPO's reference forward is its own column, outside train.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLIT = ["time/rollout_s", "time/teacher_s", "time/reference_s", "time/train_s", "sync/seconds", "time/step_s"]


def run(algo: str, steps: int, extra: list[str], out_dir: str) -> list[dict]:
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), f"--algo={algo}", f"--train.steps={steps}",
           "--train.eval_every=0", "--log.wandb_mode=disabled", "--log.progress=False",
           f"--log.out_dir={out_dir}"] + extra
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if json.loads(line)["step"] > 0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--algos", default="grpo,sdpo,dpo", help="the first is the baseline of the ratios")
    args, extra = parser.parse_known_args()
    tmp = tempfile.mkdtemp(prefix="bench-step-")
    # Build (or find) the cached warm start outside the timed runs.
    algos = args.algos.split(",")
    run(algos[0], 1, extra, os.path.join(tmp, "prime"))  # builds the tiny model and its warm start, if missing
    means = {}
    for algo in algos:
        records = run(algo, args.steps, extra, os.path.join(tmp, algo))[1:]
        means[algo] = {k: sum(r.get(k, 0.0) for r in records) / len(records) for k in SPLIT}
        means[algo]["tokens/s"] = sum(r["throughput/tokens_per_s"] for r in records) / len(records)
    print(f"{'':>6} " + " ".join(f"{k:>16}" for k in SPLIT + ["tokens/s"]))
    for algo, m in means.items():
        print(f"{algo:>6} " + " ".join(f"{m[k]:16.3f}" for k in SPLIT + ["tokens/s"]))
    base = algos[0]
    ratios = {algo: means[algo]["time/step_s"] / means[base]["time/step_s"] for algo in algos[1:]}
    print("RESULT " + " ".join(f"{algo}_over_{base}_step_time={ratio:.3f}" for algo, ratio in ratios.items()))


if __name__ == "__main__":
    main()
