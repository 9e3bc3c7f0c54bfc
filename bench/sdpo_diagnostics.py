"""Why SDPO loses to GRPO on SmolLM2-135M-Instruct's word problems: diagnostics without training,
on one fixed, saved batch (issue 52; figures in bench/results/real_model.md).

    python bench/sdpo_diagnostics.py [--out runs/sdpo-diagnostics] [--prompts 4] [--n 8]
                                     [--temperature 0.7] [--max_tokens 256] [--heldout_rows 32]
                                     [--copy_rows 32] [--regenerate]

The batch: the first `--prompts` training prompts of bench/real_model.py's seed-0 run
(data.batch_rows), `--n` samples each at `--temperature` (bench/real_model.py's 0.7) and
`--max_tokens` (the preset's 256), scored by the math reward; and `--heldout_rows` held-out
problems, 2 samples each at T=0.6 (the evaluation's), whose correct answers stand for "what the
model should get more of". Both are sampled once by the project's vLLM engine (rollout.py, as
the loop samples, seeded), with the copy test's greedy answers below, and saved to
<out>/batch.json; later runs reuse it and start no engine (`--regenerate` samples again).
Every model below is the untrained model: at the first step the EMA teacher is the policy.

(a) The counterfactual teacher. For each sample with a demonstration (a successful sibling's
answer, sdpo.py), the teacher prompt is built twice: with the real demonstration, and with the
same demonstration text whose numbers (the question's operands and the answer) are replaced by
another training row's of the same template ("Tom has 7 apples ... 7 + 5 = 12" becomes
"... 9 + 3 = 12" with the question unchanged). On the student's own tokens:
log T(real demo) - log T(counterfactual demo), split into the tokens of the final answer (the
number the math reward reads), the other numbers, and the rest of the text; and
log T(real) - log S (what SDPO distils) split alike. If the gap is ~0 outside the answer, the
teacher's knowledge is the answer it was shown. Then the copy test: the teacher answers (greedy)
held-out questions shown the row's worked solution ("a + b = c\\nAnswer: c") and a counterfactual
one (another row's numbers), and the batch's rows shown the real and the counterfactual sibling
demonstration: how often it writes the counterfactual's (wrong) answer.

(b) The SDPO gradient against GRPO's, on the whole batch as one optimizer step
(update.update_policy, --train.mini_batches=1, no gradient clip, no engine correction: the
engine's log-probs are not kept): for α in {0, 0.5, 1} and the support {token, top-5, top-20,
top-100} (token level does not depend on α), the cosine with GRPO's gradient, and the
first-order change of two quantities along the update direction d = -g/|g| (per unit step
length): the policy's mean token entropy on the batch's tokens at the sampling temperature
(d.∇H), and the mean per-token log-prob (T=1) of the correct held-out answers (d.∇LP), with
cos(d, ∇LP). GRPO's own figures are printed beside them.

(c) SDPO's divergence on the batch split by sample kind (sdpo/divergence_right|wrong|truncated),
for every variant of (b).

Prints RESULT lines (each as it comes, all again at the end). Needs bench/smollm2.py's model
(built on first use).
"""
import argparse
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import smollm2  # noqa: E402  (bench/ is not a package)
import word_problems  # noqa: E402

KINDS = ("right", "wrong", "truncated")
SUPPORTS = [("token", 0)] + [("topk", k) for k in (5, 20, 100)]
ALPHAS = (0.0, 0.5, 1.0)
PARTS = ("answer", "numbers", "text")  # the response tokens of (a)'s split


# ----------------------------------------------------------------------------------------
# the fixed batch


def sample(engine, prompts: list, n: int, temperature: float, max_tokens: int, seed: int) -> list:
    """(response ids, ending with the EOS unless truncated; truncated) for n samples of each
    prompt, prompt by prompt, from the project's vLLM engine (rollout.Engine, as the loop
    samples); temperature 0: greedy."""
    return [(s.response_ids, s.truncated) for group in engine.generate(prompts, n, temperature, max_tokens, seed)
            for s in group]


def scored(tokenizer, rows: list, samples: list) -> list:
    import feedback
    reward = feedback.get_reward_fn("math")
    out = []
    for row, (ids, truncated) in zip(rows, samples):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        r = feedback.score(reward, text, row, truncated)
        out.append({"uid": row["uid"], "response_ids": ids, "truncated": truncated, "text": text, "reward": r.score,
                    "feedback": r.feedback})
    return out


