"""SDPO teacher contexts: which sibling demonstrates for whom, and the teacher's input ids.

For every rollout the teacher (the same network, an EMA or trust-region copy) scores the
student's *exact* response ids under a richer prompt: the original question plus a
successful sibling's response (a "demonstration") and/or the environment's feedback,
then the instruction "Correctly solve the original question.". This file only
builds token ids; it runs no model. The choices made here (decoding, thinking removal,
trimming, escaping): docs/loop.md, Teacher contexts.
"""

import json
import random
import re
import string
from dataclasses import dataclass

import feedback
import tasks
from data import chat_prompt_ids, keep_images, truncate_middle
from feedback import printable

THINK_TAGS = ("<think>", "</think>")
TRIM_MARKER = "\n...\n"  # shows the teacher that text was dropped rather than splicing it silently
_MAX_FIT_ROUNDS = 8  # re-render rounds when trimming fields; boundary merges need 1-3


@dataclass
class SdpoConfig:
    """Teacher-context flags (--sdpo.*). Defaults are the ones used in the paper's runs."""
    success_threshold: float = 0.5  # a rollout is a success when its reward >= this
    dont_reprompt_on_self_success: bool = True  # a success never demonstrates for itself
    # False: a successful sample gets no teacher context (mask 0), so only failed samples are
    # distilled; in the hybrid a success keeps GRPO's advantage alone (docs/loop.md, Routing)
    distill_successes: bool = True
    remove_thinking_from_demonstration: bool = True
    # Demonstrations only: the paper's configuration without environment feedback. A weak
    # pretrained model reads feedback badly (docs/results.md); the tiny model's warm start teaches
    # it to, and tiny_models.py turns it on.
    include_environment_feedback: bool = False
    environment_feedback_only_without_solution: bool = True  # feedback only when no demonstration
    reprompt_template: str = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
    solution_template: str = "\nCorrect solution:\n\n{successful_previous_attempt}\n\n"
    feedback_template: str = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n"
    max_reprompt_len: int = 10240  # tokens of the teacher prompt (the response comes on top)


@dataclass
class TeacherBatch:
    """Teacher inputs for one rollout batch, in the batch's order."""
    input_ids: list[list[int]]  # teacher prompt ids + the student's exact response ids
    prompt_lens: list[int]  # length of the teacher prompt part of each
    mask: list[float]  # self_distillation_mask: 1.0 if the sample has a demonstration or used feedback
    demo_index: list[int | None]  # which sample of the batch served as the demonstration
    metrics: dict[str, float]  # sdpo/* fractions, see build_teacher_batch


# -----------------------------------------------------------------------------
# text pieces


def strip_thinking(text: str) -> str:
    """Remove `<think>...</think>` blocks (and the whitespace after them) from text; a leading
    `...</think>`, an unclosed `<think>`, and a text that is only thinking: docs/loop.md,
    Teacher contexts."""
    out = text
    close = out.find("</think>")
    if close >= 0 and not (0 <= out.find("<think>") < close):
        out = out[close + len("</think>"):].lstrip()
    out = re.sub(r"<think>.*?</think>\s*", "", out, flags=re.DOTALL)
    out = out.partition("<think>")[0]
    if not out.strip():
        out = text.replace("<think>", "").replace("</think>", "").strip()
    return out


