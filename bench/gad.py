"""GAD against SeqKD and a constant-reward control: distilling a black-box teacher's text, several seeds.

    python bench/gad.py [--testbed manners|quiz] [--seeds 3] [--warmup W] [--steps S] [--distil ...] [--ood ...]
                        [--out runs/bench-gad] [extra run.py flags, e.g. --gad.critic_warmup=50]

Two testbeds (docs/gad.md says what each tests):
  - manners (the default): quizzes whose teacher answers every line in one of two manners chosen
    per answer ("a) 7*8 = 56" or "(a) 7*8 is 56."), the checker accepting either but not a blend
    (tasks/manners.py); the student's start learned the same quizzes in the same two manners
    drawn per line, so it blends them and its text differs from the teacher's in coherence;
  - quiz: answers of three lines "a:7+8=15" (tasks/quiz.py), where teacher and student differ
    only in being right.
From the same student start (the task's warm start, or --model.path), at equal budgets (the
same steps, prompts per step and optimizer steps):
  - SeqKD: `--algo sft` on the teacher's responses for --steps steps;
  - GAD: `--algo gad` for --steps steps, the first --warmup of them its SFT warmup on the same
    responses (while the discriminator trains), then --gad.critic_warmup steps of the
    discriminator alone, then GAD;
  - control: the same GAD run with `--gad.reward=constant` (every reward 0: the same stages, SFT
    and KL to the start, no signal from the discriminator), which says what the discriminator added;
  - the start itself.
The teacher is the project's self-made black box (run.teacher_model: the tiny model after
--gad.teacher_steps SFT steps on the whole task; warm_start.teacher_data writes its answers to
the distillation prompts, --distil: by default quizzes of products only). As in the paper, the
shifted split is prompts unlike the distillation prompts (--ood: by default quizzes of sums
only, which the start and the teacher learned and distillation never shows). Each final model
is evaluated with one evaluation seed (the start and the teacher once) on the distillation
task's held-out rows and on the shifted split: success (avg@k at the eval temperature), the blend
rate (manners: samples whose lines are in two or more manners), and how close it is to the teacher:
the teacher model's mean per-token negative log-likelihood of the student's held-out responses
(the only use of the teacher's weights: training reads its text alone).

Writes into --out: gad.md (the table, d_acc by stage, the GAD runs' d_acc by windows of steps),
gad.png, runs/ (every run's metrics.jsonl), and prints

    RESULT gad_success=m±h seqkd_success=... gad_ood_success=... seqkd_ood_success=...
           control_success=... control_ood_success=... gad_d_acc_end_warmup=... ...

m the mean over seeds, h half the range (max - min) / 2; gad_d_acc_end_warmup is the
discriminator's held-out accuracy over the last tenth of the warmup's steps (at least 5).
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
from flags import recipe_name  # noqa: E402
from warm_start import teacher_data  # noqa: E402
from tasks.manners import is_blend  # noqa: E402  (lines in two or more manners; on the quiz every line is plain)

# Each testbed: the bench's run.py flags, the student start's own, the distillation prompts and the
# shifted split (run.py flags without their "--"), GAD's warmup and every run's steps.
# GAD after its warmup: --gad.critic_warmup steps of the discriminator alone (the paper: 10); raw score
# differences as advantages, not std-normalised (a discriminator near chance gives near-equal scores,
# which std normalisation blows up to unit advantages: with it, KL 0.001, the last-token head and the
# tiny model's rates, one screen's student fell from 59% to 0.5% on the quiz, docs/gad.md); KL 0.01
COMMON_FLAGS = ["--train.prompts_per_step=8", "--rollout.n=8", "--data.eval_rows=512", "--gad.norm_adv_by_std=False",
                "--algo.kl_coef=0.01"]
TESTBEDS = {
    # the teacher answers in one of two manners per answer (tasks/manners.py); the start learned the same
    # two manners drawn per line, so it blends (held-out rows 256 and 100 steps: 3 seeds within an hour
    # on the 2-core machine; a start in a third, plain manner learned nothing in 100 steps). A 10-step
    # warmup: after 50 SFT steps the student no longer blends and the discriminator has nothing to see
    # (docs/gad.md, the manners testbed)
    "manners": dict(flags=["--data.task=manners", "--gad.critic_warmup=10", *COMMON_FLAGS, "--data.eval_rows=256"],
                    start=["--data.manner_per=line"], distil="data.quiz_ops=*", ood="data.quiz_ops=+",
                    warmup=10, steps=100),
    # the quiz: a teacher (plain SFT for --gad.teacher_steps) far above the student (the quiz recipe's
    # warm start, stopped at 30% held-out success); distillation sees products, the shifted split is sums
    "quiz": dict(flags=["--data.task=quiz", "--gad.critic_warmup=20", *COMMON_FLAGS], start=[],
                 distil="data.quiz_ops=*", ood="data.quiz_ops=+", warmup=100, steps=200),
}


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
        blend = lambda split: sum(map(is_blend, (r.text for r in rollouts[split]))) / len(rollouts[split])
        return {"success": run.success_rate(rollouts["in"], self.cfg),
                "ood_success": run.success_rate(rollouts["ood"], self.cfg),
                "blend": blend("in"), "ood_blend": blend("ood"),
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


STAGES = ("warmup", "critic", "gad")


def end_of_warmup(records: list[dict], warmup: int) -> list[dict]:
    """The records of the warmup's last tenth of steps (at least 5): where its d_acc is read."""
    last = max(5, warmup // 10)
    return [r for r in records if warmup - last < r["step"] <= warmup and "gad/stage" in r]


def d_acc_by_stage(runs: dict, warmup: int) -> str:
    """Each GAD-type run's held-out d_acc (pairs whose texts differ) and share of identical pairs,
    averaged over each stage and over the warmup's end."""
    mean = lambda part, key: (lambda v: f"{sum(v) / len(v):.2f}" if v else "nan")([r[key] for r in part if key in r])
    rows = ["| run | warmup | end of warmup | critic | gad |", "|---|---|---|---|---|"]
    for name, records in runs.items():
        parts = [[r for r in records if r.get("gad/stage") == STAGES.index(s)] for s in STAGES]
        parts.insert(1, end_of_warmup(records, warmup))
        rows.append(f"| {name} | " + " | ".join(f"{mean(p, 'gad/d_acc')} ({mean(p, 'gad/identical_frac')})"
                                                for p in parts) + " |")
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
               capsize=4, color=["grey", "tab:blue", "tab:orange", "tab:green", "black"][:len(names)])
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("mean and min-max over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--testbed", choices=sorted(TESTBEDS), default="manners")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--warmup", type=int, help="SFT warmup steps of GAD, counted in its budget (default: the "
                        + ", ".join(f"{k}'s {v['warmup']}" for k, v in TESTBEDS.items()) + ")")
    parser.add_argument("--steps", type=int, help="steps of every run, warmup included (default: the "
                        + ", ".join(f"{k}'s {v['steps']}" for k, v in TESTBEDS.items()) + ")")
    parser.add_argument("--distil", help="run.py flags, without their '--', of the distillation prompts "
                                         "(default: the testbed's, products only)")
    parser.add_argument("--ood", help="run.py flags, without their '--', of the shifted split (default: sums only)")
    parser.add_argument("--out", default="runs/bench-gad")
    parser.add_argument("--launcher", default=sys.executable, help="e.g. 'torchrun --nproc_per_node=4'")
    args, extra = parser.parse_known_args()
    bed = TESTBEDS[args.testbed]
    for key in ("warmup", "steps", "distil", "ood"):
        if getattr(args, key) is None:
            setattr(args, key, bed[key])
    import torch
    import run
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    extra = bed["flags"] + extra  # later flags win: the user's override the bench's
    d = run.Dist(0, 1, torch.device("cpu"))
    # the student and the teacher learn the whole task (the student in its own manner where the
    # testbed says); distillation sees --distil's part
    start = warm_start(extra + bed["start"])
    teacher_cfg, teacher_dir = run.teacher_model(run.parse_config(extra + ["--log.progress=False"]), d)
    distil = [f"--{f}" for f in shlex.split(args.distil)]
    cfg = teacher_data(run.parse_config(extra + distil + ["--algo=gad", "--log.progress=False"]), teacher_cfg,
                       teacher_dir, d)
    data_flags = [f"--data.task={cfg.data.task}", f"--data.eval_path={cfg.data.eval_path}",
                  f"--data.reward={cfg.data.reward}"]
    # the runs read the teacher's data file: they take the task's recipe (tasks/<task>.py) by name
    recipe = f"--recipe={recipe_name(run.parse_config(extra))}"
    common = extra + data_flags + [recipe, f"--model.path={start}", f"--train.steps={args.steps}",
                                   "--train.eval_every=0",
                                   "--train.warm_start_demo_frac=0", "--train.warm_start_feedback_frac=0",
                                   "--train.warm_start_context_steps=0"]
    gad = ["--algo=gad", f"--gad.warmup_steps={args.warmup}"]
    runs = {"seqkd": ["--algo=sft"], "gad": gad, "control": gad + ["--gad.reward=constant"]}
    splits = {"in": run.load_data(cfg)[1],
              "ood": run.load_data(run.parse_config(extra + [f"--{f}" for f in shlex.split(args.ood)]))[1]}
    teacher = (load_policy(teacher_dir, cfg, 1, d.device), run.load_tokenizer(teacher_dir))
    teacher[0].eval()
    evaluate = Evaluator(start, run.parse_config(common), splits, teacher)
    results = {"start": [evaluate(start, 0)], **{name: [] for name in runs}}
    records = {name: [] for name in runs}
    print(f"start: {results['start'][0]}", flush=True)
    for seed in range(args.seeds):
        for name, flags in runs.items():
            t0 = time.time()
            out = os.path.join(args.out, "runs", f"{name}-seed{seed}")
            records[name].append(run_one(shlex.split(args.launcher), common + flags + [f"--train.seed={seed}"], out))
            results[name].append(evaluate(os.path.join(out, "final"), 0))
            print(f"seed {seed} {name}: {results[name][-1]} ({time.time() - t0:.0f}s)", flush=True)
    results["teacher"] = [evaluate(teacher_dir, 0)]
    evaluate.engine.close()
    plot(os.path.join(args.out, "gad.png"), results)
    keys = ("success", "ood_success", "blend", "ood_blend", "teacher_nll", "length")
    table = ["| model | held-out success | shifted split success | blend rate (held-out) | blend rate (shifted) "
             "| teacher NLL (nats/token) | response length |", "|---|---|---|---|---|---|---|"]
    for name, rs in results.items():
        cells = [spread([r[k] for r in rs]) for k in keys]
        table.append(f"| {name} | " + " | ".join(f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in cells) + " |")
    d_acc = d_acc_table(records["gad"], max(1, args.steps // 10))
    stage_runs = {f"{name} seed {seed}": rs for name in ("gad", "control") for seed, rs in enumerate(records[name])}
    by_stage = d_acc_by_stage(stage_runs, args.warmup)
    end_warmup = [sum(v) / len(v) for v in ([r["gad/d_acc"] for r in end_of_warmup(rs, args.warmup) if "gad/d_acc" in r]
                                            for rs in records["gad"]) if v]
    results["gad_d_acc"] = [{"end_warmup": v} for v in end_warmup] or [{"end_warmup": float("nan")}]
    stat = lambda name, key: spread([r[key] for r in results[name]])
    pm = lambda name, key: (lambda m, lo, hi: f"{m:.3f}±{(hi - lo) / 2:.3f}")(*stat(name, key))
    result = "RESULT " + " ".join(
        [f"{name}_{key}={pm(name, key)}" for key in ("success", "ood_success") for name in ("gad", "seqkd", "control")]
        + [f"gad_d_acc_end_warmup={pm('gad_d_acc', 'end_warmup')}"]
        + [f"{name}_{key}={pm(name, key)}" for key in ("blend", "ood_blend", "teacher_nll")
           for name in ("gad", "seqkd", "control")]
        + [f"{name}_{key}={pm(name, key)}" for name in ("start", "teacher") for key in ("success", "ood_success")])
    # the issue's bar: d_acc >= 0.75 at the end of warmup, and GAD's range above both others' on a split
    above = lambda key: all(stat("gad", key)[1] > stat(other, key)[2] for other in ("seqkd", "control"))
    verdict = (f"done-when: d_acc at the end of warmup >= 0.75: {stat('gad_d_acc', 'end_warmup')[0] >= 0.75}; "
               f"GAD's every seed above every seed of SeqKD and the control, held-out: {above('success')}, "
               f"shifted: {above('ood_success')}")
    with open(os.path.join(args.out, "gad.md"), "w") as f:
        cache = os.environ.get("SDPO_CACHE", os.path.expanduser("~/.cache/sdpo"))  # no machine paths in results
        flags = shlex.join(common).replace(cache, "$SDPO_CACHE")
        f.write(f"testbed {args.testbed}; flags: {flags}; the start's own: {shlex.join(bed['start'])}; GAD warmup "
                f"{args.warmup} of {args.steps} steps; distillation prompts: {args.distil}; shifted split: {args.ood}"
                f"\n\n")
        f.write("\n".join(table) + "\n\nd_acc (identical pairs) by stage:\n\n" + by_stage
                + "\n\nGAD runs:\n\n" + d_acc + f"\n\n{result}\n\n{verdict}\n")
    print("\n".join(table))
    print(by_stage)
    print(f"total {time.time() - t_start:.0f}s")
    print(verdict)
    print(result)


if __name__ == "__main__":
    main()