def fixed_batch(args, cfg, model, tokenizer, train_rows, heldout_rows) -> dict:
    """The saved batch (<out>/batch.json), sampled on first use: the training samples, the
    held-out samples, and the copy test's greedy answers (their prompts depend on the first)."""
    import data
    import rollout
    from distributed import Dist
    path = os.path.join(args.out, "batch.json")
    if os.path.exists(path) and not args.regenerate:
        with open(path) as f:
            return json.load(f)
    t0 = time.time()
    engine = rollout.start_engine(cfg, model, tokenizer, train_rows, Dist(0, 1, torch.device("cpu")))
    try:
        t1 = time.time()
        rows = data.batch_rows(train_rows, 0, args.prompts, 0)  # bench/real_model.py's first step, seed 0
        train = scored(tokenizer, [r for r in rows for _ in range(args.n)],
                       sample(engine, [data.chat_prompt_ids(tokenizer, r["messages"]) for r in rows], args.n,
                              args.temperature, args.max_tokens, seed=0))
        held = heldout_rows[:args.heldout_rows]
        heldout = scored(tokenizer, [r for r in held for _ in range(2)],
                         sample(engine, [data.chat_prompt_ids(tokenizer, r["messages"]) for r in held], 2, 0.6,
                                args.max_tokens, seed=1))
        batch = {"settings": {k: getattr(args, k) for k in ("prompts", "n", "temperature", "max_tokens",
                                                            "heldout_rows", "copy_rows", "copy_tokens")},
                 "train": train, "heldout": heldout}
        rollouts, _ = batch_rollouts(batch, tokenizer, cfg, {r["uid"]: r for r in train_rows + heldout_rows})
        cases = copy_cases(tokenizer, cfg, demonstrations(tokenizer, cfg, rollouts, train_rows)[4], heldout_rows, args)
        batch["copy"] = scored(tokenizer, [c[0] for c in cases],
                               sample(engine, [c[5] for c in cases], 1, 0.0, args.copy_tokens, seed=2))
        batch["seconds"], batch["generation_s"] = time.time() - t0, time.time() - t1
    finally:
        engine.close()
    with open(path + ".tmp", "w") as f:
        json.dump(batch, f)
    os.replace(path + ".tmp", path)
    return batch


def batch_rollouts(batch: dict, tokenizer, cfg, by_uid: dict) -> list:
    """The saved training samples as the loop's rollouts, with GRPO's advantages and SDPO's
    teacher contexts (the hybrid's prepare: objectives.hybrid) written on them."""
    import data
    import microbatch
    import objectives
    rollouts = []
    for s in batch["train"]:
        row = by_uid[s["uid"]]
        rollouts.append(microbatch.Rollout(row=row, prompt_ids=data.chat_prompt_ids(tokenizer, row["messages"]),
                                           response_ids=s["response_ids"], rollout_logprobs=[0.0] * len(s["response_ids"]),
                                           text=s["text"], truncated=s["truncated"], reward=s["reward"],
                                           feedback=s["feedback"]))
    return rollouts, objectives.hybrid.prepare_hybrid(rollouts, tokenizer, cfg)


# ----------------------------------------------------------------------------------------
# (a) the counterfactual teacher


def template(question: str) -> str:
    return next(kind for kind, word in (("add", " more "), ("sub", " gives "), ("mul", " boxes "), ("div", " shares "))
                if word in question)


def numbers(row: dict) -> list:
    """The question's numbers in order, then the answer."""
    return [int(x) for x in re.findall(r"\d+", row["messages"][-1]["content"])] + [int(row["answer"])]


def counterfactual(row: dict, others: list) -> tuple | None:
    """(number map, the other row) for the first other row of the same template whose numbers
    replace this row's one for one (equal numbers stay equal, each changes, the answer differs)."""
    mine, kind = numbers(row), template(row["messages"][-1]["content"])
    for other in others:
        if other["uid"] == row["uid"] or template(other["messages"][-1]["content"]) != kind:
            continue
        theirs = numbers(other)
        mapping = {}
        if len(theirs) == len(mine) and all(mapping.setdefault(a, b) == b for a, b in zip(mine, theirs)) \
                and len(set(mapping.values())) == len(mapping) and all(a != b for a, b in mapping.items()):
            return mapping, other
    return None


