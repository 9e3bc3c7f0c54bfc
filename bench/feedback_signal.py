"""Where the quiz's feedback teacher disagrees with the student, on the student's own wrong attempts.

    python bench/feedback_signal.py [--rows 128] [--model.path=DIR] [run.py flags, e.g. --data.quiz_questions=4]

The teacher gap (`run.py --eval_only --teacher_gap`) measures the teacher when it *writes* an
answer; SDPO uses it to *score* the student's answer token by token. This script measures the
second. From the quiz's warm start (built and cached as run.py does, or --model.path) it samples
--rollout.n answers per held-out quiz at the training temperature, keeps the wrong ones whose
feedback marks lines right and wrong, and scores each with the bare prompt (the student) and with
its feedback (the teacher, SDPO's feedback-only context), the same weights as both. Every
response token is put in one class: the question or the result part of a line the checker marks
right or wrong, or the end. Per class: tokens, share of the total KL(teacher || student), mean KL,
and mean teacher-minus-student log-prob of the sampled token. Then the decisive token: in each
line marked wrong, the first character of the result that differs from the correct one (there
the student sampled a wrong character); the teacher's and the student's probability of the
correct character there, and the teacher-minus-student log-prob of the wrong one. Prints

    RESULT feedback_kl_share_right_results=... feedback_kl_share_wrong_results=...
        decisive_p_correct_teacher=... decisive_p_correct_student=... decisive_t_minus_s_logprob=...
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.join(ROOT, "bench"))  # after ROOT: bench/losses.py must not shadow losses
import data  # noqa: E402
import run  # noqa: E402
import sdpo  # noqa: E402
from tasks.quiz import reward as quiz_reward  # noqa: E402
from learning import warm_start  # noqa: E402


def token_classes(tokenizer, response_ids: list[int], text: str, row: dict) -> tuple[list[str], list[int | None]]:
    """Each response token's class (that of its first character), and for the decisive token of a
    wrong line the id of the correct character there (None elsewhere, and where the sampled token
    spans more than that character)."""
    answers = {t["input"]: t["output"] for t in row["tests"]}
    char_class, char_correct = [], []  # per character of text, and one for the newline after each line
    for line in text.split("\n"):
        question, _, result = line.partition("=")
        expected = answers.get(question.strip(), "")
        marked = "right" if expected == result.strip() else "wrong"
        decisive = next((j for j in range(min(len(result), len(expected))) if result[j] != expected[j]), None)
        for offset in range(len(line) + 1):
            in_result = "=" in line[:offset]
            char_class.append(f"{marked} line, {'result' if in_result else 'question'}")
            at = offset - len(question) - 1
            char_correct.append(expected[at] if marked == "wrong" and decisive is not None and at == decisive else None)
    classes, correct_ids = [], []
    starts = [len(tokenizer.decode(response_ids[:k])) for k in range(len(response_ids))]  # each token's first char
    for k, (first, after) in enumerate(zip(starts, starts[1:])):
        classes.append(char_class[first])
        correct = char_correct[first] if after == first + 1 else None
        correct_ids.append(tokenizer.convert_tokens_to_ids(correct) if correct is not None else None)
    return classes + ["end"], correct_ids + [None]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="held-out quizzes to sample")
    args, extra = parser.parse_known_args()  # the rest are run.py flags
    flags = ["--data.task=quiz"] + extra
    model_dir = warm_start(flags)
    cfg = run.parse_config(flags)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(cfg.rollout.eval_seed)
    eos = tokenizer.eos_token_id
    totals = {}  # class -> [tokens, sum KL(T || S), sum of T - S log-prob]
    decisive = []  # (p_teacher(correct), p_student(correct), T - S log-prob of the sampled wrong char)
    sampled = scored = 0
    for row in data.task_rows("quiz", "test", args.rows, cfg=cfg.data):
        prompt = data.chat_prompt_ids(tokenizer, row["messages"])
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt] * cfg.rollout.n), attention_mask=torch.ones(
                cfg.rollout.n, len(prompt), dtype=torch.long), do_sample=True, temperature=cfg.rollout.temperature,
                max_new_tokens=cfg.rollout.max_tokens, pad_token_id=eos, eos_token_id=eos)
        for seq in out.tolist():
            response = seq[len(prompt):]
            sampled += 1
            if eos not in response:
                continue  # truncated: its feedback is the truncation's, not the lines'
            response = response[:response.index(eos) + 1]
            text = tokenizer.decode(response[:-1])
            reward = quiz_reward(text, row, False)
            if reward.score >= cfg.sdpo.success_threshold or reward.feedback.startswith("Format Error"):
                continue
            scored += 1
            teacher_prompt = sdpo.teacher_prompt_ids(tokenizer, row["messages"], None, reward.feedback, cfg.sdpo)
            with torch.no_grad():
                scale = 1 / cfg.rollout.temperature
                student = (model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1] * scale).log_softmax(-1)
                teacher = (model(torch.tensor([teacher_prompt + response])).logits[0, len(teacher_prompt) - 1:-1]
                           * scale).log_softmax(-1)
            kl = (teacher.exp() * (teacher - student)).sum(-1)
            targets = torch.tensor(response)[:, None]
            gap = (teacher.gather(-1, targets) - student.gather(-1, targets))[:, 0]
            classes, correct_ids = token_classes(tokenizer, response, text, row)
            for k, (name, correct) in enumerate(zip(classes, correct_ids)):
                total = totals.setdefault(name, [0, 0.0, 0.0])
                total[0], total[1], total[2] = total[0] + 1, total[1] + kl[k].item(), total[2] + gap[k].item()
                if correct is not None:
                    decisive.append((teacher[k, correct].exp().item(), student[k, correct].exp().item(), gap[k].item()))
    all_kl = sum(t[1] for t in totals.values())
    print(f"{sampled} answers sampled, {scored} wrong with lines marked right and wrong scored")
    print("| tokens | count | share of KL(T || S) | mean KL | mean T - S log-prob of the sampled token |")
    print("|---|---|---|---|---|")
    for name, (count, kl_sum, gap_sum) in sorted(totals.items()):
        print(f"| {name} | {count} | {kl_sum / all_kl:.1%} | {kl_sum / count:.3f} | {gap_sum / count:+.3f} |")
    mean = lambda i: sum(d[i] for d in decisive) / max(len(decisive), 1)
    print(f"decisive token of a wrong line ({len(decisive)} lines): p(correct character) teacher {mean(0):.3f}, "
          f"student {mean(1):.3f}; T - S log-prob of the sampled wrong character {mean(2):+.3f}")
    share = lambda marked: sum(t[1] for n, t in totals.items() if n == f"{marked} line, result") / all_kl
    print(f"RESULT feedback_kl_share_right_results={share('right'):.3f} feedback_kl_share_wrong_results="
          f"{share('wrong'):.3f} decisive_p_correct_teacher={mean(0):.3f} decisive_p_correct_student={mean(1):.3f} "
          f"decisive_t_minus_s_logprob={mean(2):+.3f}")


if __name__ == "__main__":
    main()
