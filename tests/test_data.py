"""
Tests for data.py (no engine): the tiny model and its tokenizer, the synthetic tasks, the
user-file loader, chat templating and truncation, padding and packing.

Each check compares against something computed another way: an independent evaluation of the
arithmetic, a re-implementation of the string ops, hand-worked index tables, hand-written
chat-template text.
Run: python -m pytest tests/test_data.py
"""

import gzip
import json
import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import data
import feedback
import packing
import run
import tasks
import tiny_models
from data import DataError
from tasks import TaskConfig
from tiny_models import TinyModelConfig

FAST = settings(max_examples=60, deadline=None)
SMALL = TinyModelConfig(num_layers=1, intermediate_size=128)  # quick to build, same tokenizer recipe
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


# -----------------------------------------------------------------------------
# the tiny model and tokenizer


def test_transformers_loads_the_tiny_model(tiny_dir, tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(tiny_dir)
    assert config.model_type == "qwen2"
    assert config.tie_word_embeddings
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM's CPU attention needs head_dim 64
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    ids = data.chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is 1 + 2?"}])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert torch.isfinite(logits).all()
    # tied: the LM head is the embedding matrix
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tokenizer_special_tokens_and_chat_template(tiny_dir, tokenizer):
    from transformers import GenerationConfig
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token == ENDOFTEXT
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer.chat_template
    for token in (IM_START, IM_END, ENDOFTEXT):  # each special token is one id
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    generation = GenerationConfig.from_pretrained(tiny_dir)
    eos = generation.eos_token_id
    assert tokenizer.eos_token_id in (eos if isinstance(eos, list) else [eos])
    assert generation.pad_token_id == tokenizer.pad_token_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert bare + "<|im_start|>assistant\n" == text


def test_tokenizer_digits_are_single_tokens_and_text_round_trips(tokenizer):
    ids = tokenizer("12345", add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([i]) for i in ids] == list("12345")
    for row in data.task_rows("arith", "train", 5) + data.task_rows("strops", "train", 5):
        text = row["messages"][0]["content"] + "\n" + row["reference"]
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_build_is_deterministic(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tiny_models.build_tiny_model(a, SMALL)
    tiny_models.build_tiny_model(b, SMALL)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    # a different seed gives different weights (so the comparison above can fail)
    c = str(tmp_path / "c")
    tiny_models.build_tiny_model(c, TinyModelConfig(**{**SMALL.__dict__, "seed": 1}))
    with open(os.path.join(a, "model.safetensors"), "rb") as fa, open(os.path.join(c, "model.safetensors"), "rb") as fc:
        assert fa.read() != fc.read()


def test_tiny_model_dir_builds_once_and_reuses_the_cache(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cache = str(tmp_path / "cache")
    path = tiny_models.tiny_model_dir(SMALL, cache_dir=cache)
    assert os.path.dirname(path) == cache
    with open(os.path.join(path, "recipe.json")) as f:
        recipe = json.load(f)
    assert recipe["source"] == tiny_models.source_hash(tiny_models.TINY_SOURCES) and recipe["num_layers"] == 1
    assert [n for n in os.listdir(cache) if n.startswith(".build-")] == []  # no temporary left behind
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 1
    assert AutoTokenizer.from_pretrained(path).eos_token == IM_END
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny_models, "build_tiny_model", no_build)
    assert tiny_models.tiny_model_dir(SMALL, cache_dir=cache) == path
    assert tiny_models.tiny_model_dir(TinyModelConfig(**SMALL.__dict__), cache_dir=cache) == path  # equal, not identical
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    # SDPO_CACHE is the default cache directory
    monkeypatch.setenv("SDPO_CACHE", cache)
    assert tiny_models.tiny_model_dir(SMALL) == path


def test_a_changed_recipe_gets_a_new_cache_path(tmp_path, monkeypatch):
    built = []

    def fake_build(out_dir, cfg):
        built.append(cfg)
        with open(os.path.join(out_dir, "marker"), "w") as f:
            f.write(json.dumps(cfg.__dict__))
        return out_dir

    monkeypatch.setattr(tiny_models, "build_tiny_model", fake_build)
    cache = str(tmp_path)
    base = tiny_models.tiny_model_dir(SMALL, cache_dir=cache)
    assert tiny_models.tiny_model_dir(SMALL, cache_dir=cache) == base and len(built) == 1
    paths = {base}
    for change in ({"seed": 1}, {"vocab_size": 512}, {"hidden_size": 256}, {"num_layers": 2},
                   {"intermediate_size": 256}, {"max_position_embeddings": 1024}):
        path = tiny_models.tiny_model_dir(TinyModelConfig(**{**SMALL.__dict__, **change}), cache_dir=cache)
        assert path not in paths, change
        paths.add(path)
    monkeypatch.setattr(tiny_models, "source_hash", lambda files: "edited")  # the code it runs changed
    bumped = tiny_models.tiny_model_dir(SMALL, cache_dir=cache)
    assert bumped not in paths
    assert len(built) == 8
    assert all(os.path.exists(os.path.join(p, "marker")) for p in paths | {bumped})


def test_the_cache_keys_follow_the_code_a_build_runs(tmp_path, monkeypatch):
    """An edit to a task generator's code gives the tiny model and its warm start new cache
    entries; an edit to its comments or docstrings, or to a file the build does not run, does not."""
    import warm_start
    monkeypatch.setattr(tiny_models, "build_tiny_model", lambda out_dir, cfg: out_dir)
    generator = tmp_path / "strops.py"
    with open(os.path.join(tiny_models.PROJECT_DIR, "tasks", "strops.py")) as f:
        original = f.read()

    def keys(source: str):
        generator.write_text(source)
        swap = lambda files: tuple(str(generator) if f == "tasks/strops.py" else f for f in files)
        monkeypatch.setattr(tiny_models, "TINY_SOURCES", swap(tiny_models.TINY_SOURCES))
        monkeypatch.setattr(warm_start, "WARM_START_SOURCES", swap(warm_start.WARM_START_SOURCES))
        tiny = tiny_models.tiny_model_dir(SMALL, cache_dir=str(tmp_path / "cache"))
        return tiny, warm_start.warm_start_config(run.parse_config([]), tiny).log.out_dir

    base = keys(original)
    assert keys(original.replace('"""', '"""Edited. ', 1) + "\n# a comment\n") == base
    edited = keys(original + "\nOPS_ADDED = 1\n")
    assert edited[0] != base[0] and edited[1] != base[1]
    assert all(f.endswith(".py") for f in warm_start.WARM_START_SOURCES)  # README, docs, benches: not in a key


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken_build(out_dir, cfg):
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(tiny_models, "build_tiny_model", broken_build)
    with pytest.raises(RuntimeError, match="disk on fire"):
        tiny_models.tiny_model_dir(SMALL, cache_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []  # neither a half-built model nor a temporary directory


# -----------------------------------------------------------------------------
# synthetic tasks


def _uids(rows):
    return [r["uid"] for r in rows]


@pytest.mark.parametrize("task", ["arith", "strops", "quiz"])
def test_train_and_test_rows_are_disjoint(task):
    test = data.task_rows(task, "test", 30)
    test_uids = set(_uids(test))
    assert len(test_uids) == 30
    for seed in range(4):
        train = data.task_rows(task, "train", 300, seed=seed)
        assert len(set(_uids(train))) == 300  # distinct within the split
        assert not test_uids & set(_uids(train)), seed
    # the row schema is complete
    for row in test[:3]:
        assert set(row) >= {"uid", "messages", "answer", "tests", "teacher_response", "reference", "reward", "source"}
        assert row["teacher_response"] is None
        assert row["messages"][-1]["role"] == "user"


@pytest.mark.parametrize("task", ["arith", "strops", "quiz"])
def test_rows_are_deterministic_and_stable_across_n(task):
    assert data.task_rows(task, "train", 20) == data.task_rows(task, "train", 20)
    assert data.task_rows(task, "train", 10)[:5] == data.task_rows(task, "train", 5)
    assert data.task_rows(task, "test", 30)[:10] == data.task_rows(task, "test", 10)
    # the seed changes the training rows but not the held-out rows: every run evaluates on the same set
    assert _uids(data.task_rows(task, "train", 20, seed=1)) != _uids(data.task_rows(task, "train", 20, seed=0))
    assert data.task_rows(task, "test", 10, seed=7) == data.task_rows(task, "test", 10, seed=0)


@pytest.mark.parametrize("task", ["arith", "strops", "quiz"])
def test_split_of_a_row_never_depends_on_n_or_seed(task):
    # Collect which split each uid landed in, over many (n, seed) draws: no uid is ever in both.
    split_of = {}
    draws = [("train", n, seed) for n in (5, 50, 200) for seed in (0, 1, 2, 3)] + [("test", n, 0) for n in (5, 20)]
    for split, n, seed in draws:
        for uid in _uids(data.task_rows(task, split, n, seed=seed)):
            assert split_of.setdefault(uid, split) == split, uid
    # a larger held-out share only moves rows from train to test, never the other way
    train_50 = set(_uids(data.task_rows(task, "train", 100, cfg=TaskConfig(heldout_percent=50))))
    assert not set(_uids(data.task_rows(task, "test", 30))) & train_50


@pytest.mark.parametrize("task,cfg", [
    ("arith", TaskConfig()),
    ("strops", TaskConfig(strops_max_ops=1, strops_str_len=3, strops_alphabet="abc", strops_hidden=0)),
    ("quiz", TaskConfig(quiz_questions=2, quiz_max=5)),
])
def test_uid_identifies_the_question(task, cfg):
    # across seeds and splits, one uid always means one question (and for arithmetic, where no
    # two expressions read alike, one question always has one uid)
    by_uid, by_prompt = {}, {}
    rows = [r for seed in range(4) for r in data.task_rows(task, "train", 100, seed=seed, cfg=cfg)]
    rows += data.task_rows(task, "test", 10, cfg=cfg)
    for row in rows:
        key = (json.dumps(row["messages"]), json.dumps(row["tests"]), row["answer"])
        assert by_uid.setdefault(row["uid"], key) == key, row["uid"]
        if task in ("arith", "quiz"):
            assert by_prompt.setdefault(key, row["uid"]) == row["uid"], key
    assert len(by_uid) < len(rows)  # the seeds drew some rows twice: the checks compared something


def test_task_rows_errors():
    with pytest.raises(ValueError, match="unknown task"):
        data.task_rows("chess", "train", 1)
    with pytest.raises(ValueError, match="split"):
        data.task_rows("arith", "valid", 1)
    with pytest.raises(ValueError, match="fewer than"):  # at most 100 one-digit additions exist
        data.task_rows("arith", "train", 150, cfg=TaskConfig(arith_digits=1, arith_ops="+"))
    with pytest.raises(ValueError, match="fewer than"):  # nothing is held out
        data.task_rows("arith", "test", 1, cfg=TaskConfig(heldout_percent=0), at_most=True)


def test_held_out_rows_are_all_there_are_where_the_split_has_fewer():
    """--data.eval_rows is an upper bound for a synthetic task's held-out split (run.py's default
    asks for more than one-digit sums have), and the rows are the first of the full draw."""
    small = TaskConfig(arith_digits=1, arith_ops="+")
    every = data.task_rows("arith", "test", 1000, cfg=small, at_most=True)
    assert 0 < len(every) < 100 and len(set(_uids(every))) == len(every)
    assert all(data.split_of(uid, small.heldout_percent) == "test" for uid in _uids(every))
    assert _uids(data.task_rows("arith", "test", 3, cfg=small)) == _uids(every)[:3]
    cfg = run.parse_config(["--data.task=arith", "--data.arith_digits=1", "--data.arith_ops=+", "--data.train_rows=50"])
    assert _uids(run.read_rows(cfg)[1]) == _uids(every)


ARITH = re.compile(r"^What is (\d+) ([-+*]) (\d+)\? ")


def _parse_arith(row):
    m = ARITH.match(row["messages"][0]["content"])
    assert m, row["messages"][0]["content"]
    return int(m.group(1)), m.group(2), int(m.group(3))


def test_arith_answer_is_correct():
    rows = data.task_rows("arith", "train", 200, cfg=TaskConfig(arith_ops="+-*")) + data.task_rows("arith", "test", 20)
    ops_seen = set()
    for row in rows:
        a, op, b = _parse_arith(row)
        ops_seen.add(op)
        expected = a + b if op == "+" else a - b if op == "-" else a * b
        assert row["answer"] == str(expected)
        assert row["reference"].endswith(f"Answer: {expected}")
        assert tasks.arith.INSTRUCTION in row["messages"][0]["content"]
        assert row["reward"] == "math" and row["tests"] is None
    assert ops_seen == {"+", "-", "*"}
    assert any(int(r["answer"]) < 0 for r in rows)  # subtraction reaches negative answers


def test_arith_knobs_change_the_rows():
    default = data.task_rows("arith", "train", 50)
    for a, _, b in map(_parse_arith, default):
        assert 10 <= a <= 99 and 10 <= b <= 99
    three = data.task_rows("arith", "train", 50, cfg=TaskConfig(arith_digits=3))
    for a, _, b in map(_parse_arith, three):
        assert 100 <= a <= 999 and 100 <= b <= 999
    one = data.task_rows("arith", "train", 50, cfg=TaskConfig(arith_digits=1))
    for a, _, b in map(_parse_arith, one):
        assert 0 <= a <= 9 and 0 <= b <= 9
    times = data.task_rows("arith", "train", 50, cfg=TaskConfig(arith_ops="*"))
    assert {op for _, op, _ in map(_parse_arith, times)} == {"*"}
    assert {op for _, op, _ in map(_parse_arith, default)} == {"+", "-"}


# An independent implementation of the string ops (not tasks.strops.OPS).
def _my_op(op, s):
    if op == "reverse":
        return "".join(s[i] for i in range(len(s) - 1, -1, -1))
    if op == "upper":
        return "".join(chr(ord(c) - 32) if "a" <= c <= "z" else c for c in s)
    if op == "lower":
        return "".join(chr(ord(c) + 32) if "A" <= c <= "Z" else c for c in s)
    if op == "swapcase":
        return "".join(_my_op("upper", c) if c.islower() else _my_op("lower", c) for c in s)
    if op == "sort":
        out = list(s)
        for i in range(len(out)):  # insertion sort by code point
            j = i
            while j > 0 and out[j - 1] > out[j]:
                out[j - 1], out[j] = out[j], out[j - 1]
                j -= 1
        return "".join(out)
    if op == "dedup":
        out = ""
        for c in s:
            if c not in out:
                out += c
        return out
    if op == "rotl":
        return s[1:] + s[0] if s else s
    if op == "rotr":
        return s[-1] + s[:-1] if s else s
    if op == "double":
        return "".join(c * 2 for c in s)
    if op == "dropfirst":
        return s[1:]
    if op == "droplast":
        return s[:len(s) - 1] if s else s
    if op == "evens":
        return "".join(c for i, c in enumerate(s) if i % 2 == 0)
    if op == "odds":
        return "".join(c for i, c in enumerate(s) if i % 2 == 1)
    raise KeyError(op)


def test_my_ops_match_hand_worked_examples():
    examples = {"reverse": "Aba", "upper": "ABA", "lower": "aba", "swapcase": "ABa", "sort": "Aab",
                "dedup": "abA", "rotl": "bAa", "rotr": "Aab", "double": "aabbAA", "dropfirst": "bA",
                "droplast": "ab", "evens": "aA", "odds": "b"}
    for op, out in examples.items():
        assert _my_op(op, "abA") == out, op
    from tasks.strops import OPS
    assert set(examples) == set(OPS)  # every op of the DSL is covered


def test_strops_expected_outputs_agree_with_an_independent_implementation():
    rows = data.task_rows("strops", "train", 200) + data.task_rows("strops", "test", 20)
    ops_seen = set()
    for row in rows:
        program = row["answer"].split(" | ")
        ops_seen.update(program)
        assert row["reference"] == "Program: " + row["answer"]
        assert len(row["tests"]) == 4
        for case in row["tests"]:
            out = case["input"]
            for op in program:
                out = _my_op(op, out)
            assert case["output"] == out, (program, case)
        prompt = row["messages"][0]["content"]
        lines = prompt.split("\n")
        assert lines[:2] == [f"{c['input']} -> {c['output']}" for c in row["tests"][:2]]
        assert lines[2] == tasks.strops.INSTRUCTION
        for case in row["tests"][2:]:  # hidden tests stay hidden
            assert case["input"] not in prompt
        assert len({c["input"] for c in row["tests"]}) == 4
    from tasks.strops import OPS
    assert ops_seen == set(OPS)


def test_strops_knobs_change_the_rows():
    default = data.task_rows("strops", "train", 100)
    assert {len(r["answer"].split(" | ")) for r in default} == {1}  # single-op programs by default
    two = data.task_rows("strops", "train", 100, cfg=TaskConfig(strops_max_ops=2))
    assert {len(r["answer"].split(" | ")) for r in two} == {1, 2}
    cfg = TaskConfig(strops_max_ops=4, strops_str_len=7, strops_shown=3, strops_hidden=1, strops_alphabet="xyz")
    rows = data.task_rows("strops", "train", 100, cfg=cfg)
    assert {len(r["answer"].split(" | ")) for r in rows} == {1, 2, 3, 4}
    for row in rows:
        assert len(row["tests"]) == 4
        assert all(len(c["input"]) == 7 and set(c["input"]) <= set("xyz") for c in row["tests"])
        lines = row["messages"][0]["content"].split("\n")
        assert lines[:3] == [f"{c['input']} -> {c['output']}" for c in row["tests"][:3]]
        assert lines[3] == tasks.strops.INSTRUCTION
    single = data.task_rows("strops", "train", 50, cfg=TaskConfig(strops_max_ops=1))
    assert all(" | " not in r["answer"] for r in single)
    more_tests = data.task_rows("strops", "train", 20, cfg=TaskConfig(strops_hidden=5))
    assert all(len(r["tests"]) == 7 for r in more_tests)


@pytest.mark.parametrize("task", ["arith", "strops", "quiz"])
def test_the_reference_response_scores_full_reward(task):
    rows = data.task_rows(task, "train", 100) + data.task_rows(task, "test", 20)
    for row in rows:
        fn = feedback.get_reward_fn(row["reward"])
        assert fn(row["reference"], row, False).score == 1.0, row["uid"]
    # and a wrong response does not (the check can fail)
    row = rows[0]
    fn = feedback.get_reward_fn(row["reward"])
    if task == "arith":
        wrong = f"Answer: {int(row['answer']) + 1}"
    elif task == "quiz":
        wrong = row["reference"] + "0"  # the last result times ten
    else:
        wrong = "Program: " + " | ".join(["double"] * 3)
        row = {**row, "tests": [{"input": "ab", "output": "ab"}]}  # 'double' three times never maps ab to ab
    assert fn(wrong, row, False).score == 0.0


QUIZ_LINE = re.compile(r"^[a-z]:(\d+)([-+*])(\d+)$")


def _quiz_value(question):
    a, op, b = QUIZ_LINE.match(question).groups()
    a, b = int(a), int(b)
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_quiz_results_are_correct_and_only_the_questions_are_shown():
    rows = data.task_rows("quiz", "train", 200, cfg=TaskConfig(quiz_ops="+-*")) + data.task_rows("quiz", "test", 20)
    ops_seen = set()
    for row in rows:
        questions = row["messages"][0]["content"].split("\n")
        assert questions[-1] == tasks.quiz.INSTRUCTION and len(questions) == 4
        assert [t["input"] for t in row["tests"]] == questions[:-1]
        for t in row["tests"]:
            assert t["output"] == str(_quiz_value(t["input"])) and int(t["output"]) >= 0
            ops_seen.add(QUIZ_LINE.match(t["input"]).group(2))
        assert row["reference"] == "\n".join(f"{t['input']}={t['output']}" for t in row["tests"])
        assert [q[0] for q in questions[:-1]] == ["a", "b", "c"]
        assert row["reward"] == "quiz" and row["uid"] == "quiz:" + ",".join(questions[:-1])
    assert ops_seen == {"+", "-", "*"}


def test_quiz_knobs_change_the_rows():
    operands = lambda rows: {int(x) for r in rows for t in r["tests"] for x in QUIZ_LINE.match(t["input"]).group(1, 3)}
    default = data.task_rows("quiz", "train", 100)
    assert operands(default) == set(range(2, 21)) and {len(r["tests"]) for r in default} == {3}
    assert {QUIZ_LINE.match(t["input"]).group(2) for r in default for t in r["tests"]} == {"+", "*"}
    wide = data.task_rows("quiz", "train", 100, cfg=TaskConfig(quiz_max=6, quiz_questions=6, quiz_ops="*"))
    assert operands(wide) == set(range(2, 7)) and {len(r["tests"]) for r in wide} == {6}
    assert {QUIZ_LINE.match(t["input"]).group(2) for r in wide for t in r["tests"]} == {"*"}
    with pytest.raises(ValueError, match="labelled a-z"):
        data.task_rows("quiz", "train", 1, cfg=TaskConfig(quiz_questions=27))
    assert {r["quiz_feedback"] for r in default} == {"marks"}
    values = data.task_rows("quiz", "train", 100, cfg=TaskConfig(quiz_feedback="values"))
    assert [r["uid"] for r in values] == [r["uid"] for r in default]  # the wording changes no question
    assert {r["quiz_feedback"] for r in values} == {"values"}
    with pytest.raises(ValueError, match="--data.quiz_feedback='numbers': choose from"):
        data.task_rows("quiz", "train", 1, cfg=TaskConfig(quiz_feedback="numbers"))


@pytest.mark.parametrize("task", ["arith", "strops", "quiz"])
def test_wrong_responses_fail_with_feedback(task):
    """What the warm start and the teacher gap show as a failed attempt really fails, and its
    feedback never holds the reference answer."""
    import random
    rng = random.Random(0)
    for row in data.task_rows(task, "train", 100):
        wrong = tasks.wrong_response(row, rng)
        reward = feedback.get_reward_fn(row["reward"])(wrong, row, False)
        assert reward.score == 0.0, (row["uid"], wrong)
        assert row["reference"] not in reward.feedback
        if task != "arith":  # the math reward says nothing about a well-formed wrong number
            assert reward.feedback


def test_wrong_quiz_responses_are_slips_on_some_lines():
    import random
    rng, wrong_lines = random.Random(1), []
    for row in data.task_rows("quiz", "train", 200):
        lines = tasks.wrong_response(row, rng).split("\n")
        assert [ln.split("=")[0] for ln in lines] == [t["input"] for t in row["tests"]]
        diffs = [int(ln.split("=")[1]) - int(t["output"]) for ln, t in zip(lines, row["tests"])]
        wrong_lines.append(sum(d != 0 for d in diffs))
        for t, d in zip(row["tests"], diffs):  # off by one or two, or a neighbouring table entry a*(b±1)
            a, op, _ = QUIZ_LINE.match(t["input"]).groups()[:3]
            assert d == 0 or abs(d) <= 2 or (op == "*" and abs(d) == int(a)), (t, d)
    # each line wrong with probability 1/3, given at least one of 3 is: 1 / (1 - (2/3)^3) = 27/19 wrong lines
    assert min(wrong_lines) == 1 and max(wrong_lines) == 3 and abs(sum(wrong_lines) / len(wrong_lines) - 27 / 19) < 0.15


# -----------------------------------------------------------------------------
# user files: JSONL and Parquet


def _write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)


MAPPED = "prompt=question,answer=solution,system=sys,uid=id,tests=cases,teacher_response=demo"


def test_jsonl_with_a_field_mapping(tmp_path):
    tests = [{"input": "ab", "output": "ba"}]
    path = _write_jsonl(tmp_path / "train.jsonl", [
        {"question": "What is 2 + 2?", "solution": 4, "sys": "Be brief.", "id": 7, "extra": "ignored"},
        "",  # blank lines are skipped (and still counted in row numbers)
        {"question": [{"role": "system", "content": "old system"}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}],
         "solution": 2.5, "cases": json.dumps(tests), "demo": "Answer: 2.5", "sys": "New system."},
        {"question": "Reverse it.", "cases": tests, "solution": None, "demo": 12},
        {"question": "Map.", "cases": {"inputs": ["a", "b"], "outputs": ["A", "B"]}},
    ])
    rows = data.load_rows(path, fields=MAPPED, reward="code")
    assert len(rows) == 4
    r0, r1, r2, r3 = rows
    assert r0["messages"] == [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "What is 2 + 2?"}]
    assert r0["answer"] == "4" and r0["uid"] == "7" and r0["tests"] is None
    assert r0["reward"] == "code" and r0["source"] == f"{path}, row 1"
    assert r0["teacher_response"] is None and r0["reference"] is None
    # chat messages as the prompt; the system field replaces the prompt's own system message
    assert r1["messages"] == [{"role": "system", "content": "New system."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    assert r1["answer"] == "2.5"
    assert r1["tests"] == tests  # decoded from a JSON string
    assert r1["teacher_response"] == "Answer: 2.5" and r1["reference"] == "Answer: 2.5"
    assert r1["uid"] == "train.jsonl:3" and r1["source"] == f"{path}, row 3"
    assert r2["messages"] == [{"role": "user", "content": "Reverse it."}]
    assert r2["tests"] == tests and r2["answer"] is None
    assert r2["teacher_response"] == "12"  # numbers become strings
    assert r3["tests"] == [{"input": "a", "output": "A"}, {"input": "b", "output": "B"}]
    limited = data.load_rows(path, fields=MAPPED, reward="code", limit=2)
    assert limited == rows[:2]


def test_jsonl_default_field_names(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q?", "answer": "A", "uid": "u1"}])
    (row,) = data.load_rows(path)
    assert row["messages"] == [{"role": "user", "content": "Q?"}]
    assert row["answer"] == "A" and row["uid"] == "u1" and row["reward"] == "math"


def test_parquet_with_a_field_mapping(tmp_path):
    tests = [{"input": "ab", "output": "ba"}, {"input": "c", "output": "c"}]
    records = [
        {"question": "What is 2 + 2?", "solution": 4, "sys": "Be brief.", "id": 10,
         "cases": json.dumps(tests), "demo": None},
        {"question": "Reverse.", "solution": 7, "sys": None, "id": 11, "cases": json.dumps(tests[:1]), "demo": "x"},
    ]
    rows = data.load_rows(_write_parquet(tmp_path / "t.parquet", records), fields=MAPPED, reward="strops")
    assert [r["uid"] for r in rows] == ["10", "11"]
    assert rows[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 2 + 2?"}]
    assert rows[1]["messages"] == [{"role": "user", "content": "Reverse."}]
    assert [r["answer"] for r in rows] == ["4", "7"]  # an int64 column becomes strings
    assert rows[0]["tests"] == tests and rows[1]["tests"] == tests[:1]
    assert rows[1]["teacher_response"] == "x" and rows[0]["teacher_response"] is None
    assert rows[1]["source"].endswith("t.parquet, row 2")
    # chat messages and tests stored as nested Parquet columns (list<struct>)
    nested = [{"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
               "tests": tests, "answer": 1.5}]
    (row,) = data.load_rows(_write_parquet(tmp_path / "n.parquet", nested))
    assert row["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert row["tests"] == tests and row["answer"] == "1.5"
    assert row["uid"] == "n.parquet:1"


CODE_TESTS = [{"input": "1 2\n", "output": "3"},
              {"fn": "Solution.add", "args": [1, [2, 3]], "kwargs": {"k": 1}, "expected": [1, 2], "tol": 0.001},
              {"fn": "add", "args": [], "expected": None},
              {"fn": "add", "assert": "assert candidate(1, 2) == 3\n"}]


def test_code_test_kinds_from_jsonl_gz_and_parquet(tmp_path):
    """Function-call and assert tests beside stdin/stdout; .jsonl.gz files; Parquet's nulls for the
    other kinds' columns are dropped (a stored expected null stays)."""
    path = tmp_path / "code.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"prompt": "p", "tests": CODE_TESTS}) + "\n")
    (row,) = data.load_rows(str(path), reward="code")
    assert row["tests"] == [CODE_TESTS[0], CODE_TESTS[1], {**CODE_TESTS[2], "kwargs": {}}, CODE_TESTS[3]]
    assert row["source"] == f"{path}, row 1"
    unified = [{"input": None, "output": None, "fn": "f", "args": None, "kwargs": None, "expected": 2,
                "assert": None}]  # what Parquet gives for a call test stored beside stdin tests
    (row,) = data.load_rows(_write_jsonl(tmp_path / "u.jsonl", [{"prompt": "p", "tests": unified}]))
    assert row["tests"] == [{"fn": "f", "args": [], "kwargs": {}, "expected": 2}]
    (row,) = data.load_rows(_write_parquet(tmp_path / "c.parquet", [{"prompt": "p", "tests": json.dumps(CODE_TESTS)}]))
    assert row["tests"][3] == CODE_TESTS[3]


@pytest.mark.parametrize("test, message", [
    ({"fn": "f", "args": [1]}, "needs 'expected'"),
    ({"fn": "f(x)", "expected": 1}, "'fn' must be a name"),
    ({"fn": "f", "args": 1, "expected": 1}, "'args' must be a list"),
    ({"fn": "f", "kwargs": [1], "expected": 1}, "'kwargs' must be a dict"),
    ({"fn": "f", "expected": 1, "tol": "small"}, "'tol' must be a non-negative number"),
    ({"fn": "f", "assert": "assert (1"}, "'assert' is not valid Python"),
    ({"fn": "f", "assert": 3}, "'assert' must be test code"),
    ({"cmd": "ls"}, "expected one of"),
])
def test_bad_code_tests_name_file_row_field_and_test(tmp_path, test, message):
    path, msg = _error(tmp_path, [{"prompt": "p", "tests": [{"input": "", "output": ""}, test]}])
    assert msg.startswith(f"{path}, row 1, field 'tests' (column 'tests'), test 1: ") and message in msg, msg


def _error(tmp_path, records, fields="", name="bad.jsonl"):
    path = (_write_parquet if name.endswith(".parquet") else _write_jsonl)(tmp_path / name, records)
    with pytest.raises(DataError) as info:
        data.load_rows(path, fields=fields)
    return path, str(info.value)


def test_bad_json_line_names_file_and_row(tmp_path):
    path, msg = _error(tmp_path, [{"prompt": "ok"}, '{"prompt": "broken"'])
    assert msg.startswith(f"{path}, row 2:") and "not valid JSON" in msg
    path, msg = _error(tmp_path, [{"prompt": "ok"}, "", "[1, 2]"])
    assert msg.startswith(f"{path}, row 3:") and "JSON object" in msg and "list" in msg


def test_missing_prompt_names_file_row_field_and_column(tmp_path):
    path, msg = _error(tmp_path, [{"question": "ok"}, {"q": "where is it"}], fields="prompt=question")
    assert msg.startswith(f"{path}, row 2, field 'prompt' (column 'question')")
    assert "missing" in msg and "['q']" in msg  # shows the columns the row has
    path, msg = _error(tmp_path, [{"prompt": None}])
    assert msg.startswith(f"{path}, row 1, field 'prompt'") and "missing" in msg


def test_bad_messages_name_file_row_field_and_message(tmp_path):
    path, msg = _error(tmp_path, [{"prompt": "fine"}, {"prompt": [{"role": "user", "content": "a"},
                                                                  {"role": "user", "content": 5}]}])
    assert msg.startswith(f"{path}, row 2, field 'prompt'") and "message 1" in msg
    path, msg = _error(tmp_path, [{"prompt": [{"content": "no role"}]}])
    assert msg.startswith(f"{path}, row 1, field 'prompt'") and "message 0" in msg
    path, msg = _error(tmp_path, [{"prompt": []}])
    assert msg.startswith(f"{path}, row 1, field 'prompt'") and "non-empty" in msg
    path, msg = _error(tmp_path, [{"prompt": 42}])
    assert msg.startswith(f"{path}, row 1, field 'prompt'")


@pytest.mark.parametrize("tests", [
    [{"input": "a"}],  # no output
    [{"input": "a", "output": 1}],  # output not a string
    ["a -> b"],  # not a dict
    {"input": "a", "output": "b"},  # one test, not a list
    5,
    "[{\"input\": \"a\"",  # a string that is not JSON
    json.dumps([{"input": 1, "output": 2}]),  # JSON of the wrong shape
])
def test_tests_of_the_wrong_shape_name_file_row_and_field(tmp_path, tests):
    path, msg = _error(tmp_path, [{"q": "fine", "t": [{"input": "x", "output": "y"}]}, {"q": "p", "t": tests}],
                       fields="prompt=q,tests=t")
    assert msg.startswith(f"{path}, row 2, field 'tests' (column 't')"), msg


@pytest.mark.parametrize("tests", [{"inputs": ["1", "2"], "outputs": ["1"]}, {"inputs": ["1", "2"]}])
def test_tests_dict_with_unmatched_inputs_and_outputs_is_an_error(tmp_path, tests):
    path, msg = _error(tmp_path, [{"prompt": "p", "tests": tests}])
    assert msg.startswith(f"{path}, row 1, field 'tests'"), msg


@pytest.mark.parametrize("field,value,type_name", [
    ("answer", ["4"], "list"), ("answer", True, "bool"), ("answer", {"v": 1}, "dict"),
    ("teacher_response", ["x"], "list"), ("system", 3, "int"),
])
def test_fields_of_the_wrong_type_name_file_row_and_field(tmp_path, field, value, type_name):
    path, msg = _error(tmp_path, [{"prompt": "p", field: value}])
    assert msg.startswith(f"{path}, row 1, field '{field}'"), msg
    assert f"got {type_name}" in msg


def test_parquet_errors_name_the_row(tmp_path):
    path, msg = _error(tmp_path, [{"prompt": "ok", "answer": "1"}, {"prompt": None, "answer": "2"}],
                       name="bad.parquet")
    assert msg.startswith(f"{path}, row 2, field 'prompt'") and "missing" in msg
    path, msg = _error(tmp_path, [{"prompt": "ok", "answer": ["1"]}], name="list.parquet")
    assert msg.startswith(f"{path}, row 1, field 'answer'") and "got list" in msg


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        data.load_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("prompt\nhi\n")
    with pytest.raises(DataError, match=r"unsupported file type \(use .jsonl, .jsonl.gz or .parquet\)"):
        data.load_rows(str(tmp_path / "x.csv"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        data.load_rows(str(tmp_path / "empty.jsonl"))
    path = _write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "p"}])
    for spec in ("question=prompt", "prompt=", "prompt"):
        with pytest.raises(DataError, match="bad field mapping"):
            data.load_rows(path, fields=spec)


def test_parse_field_map():
    mapping = data.parse_field_map(" prompt=question , answer=solution,")
    assert mapping["prompt"] == "question" and mapping["answer"] == "solution"
    assert mapping["tests"] == "tests" and mapping["uid"] == "uid"
    assert set(mapping) == set(data.FIELDS)


# Bad input fails while the file is read, naming the file, the row and the field.


def test_a_byte_that_is_not_utf8_names_file_row_and_column(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n\n{"prompt": "caf\xe9 au lait"}\n')
    with pytest.raises(DataError) as info:
        data.load_rows(str(path))
    assert str(info.value) == f"{path}, row 3: not UTF-8 (byte 0xe9 at column 16); save the file as UTF-8"
    # the column counts characters, as an editor does: the two-byte ü before it is one
    path = tmp_path / "train.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write('{"prompt": "ü'.encode() + b'\xff"}\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}, row 1: not UTF-8 \(byte 0xff at column 14\)"):
        data.load_rows(str(path))


def test_a_damaged_gzip_file_names_file_and_row(tmp_path):
    whole = gzip.compress(b"".join(json.dumps({"prompt": f"q{i}"}).encode() + b"\n" for i in range(5000)))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[:len(whole) // 2])  # a download cut short
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}, row \d+: cannot be read \(Compressed file ended"):
        data.load_rows(str(path))
    path = tmp_path / "plain.jsonl.gz"
    path.write_text('{"prompt": "p"}\n')  # not compressed at all
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}, row 1: cannot be read \(Not a gzipped file"):
        data.load_rows(str(path))

def test_a_parquet_string_that_is_not_utf8_names_file_row_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    # pyarrow checks UTF-8 when it builds a string column from Python, not when it reads one from
    # a file: build the column from its buffers, as another writer would have stored it
    texts = [b"ok"] * 1100
    texts[1049] = b"caf\xe9"
    offsets = pa.array([sum(map(len, texts[:i])) for i in range(len(texts) + 1)], pa.int32()).buffers()[1]
    prompts = pa.Array.from_buffers(pa.string(), len(texts), [None, offsets, pa.py_buffer(b"".join(texts))])
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"answer": ["1"] * len(texts), "prompt": prompts}), path)
    with pytest.raises(DataError) as info:
        data.load_rows(path)  # row 1050: in the second batch of rows read
    assert str(info.value) == f"{path}, row 1050, column 'prompt': not UTF-8 (byte 0xe9 at character 4 of a string)"


def test_an_overlong_row_is_refused_before_it_is_parsed_or_read_whole(tmp_path, monkeypatch):
    import tracemalloc
    monkeypatch.setattr(data, "MAX_ROW_BYTES", 1000)
    big = {"prompt": "p", "tests": [{"input": "x" * 4_000_000, "output": ""}]}
    path = _write_jsonl(tmp_path / "big.jsonl", [{"prompt": "ok"}, big, {"prompt": "after"}])
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as info:
            data.load_rows(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value) == (f"{path}, row 2: {len(json.dumps(big)):,} bytes, over the limit of 1,000 bytes a "
                               f"row (data.MAX_ROW_BYTES)")
    assert peak < 1_000_000  # read in chunks: the 4 MB line was never held whole
    # the limit counts the row's bytes, its line break left out; a last line may have none
    for line in ("", "\n"):
        for size, ok in ((1000, True), (1001, False)):
            with open(path, "w") as f:
                f.write(json.dumps({"prompt": "x" * (size - 14)}) + line)
            if ok:
                assert len(data.load_rows(path)) == 1
            else:
                with pytest.raises(DataError, match="1,001 bytes, over the limit of 1,000"):
                    data.load_rows(path)


@pytest.mark.parametrize("name", ["t.jsonl", "t.parquet"])
@pytest.mark.parametrize("field", ["prompt", "teacher_response"])
def test_an_overlong_text_names_file_row_field_and_limit(tmp_path, monkeypatch, name, field):
    monkeypatch.setattr(data, "MAX_TEXT_CHARS", 100)
    rows = [{"prompt": "ok", "teacher_response": "fine"}, {"prompt": "p", "teacher_response": "r", field: "x" * 101}]
    path, msg = _error(tmp_path, rows, name=name)
    assert msg == f"{path}, row 2, field '{field}' (column '{field}'): 101 characters, over the limit of 100 " \
                  "(data.MAX_TEXT_CHARS)"
    # a prompt's text is all its messages', the system message's too
    messages = [{"role": "user", "content": "x" * 30}, {"role": "assistant", "content": "x" * 30},
                {"role": "user", "content": [{"type": "text", "text": "x" * 30}]}]
    assert len(data.load_rows(_write_jsonl(tmp_path / "ok.jsonl", [{"prompt": messages, "system": "x" * 10}]))) == 1
    path, msg = _error(tmp_path, [{"prompt": messages, "system": "x" * 11}])
    assert msg.startswith(f"{path}, row 1, field 'prompt' (column 'prompt'): 101 characters")


def test_a_prompt_over_the_default_text_limit_is_refused(tmp_path):
    path, msg = _error(tmp_path, [{"prompt": "x" * (data.MAX_TEXT_CHARS + 1)}])
    assert msg.startswith(f"{path}, row 1, field 'prompt' (column 'prompt'): 1,048,577 characters")


@pytest.mark.parametrize("name", ["bad.jsonl", "bad.parquet"])
def test_two_rows_with_one_uid_are_refused_naming_both_rows(tmp_path, name):
    """Rollouts are grouped by uid: two prompts under one would share demonstrations and advantages."""
    rows = [{"uid": "q1", "prompt": "What is 2 + 2?", "answer": "4"}, {"uid": "q2", "prompt": "x", "answer": "1"},
            {"uid": "q1", "prompt": "What is 3 + 3?", "answer": "6"}]
    path, msg = _error(tmp_path, rows, name=name)
    assert msg.startswith(f"{path}, row 3, field 'uid': 'q1' is also the uid of {path}, row 1, a different row")
    # one prompt with another answer is still another row
    path, msg = _error(tmp_path, [rows[0], {**rows[0], "answer": "5"}], name=name)
    assert msg.startswith(f"{path}, row 2, field 'uid': 'q1' is also the uid of {path}, row 1")


def test_a_generated_uid_never_collides(tmp_path):
    # rows without a uid get file:row, distinct even for one prompt written twice
    rows = data.load_rows(_write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p"}, {"prompt": "p"}]))
    assert [r["uid"] for r in rows] == ["d.jsonl:1", "d.jsonl:2"]
    # a file's own uid that equals a generated one, or 7 and "7", is caught as a shared uid
    path, msg = _error(tmp_path, [{"uid": "bad.jsonl:2", "prompt": "a"}, {"prompt": "b"}])
    assert msg.startswith(f"{path}, row 2, field 'uid': 'bad.jsonl:2' is also the uid of {path}, row 1")
    path, msg = _error(tmp_path, [{"uid": 7, "prompt": "a"}, {"uid": "7", "prompt": "b"}])
    assert msg.startswith(f"{path}, row 2, field 'uid': '7' is also the uid of {path}, row 1")


def test_an_exact_copy_of_a_row_is_dropped_with_a_warning(tmp_path, capsys):
    row = {"uid": "a", "prompt": "p", "answer": "1", "tests": [{"input": "x", "output": "y"}]}
    path = _write_jsonl(tmp_path / "d.jsonl", [row, {**row, "uid": "b"}, row, {**row, "uid": "c"}])
    assert [r["uid"] for r in data.load_rows(path)] == ["a", "b", "c"]
    assert f"warning: {path}, row 3 repeats {path}, row 1 (uid 'a'): dropped" in capsys.readouterr().err
    assert [r["uid"] for r in data.load_rows(path, limit=3)] == ["a", "b", "c"]  # the limit counts rows kept


def test_check_model_dir_names_the_path_and_what_is_missing(tmp_path, tiny_dir):
    assert data.check_model_dir(tiny_dir) == tiny_dir
    missing = str(tmp_path / "nowhere")
    with pytest.raises(data.PathError, match=rf"^--model.path {re.escape(missing)}: no such directory; "
                                                r"a model directory holds config.json"):
        data.check_model_dir(missing)
    (tmp_path / "model.safetensors").write_text("")
    with pytest.raises(DataError, match=r"^--teacher.path \S+model.safetensors: not a directory"):
        data.check_model_dir(str(tmp_path / "model.safetensors"), "--teacher.path")
    model = tmp_path / "model"
    model.mkdir()
    for name, still_missing in (("README.md", "config.json, no tokenizer file, no weights"),
                                ("config.json", "tokenizer file, no weights"),
                                ("tokenizer.model", "weights"),
                                ("model.safetensors.index.json", "weights")):  # an index is not the weights
        (model / name).write_text("{}")
        with pytest.raises(DataError) as info:
            data.check_model_dir(str(model))
        assert str(info.value) == f"--model.path {model}: no {still_missing}; {data.MODEL_DIR}"
    for weights in ("model-00001-of-00002.safetensors", "pytorch_model.bin"):
        shard = model / weights
        shard.write_text("")
        assert data.check_model_dir(str(model)) == str(model)
        shard.unlink()


# -----------------------------------------------------------------------------
# chat templating and truncation


def _gen_prompt(tokenizer):
    ids = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)
    return ids


def test_chat_prompt_ids_end_with_the_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]
    ids = data.chat_prompt_ids(tokenizer, messages)
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    gen = _gen_prompt(tokenizer)
    assert ids[-len(gen):] == gen
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)
    assert data.chat_prompt_ids(tokenizer, messages, max_len=len(ids)) == ids  # at the limit: untouched
    assert data.chat_prompt_ids(tokenizer, messages, max_len=0) == ids  # 0: no limit


