"""GAD against SeqKD: distilling a black-box teacher's text into the student, several seeds.

    python bench/gad.py [--seeds 3] [--warmup 100] [--steps 200] [--distil data.quiz_ops=*] [--ood data.quiz_ops=+]
                        [--out runs/bench-gad] [extra run.py flags, e.g. --gad.critic_warmup=50]

On the quiz (answers of three lines "a:7+8=15"; the recipe's values, tasks/quiz.py), from the
same student start (the quiz recipe's warm start, ~30% held-out success, or --model.path), at
equal budgets (the same steps, prompts per step and optimizer steps):
  - SeqKD: `--algo sft` on the teacher's responses for --steps steps;
  - GAD: `--algo gad` for --steps steps, the first --warmup of them its SFT warmup on the same
    responses (while the discriminator trains), then --gad.critic_warmup steps of the
    discriminator alone, then GAD;
  - the start itself.
The teacher is the project's self-made black box (run.teacher_model: the tiny model after
--gad.teacher_steps SFT steps on the whole task; warm_start.teacher_data writes its answers to
the distillation prompts, --distil: by default quizzes of products only). As in the paper, the
shifted split is prompts unlike the distillation prompts (--ood: by default quizzes of sums
only, which the start and the teacher learned and distillation never shows). Each final model
is evaluated with one evaluation seed (the start and the teacher once) on the distillation
task's held-out rows and on the shifted split: success (avg@k at the eval temperature), and
how close it is to the teacher: the teacher model's mean per-token negative log-likelihood of
the student's held-out responses (the only use of the teacher's weights: training reads its
text alone).

Writes into --out: gad.md (the table and the GAD runs' d_acc by windows of steps), gad.png,
runs/ (every run's metrics.jsonl), and prints

    RESULT gad_success=... seqkd_success=... gad_ood_success=... seqkd_ood_success=...
           gad_success_spread=... (max - min over seeds) ...
"""
import argparse
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from learning import run_one, warm_start  # noqa: E402
from policy import load_policy  # noqa: E402
from config import recipe_name  # noqa: E402
from warm_start import teacher_data  # noqa: E402

# The quiz: answers of several lines, a teacher (plain SFT for --gad.teacher_steps) far above the
# student (the quiz recipe's warm start, stopped at 30% held-out success)
DEFAULT_FLAGS = ["--data.task=quiz", "--train.prompts_per_step=8", "--rollout.n=8", "--data.eval_rows=512",
                 # GAD after its warmup: 20 steps of the discriminator alone (the paper: 10); raw score
                 # differences as advantages, not std-normalised (a discriminator near chance gives
                 # near-equal scores, which std normalisation blows up to unit advantages: with it, KL
                 # 0.001, the last-token head and the tiny model's rates, one screen's student fell
                 # from 59% to 0.5%, docs/gad.md); KL 0.01
                 "--gad.critic_warmup=20", "--gad.norm_adv_by_std=False", "--algo.kl_coef=0.01"]
WARMUP, STEPS = 100, 200
# The distillation prompts are a part of the task (run.py flags without their "--"): quizzes of
# products only (the start's weakest part); the shifted split is another part, which only the start
# and the teacher learned: sums
DISTIL, OOD = "data.quiz_ops=*", "data.quiz_ops=+"


class Evaluator:
    """One engine for every model (all are the tiny architecture): each model's weights are
    loaded into it and the load is verified (run.sync_engine) before it samples."""

    def __init__(self, model_dir: str, cfg, splits: dict, teacher):
        import torch
        import run
        self.cfg, self.splits, self.teacher, self.d = cfg, splits, teacher, run.Dist(0, 1, torch.device("cpu"))
        self.tokenizer = run.load_tokenizer(model_dir)
        self.engine = run.start_engine(cfg, model_dir, self.tokenizer, [r for rows in splits.values() for r in rows],
                                       self.d)

    def __call__(self, model_dir: str, seed: int) -> dict:
        """Held-out success of model_dir's samples on each split ("in": the task's held-out rows,
        "ood": the shifted ones) and the teacher's NLL of its in-distribution samples (per token)."""
        import run
        self.loads = getattr(self, "loads", 0) + 1  # the weights' version, as the engine stamps samples
        run.sync_engine(self.cfg, self.engine, load_policy(model_dir, self.cfg, 1, self.d.device), self.tokenizer,
                        self.d, self.loads)
        rollouts = {split: run.generate_and_score(self.engine, self.tokenizer, rows, self.cfg, seed,
                                                  self.cfg.rollout.eval_k, self.cfg.rollout.eval_temperature)
                    for split, rows in self.splits.items()}
        return {"success": run.success_rate(rollouts["in"], self.cfg),
                "ood_success": run.success_rate(rollouts["ood"], self.cfg),
                "teacher_nll": teacher_nll(self.teacher, rollouts["in"], self.cfg),
                "length": sum(len(r.response_ids) for r in rollouts["in"]) / len(rollouts["in"])}


