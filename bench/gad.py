"""GAD against SeqKD: distilling a black-box teacher's text into the student, several seeds.

    python bench/gad.py [--seeds 3] [--warmup 10] [--steps 30] [--out runs/bench-gad]
                        [extra run.py flags, e.g. --gad.teacher_steps=1000 --train.prompts_per_step=16]

From the same student start (the tiny model's cached warm start, or --model.path), at equal
budgets (the same steps, prompts per step and optimizer steps):
  - SeqKD: `--algo sft` on the teacher's responses for --steps steps;
  - GAD: `--algo gad` for --steps steps, the first --warmup of them its SFT warmup on the same
    responses (while the discriminator trains);
  - the start itself.
The teacher is the project's self-made black box (run.teacher_model: a much longer SFT of the
tiny model; run.with_teacher_data writes its sampled text). Each final model is evaluated on
the task's held-out rows with one evaluation seed (the start and the teacher once): success
(avg@k at the eval temperature) and how close it is to the teacher, the teacher model's mean per-token negative log-likelihood of the student's held-out
responses (the only use of the teacher's weights: training reads its text alone).

Writes into --out: gad.md (the table and the GAD runs' d_acc / reward diagnostics), gad.png,
runs/ (every run's metrics.jsonl), and prints

    RESULT gad_success=... seqkd_success=... gad_teacher_nll=... seqkd_teacher_nll=...
"""
import argparse
import json
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from learning import run_one, warm_start  # noqa: E402


class Evaluator:
    """One engine for every model (all are the tiny architecture): each model's weights are
    loaded into it and the load is verified (run.sync_engine) before it samples."""

    def __init__(self, model_dir: str, cfg, rows: list, teacher):
        import torch
        import run
        from policy import load_policy
        self.cfg, self.rows, self.teacher, self.d = cfg, rows, teacher, run.Dist(0, 1, torch.device("cpu"))
        self.tokenizer = run.load_tokenizer(model_dir)
        self.engine = run.start_engine(cfg, model_dir, self.tokenizer, rows, self.d)

    def __call__(self, model_dir: str, seed: int) -> dict:
        """Held-out success of model_dir's samples and the teacher's NLL of them (per token)."""
        import run
        self.loads = getattr(self, "loads", 0) + 1  # the weights' version, as the engine stamps samples
        run.sync_engine(self.cfg, self.engine, load_policy(model_dir, self.cfg, 1, self.d.device), self.tokenizer,
                        self.d, self.loads)
        rollouts = run.generate_and_score(self.engine, self.tokenizer, self.rows, self.cfg, seed, self.cfg.rollout.eval_k,
                                          self.cfg.rollout.eval_temperature)
        return {"success": run.success_rate(rollouts, self.cfg),
                "teacher_nll": teacher_nll(self.teacher, rollouts, self.cfg),
                "length": sum(len(r.response_ids) for r in rollouts) / len(rollouts)}


def teacher_nll(teacher, rollouts: list, cfg) -> float:
    """−(Σ log p_teacher(token)) / tokens over the responses' text, tokenised by the teacher
    (a finished response ends with the teacher's EOS), at temperature 1."""
    import torch
    import data
    import losses
    import objectives
    model, tokenizer = teacher
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rollouts), 32):
            part = rollouts[i:i + 32]
            prompts = [data.chat_prompt_ids(tokenizer, r.row["messages"], cfg.data.max_prompt_len) for r in part]
            responses = [tokenizer(r.text, add_special_tokens=False)["input_ids"] +
                         ([] if r.truncated else [tokenizer.eos_token_id]) for r in part]
            keep = [j for j, resp in enumerate(responses) if resp]
            packed = data.pack([prompts[j] + responses[j] for j in keep], [len(responses[j]) for j in keep],
                               tokenizer.pad_token_id, "cpu")
            logprobs = objectives.forward(model, packed, lambda h, w: losses.logprobs_and_entropy_from_hidden(
                h, w, packed.targets)[0])
            total -= logprobs.sum().item()
            tokens += logprobs.numel()
    return total / max(tokens, 1)


def spread(values: list[float]) -> tuple[float, float, float]:
    return sum(values) / len(values), min(values), max(values)