def substitute(text: str, mapping: dict) -> str:
    return re.sub(r"\d+", lambda m: str(mapping.get(int(m.group()), m.group())), text)


def token_parts(tokenizer, ids: list) -> list:
    """Each response token's part: "answer" (overlaps the final answer the math reward reads),
    "numbers" (another digit) or "text"."""
    from feedback.math import extract_answer
    pieces = [tokenizer.decode([i], skip_special_tokens=True) for i in ids]
    text = "".join(pieces)
    answer = extract_answer(text)
    span = (-1, -1)
    if answer is not None:
        at = text.rfind(answer)
        span = (at, at + len(answer)) if at >= 0 else span
    parts, pos = [], 0
    for piece in pieces:
        start, pos = pos, pos + len(piece)
        if start < span[1] and pos > span[0] and piece:
            parts.append("answer")
        else:
            parts.append("numbers" if any(c.isdigit() for c in piece) else "text")
    return parts


def sequence_logprobs(policy, seqs: list, response_lens: list, pad_id: int, temperature: float = 1.0) -> list:
    """Per-token log-probs of each sequence's last response_lens tokens, 8 sequences a forward."""
    import chunked_head
    import microbatch
    import packing
    out = []
    with torch.no_grad():
        for i in range(0, len(seqs), 8):
            packed = packing.pack(seqs[i:i + 8], response_lens[i:i + 8], pad_id, "cpu")
            lp = microbatch.forward(policy, packed, lambda h, w: chunked_head.logprobs_and_entropy_from_hidden(
                h, w, packed.targets, temperature)[0])
            out += list(lp.split(response_lens[i:i + 8]))
    return out


def demonstrations(tokenizer, cfg, rollouts: list, train_rows: list) -> tuple:
    """For each sample with a demonstration (and a counterfactual row): (sample indices, real
    teacher ids, counterfactual teacher ids, None, {uid: (row, demo, counterfactual demo, map)})."""
    import sdpo
    tb = sdpo.build_teacher_batch(tokenizer, [r.row for r in rollouts], [r.response_ids for r in rollouts],
                                  [r.text for r in rollouts], [r.reward for r in rollouts],
                                  [""] * len(rollouts), cfg.sdpo)
    demo_text, real, cf, chosen, pairs = {}, [], [], [], {}
    for i, r in enumerate(rollouts):
        j = tb.demo_index[i]
        found = counterfactual(r.row, train_rows) if j is not None else None
        if found is None:
            continue
        demo = demo_text.setdefault(j, sdpo.strip_thinking(tokenizer.decode(rollouts[j].response_ids,
                                                                              skip_special_tokens=True)))
        real_prompt = sdpo.teacher_prompt_ids(tokenizer, r.row["messages"], demo, None, cfg.sdpo)
        assert real_prompt + r.response_ids == r.fields.teacher_ids, "the demonstration is not the one sdpo.py chose"
        cf_demo = substitute(demo, found[0])
        real.append(r.fields.teacher_ids)
        cf.append(sdpo.teacher_prompt_ids(tokenizer, r.row["messages"], cf_demo, None, cfg.sdpo) + r.response_ids)
        chosen.append(i)
        pairs.setdefault(r.row["uid"], (r.row, demo, cf_demo, found[0]))
    return chosen, real, cf, None, pairs


def copy_cases(tokenizer, cfg, pairs: dict, heldout_rows: list, args) -> list:
    """The copy test's prompts: (row, demonstration or None, the counterfactual's answer, source,
    shown, prompt ids): held-out rows bare, shown their worked solution and a counterfactual
    one; the batch's rows shown their real and their counterfactual sibling demonstration."""
    import data
    import sdpo
    cases = []
    for row in heldout_rows[:args.copy_rows]:
        found = counterfactual(row, heldout_rows)
        if found is None:
            continue
        for demo, shown in ((None, "bare"), (row["teacher_response"], "real"),
                            (substitute(row["teacher_response"], found[0]), "counterfactual")):
            cases.append((row, demo, found[0][int(row["answer"])], "worked", shown))
    for row, demo, cf_demo, mapping in pairs.values():
        for d, shown in ((demo, "real"), (cf_demo, "counterfactual")):
            cases.append((row, d, mapping[int(row["answer"])], "sibling", shown))
    return [c + (data.chat_prompt_ids(tokenizer, c[0]["messages"]) if c[1] is None
                 else sdpo.teacher_prompt_ids(tokenizer, c[0]["messages"], c[1], None, cfg.sdpo),) for c in cases]