def teacher_nll(teacher, rollouts: list, cfg) -> float:
    """−(Σ log p_teacher(token)) / tokens over the responses' text, tokenised by the teacher
    (a finished response ends with the teacher's EOS), at temperature 1."""
    import torch
    import data
    import microbatch
    import packing
    import chunked_head
    model, tokenizer = teacher
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rollouts), 32):
            part = rollouts[i:i + 32]
            prompts = [data.chat_prompt_ids(tokenizer, r.row["messages"], cfg.data.max_prompt_len) for r in part]
            responses = [tokenizer(r.text, add_special_tokens=False)["input_ids"] +
                         ([] if r.truncated else [tokenizer.eos_token_id]) for r in part]
            keep = [j for j, resp in enumerate(responses) if resp]
            packed = packing.pack([prompts[j] + responses[j] for j in keep], [len(responses[j]) for j in keep],
                               tokenizer.pad_token_id, "cpu")
            logprobs = microbatch.forward(model, packed, lambda h, w: chunked_head.logprobs_and_entropy_from_hidden(
                h, w, packed.targets)[0])
            total -= logprobs.sum().item()
            tokens += logprobs.numel()
    return total / max(tokens, 1)


def spread(values: list[float]) -> tuple[float, float, float]:
    return sum(values) / len(values), min(values), max(values)


def d_acc_table(runs: list[list[dict]], window: int) -> str:
    """Each GAD run's held-out d_acc (pairs whose texts differ), share of identical pairs and
    training success, averaged over windows of steps, and the stage each window ended in."""
    seeds = " | ".join(f"seed {s}: d_acc, identical, success" for s in range(len(runs)))
    rows = [f"| steps | {seeds} | stage |",
            "|---|" + "---|" * len(runs) + "---|"]
    stages = ("warmup", "critic", "gad")
    for lo in range(1, max((r["step"] for r in runs[0]), default=0) + 1, window):
        cells, stage = [], ""
        for records in runs:
            part = [r for r in records if lo <= r["step"] < lo + window and "gad/identical_frac" in r]
            values = lambda key: [r[key] for r in part if key in r]  # no d_acc where every pair was identical
            cells.append(", ".join(f"{sum(values(key)) / len(values(key)):.2f}" if values(key) else "nan"
                                   for key in ("gad/d_acc", "gad/identical_frac", "reward/success_rate")))
            stage = stages[int(part[-1]["gad/stage"])] if part else stage
        rows.append(f"| {lo}-{lo + window - 1} | " + " | ".join(cells) + f" | {stage} |")
    return "\n".join(rows)