def context_text(tokenizer, text: str, keep: tuple[str, ...] = ()) -> str:
    """Text made by a program or a model, as it may enter a teacher context: control characters
    escaped (feedback.printable) and every special token's text broken by a backslash after its
    first character ("<\\|im_end|>"), so that tokenizing the context cannot turn a program's
    output or a demonstration into chat-template tokens. `keep`: special tokens left whole."""
    specials = ({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
                | set(tokenizer.all_special_tokens)) - set(keep)
    specials = sorted((t for t in specials if len(t) > 1), key=len, reverse=True)
    text = printable(text)
    if specials:
        pattern = re.compile("|".join(map(re.escape, specials)))
        for _ in range(_MAX_FIT_ROUNDS):  # breaking one cannot form another unless a token holds "\\"
            text, n = pattern.subn(lambda m: m.group()[0] + "\\" + m.group()[1:], text)
            if not n:
                break
    return text


def reprompt_content(cfg: SdpoConfig, prompt, demonstration: str | None, feedback: str | None):
    """The teacher's last user message: the templates filled in (None = field left out). A prompt
    may be a list of parts (a prompt with pictures): the template's text then goes around them,
    and they stay as they are and in place, so the teacher sees the same pictures."""
    solution = "" if demonstration is None else cfg.solution_template.format(successful_previous_attempt=demonstration)
    fb = "" if feedback is None else cfg.feedback_template.format(feedback_raw=feedback)
    marker = "\x00prompt\x00"  # where a list of parts goes
    text = cfg.reprompt_template.format(prompt=prompt if isinstance(prompt, str) else marker, solution=solution,
                                        feedback=fb)
    if isinstance(prompt, str):
        return text
    before, after = text.split(marker)
    parts = [{"type": "text", "text": before}] + list(prompt) + [{"type": "text", "text": after}]
    merged = []
    for part in parts:  # adjacent text parts as one: the render equals the text-only prompt's
        if part["type"] == "text" and merged and merged[-1]["type"] == "text":
            merged[-1] = {"type": "text", "text": merged[-1]["text"] + part["text"]}
        elif part["type"] != "text" or part["text"]:
            merged.append(part)
    return merged


def _instruction(cfg: SdpoConfig) -> str:
    """The literal text of reprompt_template after its last field: the part never cut."""
    parts = list(string.Formatter().parse(cfg.reprompt_template))
    return parts[-1][0] if parts and parts[-1][1] is None else ""


# -----------------------------------------------------------------------------
# tokenisation under a length limit


def _tokenize(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _render(tokenizer, messages: list[dict], generation_prompt: bool = True) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _water_fill(lens: list[int], budget: int) -> list[int]:
    """Tokens to keep per field, sum <= budget: short fields stay whole, long ones share the rest."""
    keeps, left = [0] * len(lens), max(budget, 0)
    order = sorted(range(len(lens)), key=lambda k: lens[k])
    for n, k in enumerate(order):
        keeps[k] = min(lens[k], left // (len(lens) - n))
        left -= keeps[k]
    return keeps


def _trim_text(tokenizer, ids: list[int], keep: int) -> str:
    """The text of ids with its middle cut to `keep` tokens, the cut marked by TRIM_MARKER."""
    if keep >= len(ids):
        return tokenizer.decode(ids)
    head = keep // 2
    return tokenizer.decode(ids[:head]) + TRIM_MARKER + tokenizer.decode(ids[len(ids) - (keep - head):])


def _protected_tail(tokenizer, messages: list[dict], text: str, ids: list[int], instruction: str, limit: int) -> int:
    """How many trailing ids hold the instruction and the generation prompt (or, if those
    do not fit in limit, the generation prompt alone). +1 covers a token merged across the
    boundary, as in data.chat_prompt_ids."""
    pos = text.rfind(instruction.strip()) if instruction.strip() else -1
    if pos >= 0:
        tail = len(ids) - len(_tokenize(tokenizer, text[:pos])) + 1
        if tail < limit:
            return tail
    bare = _tokenize(tokenizer, _render(tokenizer, messages, generation_prompt=False))
    return len(ids) - len(bare) + 1


def teacher_prompt_ids(tokenizer, messages: list[dict], demonstration: str | None, feedback: str | None,
                       cfg: SdpoConfig) -> list[int]:
    """Token ids of the teacher prompt for one sample, at most cfg.max_reprompt_len long.

    Over the limit, the demonstration and feedback are cut in the middle (_water_fill) and the
    prompt rendered again until it fits, so the tokenisation stays the one a plain render gives;
    if the prompt and instruction alone do not fit, the render is cut in the middle with the
    instruction and generation prompt protected (docs/loop.md, Teacher contexts).
    """
    head, prompt, limit = list(messages[:-1]), messages[-1]["content"], cfg.max_reprompt_len
    # the one door into a teacher context for text the model or a program controls
    demonstration = None if demonstration is None else context_text(tokenizer, demonstration, keep=THINK_TAGS)
    feedback = None if feedback is None else context_text(tokenizer, feedback)

    def render(demo, fb):
        return _render(tokenizer, head + [{"role": "user", "content": reprompt_content(cfg, prompt, demo, fb)}])

    full_text = render(demonstration, feedback)
    ids = _tokenize(tokenizer, full_text)
    if not limit or len(ids) <= limit:
        return ids
    fields = [f for f in (demonstration, feedback) if f is not None]
    if fields and len(_tokenize(tokenizer, render(None, None))) <= limit:
        field_ids = [_tokenize(tokenizer, f) for f in fields]
        budget = sum(len(f) for f in field_ids) - (len(ids) - limit)
        for _ in range(_MAX_FIT_ROUNDS):
            if budget < 0:
                break
            keeps = _water_fill([len(f) for f in field_ids], budget)
            texts = [_trim_text(tokenizer, f, k) for f, k in zip(field_ids, keeps)]
            demo = texts.pop(0) if demonstration is not None else None
            fb = texts.pop(0) if feedback is not None else None
            trimmed = _tokenize(tokenizer, render(demo, fb))
            if len(trimmed) <= limit:
                return trimmed
            budget -= len(trimmed) - limit  # the marker and merges at the cut cost a few tokens
    # Prompt + instruction alone over the limit (or the frames around empty fields are):
    # cut the middle of the whole render, never the instruction or generation prompt.
    messages_out = head + [{"role": "user", "content": reprompt_content(cfg, prompt, demonstration, feedback)}]
    keep_tail = _protected_tail(tokenizer, messages_out, full_text, ids, _instruction(cfg), limit)
    if keep_tail >= limit:
        raise ValueError(f"sdpo.max_reprompt_len={limit} cannot hold even the chat template's generation prompt")
    return keep_images(tokenizer, ids, truncate_middle(ids, limit, keep_tail=keep_tail), "sdpo.max_reprompt_len")


# -----------------------------------------------------------------------------
# the batch


def build_teacher_batch(tokenizer, rows: list[dict], response_ids: list[list[int]], response_texts: list[str],
                        rewards: list[float], feedbacks: list[str], cfg: SdpoConfig) -> TeacherBatch:
    """Teacher inputs, self-distillation mask and metrics for a batch of rollouts.

    rows[i] is the prompt row of sample i; samples of the same prompt share rows[i]["uid"]
    and may come in any order. rewards[i] is sample i's total reward, feedbacks[i] its
    environment feedback ("" or None = none). Samples with mask 0 get their plain original
    prompt (same limit) + response, so every sample has a teacher input. Metrics: the sdpo/
    fractions of docs/metrics.md.
    """
    n = len(rows)
    for name, seq in (("response_ids", response_ids), ("response_texts", response_texts),
                      ("rewards", rewards), ("feedbacks", feedbacks)):
        if len(seq) != n:
            raise ValueError(f"build_teacher_batch: {name} has {len(seq)} entries for {n} rows")
    uids = [row["uid"] for row in rows]
    success = [float(r) >= cfg.success_threshold for r in rewards]

    successes, demo_index = _demonstrations(uids, success, cfg)
    routed = [success[i] and not cfg.distill_successes for i in range(n)]  # no teacher context
    demo_index = [None if routed[i] else j for i, j in enumerate(demo_index)]
    has_fb = [bool(f and f.strip()) for f in feedbacks]  # empty or whitespace-only: no feedback
    use_fb = [cfg.include_environment_feedback and has_fb[i] and not routed[i]
              and not (cfg.environment_feedback_only_without_solution and demo_index[i] is not None)
              for i in range(n)]
    mask = [1.0 if demo_index[i] is not None or use_fb[i] else 0.0 for i in range(n)]

    input_ids, prompt_lens = _teacher_inputs(tokenizer, rows, response_ids, feedbacks, demo_index, use_fb, mask, cfg)
    groups = set(uids)
    metrics = {
        "sdpo/groups_with_success": sum(1 for u in groups if successes[u]) / max(len(groups), 1),
        "sdpo/samples_with_success": sum(success) / max(n, 1),
        "sdpo/feedback_available": sum(has_fb) / max(n, 1),
        "sdpo/feedback_used": sum(use_fb) / max(n, 1),
        "sdpo/teacher_coverage": sum(mask) / max(n, 1),
    }
    return TeacherBatch(input_ids=input_ids, prompt_lens=prompt_lens, mask=mask, demo_index=demo_index, metrics=metrics)


def _demonstrations(uids: list, success: list[bool], cfg: SdpoConfig) -> tuple[dict, list]:
    """(each uid's successful samples, each sample's demonstration index or None): the first
    success of the group in batch order, not the sample itself if dont_reprompt_on_self_success."""
    successes = {uid: [] for uid in uids}
    for i, uid in enumerate(uids):
        if success[i]:
            successes[uid].append(i)
    demo_index = [next((j for j in successes[uid] if not (cfg.dont_reprompt_on_self_success and j == i)), None)
                  for i, uid in enumerate(uids)]
    return successes, demo_index


def _teacher_inputs(tokenizer, rows, response_ids, feedbacks, demo_index, use_fb, mask, cfg: SdpoConfig):
    """(teacher input ids, teacher prompt lengths): each sample's teacher prompt, then its own response ids."""
    # Special ids to drop when decoding demonstrations (think tags kept: strip_thinking finds them).
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids)
    keep_ids = {i for i in special if tokenizer.convert_ids_to_tokens(i) in THINK_TAGS}

    demo_text: dict[int, str] = {}  # sample j -> its demonstration text, decoded once
    prompt_cache: dict = {}  # (messages, demonstration, feedback) -> teacher prompt ids
    input_ids, prompt_lens = [], []
    for i, row in enumerate(rows):
        j = demo_index[i]
        if j is not None and j not in demo_text:  # without special tokens but think tags, thinking stripped
            text = tokenizer.decode([t for t in response_ids[j] if t not in special or t in keep_ids],
                                    skip_special_tokens=False)
            demo_text[j] = strip_thinking(text) if cfg.remove_thinking_from_demonstration else text
        demo = demo_text[j] if j is not None else None
        fb = feedbacks[i] if use_fb[i] else None
        # Siblings sharing a demonstration and no feedback get the same context: tokenise it once.
        # (Pictures are not in the messages: the ids hold a placeholder, expanded per row in the trainer.)
        key = (json.dumps(row["messages"]), demo, fb)
        if key not in prompt_cache:
            prompt_cache[key] = (teacher_prompt_ids(tokenizer, row["messages"], demo, fb, cfg) if mask[i]
                                 else chat_prompt_ids(tokenizer, row["messages"], cfg.max_reprompt_len))
        prompt = prompt_cache[key]
        input_ids.append(list(prompt) + list(response_ids[i]))  # the student's ids, unchanged
        prompt_lens.append(len(prompt))
    return input_ids, prompt_lens


def teacher_context_ids(tokenizer, row: dict, kind: str, rng: random.Random | None, cfg) -> list[int] | None:
    """The row's prompt as SDPO's teacher sees it: with the reference as the demonstration
    ("demonstration"), or with the feedback on a plausible wrong attempt ("feedback"; None
    when the task has no wrong-answer generator or the feedback is empty). cfg: config.Config.
    The warm start's teacher-context examples and the teacher gap's prompts."""
    if kind == "demonstration":
        return teacher_prompt_ids(tokenizer, row["messages"], row["reference"], None, cfg.sdpo)
    wrong = tasks.wrong_response(row, rng)
    if wrong is None:
        return None
    reward = feedback.score(feedback.reward_function(cfg, row), wrong, row, False)
    return teacher_prompt_ids(tokenizer, row["messages"], None, reward.feedback, cfg.sdpo) if reward.feedback else None