def counterfactual_teacher(args, policy, tokenizer, cfg, batch, rollouts, train_rows, heldout_rows) -> list:
    pad = tokenizer.pad_token_id
    chosen, real, cf, _, pairs = demonstrations(tokenizer, cfg, rollouts, train_rows)
    lens = [len(rollouts[i].response_ids) for i in chosen]
    t_real = sequence_logprobs(policy, real, lens, pad, cfg.rollout.temperature)
    t_cf = sequence_logprobs(policy, cf, lens, pad, cfg.rollout.temperature)
    student = sequence_logprobs(policy, [rollouts[i].prompt_ids + rollouts[i].response_ids for i in chosen], lens, pad,
                                cfg.rollout.temperature)
    gaps = ("real_minus_cf", "real_minus_student", "cf_minus_student")
    sums = {(what, part): [0.0, 0] for what in gaps for part in PARTS}
    for i, tr, tc, s in zip(chosen, t_real, t_cf, student):
        for part, a, b, c in zip(token_parts(tokenizer, rollouts[i].response_ids), tr.tolist(), tc.tolist(), s.tolist()):
            for what, v in zip(gaps, (a - b, a - c, b - c)):
                sums[what, part][0] += v
                sums[what, part][1] += 1
    mean = {k: v[0] / max(v[1], 1) for k, v in sums.items()}
    lines = [f"RESULT diag=counterfactual_gap samples={len(chosen)} rows={len(pairs)} "
             + " ".join(f"tokens_{p}={sums['real_minus_cf', p][1]}" for p in PARTS) + " "
             + " ".join(f"{what}_{p}={mean[what, p]:+.3f}" for what in gaps for p in PARTS)]
    from feedback.math import extract_answer, normalize
    cases = copy_cases(tokenizer, cfg, pairs, heldout_rows, args)
    assert len(cases) == len(batch["copy"]), "the saved copy answers are of other prompts: --regenerate"
    tally = {}
    for (row, demo, cf_answer, source, shown, _), a in zip(cases, batch["copy"]):
        assert a["uid"] == row["uid"]
        got = extract_answer(a["text"])
        got = normalize(got) if got is not None else None
        t = tally.setdefault((source, shown), [0, 0, 0, 0])
        t[0] += 1
        t[1] += got == normalize(str(row["answer"]))
        t[2] += got == str(cf_answer)
        t[3] += a["truncated"]
    for (source, shown), (n, right, copied, truncated) in sorted(tally.items()):
        lines.append(f"RESULT diag=copy demo={source} shown={shown} rows={n} right={right / n:.3f} "
                     f"counterfactual_answer={copied / n:.3f} truncated={truncated / n:.3f}")
    return lines


# ----------------------------------------------------------------------------------------
# (b) gradients and (c) the divergence split


class GradKeeper:
    """Stands in for the optimizer: keeps the (flattened) gradient instead of stepping."""

    def __init__(self, model):
        self.params, self.grad = [p for p in model.parameters() if p.requires_grad], None

    def step(self):
        self.grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in self.params])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


class NoSchedule:
    def step(self):
        pass

    def get_last_lr(self):
        return [0.0]


def flat_grad(policy, seqs: list, response_lens: list, pad_id: int, head, weight_of) -> torch.Tensor:
    """∇ of Σ_sequences weight_of(i) · head-value (a per-token tensor summed), 8 sequences a forward."""
    import microbatch
    import packing
    policy.zero_grad(set_to_none=True)
    for i in range(0, len(seqs), 8):
        packed = packing.pack(seqs[i:i + 8], response_lens[i:i + 8], pad_id, "cpu")
        weights = torch.cat([torch.full((n,), weight_of(i + k)) for k, n in enumerate(response_lens[i:i + 8])])
        values = microbatch.forward(policy, packed, lambda h, w: head(h, w, packed.targets))
        (values * weights).sum().backward()
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in policy.parameters()])
    policy.zero_grad(set_to_none=True)
    return grad


