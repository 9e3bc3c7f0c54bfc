"""Why every objective first loses held-out success on the quiz: held-out success along the
update of a few RL steps, against random directions of the same size.

    python bench/curvature.py [--algo grpo] [--steps 5] [--eval_rows 2048] [--out runs/bench-curvature]
                              [extra run.py flags, e.g. --data.task=strops]

From the warm start W (the tiny model's cached one, or --model.path), runs --steps steps of
--algo and takes their update D = W_after - W. Then evaluates (run.py --eval_only, the same
evaluation seed, so the samples' randomness is shared) W + t*D for t in 0, 0.5, 1, -1; W plus a
random direction with D's norm in every tensor (two draws); and W + D restricted to one group
of tensors (attention, MLP, embeddings, norms). If held-out success falls along D but not along
random directions of its size, the fall is curvature along the gradients' directions, not noise
or a bug in the loop. Prints a table and

    RESULT base=... along_update=... half=... negated=... random=... linear=... quadratic=...

where linear and quadratic fit f(t) = base + linear*t + quadratic*t^2 through t = -1, 0, 1.
"""
import argparse
import os
import re
import shutil
import sys
import time

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning import run_one, warm_start  # noqa: E402

GROUPS = {"attention": r"self_attn", "mlp": r"\.mlp\.", "embeddings": r"embed_tokens|lm_head", "norms": r"norm"}


def write_moved(base: str, out: str, moved_by) -> str:
    """A copy of the HF directory base whose weights are moved_by(name, weight) -> new weight."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out)
    weights = load_file(os.path.join(base, "model.safetensors"))
    save_file({k: moved_by(k, w.float()).to(w.dtype) for k, w in weights.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--eval_rows", type=int, default=2048)
    parser.add_argument("--out", default="runs/bench-curvature")
    args, extra = parser.parse_known_args()
    task_flags = ["--data.task=quiz"] + extra  # later flags win
    start = warm_start(task_flags)
    t0 = time.time()
    trained = os.path.join(args.out, "trained")
    run_one([sys.executable], task_flags + [f"--model.path={start}", f"--algo={args.algo}", f"--train.steps={args.steps}",
                                            "--train.eval_every=0"], trained)
    before = load_file(os.path.join(start, "model.safetensors"))
    after = load_file(os.path.join(trained, "final", "model.safetensors"))
    update = {k: after[k].float() - w.float() for k, w in before.items()}

    def random_direction(seed: int):
        generator = torch.Generator().manual_seed(seed)

        def moved(name, w):
            noise = torch.randn(w.shape, generator=generator)
            return w + noise * (update[name].norm() / noise.norm().clamp_min(1e-30))
        return moved

    variants = {f"t={t:g}": (lambda t: lambda k, w: w + t * update[k])(t) for t in (0, 0.5, 1, -1)}
    variants.update({f"random {seed}": random_direction(seed) for seed in (1, 2)})
    variants.update({f"update on {group} only": (lambda pattern: lambda k, w: w + update[k] * bool(re.search(pattern, k)))(p)
                     for group, p in GROUPS.items()})
    success = {}
    for name, moved in variants.items():
        model = write_moved(start, os.path.join(args.out, "models", re.sub(r"\W+", "_", name)), moved)
        records = run_one([sys.executable], task_flags + [f"--model.path={model}", "--eval_only=True",
                                                          f"--data.eval_rows={args.eval_rows}"],
                          os.path.join(args.out, "evals", re.sub(r"\W+", "_", name)))
        success[name] = next(r for r in records if "eval/success_rate" in r)["eval/success_rate"]
        print(f"{name}: {100 * success[name]:.2f}%", flush=True)
    norm = sum(float(d.norm()) ** 2 for d in update.values()) ** 0.5
    weight_norm = sum(float(w.float().norm()) ** 2 for w in before.values()) ** 0.5
    print(f"\n{args.steps} {args.algo} steps from {start}: update norm {norm:.4g} ({norm / weight_norm:.2e} of the "
          f"weights'), {args.eval_rows} held-out rows, {time.time() - t0:.0f}s\n")
    print("| weights | held-out success |\n|---|---|")
    for name, value in success.items():
        print(f"| {name} | {100 * value:.2f}% |")
    base, plus, minus = success["t=0"], success["t=1"], success["t=-1"]
    print(f"\nRESULT base={base:.4f} along_update={plus:.4f} half={success['t=0.5']:.4f} negated={minus:.4f} "
          f"random={(success['random 1'] + success['random 2']) / 2:.4f} linear={(plus - minus) / 2:.4f} "
          f"quadratic={(plus + minus) / 2 - base:.4f}")


if __name__ == "__main__":
    main()
