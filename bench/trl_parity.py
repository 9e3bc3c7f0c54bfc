"""Our SDPO and TRL's SDPOTrainer on the same batch: teacher input ids, per-token divergence, gradient.

    pip install trl==1.16.0                            # bench-only, as bench/trl_sdpo.py
    python bench/trl_parity.py [--out runs/sdpo-diagnostics]   # SmolLM2 on the diagnostics batch
    python bench/trl_parity.py --record                # tests/trl_sdpo_parity.json, on the tests' tiny model

The batch: bench/sdpo_diagnostics.py's cached one (4 prompts x 8 samples of SmolLM2-135M-Instruct
at T=0.7, scored by the math reward; sampled on first use with that script's engine), or with
--record the tests' canned batch on the tests' tiny model (canned_batch: three strops prompts x 4
answers, a group with two successes, one with none, a truncated answer). Both sides start from
the same weights (the EMA teacher at the first step is the policy) and distil at the sampling
temperature, top-100 (top-8 on the tiny model's vocabulary) with a tail, JSD alpha 0.5,
demonstrations only:

- TRL (1.16.0): its SuccessfulRolloutTeacherContextBuilder.build on the padded batch, its
  _compute_teacher_student_logits (HF forwards of the padded rows) and loss_utils'
  compute_topk_self_distillation_loss for the per-token divergence, and its compute_loss over
  micro-batches with its own gradient-accumulation scale for the gradient.
- ours: objectives/sdpo.py's prepare_teacher_contexts, the SDPO head (chunked_head, packed rows) and
  update.update_policy at --train.mini_batches=1 (no clip, no engine correction), with
  --sdpo.loss_agg seq_mean_token_mean (the aggregation matched) and token_mean (the default).

RESULT trl_parity: how many teacher inputs are identical (each difference is printed), the
largest per-token divergence difference, the losses, and the gradient cosines with TRL's.
--record writes the TRL side of the tiny batch (teacher ids, per-token divergence, loss, gradient
fingerprints, TRL's version) for tests/test_trl_parity.py, which checks ours against it
without TRL; rerun --record when the tests' tiny model or tokenizer changes (the test says so).
"""
import argparse
import json
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

FIXTURE = os.path.join(ROOT, "tests", "trl_sdpo_parity.json")
TINY_FLAGS = ["--sdpo.topk=8", "--sdpo.chunk_size=7"]  # the tiny vocabulary; K chosen below it


def canned_batch(tokenizer) -> dict:
    """The tests' batch for the tiny model: three strops prompts x 4 answers (ids ending with the
    EOS, one truncated), rewards chosen so that one group has two successes (each the other's
    demonstration), one none (no teacher context) and one a single success."""
    import data
    rows = data.task_rows("strops", "train", 3, seed=0)
    eos = tokenizer.eos_token_id
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    rewards = [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    samples = []
    for g, row in enumerate(rows):
        wrong = ["Program: upper", "Program: reverse | sort | dedup", "I think the answer is lower", "Program:"]
        for j, reward in enumerate(rewards[g]):
            text = row["reference"] if reward else wrong[(g + j) % 4]
            truncated = (g, j) == (2, 3)
            samples.append({"uid": row["uid"], "response_ids": ids(text) + ([] if truncated else [eos]),
                            "reward": reward, "truncated": truncated})
    return {"rows": rows, "samples": samples, "n": 4}


SHARPEN = 50.0  # the tiny model's final-norm weight times this: logits 50x, divergences far above rounding


def sharpened_tiny(out_dir: str) -> str:
    """The tests' tiny model (tiny_models.tiny_model_dir) with its final RMSNorm weight times SHARPEN,
    saved to out_dir: the untrained model's logits are near 0, so its teacher and student nearly
    agree (divergences ~1e-6, below what a test can tell from rounding); 50x apart they do not."""
    import tiny_models
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    tiny = tiny_models.tiny_model_dir()
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out_dir)
    GenerationConfig.from_pretrained(tiny).save_pretrained(out_dir)
    return out_dir