def _long_messages():
    question = " ".join(f"word{i}" for i in range(300))
    return [{"role": "system", "content": "You solve problems."},
            {"role": "user", "content": f"{question} Give the final answer as 'Answer: <number>'."}]


@pytest.mark.parametrize("max_len", [6, 7, 12, 40, 101, 500])
def test_prompt_truncation_keeps_start_and_generation_prompt(tokenizer, max_len):
    messages = _long_messages()
    full = data.chat_prompt_ids(tokenizer, messages)
    assert len(full) > 500
    ids = data.chat_prompt_ids(tokenizer, messages, max_len=max_len)
    assert len(ids) == max_len  # never longer, and no shorter than needed
    # the user's turn is closed and the assistant's opened: <|im_end|> \n <|im_start|> assistant \n
    tail = [tokenizer.convert_tokens_to_ids(IM_END)] + tokenizer("\n", add_special_tokens=False)["input_ids"] \
        + _gen_prompt(tokenizer)
    assert ids[-len(tail):] == tail
    assert full[-len(tail):] == tail
    # a head of the prompt and a tail of the prompt: only the middle is gone
    head = next(h for h in range(max_len + 1) if ids[h:] == full[len(full) - (max_len - h):])
    assert ids[:head] == full[:head]
    assert head >= (max_len - len(tail)) // 2  # about half the room goes to the start
    if max_len >= 6:
        assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)  # the start survives
    if max_len >= 40:
        assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou solve problems.<|im_end|>")
        assert tokenizer.decode(ids).endswith("<number>'.<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_truncation_below_the_protected_tail_raises(tokenizer):
    with pytest.raises(ValueError, match="protected"):
        data.chat_prompt_ids(tokenizer, _long_messages(), max_len=3)


def test_truncate_middle_hand_worked():
    ids = list(range(10))
    assert data.truncate_middle(ids, 6) == [0, 1, 2, 7, 8, 9]
    assert data.truncate_middle(ids, 5) == [0, 1, 7, 8, 9]  # the odd token goes to the end
    assert data.truncate_middle(ids, 6, keep_tail=2) == [0, 1, 6, 7, 8, 9]
    assert data.truncate_middle(ids, 7, keep_tail=6) == [3, 4, 5, 6, 7, 8, 9]
    assert data.truncate_middle(ids, 1) == [9]
    assert data.truncate_middle(ids, 10) == ids
    assert data.truncate_middle((1, 2, 3), 5) == [1, 2, 3]  # short input comes back as a list
    with pytest.raises(ValueError):
        data.truncate_middle(ids, 4, keep_tail=4)


@FAST
@given(n=st.integers(0, 60), max_len=st.integers(1, 70), keep=st.integers(0, 70))
def test_truncate_middle_properties(n, max_len, keep):
    ids = list(range(100, 100 + n))
    if n > max_len and keep >= max_len:
        with pytest.raises(ValueError):
            data.truncate_middle(ids, max_len, keep_tail=keep)
        return
    out = data.truncate_middle(ids, max_len, keep_tail=keep)
    assert len(out) == min(n, max_len)
    if n <= max_len:
        assert out == ids
        return
    # out = a prefix + a suffix of ids, the suffix holds the protected tail, the cut is mid-way
    head = next(h for h in range(max_len + 1) if out[:h] == ids[:h] and out[h:] == ids[n - (max_len - h):])
    assert max_len - head >= keep
    room = max_len - keep
    assert head in (room // 2, (room + 1) // 2)


# -----------------------------------------------------------------------------
# padding and packing


def test_pad():
    ids, mask = packing.pad([[1, 2, 3], [4], [5, 6]], pad_id=0)
    assert ids.dtype == torch.long and mask.dtype == torch.long
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4], [0, 5, 6]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    ids, mask = packing.pad([[7], []], pad_id=9)
    assert ids.tolist() == [[7], [9]] and mask.tolist() == [[1], [0]]
    ids, mask = packing.pad([[1, 2, 3], [4]], pad_id=0, min_width=4, left=False)
    assert ids.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]] and mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_pack_responses_hand_worked():
    seqs = [[10, 11, 12, 13], [20, 21, 22]]
    ids, mask, hidden_index, targets, token_index = packing.pack_responses(seqs, [2, 1], pad_id=0)
    assert ids.tolist() == [[10, 11, 12, 13], [20, 21, 22, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    # flattened [B*L] positions one before each response token: 11->12, 12->13 | 21->22 (row 1 starts at 4)
    assert hidden_index.tolist() == [1, 2, 5]
    assert targets.tolist() == [12, 13, 22]
    # positions in the [B, R=2] response matrix: (0,0), (0,1), (1,0)
    assert token_index.tolist() == [0, 1, 2]
    for t in (ids, mask, hidden_index, targets, token_index):
        assert t.dtype == torch.long

    # an empty response contributes nothing; R is the longest response
    ids, mask, hidden_index, targets, token_index = packing.pack_responses([[5, 6, 7], [8, 9, 3, 4]], [0, 3], pad_id=1)
    assert ids.tolist() == [[5, 6, 7, 1], [8, 9, 3, 4]]
    assert hidden_index.tolist() == [4, 5, 6]
    assert targets.tolist() == [9, 3, 4]
    assert token_index.tolist() == [3, 4, 5]  # row 1 of a [2, 3] matrix


def test_pack_responses_needs_a_prompt_token():
    with pytest.raises(ValueError, match="sequence 1.*no prompt token"):
        packing.pack_responses([[1, 2, 3], [4, 5]], [1, 2], pad_id=0)
    with pytest.raises(ValueError, match="sequence 0"):
        packing.pack_responses([[]], [0], pad_id=0)


@FAST
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 6)), min_size=1, max_size=5))
def test_pack_responses_properties(shape):
    seqs, lens = [], []
    for b, (prompt_len, resp_len) in enumerate(shape):
        seqs.append([1000 * (b + 1) + t for t in range(prompt_len + resp_len)])
        lens.append(resp_len)
    ids, mask, hidden_index, targets, token_index = packing.pack_responses(seqs, lens, pad_id=-1)
    width = max(len(s) for s in seqs)
    R = max(max(lens), 1)
    assert ids.shape == mask.shape == (len(seqs), width)
    assert mask.sum().item() == sum(len(s) for s in seqs)
    assert len(targets) == len(hidden_index) == len(token_index) == sum(lens)
    # the token after each hidden position is the target
    assert ids.flatten()[hidden_index + 1].tolist() == targets.tolist()
    # scattering the targets through token_index rebuilds the right-padded response matrix
    matrix = torch.full((len(seqs) * R,), -1, dtype=torch.long).index_copy(0, token_index, targets).view(len(seqs), R)
    expected = [s[len(s) - r:] + [-1] * (R - r) for s, r in zip(seqs, lens)]
    assert matrix.tolist() == expected