def plot(path: str, results: dict):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    names = list(results)
    for ax, key, label in zip(axes, ("success", "teacher_nll"), ("held-out success (avg@k)",
                                                                  "teacher NLL of student responses (nats/token)")):
        stats = [spread([r[key] for r in results[n]]) for n in names]
        ax.bar(names, [m for m, _, _ in stats], yerr=[[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]],
               capsize=4, color=["grey", "tab:blue", "tab:orange", "black"][:len(names)])
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("mean and min-max over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5, help="SFT warmup steps of GAD (counted in its budget)")
    parser.add_argument("--steps", type=int, default=20, help="steps of every run, warmup included")
    parser.add_argument("--out", default="runs/bench-gad")
    parser.add_argument("--launcher", default=sys.executable, help="e.g. 'torchrun --nproc_per_node=4'")
    args, extra = parser.parse_known_args()
    import torch
    import run
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    d = run.Dist(0, 1, torch.device("cpu"))
    start = warm_start(extra)
    cfg = run.with_teacher_data(run.parse_config(extra + ["--algo=gad", "--log.progress=False"]), d)
    _, teacher_dir = run.teacher_model(run.parse_config(extra + ["--log.progress=False"]), d)
    data_flags = [f"--data.task={cfg.data.task}", f"--data.eval_path={cfg.data.eval_path}",
                  f"--data.reward={cfg.data.reward}"]
    common = extra + data_flags + [f"--model.path={start}", f"--train.steps={args.steps}", "--train.eval_every=0",
                                   "--train.warm_start_demo_frac=0", "--train.warm_start_feedback_frac=0"]
    runs = {"seqkd": ["--algo=sft"], "gad": ["--algo=gad", f"--gad.warmup_steps={args.warmup}"]}
    eval_rows = run.load_data(cfg)[1]
    teacher = (load_policy(teacher_dir, cfg, 1, d.device), run.load_tokenizer(teacher_dir))
    teacher[0].eval()
    evaluate = Evaluator(start, run.parse_config(common), eval_rows, teacher)
    results, diagnostics = {"start": [evaluate(start, 0)], "seqkd": [], "gad": []}, []
    for seed in range(args.seeds):
        for name, flags in runs.items():
            t0 = time.time()
            out = os.path.join(args.out, "runs", f"{name}-seed{seed}")
            records = run_one(shlex.split(args.launcher), common + flags + [f"--train.seed={seed}"], out)
            results[name].append(evaluate(os.path.join(out, "final"), 0))
            if name == "gad":
                diagnostics.append([{k: r[k] for k in ("step", "gad/d_acc", "gad/d_loss", "gad/teacher_score",
                                                       "gad/student_score", "actor/kl") if k in r} for r in records])
            print(f"seed {seed} {name}: {results[name][-1]} ({time.time() - t0:.0f}s)", flush=True)
    results["teacher"] = [evaluate(teacher_dir, 0)]
    evaluate.engine.close()
    plot(os.path.join(args.out, "gad.png"), results)
    table = ["| model | held-out success | teacher NLL (nats/token) | response length |", "|---|---|---|---|"]
    for name, rs in results.items():
        cells = [spread([r[k] for r in rs]) for k in ("success", "teacher_nll", "length")]
        table.append(f"| {name} | " + " | ".join(f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in cells) + " |")
    d_acc = ["| step | " + " | ".join(f"seed {s}" for s in range(len(diagnostics))) + " |",
             "|---|" + "---|" * len(diagnostics)]
    for i, record in enumerate(diagnostics[0] if diagnostics else []):
        if "gad/d_acc" in record:
            d_acc.append(f"| {record['step']} | " + " | ".join(
                f"d_acc {runs_[i].get('gad/d_acc', float('nan')):.2f}, D(t)-D(s) "
                f"{runs_[i].get('gad/teacher_score', 0) - runs_[i].get('gad/student_score', 0):.2f}"
                for runs_ in diagnostics) + " |")
    mean = lambda name, key: spread([r[key] for r in results[name]])[0]
    result = (f"RESULT gad_success={mean('gad', 'success'):.3f} seqkd_success={mean('seqkd', 'success'):.3f} "
              f"gad_teacher_nll={mean('gad', 'teacher_nll'):.3f} seqkd_teacher_nll={mean('seqkd', 'teacher_nll'):.3f} "
              f"start_success={mean('start', 'success'):.3f} start_teacher_nll={mean('start', 'teacher_nll'):.3f} "
              f"teacher_success={mean('teacher', 'success'):.3f}")
    with open(os.path.join(args.out, "gad.md"), "w") as f:
        f.write(f"flags: {shlex.join(common)}; GAD warmup {args.warmup} of {args.steps} steps\n\n")
        f.write("\n".join(table) + "\n\nGAD runs, per step:\n\n" + "\n".join(d_acc) + f"\n\n{result}\n")
    print("\n".join(table))
    print(f"total {time.time() - t_start:.0f}s")
    print(result)


if __name__ == "__main__":
    main()