def diagnostics_batch(args, model: str) -> dict:
    """bench/sdpo_diagnostics.py's cached batch (sampled now if absent) in canned_batch's form."""
    import data
    import run
    import sdpo_diagnostics
    import word_problems
    files = word_problems.write(os.path.join(args.out, "data"), 200, test_rows=800)
    train_rows = data.load_rows(files["train"], reward="math")
    heldout_rows = data.load_rows(files["test"], reward="math")
    cfg = run.parse_config(our_flags(model, files["train"], args.temperature) + ["--algo=sdpo"])
    settings = types.SimpleNamespace(out=args.out, prompts=4, n=8, temperature=args.temperature, max_tokens=256,
                                     heldout_rows=32, copy_rows=32, copy_tokens=128, regenerate=False)
    os.makedirs(args.out, exist_ok=True)
    batch = sdpo_diagnostics.fixed_batch(settings, cfg, model, run.load_tokenizer(model), train_rows, heldout_rows)
    by_uid = {r["uid"]: r for r in train_rows}
    uids = list(dict.fromkeys(s["uid"] for s in batch["train"]))
    return {"rows": [by_uid[u] for u in uids], "samples": batch["train"], "n": settings.n}


def our_flags(model: str, train: str, temperature: float) -> list:
    return [f"--model.path={model}", f"--data.task={train}", "--data.reward=math",
            f"--rollout.temperature={temperature}", "--train.mini_batches=1", "--train.micro_batch=8",
            "--optim.grad_clip=1e30", "--rollout.is_correction=False", "--sdpo.include_environment_feedback=False"]


# ----------------------------------------------------------------------------------------
# TRL's side