def test_a_file_without_a_reward_is_refused_and_a_row_keeps_the_files_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "answer": "4", "difficulty": 3}) + "\n")
    cfg = run.parse_config([f"--data.task={path}"])
    with pytest.raises(data.DataError, match=r"d.jsonl, row 1, field 'reward' \(column 'reward'\): missing, and "
                                             r"--data.reward is not set: pass --data.reward code\|manners\|math\|mc\|"):
        data.read_rows(cfg)
    row = data.load_rows(str(path), reward="math")[0]
    assert row["reward"] == "math" and row["columns"] == {"prompt": "2+2?", "answer": "4", "difficulty": 3}
    path.write_text(json.dumps({"prompt": "2+2?", "answer": "4", "grader": "mc"}) + "\n")
    assert data.load_rows(str(path), fields="reward=grader", reward="")[0]["reward"] == "mc"  # the row's own
    assert data.load_rows(str(path), fields="reward=grader", reward="math")[0]["reward"] == "math"  # the flag wins


def test_the_custom_reward_example_in_docs_reads_a_column_of_the_file(tmp_path):
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "data.md")) as f:
        example = re.search(r"```python\n(# my_reward\.py.*?)```", f.read(), re.S).group(1)
    (tmp_path / "my_reward.py").write_text(example)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "How far?", "answer": "42", "unit": "km"}) + "\n")
    row = data.load_rows(str(path), reward=f"{tmp_path / 'my_reward.py'}:reward")[0]
    fn = feedback.get_reward_fn(row["reward"])
    assert fn("42 km", row, False) == 1.0
    assert fn("42", row, False) == {"score": 0.0, "feedback": "Give the number with its unit (km)."}


