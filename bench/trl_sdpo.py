"""TRL's experimental SDPOTrainer on the same model, data and step count as run.py: a reference.

    pip install trl==1.16.0        # bench-only; installs next to the CPU stack (PLATFORM.md)
    python bench/trl_sdpo.py --model DIR --train FILE.jsonl --out DIR [--steps 4] [--prompts 4] [--n 4]
                             [--max_tokens 64] [--lr 1e-4] [--mini_batches 4] [--preset ours|trl]

Trains with trl.experimental.sdpo.SDPOTrainer (transformers generation, no vLLM) and saves an
HF directory to OUT/final, which `python run.py --eval_only=True --model.path OUT/final ...`
evaluates exactly as it evaluates our runs. Rewards: our math reward (feedback/math.py),
score only: TRL takes feedback from a per-prompt dataset column (`privileged_context`), not
from the reward function, so it cannot show the teacher the feedback on *this* attempt.

Presets (everything not listed is TRL's default):
  ours  run.py's SDPO defaults as far as TRL has them: top-100 logits with a tail bucket,
        JSD alpha 0.5, success threshold 0.5, EMA 0.05, AdamW lr/warmup 2/wd 0.01/clip 1,
        `--mini_batches` optimizer steps per rollout batch (TRL: steps_per_generation)
  trl   TRL's own SDPO defaults: sampled-token reverse KL (alpha 1), no tail
Each optimizer step's loss is TRL's: the mean over *all* sequences of the step (masked ones
count as 0) of each sequence's token-mean loss; the EMA teacher moves after every optimizer
step; a step whose samples all lack a teacher context still calls optimizer.step() (zero
gradient). The teacher prompts TRL builds are written to OUT/teacher_prompts.jsonl.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4, help="rollout batches")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout batch")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--mini_batches", type=int, default=4, help="optimizer steps per rollout batch")
    parser.add_argument("--preset", choices=("ours", "trl"), default="ours")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    import data
    import feedback

    rows = data.load_rows(args.train, "", "math")
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])
    math_fn = feedback.get_reward_fn("math")

    def math_reward(prompts, completions, answer, **_):
        return [feedback.score(math_fn, c[0]["content"], {"answer": a}, False).score
                for c, a in zip(completions, answer)]

    batch = args.prompts * args.n
    if batch % args.mini_batches:
        raise SystemExit(f"--mini_batches {args.mini_batches} must divide the {batch} samples of a rollout batch")
    loss_args = dict(distillation_mode="topk_logits", distillation_topk=100, distillation_add_tail=True,
                     distillation_alpha=0.5, success_reward_threshold=0.5) if args.preset == "ours" else {}
    config = SDPOConfig(
        output_dir=args.out, max_steps=args.steps * args.mini_batches, seed=args.seed,
        per_device_train_batch_size=batch // args.mini_batches, steps_per_generation=args.mini_batches,
        gradient_accumulation_steps=1, num_generations=args.n, max_completion_length=args.max_tokens,
        temperature=1.0, learning_rate=args.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=2,
        weight_decay=0.01, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999,
        teacher_model_kind="ema", teacher_update_rate=0.05, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(), bf16=False, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32}, **loss_args)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    os.makedirs(args.out, exist_ok=True)
    prompts_log = open(os.path.join(args.out, "teacher_prompts.jsonl"), "w")

    class LogTeacherPrompts(TrainerCallback):
        def on_teacher_context_built(self, teacher_input_ids, teacher_attention_mask, self_distillation_mask, **_):
            for ids, mask, used in zip(teacher_input_ids, teacher_attention_mask, self_distillation_mask):
                prompts_log.write(json.dumps({"used": float(used), "text": tokenizer.decode(ids[mask.bool()])}) + "\n")

    trainer = SDPOTrainer(model=args.model, reward_funcs=math_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[LogTeacherPrompts()])
    trainer.train()
    prompts_log.close()
    with open(os.path.join(args.out, "log_history.jsonl"), "w") as f:
        for record in trainer.state.log_history:
            f.write(json.dumps(record) + "\n")
    trainer.model.save_pretrained(os.path.join(args.out, "final"))
    tokenizer.save_pretrained(os.path.join(args.out, "final"))
    print(os.path.join(args.out, "final"))


if __name__ == "__main__":
    main()