def gradients(args, policy, tokenizer, flags, rollouts, heldout) -> list:
    import copy
    import losses
    import run
    from microbatch import Models
    from objectives import OBJECTIVES
    from teacher import Teacher
    pad = tokenizer.pad_token_id
    temperature = args.temperature

    def entropy_head(h, w, targets):
        return losses.entropy_from_logits(h @ w.T, temperature)

    def logprob_head(h, w, targets):
        return losses.token_logprobs(h @ w.T, targets, 1.0)

    t0 = time.time()
    seqs = [r.prompt_ids + r.response_ids for r in rollouts]
    lens = [len(r.response_ids) for r in rollouts]
    grad_entropy = flat_grad(policy, seqs, lens, pad, entropy_head, lambda i: 1.0 / sum(lens))
    correct = [h for h in heldout if h["reward"] >= 0.5]
    held_seqs = [h["prompt_ids"] + h["response_ids"] for h in correct]
    held_lens = [len(h["response_ids"]) for h in correct]
    grad_heldout = flat_grad(policy, held_seqs, held_lens, pad, logprob_head, lambda i: 1.0 / sum(held_lens))
    print(f"[{time.strftime('%H:%M:%S')}] entropy and held-out gradients ({len(correct)} correct held-out answers, "
          f"{time.time() - t0:.0f}s)", flush=True)

    def update_grad(extra):
        cfg = run.parse_config(flags + extra)
        objective = OBJECTIVES[cfg.algo.name]
        teacher = Teacher("live", 0.0) if cfg.algo.name in ("sdpo", "hybrid") else None  # the EMA teacher at step 0
        keeper = GradKeeper(policy)
        trainer = run.Trainer(Models(policy, teacher=teacher), keeper, NoSchedule())
        metrics, _ = run.update_policy(cfg, objective, trainer, copy.deepcopy(rollouts), 0, pad, run.Dist(0, 1, "cpu"))
        return keeper.grad, metrics

    grad_entropy, grad_heldout = grad_entropy.double(), grad_heldout.double()  # 135M-term sums
    norm = lambda v: v.norm().clamp_min(1e-30)
    lines, grpo = [], None

    def report(name: str, g: torch.Tensor, metrics: dict, token_level: bool = False):
        g = g.double()
        d = -g / norm(g)
        fields = {"grad_norm": f"{g.norm():.4g}", "cos_grpo": f"{float(g @ grpo / (norm(g) * norm(grpo))):+.3f}",
                  "d_entropy": f"{float(d @ grad_entropy):+.4g}",
                  "cos_entropy": f"{float(d @ grad_entropy / norm(grad_entropy)):+.3f}",
                  "d_heldout_logprob": f"{float(d @ grad_heldout):+.4g}",
                  "cos_heldout_logprob": f"{float(d @ grad_heldout / norm(grad_heldout)):+.3f}"}
        for kind in ("",) + tuple(f"_{k}" for k in KINDS):  # token level logs its surrogate, not a divergence
            if f"sdpo/divergence{kind}" in metrics and not token_level:
                fields[f"divergence{kind}"] = f"{metrics[f'sdpo/divergence{kind}']:.4f}"
        lines.append(f"RESULT diag=gradient {name} " + " ".join(f"{k}={v}" for k, v in fields.items()))
        print(lines[-1], flush=True)

    t0 = time.time()
    grpo = update_grad(["--algo=grpo"])[0].double()
    print(f"[{time.strftime('%H:%M:%S')}] GRPO gradient ({time.time() - t0:.0f}s)", flush=True)
    report("algo=grpo", grpo, {})
    for support, k in SUPPORTS:
        for alpha in (ALPHAS if support != "token" else (0.5,)):
            name = support if not k else f"top{k}:{alpha}"
            if args.variants and name not in args.variants.split(","):
                continue
            t0 = time.time()
            extra = ["--algo=sdpo", f"--sdpo.distill={support}", f"--sdpo.alpha={alpha}"] + \
                    ([f"--sdpo.topk={k}"] if k else [])
            grad, metrics = update_grad(extra)
            print(f"[{time.strftime('%H:%M:%S')}] SDPO {support}{k or ''} α={alpha} ({time.time() - t0:.0f}s)",
                  flush=True)
            report(f"algo=sdpo support={support if not k else f'top{k}'} alpha={'-' if not k else alpha}", grad,
                   metrics, token_level=not k)
    return lines


