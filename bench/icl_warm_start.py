"""The paper's explanation tested: SDPO needs a model that learns in context. SmolLM2-135M-Instruct
given a short SFT warm start that shows it a demonstration (or feedback) before most answers, as
the tiny model's warm start does, then GRPO vs SDPO vs the λ-hybrid from that start.

    python bench/icl_warm_start.py [--sft_steps 30] [--sft_batch 16] [--sft_lr 2e-5] [--demo_frac 0.7]
                                   [--feedback_frac 0.1] [--seeds 0,1] [--algos grpo,sdpo_demo,hybrid]
                                   [--out runs/bench-icl-warm-start] [bench/real_model.py's flags]
                                   [run.py flags for the RL runs, e.g. the paper's layout below]

1. The warm start: `run.py --algo sft` on bench/real_model.py's training split (the word problems'
   worked solutions, "a + b = c\\nAnswer: c", are the targets), `--sft_steps` steps of
   `--sft_batch` rows at `--sft_lr` (constant after 2 warm-up steps, one AdamW step a batch),
   each target shown after SDPO's teacher prompt with the row's own solution as the
   demonstration for `--demo_frac` of the rows and after the feedback on a plausible wrong
   attempt for `--feedback_frac` (warm_start.sft_rollouts, the tiny model's mix), the bare prompt
   for the rest. Written to <out>/sft/final (kept: a second run reads it).
2. Before and after it, `--eval_only --teacher_gap` on `--teacher_gap_rows` held-out rows: success
   bare, shown the row's worked solution, shown a wrong attempt's feedback; and right minus wrong,
   the teacher's log-prob of the model's own right samples minus its wrong ones, per token, with
   its standard error (evaluate.right_minus_wrong).
3. bench/real_model.py's runs (`--algos`, `--seeds`) from the warm start, every run paired with the
   first's step-0 evaluation of the warm-started model.

Prints real_model.py's table and RESULT lines, then

    RESULT icl_warm_start demo_gap_before=... demo_gap_after=... right_minus_wrong_before=...
           right_minus_wrong_after=... grpo_gain=... sdpo_gain=... hybrid_gain=... sdpo_minus_grpo=... se=...

(demo_gap: success shown a demonstration minus bare; the gains and SDPO minus GRPO over the seeds,
paired per seed, SEs in quadrature / seeds). The paper's layout, as bench/results/real_model.md:

    python bench/icl_warm_start.py --seeds 0,1 --train.mini_batches=1 --train.micro_batch=8 \\
        --optim.lr=1e-5 --optim.warmup_steps=2
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import real_model  # noqa: E402  (bench/ is not a package)
import smollm2  # noqa: E402
import word_problems  # noqa: E402


def warm_start(common: list[str], args, out: str) -> str:
    """<out>/sft/final: the SFT warm start (run.py --algo sft, warm_start.sft_rollouts' mix), built once."""
    final = os.path.join(out, "sft", "final")
    if not os.path.exists(os.path.join(final, "config.json")):
        real_model.run_monitored(
            common + ["--algo=sft", f"--train.steps={args.sft_steps}", f"--train.prompts_per_step={args.sft_batch}",
                      f"--optim.lr={args.sft_lr}", "--optim.warmup_steps=2", "--train.mini_batches=1",
                      "--train.micro_batch=8", "--train.eval_every=0", f"--train.warm_start_demo_frac={args.demo_frac}",
                      f"--train.warm_start_feedback_frac={args.feedback_frac}"],
            os.path.join(out, "sft"))
    return final


def gap_fields(gap: dict, when: str) -> str:
    value = lambda key: gap.get(f"eval/{key}", float("nan"))
    return (f"demo_gap_{when}={value('success_rate_with_demonstration') - value('success_rate'):+.3f} "
            f"feedback_gap_{when}={value('success_rate_with_feedback') - value('success_rate'):+.3f} "
            f"right_minus_wrong_{when}={value('teacher_gap_right_minus_wrong'):+.3f} "
            f"right_minus_wrong_{when}_se={value('teacher_gap_right_minus_wrong_stderr'):.3f}")


def main():
    parser = real_model.bench_parser(__doc__)
    parser.set_defaults(out="runs/bench-icl-warm-start", seeds="0,1", teacher_gap_rows=100)
    parser.add_argument("--sft_steps", type=int, default=30)
    parser.add_argument("--sft_batch", type=int, default=16, help="rows per SFT step")
    parser.add_argument("--sft_lr", type=float, default=2e-5)
    parser.add_argument("--demo_frac", type=float, default=0.7, help="share of SFT prompts shown their solution")
    parser.add_argument("--feedback_frac", type=float, default=0.1, help="share shown a wrong attempt's feedback")
    args, extra = parser.parse_known_args()
    out, t_start = os.path.abspath(args.out), time.time()
    model = args.model or smollm2.smollm2_dir()
    files = word_problems.write(os.path.join(out, "data"), args.train_rows, test_rows=args.eval_rows)
    common = real_model.common_flags(args, model, files, [])  # the warm start and gaps: not the RL flags
    before = real_model.teacher_gap_metrics(common, args.teacher_gap_rows, os.path.join(out, "gap_before"), True)
    warmed = warm_start(common, args, out)
    print(f"[{time.strftime('%H:%M:%S')}] warm start {warmed} ({time.time() - t_start:.0f}s)", flush=True)
    after_common = real_model.common_flags(args, warmed, files, [])
    after = real_model.teacher_gap_metrics(after_common, args.teacher_gap_rows, os.path.join(out, "gap_after"), True)
    algos = args.algos.split(",")
    results = real_model.run_all(args, algos, real_model.common_flags(args, warmed, files, extra), files, out)
    lines = [real_model.result_line(r) for r in results] + [real_model.summary_line(results)]
    gains = real_model.gains_by_algo(results)
    diffs = real_model.minus_grpo(results, "sdpo_demo")
    nan = (float("nan"), float("nan"))
    gain = lambda name, algo: f"{name}_gain={gains.get(algo, nan)[0]:.4f} {name}_gain_se={gains.get(algo, nan)[1]:.4f}"
    d, se = real_model.mean_over_seeds([(v, e) for _, v, e in diffs]) if diffs else nan
    lines.append(f"RESULT icl_warm_start {gap_fields(before, 'before')} {gap_fields(after, 'after')} "
                 f"{gain('grpo', 'grpo')} {gain('sdpo', 'sdpo_demo')} {gain('hybrid', 'hybrid')} "
                 f"sdpo_minus_grpo={d:.4f} se={se:.4f} seeds={len(diffs)}")
    print("\n".join(real_model.verdicts(results) + lines), flush=True)


if __name__ == "__main__":
    main()
