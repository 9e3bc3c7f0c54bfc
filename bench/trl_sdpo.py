"""TRL's experimental SDPOTrainer on the same model, data and layout as run.py: the reference.

    pip install trl==1.16.0        # bench-only; installs next to the CPU stack (PLATFORM.md)
    python bench/trl_sdpo.py --model DIR --train FILE.jsonl --out DIR [--steps 12] [--prompts 4] [--n 8]
                             [--max_tokens 256] [--temperature 0.7] [--lr 1e-5] [--warmup 2]
                             [--mini_batches 1] [--micro_batch 8] [--preset ours|trl] [--seed 0]

Trains with trl.experimental.sdpo.SDPOTrainer (transformers generation, no vLLM) and saves an
HF directory to OUT/final, which `python run.py --eval_only=True --model.path OUT/final ...`
evaluates exactly as it evaluates our runs (bench/real_model.py's `--algos trl_sdpo` does both
and pairs the result with the shared step-0 evaluation). Rewards: our math reward
(feedback/math.py), score only: TRL takes feedback from a per-prompt dataset column
(`privileged_context`), not from the reward function, so it cannot show the teacher the
feedback on *this* attempt; the comparison is of demonstrations only, the pretrained preset's.

The defaults are the paper's layout as bench/real_model.py runs it (bench/results/real_model.md):
12 rollout batches of 4 prompts x 8 samples at T=0.7, 256 tokens, one AdamW step per batch
(`--mini_batches 1`) at lr 1e-5 after 2 warm-up steps. `--temperature` is both the sampling
temperature and the one the distillation's logits are divided by (TRL's, and ours:
--rollout.temperature). `--micro_batch` sequences per forward: TRL's per-device batch, with
gradient accumulation up to the optimizer step's samples (it bounds memory, not the gradient).
One difference in the schedule stays: HF's constant_with_warmup starts at 0, so TRL's first
optimizer step has lr 0 and its second lr/2 with `--warmup 2`, where ours has lr/2 then lr
(policy.lr_factor): TRL's run is one step behind ours in its rate.

Presets (everything not listed is TRL's default):
  ours  run.py's SDPO defaults as far as TRL has them: top-100 logits with a tail bucket,
        JSD alpha 0.5, success threshold 0.5, EMA 0.05, AdamW warmup/wd 0.01/clip 1,
        `--mini_batches` optimizer steps per rollout batch (TRL: steps_per_generation)
  trl   TRL's own SDPO defaults: sampled-token reverse KL (alpha 1), no tail
Each optimizer step's loss is TRL's: the mean over *all* sequences of the step (masked ones
count as 0) of each sequence's token-mean loss (ours: --sdpo.loss_agg=seq_mean_token_mean);
the EMA teacher moves after every optimizer step; a step whose samples all lack a teacher
context still calls optimizer.step() (zero gradient). The teacher prompts TRL builds are
written to OUT/teacher_prompts.jsonl.
"""
import argparse
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TRL_VERSION = "1.16.0"  # the release every figure of this bench and of tests/trl_sdpo_parity.json is of


def math_dataset(rows: list):
    """The rows (data.load_rows) as TRL's dataset: chat prompts and the answer the reward reads."""
    from datasets import Dataset
    return Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])


def math_reward(prompts, completions, answer, **_):
    """Our math reward's score (feedback/math.py) in TRL's reward-function form."""
    import feedback
    fn = feedback.get_reward_fn("math")
    return [feedback.score(fn, c[0]["content"], {"answer": a}, False).score for c, a in zip(completions, answer)]


def trl_config(out: str, steps: int, prompts: int, n: int, max_tokens: int, temperature: float, lr: float,
               warmup: int, mini_batches: int, micro_batch: int, preset: str = "ours", seed: int = 0):
    """TRL's SDPOConfig for `steps` rollout batches of prompts x n samples, `mini_batches` optimizer
    steps each, `micro_batch` sequences per forward (gradient accumulation for the rest)."""
    import torch
    from trl.experimental.sdpo import SDPOConfig
    batch = prompts * n
    if batch % mini_batches or (batch // mini_batches) % micro_batch:
        raise SystemExit(f"--mini_batches {mini_batches} x --micro_batch {micro_batch} must divide the {batch} "
                         "samples of a rollout batch")
    accumulation = batch // mini_batches // micro_batch
    loss_args = dict(distillation_mode="topk_logits", distillation_topk=100, distillation_add_tail=True,
                     distillation_alpha=0.5, success_reward_threshold=0.5) if preset == "ours" else {}
    return SDPOConfig(
        output_dir=out, max_steps=steps * mini_batches, seed=seed,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation * mini_batches, num_generations=n, max_completion_length=max_tokens,
        temperature=temperature, learning_rate=lr, lr_scheduler_type="constant_with_warmup", warmup_steps=warmup,
        weight_decay=0.01, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999,
        teacher_model_kind="ema", teacher_update_rate=0.05, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(), bf16=False, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32}, **loss_args)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12, help="rollout batches")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout batch")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max_tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature, and the distillation's (bench/real_model.py's 0.7)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps of linear warm-up")
    parser.add_argument("--mini_batches", type=int, default=1, help="optimizer steps per rollout batch")
    parser.add_argument("--micro_batch", type=int, default=8, help="sequences per forward (gradient accumulation)")
    parser.add_argument("--preset", choices=("ours", "trl"), default="ours")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.sdpo import SDPOTrainer

    import data

    config = trl_config(args.out, args.steps, args.prompts, args.n, args.max_tokens, args.temperature, args.lr,
                        args.warmup, args.mini_batches, args.micro_batch, args.preset, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    os.makedirs(args.out, exist_ok=True)
    prompts_log = open(os.path.join(args.out, "teacher_prompts.jsonl"), "w")

    class LogTeacherPrompts(TrainerCallback):
        def on_teacher_context_built(self, teacher_input_ids, teacher_attention_mask, self_distillation_mask, **_):
            for ids, mask, used in zip(teacher_input_ids, teacher_attention_mask, self_distillation_mask):
                prompts_log.write(json.dumps({"used": float(used), "text": tokenizer.decode(ids[mask.bool()])}) + "\n")

    trainer = SDPOTrainer(model=args.model, reward_funcs=math_reward, args=config,
                          train_dataset=math_dataset(data.load_rows(args.train, "", "math")),
                          processing_class=tokenizer, callbacks=[LogTeacherPrompts()])
    trainer.train()
    prompts_log.close()
    with open(os.path.join(args.out, "log_history.jsonl"), "w") as f:
        for record in trainer.state.log_history:
            f.write(json.dumps(record) + "\n")
    final = os.path.join(args.out, "final")
    trainer.model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    # the start's generation config (its EOS and pad), not the one TRL set up for its own sampling:
    # the engine that evaluates OUT/final takes its defaults from it
    if os.path.exists(os.path.join(args.model, "generation_config.json")):
        shutil.copy(os.path.join(args.model, "generation_config.json"), final)
    print(final)


if __name__ == "__main__":
    main()