# ----------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/sdpo-diagnostics")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the fixed batch (a bench step's)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=0.7, help="the training samples' (bench/real_model.py's)")
    parser.add_argument("--max_tokens", type=int, default=256)
    parser.add_argument("--heldout_rows", type=int, default=32, help="held-out problems (2 samples each at T=0.6)")
    parser.add_argument("--copy_rows", type=int, default=32, help="held-out problems of the copy test")
    parser.add_argument("--copy_tokens", type=int, default=128, help="the copy test's greedy answers' token limit")
    parser.add_argument("--regenerate", action="store_true", help="sample the fixed batch again")
    parser.add_argument("--model", default="", help="HF directory (default: bench/smollm2.py's)")
    parser.add_argument("--variants", default="",
                        help="SDPO variants of (b), e.g. token,top100:0.5 (default: all ten)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the trainer's part (0: the cores)")
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    import data
    import run
    from policy import load_policy
    model = args.model or smollm2.smollm2_dir()
    files = word_problems.write(os.path.join(args.out, "data"), 200, test_rows=800)  # bench/real_model.py's rows
    train_rows = data.load_rows(files["train"], reward="math")
    heldout_rows = data.load_rows(files["test"], reward="math")
    flags = [f"--model.path={model}", f"--data.task={files['train']}", "--data.reward=math",
             f"--rollout.temperature={args.temperature}", f"--rollout.max_tokens={args.max_tokens}",
             f"--rollout.n={args.n}", f"--train.prompts_per_step={args.prompts}", "--train.mini_batches=1",
             "--train.micro_batch=8", "--optim.grad_clip=1e30", "--rollout.is_correction=False",
             "--sdpo.include_environment_feedback=False", "--rollout.kv_cache_tokens=32768"]
    cfg = run.parse_config(flags + ["--algo=sdpo"])
    tokenizer = run.load_tokenizer(model)
    by_uid = {r["uid"]: r for r in train_rows + heldout_rows}
    batch = fixed_batch(args, cfg, model, tokenizer, train_rows, heldout_rows)
    torch.set_num_threads(args.threads or os.cpu_count())
    policy = load_policy(model, cfg, 1, torch.device("cpu"))
    policy.eval()  # no dropout; update_policy sets train(), which this model does not use
    rollouts, prepared = batch_rollouts(batch, tokenizer, cfg, by_uid)
    for h in batch["heldout"]:
        h["prompt_ids"] = data.chat_prompt_ids(tokenizer, by_uid[h["uid"]]["messages"])
    kinds = {k: sum(1 for r in rollouts if (r.truncated if k == "truncated" else
                                            (not r.truncated and (r.reward >= 0.5) == (k == "right"))))
             for k in KINDS}
    lines = [f"RESULT diag=batch samples={len(rollouts)} " + " ".join(f"{k}={v}" for k, v in kinds.items())
             + f" with_demonstration={sum(r.fields.sdpo_mask > 0 for r in rollouts)}"
             f" groups_with_success={prepared['sdpo/groups_with_success']:.3f}"
             f" response_length={sum(len(r.response_ids) for r in rollouts) / len(rollouts):.1f}"
             f" heldout_correct={sum(h['reward'] >= 0.5 for h in batch['heldout'])}/{len(batch['heldout'])}"
             f" sampling_s={batch['seconds']:.0f}"]
    print(f"[{time.strftime('%H:%M:%S')}] {lines[0]} ({time.time() - t_start:.0f}s)", flush=True)
    t0 = time.time()
    lines += counterfactual_teacher(args, policy, tokenizer, cfg, batch, rollouts, train_rows, heldout_rows)
    print(f"[{time.strftime('%H:%M:%S')}] counterfactual teacher ({time.time() - t0:.0f}s)\n"
          + "\n".join(lines[1:]), flush=True)  # all of them again at the end
    lines += gradients(args, policy, tokenizer, flags, rollouts, batch["heldout"])
    load = os.getloadavg()
    lines.append(f"RESULT diag=run wall_s={time.time() - t_start:.0f} threads={torch.get_num_threads()} "
                 f"loadavg_1m={load[0]:.1f} loadavg_15m={load[2]:.1f}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