def test_the_adding_a_task_example_in_docs_is_one_file_and_one_table_line(tmp_path):
    """docs/data.md's worked example, as written: a copy of the project with its task file and
    its table line added runs it through the run's own paths: the flags (its difficulty, its
    recipe), the rows, the checker a row names, the wrong answers the warm start shows."""
    import shutil
    import subprocess
    import sys
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(project, "docs", "data.md")) as f:
        blocks = dict(re.findall(r"```python\n# ([\w/.]+\.py)[^\n]*\n(.*?)```", f.read(), re.S))
    copy = tmp_path / "project"
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns(".git", "tests", "bench", "docs", "sweeps", "__pycache__"))
    (copy / "tasks" / "sort.py").write_text(blocks["tasks/sort.py"])
    table = (copy / "tasks" / "__init__.py").read_text()
    assert '    "shapes",\n' in table
    (copy / "tasks" / "__init__.py").write_text(table.replace('    "shapes",\n', '    "shapes",\n' + blocks["tasks/__init__.py"], 1))
    check = """
import random, data, feedback, tasks
from flags import parse_config
cfg = parse_config(["--data.task=sort", "--data.sort_len=4", "--data.train_rows=40", "--data.eval_rows=8"])
assert cfg.recipe == "sort" and cfg.train.warm_start_steps == 200, cfg.recipe
train, held_out = data.read_rows(cfg)
assert len(train) == 40 and len(held_out) == 8 and not {r["uid"] for r in train} & {r["uid"] for r in held_out}
assert all(len(r["answer"].split()) == 4 for r in train)
for row in train:
    check = feedback.get_reward_fn(row["reward"])
    assert feedback.score(check, row["reference"], row, False).score == 1.0
    wrong = feedback.score(check, tasks.wrong_response(row, random.Random(0)) or "Answer:", row, False)
    assert wrong.score == 0.0 and "out of order" in wrong.feedback and row["answer"] not in wrong.feedback, wrong
    assert "exactly once (you gave 3)" in check("Answer: 1 2 3", row, False).feedback
    assert feedback.score(check, row["reference"], row, True).score == 0.0
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", check], cwd=copy, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]