def trl_side(model: str, tokenizer, batch: dict, temperature: float, topk: int, micro_batch: int) -> dict:
    """TRL's teacher inputs, per-token divergence, loss and gradient ({name: tensor}) on the batch."""
    import trl_sdpo
    from datasets import Dataset
    from trl.experimental.sdpo import SDPOTrainer
    from trl.experimental.sdpo.loss_utils import compute_topk_self_distillation_loss
    from trl.trainer.utils import pad
    rows = {r["uid"]: r for r in batch["rows"]}
    samples, n = batch["samples"], batch["n"]
    config = trl_sdpo.trl_config(os.path.join(ROOT, "runs", "trl-parity"), 1, len(samples) // n, n, 256, temperature,
                                 1e-5, 0, 1, micro_batch)
    config.distillation_topk = topk
    trainer = SDPOTrainer(model=model, reward_funcs=trl_sdpo.math_reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": r["messages"]} for r in batch["rows"]]))
    prompts = [rows[s["uid"]]["messages"] for s in samples]
    prompt_ids = [torch.tensor(ids) for ids in trainer._tokenize_prompts(prompts)]
    completions = [torch.tensor(s["response_ids"]) for s in samples]
    inputs = {"prompt_ids": pad(prompt_ids, padding_value=tokenizer.pad_token_id, padding_side="left"),
              "prompt_mask": pad([torch.ones_like(t) for t in prompt_ids], padding_value=0, padding_side="left"),
              "completion_ids": pad(completions, padding_value=tokenizer.pad_token_id, padding_side="right"),
              "completion_mask": pad([torch.ones_like(t) for t in completions], padding_value=0, padding_side="right")}
    inputs.update(trainer.teacher_context_builder.build(inputs, prompts, torch.tensor([s["reward"] for s in samples])))
    model_ = trainer.model
    with torch.no_grad():
        logits = trainer._compute_teacher_student_logits(model_, trainer.teacher_model, inputs)
        per_token = compute_topk_self_distillation_loss(logits.student_logits, logits.teacher_logits,
                                                        distillation_topk=topk, distillation_alpha=0.5,
                                                        distillation_add_tail=True)
    trainer.current_gradient_accumulation_steps = len(samples) // micro_batch
    model_.train()
    model_.zero_grad(set_to_none=True)
    loss = 0.0
    for i in range(0, len(samples), micro_batch):  # TRL's gradient accumulation over micro-batches
        part = trainer.compute_loss(model_, {k: v[i:i + micro_batch] for k, v in inputs.items()})
        part.backward()
        loss += part.item()
    lens = [len(s["response_ids"]) for s in samples]
    mask = inputs["teacher_attention_mask"].bool()
    return {"prompt_ids": [t.tolist() for t in prompt_ids],
            "teacher_ids": [ids[m].tolist() for ids, m in zip(inputs["teacher_input_ids"], mask)],
            "mask": inputs["self_distillation_mask"].tolist(),
            "divergence": [per_token[i, :lens[i]].tolist() for i in range(len(samples))], "loss": loss,
            "grads": {name: p.grad.detach().clone() for name, p in model_.named_parameters() if p.grad is not None}}


# ----------------------------------------------------------------------------------------
# ours


def our_rollouts(tokenizer, batch: dict, cfg) -> list:
    """The batch as the loop's rollouts, teacher contexts written (objectives/sdpo.py's prepare_teacher_contexts)."""
    import data
    import microbatch
    from objectives import sdpo as sdpo_objective
    rows = {r["uid"]: r for r in batch["rows"]}
    rollouts = [microbatch.Rollout(row=rows[s["uid"]], prompt_ids=data.chat_prompt_ids(tokenizer, rows[s["uid"]]["messages"]),
                                   response_ids=list(s["response_ids"]), rollout_logprobs=[0.0] * len(s["response_ids"]),
                                   text=tokenizer.decode(s["response_ids"], skip_special_tokens=True),
                                   truncated=s["truncated"], reward=s["reward"])
                for s in batch["samples"]]
    sdpo_objective.prepare_teacher_contexts(rollouts, tokenizer, cfg)
    return rollouts


def our_divergence(policy, rollouts: list, cfg, pad_id: int) -> list:
    """Each rollout's per-token divergence from the SDPO head (objectives/sdpo.py's sdpo_head), the
    policy its own teacher (the EMA teacher at the first step)."""
    import microbatch
    import update
    from objectives import OBJECTIVES, sdpo as sdpo_objective
    from teacher import Teacher
    models = microbatch.Models(policy, teacher=Teacher("live", 0.0))
    mb = microbatch.micro_batch(policy, rollouts, update.step_counts(rollouts, OBJECTIVES["sdpo"]), pad_id,
                                torch.device("cpu"), None, 1)
    with torch.no_grad():
        hidden = sdpo_objective.teacher_hidden_for(mb, models, cfg)
        loss = microbatch.forward(policy, mb.packed, sdpo_objective.sdpo_head(mb, models, cfg, hidden))[0]
    return [v.tolist() for v in loss.split([len(r.response_ids) for r in rollouts])]


def our_gradient(policy, rollouts: list, cfg, pad_id: int) -> tuple[dict, float]:
    """({HF parameter name: gradient}, loss) of one optimizer step on the rollouts (update.update_policy)."""
    import copy
    import update
    from distributed import Dist
    from microbatch import Models
    from objectives import OBJECTIVES
    from policy import Trainer
    from sdpo_diagnostics import GradKeeper, NoSchedule
    from teacher import Teacher
    keeper = GradKeeper(policy)
    metrics, _ = update.update_policy(cfg, OBJECTIVES["sdpo"], Trainer(Models(policy, teacher=Teacher("live", 0.0)), keeper,
                                                                        NoSchedule()),
                                      copy.deepcopy(rollouts), 0, pad_id, Dist(0, 1, torch.device("cpu")))
    names = [n.removeprefix("hf.") for n, p in policy.named_parameters() if p.requires_grad]
    sizes = [p.numel() for p in policy.parameters() if p.requires_grad]
    return dict(zip(names, keeper.grad.split(sizes))), metrics["actor/loss"]


def ours(model: str, tokenizer, batch: dict, flags: list) -> dict:
    """Our teacher inputs, per-token divergence, and the loss and gradient under each --sdpo.loss_agg."""
    import run
    from policy import load_policy
    cfg = run.parse_config(flags + ["--algo=sdpo"])
    policy = load_policy(model, cfg, 1, torch.device("cpu"))
    policy.eval()  # no dropout; update_policy sets train(), which these models do not use
    rollouts = our_rollouts(tokenizer, batch, cfg)
    out = {"prompt_ids": [r.prompt_ids for r in rollouts], "teacher_ids": [r.fields.teacher_ids for r in rollouts],
           "mask": [r.fields.sdpo_mask for r in rollouts],
           "divergence": our_divergence(policy, rollouts, cfg, tokenizer.pad_token_id)}
    for agg in ("seq_mean_token_mean", "token_mean"):
        out[agg] = our_gradient(policy, rollouts, run.parse_config(flags + ["--algo=sdpo", f"--sdpo.loss_agg={agg}"]),
                                tokenizer.pad_token_id)
    return out


# ----------------------------------------------------------------------------------------
# the comparison


def cosine(a: dict, b: dict) -> float:
    """The cosine of two gradients given as {name: tensor} over the names both have."""
    names = sorted(set(a) & set(b))
    x, y = (torch.cat([g[n].double().flatten() for n in names]) for g in (a, b))
    return float(x @ y / (x.norm() * y.norm()).clamp_min(1e-300))


def id_differences(tokenizer, name: str, theirs: list, mine: list) -> list[str]:
    """Each sample whose ids differ: where, and the text around it on both sides."""
    out = []
    for i, (t, m) in enumerate(zip(theirs, mine)):
        if t != m:
            at = next((k for k, (a, b) in enumerate(zip(t, m)) if a != b), min(len(t), len(m)))
            show = lambda ids: repr(tokenizer.decode(ids[max(at - 8, 0):at + 8]))
            out.append(f"{name} of sample {i} differ from token {at} (TRL {len(t)}, ours {len(m)} tokens): "
                       f"TRL {show(t)}, ours {show(m)}")
    return out


def report(tokenizer, theirs: dict, mine: dict) -> list[str]:
    """The differences, then RESULT trl_parity."""
    lines = id_differences(tokenizer, "student prompt ids", theirs["prompt_ids"], mine["prompt_ids"])
    lines += id_differences(tokenizer, "teacher input ids", theirs["teacher_ids"], mine["teacher_ids"])
    used = [i for i, m in enumerate(theirs["mask"]) if m > 0]
    diff = max((abs(a - b) for i in used for a, b in zip(theirs["divergence"][i], mine["divergence"][i])), default=0.0)
    same = sum(t == m for t, m in zip(theirs["teacher_ids"], mine["teacher_ids"]))
    seq_grads, seq_loss = mine["seq_mean_token_mean"]
    token_grads, token_loss = mine["token_mean"]
    lines.append(f"RESULT trl_parity samples={len(theirs['mask'])} distilled={len(used)} "
                 f"teacher_ids_identical={same}/{len(theirs['mask'])} masks_equal={theirs['mask'] == mine['mask']} "
                 f"max_divergence_diff={diff:.2e} trl_loss={theirs['loss']:.6g} ours_seq_mean_loss={seq_loss:.6g} "
                 f"ours_token_mean_loss={token_loss:.6g} grad_cos_seq_mean_token_mean={cosine(theirs['grads'], seq_grads):.6f} "
                 f"grad_cos_token_mean={cosine(theirs['grads'], token_grads):.6f}")
    return lines


def record(tokenizer, batch: dict, theirs: dict):
    """tests/trl_sdpo_parity.json: the tiny batch and TRL's side of it."""
    import datetime
    import trl
    from golden import fingerprint
    import tiny_models
    fixture = {"trl_version": trl.__version__, "recorded": datetime.date.today().isoformat(),
               "command": "python bench/trl_parity.py --record",
               "model": f"{os.path.basename(tiny_models.tiny_model_dir())}, final norm x {SHARPEN}",
               "vocab": len(tokenizer), "flags": TINY_FLAGS, "temperature": 0.7, "micro_batch": 4,
               "rows": [{"uid": r["uid"], "messages": r["messages"]} for r in batch["rows"]], "n": batch["n"],
               "samples": batch["samples"], **{k: theirs[k] for k in ("prompt_ids", "teacher_ids", "mask", "divergence",
                                                                        "loss")},
               "grads": fingerprint(theirs["grads"])}
    with open(FIXTURE, "w") as f:
        json.dump(fixture, f, indent=None, separators=(",", ":"))
    print(f"wrote {FIXTURE}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/sdpo-diagnostics", help="where the diagnostics batch is cached")
    parser.add_argument("--model", default="", help="HF directory (default: bench/smollm2.py's)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--record", action="store_true", help="write tests/trl_sdpo_parity.json on the tiny model")
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    import run
    if args.record:
        import tempfile
        model = sharpened_tiny(tempfile.mkdtemp(prefix="trl-parity-"))
        tokenizer = run.load_tokenizer(model)
        batch, topk, micro, flags = canned_batch(tokenizer), 8, 4, TINY_FLAGS + ["--train.micro_batch=4"]
        flags = our_flags(model, "strops", 0.7) + flags
    else:
        import smollm2
        model = args.model or smollm2.smollm2_dir()
        tokenizer = run.load_tokenizer(model)
        batch, topk, micro, flags = diagnostics_batch(args, model), 100, 8, []
        flags = our_flags(model, os.path.join(args.out, "data", "word_problems_train.jsonl"), args.temperature)
    theirs = trl_side(model, tokenizer, batch, args.temperature, topk, micro)
    print("\n".join(report(tokenizer, theirs, ours(model, tokenizer, batch, flags))), flush=True)
    if args.record:
        record(tokenizer, batch, theirs)


if __name__ == "__main__":
    main()