def plot(path: str, results: dict):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    names = list(results)
    for ax, key, label in zip(axes, ("success", "ood_success", "teacher_nll"),
                              ("held-out success (avg@k)", "shifted split success (avg@k)",
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
    parser.add_argument("--warmup", type=int, default=WARMUP, help="SFT warmup steps of GAD (counted in its budget)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps of every run, warmup included")
    parser.add_argument("--distil", default=DISTIL,
                        help="run.py flags, without their '--', of the distillation prompts")
    parser.add_argument("--ood", default=OOD, help="run.py flags, without their '--', of the shifted split")
    parser.add_argument("--out", default="runs/bench-gad")
    parser.add_argument("--launcher", default=sys.executable, help="e.g. 'torchrun --nproc_per_node=4'")
    args, extra = parser.parse_known_args()
    import torch
    import run
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    extra = DEFAULT_FLAGS + extra  # later flags win: the user's override the bench's
    d = run.Dist(0, 1, torch.device("cpu"))
    start = warm_start(extra)  # the student and the teacher learn the whole task; distillation sees --distil's part
    teacher_cfg, teacher_dir = run.teacher_model(run.parse_config(extra + ["--log.progress=False"]), d)
    distil = [f"--{f}" for f in shlex.split(args.distil)]
    cfg = teacher_data(run.parse_config(extra + distil + ["--algo=gad", "--log.progress=False"]), teacher_cfg,
                       teacher_dir, d)
    data_flags = [f"--data.task={cfg.data.task}", f"--data.eval_path={cfg.data.eval_path}",
                  f"--data.reward={cfg.data.reward}"]
    # the runs read the teacher's data file: they take the task's recipe (tasks/quiz.py) by name
    recipe = f"--recipe={recipe_name(run.parse_config(extra))}"
    common = extra + data_flags + [recipe, f"--model.path={start}", f"--train.steps={args.steps}",
                                   "--train.eval_every=0",
                                   "--train.warm_start_demo_frac=0", "--train.warm_start_feedback_frac=0",
                                   "--train.warm_start_context_steps=0"]
    runs = {"seqkd": ["--algo=sft"], "gad": ["--algo=gad", f"--gad.warmup_steps={args.warmup}"]}
    splits = {"in": run.load_data(cfg)[1],
              "ood": run.load_data(run.parse_config(extra + [f"--{f}" for f in shlex.split(args.ood)]))[1]}
    teacher = (load_policy(teacher_dir, cfg, 1, d.device), run.load_tokenizer(teacher_dir))
    teacher[0].eval()
    evaluate = Evaluator(start, run.parse_config(common), splits, teacher)
    results, diagnostics = {"start": [evaluate(start, 0)], "seqkd": [], "gad": []}, []
    print(f"start: {results['start'][0]}", flush=True)
    for seed in range(args.seeds):
        for name, flags in runs.items():
            t0 = time.time()
            out = os.path.join(args.out, "runs", f"{name}-seed{seed}")
            records = run_one(shlex.split(args.launcher), common + flags + [f"--train.seed={seed}"], out)
            results[name].append(evaluate(os.path.join(out, "final"), 0))
            if name == "gad":
                diagnostics.append(records)
            print(f"seed {seed} {name}: {results[name][-1]} ({time.time() - t0:.0f}s)", flush=True)
    results["teacher"] = [evaluate(teacher_dir, 0)]
    evaluate.engine.close()
    plot(os.path.join(args.out, "gad.png"), results)
    keys = ("success", "ood_success", "teacher_nll", "length")
    table = ["| model | held-out success | shifted split success | teacher NLL (nats/token) | response length |",
             "|---|---|---|---|---|"]
    for name, rs in results.items():
        cells = [spread([r[k] for r in rs]) for k in keys]
        table.append(f"| {name} | " + " | ".join(f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in cells) + " |")
    d_acc = d_acc_table(diagnostics, max(1, args.steps // 10))
    mean = lambda name, key: spread([r[key] for r in results[name]])[0]
    width = lambda name, key: (lambda _, lo, hi: hi - lo)(*spread([r[key] for r in results[name]]))
    result = "RESULT " + " ".join(
        [f"{name}_{key}={mean(name, key):.3f}" for key in ("success", "ood_success") for name in ("gad", "seqkd")]
        + [f"gad_{key}_spread={width('gad', key):.3f}" for key in ("success", "ood_success")]
        + [f"{name}_teacher_nll={mean(name, 'teacher_nll'):.3f}" for name in ("gad", "seqkd")]
        + [f"{name}_{key}={mean(name, key):.3f}" for name in ("start", "teacher")
           for key in ("success", "ood_success")])
    with open(os.path.join(args.out, "gad.md"), "w") as f:
        cache = os.environ.get("SDPO_CACHE", os.path.expanduser("~/.cache/sdpo"))  # no machine paths in results
        flags = shlex.join(common).replace(cache, "$SDPO_CACHE")
        f.write(f"flags: {flags}; GAD warmup {args.warmup} of {args.steps} steps; distillation prompts: "
                f"{args.distil}; shifted split: {args.ood}\n\n")
        f.write("\n".join(table) + "\n\nGAD runs:\n\n" + d_acc + f"\n\n{result}\n")
    print("\n".join(table))
    print(f"total {time.time() - t_start:.0f}s")
    print(result)


if __name__ == "__main__":
    main()
