"""Test-time self-distillation against best-of-k at equal generations (paper section 5).

    python bench/ttt.py [--prompts 16] [--steps 8] [--n 16] [--out runs/bench-ttt]
                        [--launcher "torchrun --nproc_per_node=4"] [extra run.py flags]

One `run.py --ttt_prompts=...` process: it picks the held-out prompts the starting model
fails (no success in --rollout.eval_k samples; 16 here), and for each, from the same
weights, draws k = steps x n samples (best-of-k) and runs up to `steps` SDPO steps of n
samples on that prompt alone, stopping at the first success. The SDPO settings default to
the paper's test-time column (top-20, reverse KL, EMA 0.01); any run.py flag overrides them.
Prints discovery@k for every k = n, 2n, ... and

    RESULT ttt_discovery=... best_of_k_discovery=... k=...
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_TTT = ["--algo=sdpo", "--sdpo.topk=20", "--sdpo.alpha=1.0", "--sdpo.teacher_rate=0.01"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--out", default="runs/bench-ttt")
    parser.add_argument("--launcher", default=sys.executable, help="e.g. 'torchrun --nproc_per_node=4'")
    args, extra = parser.parse_known_args()
    cmd = shlex.split(args.launcher) + [os.path.join(ROOT, "run.py")] + PAPER_TTT + [
        f"--ttt_prompts={args.prompts}", f"--train.steps={args.steps}", f"--rollout.n={args.n}",
        "--rollout.eval_k=16", f"--log.out_dir={args.out}", "--log.wandb_mode=disabled",
        "--log.progress=False"] + extra  # later flags win
    shutil.rmtree(args.out, ignore_errors=True)  # run.py appends to metrics.jsonl
    os.makedirs(args.out)
    with open(os.path.join(args.out, "stdout.log"), "w") as log:
        done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"run failed ({done.returncode}): {shlex.join(cmd)}; see {args.out}/stdout.log")
    with open(os.path.join(args.out, "metrics.jsonl")) as f:
        summary = [json.loads(line) for line in f][-1]
    ks = sorted(int(key.split("@")[1]) for key in summary if key.startswith("ttt/discovery@"))
    print(f"{summary['ttt/prompts']} prompts the starting model fails; discovery@k:")
    print(f"{'k':>6} {'ttt':>8} {'best-of-k':>10}")
    for k in ks:
        print(f"{k:>6} {summary[f'ttt/discovery@{k}']:>8.3f} {summary[f'best_of_k/discovery@{k}']:>10.3f}")
    k = ks[-1]
    print(f"RESULT ttt_discovery={summary[f'ttt/discovery@{k}']:.3f} "
          f"best_of_k_discovery={summary[f'best_of_k/discovery@{k}']:.3f} k={k}")


if __name__ == "__main__":
    main()
