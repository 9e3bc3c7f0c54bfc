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
import shlex
import sys

from learning import run_one  # the same run.py process, log and error handling as bench/learning.py

PAPER_TTT = ["--algo=sdpo", "--sdpo.topk=20", "--sdpo.alpha=1.0", "--sdpo.teacher_rate=0.01"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--out", default="runs/bench-ttt")
    parser.add_argument("--launcher", default=sys.executable, help="e.g. 'torchrun --nproc_per_node=4'")
    args, extra = parser.parse_known_args()
    flags = PAPER_TTT + [f"--ttt_prompts={args.prompts}", f"--train.steps={args.steps}", f"--rollout.n={args.n}",
                         "--rollout.eval_k=16", "--data.eval_rows=256"] + extra  # later flags win
    summary = run_one(shlex.split(args.launcher), flags, args.out)[-1]
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
