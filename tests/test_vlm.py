"""
Tests for images: the picture task and its reward, image rows in data files and their errors,
the tiny vision-language model, ImagePrompts, and (slow) the vLLM engine on image
prompts: the prompt ids it expands, its log-probs against a float32 HF forward, and a weight
sync that the image probe proves for the vision tower.

The engine's numbers are checked against transformers' Qwen2.5-VL forward of the same weights;
the scenes against the row's own description (the uid), the expansion against the image
processor's patch grid.
Run: python -m pytest tests/test_vlm.py   (the engine tests: about 2 minutes on 2 CPU cores)
"""

import copy
import io
import itertools
import json
import os
import random
import re
import statistics

import pytest
import torch

import data
import feedback
import microbatch
import tasks
import tiny_models
import warm_start
from flags import parse_config
from data import DataError
from image_prompts import ImagePrompts
from tasks import TaskConfig

TOL = 1e-4


@pytest.fixture(scope="module")
def vlm_dir():
    return tiny_models.tiny_vlm_dir()


@pytest.fixture(scope="module")
def vlm_tokenizer(vlm_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(vlm_dir)


@pytest.fixture(scope="module")
def image_prompts(vlm_dir):
    return ImagePrompts(vlm_dir)


@pytest.fixture(scope="module")
def hf(vlm_dir):
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()


def scene_of(row) -> list[tuple]:
    """(colour, kind, cell, dx, dy) of each shape, parsed back from the uid."""
    scene = row["uid"].split(":")[1]
    return [(m[0], m[1], int(m[2]), float(m[3]), float(m[4]))
            for m in re.findall(r"(\w+) (\w+)@(\d+)x[\d.]+([+-][\d.]+)([+-][\d.]+)", scene)]


def pixel_colour(image, cell, dx=0.0, dy=0.0, grid=2):
    """The colour name at the centre of a grid cell (moved by dx, dy cells), or None for white."""
    size = image.size[0]
    r, c = divmod(cell, grid)
    rgb = image.getpixel((int((c + 0.5 + dx) * size / grid), int((r + 0.5 + dy) * size / grid)))
    names = {(255, 0, 0): "red", (0, 128, 0): "green", (0, 0, 255): "blue", (255, 255, 0): "yellow",
             (255, 255, 255): None}
    return names[rgb]


# -----------------------------------------------------------------------------
# the picture task and its reward


def test_shapes_rows_show_what_their_answer_says():
    rows = data.task_rows("shapes", "train", 200)
    kinds = {"count": 0, "colour": 0, "position": 0}
    positions = tasks.shapes.grid_positions(2)
    for row in rows:
        scene, question = scene_of(row), row["messages"][0]["content"][1]["text"]
        (image,) = row["images"]
        assert image.size == (112, 112) and image.mode == "RGB"
        assert row["messages"][0]["content"][0] == {"type": "image"}
        assert row["reference"] == f"Answer: {row['answer']}"
        # every shape is drawn around its centre, the empty cells are white
        assert len(scene) == len({c for _, _, c, _, _ in scene}) > 0
        for colour, _, cell, dx, dy in scene:
            assert pixel_colour(image, cell, dx, dy) == colour
        for cell in set(range(4)) - {c for _, _, c, _, _ in scene}:
            assert pixel_colour(image, cell) is None
        if question.startswith("How many"):
            kinds["count"] += 1
            assert row["answer"] == str(len(scene))
        elif m := re.match(r"What colour is the (\w+)\?", question):
            kinds["colour"] += 1
            assert [colour for colour, kind, *_ in scene if kind == m.group(1)] == [row["answer"]]
        else:
            kinds["position"] += 1
            colour, kind = re.match(r"Where is the (\w+) (\w+)\?", question).groups()
            cells = [c for col, k, c, *_ in scene if (col, k) == (colour, kind)]
            assert len(cells) == 1 and positions[cells[0]] == row["answer"]
    assert min(kinds.values()) > 20, kinds


def test_scene_questions_name_every_shape_in_reading_order_and_feedback_hides_them():
    cfg = TaskConfig(shapes_questions="scene")
    rows = data.task_rows("shapes", "train", 50, cfg=cfg)
    positions = tasks.shapes.grid_positions(2)
    fn = feedback.get_reward_fn("shapes")
    for row in rows:
        assert row["messages"][0]["content"][1]["text"].startswith(tasks.shapes.SCENE_QUESTION)
        assert row["answer"] == ", ".join(f"{colour} {kind} {positions[cell]}"
                                          for colour, kind, cell, _, _ in sorted(scene_of(row), key=lambda s: s[2]))
        assert feedback.score(fn, f"Answer: {row['answer']}", row, False).score == 1.0
        shapes = row["answer"].split(", ")
        reward = feedback.score(fn, "Answer: red circle top left, red circle top right", row, False)
        if len(shapes) != 2:
            assert reward.score == 0.0 and f"names 2 shapes, but the picture has {len(shapes)}" in reward.feedback
        one_wrong = ", ".join(shapes[:-1] + ["yellow square centre"])
        reward = feedback.score(fn, f"Answer: {one_wrong}", row, False)
        assert reward.score == 0.0 and f"shape number {len(shapes)} (in reading order) is wrong" in reward.feedback
        assert not any(s in reward.feedback for s in shapes)


def test_a_picture_quiz_asks_what_the_picture_answers_and_its_feedback_marks_each_line():
    rows = data.task_rows("shapes", "train", 120, cfg=TaskConfig(shapes_questions="quiz"))
    positions = tasks.shapes.grid_positions(2)
    fn = feedback.get_reward_fn("shapes")
    rng = random.Random(0)
    assert sum(len(row["tests"]) == 3 for row in rows) > 100
    for row in rows:
        scene, text = scene_of(row), row["messages"][0]["content"][1]["text"]
        assert text.splitlines()[-1] == tasks.shapes.PICTURE_QUIZ_INSTRUCTION
        assert text.splitlines()[:-1] == [t["input"] for t in row["tests"]]
        assert len({t["input"] for t in row["tests"]}) == len(row["tests"])
        for label, test in zip("abc", row["tests"]):
            question = test["input"].removeprefix(f"{label}: ")
            if question.startswith("How many"):
                truth = [str(len(scene))]
            elif m := re.match(r"What colour is the (\w+)\?", question):
                truth = [colour for colour, kind, *_ in scene if kind == m.group(1)]
            else:
                colour, kind = re.match(r"Where is the (\w+) (\w+)\?", question).groups()
                truth = [positions[c] for col, k, c, *_ in scene if (col, k) == (colour, kind)]
            assert truth == [test["output"]], (test, scene)
        assert row["reference"] == row["answer"] == "\n".join(f"{l}: {t['output']}" for l, t in zip("abc", row["tests"]))
        assert feedback.score(fn, "I see:\n" + row["answer"].upper(), row, False).score == 1.0
        # a plausible wrong reply: each line marked, the right ones repeated, a wrong one's answer never shown
        wrong = tasks.wrong_response(row, rng)
        given = dict(line.split(": ") for line in wrong.splitlines())
        reward = feedback.score(fn, wrong, row, False)
        marks = reward.feedback.splitlines()
        assert reward.score == 0.0 and marks[-1] == "Look at the picture again."
        bad = [l for l, t in zip("abc", row["tests"]) if given[l] != t["output"]]
        assert bad and marks[0] == f"{len(bad)} of {len(row['tests'])} answers {'is' if len(bad) == 1 else 'are'} wrong."
        for l, t, mark in zip("abc", row["tests"], marks[1:-1]):
            assert mark == (f"{l} is wrong." if l in bad else f"{l}: {t['output']} is right.")
    row = next(r for r in rows if len(r["tests"]) == 3)
    a, b, c = (t["output"] for t in row["tests"])
    reward = feedback.score(fn, f"a: {a}\nc: {c}", row, False)  # a line left out is wrong
    assert reward.score == 0.0 and "b has no answer." in reward.feedback and f"c: {c} is right." in reward.feedback
    assert "none of the questions" in feedback.score(fn, f"Answer: {a}", row, False).feedback
    assert feedback.score(fn, row["answer"], row, True).score == 0.0  # truncated
    # --data.shapes_quiz_kinds: what a quiz may ask
    places = data.task_rows("shapes", "train", 60, cfg=TaskConfig(shapes_questions="quiz", shapes_quiz_kinds="position"))
    assert all(t["input"][3:].startswith("Where is") for row in places for t in row["tests"])
    assert sum(len(row["tests"]) > 1 for row in places) > 20
    with pytest.raises(ValueError, match="shapes_quiz_kinds=count,scene: unknown kinds \\['scene'\\]"):
        data.task_rows("shapes", "train", 5, cfg=TaskConfig(shapes_questions="quiz", shapes_quiz_kinds="count,scene"))


def test_the_warm_start_may_ask_other_questions_than_the_rl_run():
    """--data.shapes_warm_start_questions is what the warm start trains on; the RL run asks
    --data.shapes_questions. Runs that differ only in the RL questions share one warm start."""
    def warm(*flags):
        cfg = parse_config(["--data.task=shapes", *flags])
        return warm_start.warm_start_config(cfg, "tiny-vlm"), cfg
    (quiz, quiz_cfg), (scene, _) = (warm("--data.shapes_questions=quiz", f"--data.shapes_warm_start_questions={q}")
                                    for q in ("count,scene,quiz", "count,scene"))
    assert quiz_cfg.data.shapes_questions == "quiz"
    assert quiz.data.shapes_questions == "count,scene,quiz" and quiz.data.shapes_warm_start_questions == ""
    assert quiz.log.out_dir != scene.log.out_dir
    same, _ = warm("--data.shapes_questions=count", "--data.shapes_warm_start_questions=count,scene,quiz")
    assert same.log.out_dir == quiz.log.out_dir
    # empty: the warm start asks the RL run's questions, under the name such a warm start always had
    plain, _ = warm("--data.shapes_questions=count,scene", "--data.shapes_warm_start_questions=")
    assert plain.data.shapes_questions == "count,scene" and plain.log.out_dir == scene.log.out_dir
    # the quiz's flags are read only by a warm start that asks quizzes
    for flag in ("--data.shapes_quiz_questions=2", "--data.shapes_quiz_kinds=count"):
        assert warm("--data.shapes_questions=count,scene", "--data.shapes_warm_start_questions=",
                    flag)[0].log.out_dir == plain.log.out_dir
        assert warm("--data.shapes_questions=quiz", "--data.shapes_warm_start_questions=count,scene,quiz",
                    flag)[0].log.out_dir != quiz.log.out_dir


def test_shapes_split_and_difficulty_flags():
    train = {r["uid"] for seed in (0, 1) for r in data.task_rows("shapes", "train", 100, seed=seed)}
    test = {r["uid"] for r in data.task_rows("shapes", "test", 50)}
    assert not train & test
    assert data.task_rows("shapes", "test", 5, seed=3) == data.task_rows("shapes", "test", 5)
    cfg = TaskConfig(shapes_max=9, shapes_grid=3, shapes_questions="count", shapes_image_size=84)
    rows = data.task_rows("shapes", "train", 100, cfg=cfg)
    assert {r["images"][0].size for r in rows} == {(84, 84)}
    assert all(r["messages"][0]["content"][1]["text"].startswith("How many") for r in rows)
    assert max(int(r["answer"]) for r in rows) > 4
    with pytest.raises(ValueError, match="shapes_questions"):
        data.task_rows("shapes", "train", 1, cfg=TaskConfig(shapes_questions="size"))
    with pytest.raises(ValueError, match="shapes_max"):
        data.task_rows("shapes", "train", 1, cfg=TaskConfig(shapes_max=5))


def test_shapes_reward_and_its_feedback_never_give_the_answer():
    fn = feedback.get_reward_fn("shapes")
    rows = data.task_rows("shapes", "train", 60)
    rng = random.Random(0)
    for row in rows:
        assert feedback.score(fn, f"I see it.\nAnswer: {row['answer'].upper()}.", row, False).score == 1.0
        wrong = tasks.wrong_response(row, rng)
        assert wrong != row["reference"]
        reward = feedback.score(fn, wrong, row, False)
        assert reward.score == 0.0
        assert wrong.split(": ")[1] in reward.feedback
        assert not re.search(rf"\b{re.escape(row['answer'])}\b", reward.feedback.replace(wrong.split(': ')[1], ""))
        question = row["messages"][0]["content"][1]["text"]
        expected = ("the number of shapes" if question.startswith("How many") else
                    "the colour of the" if question.startswith("What colour") else "where the")
        assert expected in reward.feedback
    row = rows[0]
    assert feedback.score(fn, "no idea", row, False).feedback == tasks.shapes.FORMAT_FEEDBACK
    assert feedback.score(fn, "Answer: ", row, False).score == 0.0
    assert feedback.score(fn, f"Answer: {row['answer']}", row, True).score == 0.0  # truncated
    assert feedback.score(fn, f"Answer: x\nAnswer: {row['answer']}", row, False).score == 1.0  # the last one counts


# -----------------------------------------------------------------------------
# image rows in data files


@pytest.fixture
def pictures(tmp_path):
    """Two PNG files next to the data files, and the bytes of a third picture."""
    rows = data.task_rows("shapes", "train", 3)
    for i in range(2):
        rows[i]["images"][0].save(tmp_path / f"p{i}.png")
    buf = io.BytesIO()
    rows[2]["images"][0].save(buf, format="PNG")
    return [r["images"][0] for r in rows], buf.getvalue()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_image_placeholders_and_paths_relative_to_the_file(tmp_path, pictures):
    images, _ = pictures
    (tmp_path / "sub").mkdir()
    path = write_jsonl(tmp_path / "sub" / "d.jsonl", [
        {"prompt": "<image>Compare with <image>. Which has more?", "images": ["../p0.png", str(tmp_path / "p1.png")],
         "answer": 2},
        {"prompt": "No picture here.", "answer": "1"},
    ])
    first, second = data.load_rows(path)
    assert first["messages"] == [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Compare with "}, {"type": "image"},
        {"type": "text", "text": ". Which has more?"}]}]
    assert first["images"] == images[:2]
    assert "images" not in second and second["messages"][0]["content"] == "No picture here."


def test_parquet_images_as_geo3k_stores_them(tmp_path, pictures):
    import pyarrow as pa
    import pyarrow.parquet as pq
    images, png = pictures
    pq.write_table(pa.table({
        "question": ["<image>What colour is the circle?"],
        "images": [[{"bytes": png, "path": "ignored.png"}]],
        "system": ["Look carefully."],
        "solution": ["red"],
    }), tmp_path / "geo.parquet")
    (row,) = data.load_rows(str(tmp_path / "geo.parquet"), fields="prompt=question,answer=solution")
    assert row["images"] == [images[2]]
    assert row["messages"][0] == {"role": "system", "content": "Look carefully."}
    assert row["messages"][1]["content"] == [{"type": "image"}, {"type": "text", "text": "What colour is the circle?"}]
    # verl's own layout: chat messages with <image> in their text, the answer nested in reward_model
    pq.write_table(pa.table({
        "prompt": [[{"role": "user", "content": "<image>Find x."}]],
        "images": [[{"bytes": png, "path": None}]],
        "reward_model": [{"ground_truth": "6", "style": "rule"}],
    }), tmp_path / "verl.parquet")
    (row,) = data.load_rows(str(tmp_path / "verl.parquet"), fields="answer=reward_model.ground_truth")
    assert row["answer"] == "6" and row["images"] == [images[2]]
    assert row["messages"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]


def test_chat_messages_with_image_parts(tmp_path, pictures):
    images, _ = pictures
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": [
        {"type": "image", "image": "p1.png"},
        {"type": "image_url", "image_url": {"url": "file://" + str(tmp_path / "p0.png")}},
        {"type": "image"},
        {"type": "text", "text": "Which is odd?"}]}], "images": ["p0.png"]}])
    (row,) = data.load_rows(path)
    assert row["images"] == [images[1], images[0], images[0]]
    assert [p["type"] for p in row["messages"][0]["content"]] == ["image", "image", "image", "text"]


@pytest.mark.parametrize("record,match", [
    ({"prompt": "<image>?", "images": ["missing.png"]}, r"row 1, field 'images' \(column 'images'\), image 0: no such image file 'missing.png'"),
    ({"prompt": "<image>?", "images": [{"bytes": "not a picture"}]}, r"row 1, field 'images'.*image 0: 'bytes' must hold the encoded image, got str"),
    ({"prompt": "<image>?", "images": [7]}, r"row 1, field 'images'.*image 0: expected an image path, bytes or"),
    ({"prompt": "<image><image>?", "images": ["p0.png"]}, r"row 1, field 'images'.*more image places than the 1 images"),
    ({"prompt": "<image>?", "images": ["p0.png", "p1.png"]}, r"row 1, field 'images'.*2 images but the prompt has 1 places"),
    ({"prompt": "Look.", "images": ["p0.png"]}, r"row 1, field 'images'.*1 images but the prompt has 0 places"),
    ({"prompt": "<image>?", "images": "p0.png"}, r"row 1, field 'images'.*expected a list of images, got str"),
    ({"prompt": [{"role": "user", "content": [{"type": "video"}]}]}, r"row 1, field 'prompt'.*message 0, part 0: expected"),
    ({"prompt": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]}]},
     r"row 1, field 'prompt'.*image part 0: no such image file 'nope.png'"),
])
def test_image_errors_name_the_file_row_and_field(tmp_path, pictures, record, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [record])
    with pytest.raises(DataError, match=re.escape(path) + ", " + match):
        data.load_rows(path)


def test_unreadable_image_bytes_and_files(tmp_path, pictures):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": ["ok", "<image>?"], "images": [[], [{"bytes": b"\x89PNG broken", "path": None}]]}),
                   tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet, row 2, field 'images'.*image 0: cannot read the image \(11 bytes\)"):
        data.load_rows(str(tmp_path / "b.parquet"))
    (tmp_path / "fake.png").write_text("text, not a PNG")
    path = write_jsonl(tmp_path / "f.jsonl", [{"prompt": "<image>", "images": ["fake.png"]}])
    with pytest.raises(DataError, match=r"row 1, field 'images'.*cannot read the image \(fake.png\)"):
        data.load_rows(path)


# -----------------------------------------------------------------------------
# the tiny vision-language model and what a prompt becomes


def test_transformers_loads_the_tiny_vlm(vlm_dir, vlm_tokenizer, hf, image_prompts):
    config = hf.config
    assert config.model_type == "qwen2_5_vl"
    assert config.text_config.hidden_size // config.text_config.num_attention_heads == 64  # vLLM's CPU attention
    assert config.image_token_id == vlm_tokenizer.convert_tokens_to_ids("<|image_pad|>") == image_prompts.image_token_id
    assert config.text_config.vocab_size == len(vlm_tokenizer)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = vlm_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many?<|im_end|>\n<|im_start|>assistant\n"
    # the text tokenizer's shortcuts survive: the task text tokenises compactly, digits singly
    row = data.task_rows("shapes", "train", 1)[0]
    assert len(vlm_tokenizer(row["messages"][0]["content"][1]["text"])["input_ids"]) < 20
    assert tiny_models.tiny_vlm_dir() == vlm_dir  # cached by recipe


def test_image_prompts_expand_one_token_per_merged_patch(vlm_tokenizer, image_prompts):
    from PIL import Image
    rows = data.task_rows("shapes", "train", 2)
    ids = data.chat_prompt_ids(vlm_tokenizer, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "?"}]}])
    wide = Image.new("RGB", (300, 90), "white")
    inputs = image_prompts(ids, [rows[0]["images"][0], wide])
    grid = inputs.image_grid_thw.tolist()
    assert grid[0] == [1, 8, 8]  # 112 x 112 pixels: 8 x 8 patches of 14
    t, h, w = grid[1]  # resized to about 112*112 pixels at the same aspect, in units of 28
    assert t == 1 and h % 2 == 0 and w % 2 == 0 and w > 2 * h and (h * 14) * (w * 14) <= 112 * 112
    counts = [g[0] * g[1] * g[2] // 4 for g in grid]
    pad = image_prompts.image_token_id
    runs = [len(list(run)) for token, run in itertools.groupby(inputs.input_ids) if token == pad]
    assert runs == counts  # each image's placeholder became its own run of tokens, in order
    assert len(inputs.input_ids) == len(ids) - 2 + sum(counts)
    assert inputs.pixel_values.shape == (sum(g[0] * g[1] * g[2] for g in grid), 3 * 2 * 14 * 14)
    assert inputs.mm_token_type_ids == [int(t == pad) for t in inputs.input_ids]
    without_images = [t for t in inputs.input_ids if t != pad]
    assert without_images == [t for t in ids if t != pad]
    with pytest.raises(ValueError, match="2 image tokens but 1 images"):
        image_prompts(ids, [wide])


def test_prompt_truncation_never_cuts_an_image(vlm_tokenizer):
    text = {"type": "text", "text": "How many shapes? " * 5}
    messages = [{"role": "user", "content": [text, {"type": "image"}, text]}]  # the picture in the middle
    full = data.chat_prompt_ids(vlm_tokenizer, messages)
    assert data.chat_prompt_ids(vlm_tokenizer, messages, max_len=len(full)) == full
    with pytest.raises(ValueError, match="would cut through an image"):
        data.chat_prompt_ids(vlm_tokenizer, messages, max_len=len(full) // 2)
    # text on one side of the picture can go
    messages[0]["content"] = messages[0]["content"][1:]
    tail = data.chat_prompt_ids(vlm_tokenizer, messages)
    cut = data.chat_prompt_ids(vlm_tokenizer, messages, max_len=len(tail) - 10)
    assert len(cut) == len(tail) - 10 and cut.count(vlm_tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 1


def test_the_picture_changes_what_the_model_predicts(vlm_tokenizer, image_prompts, hf):
    import rollout
    import sync
    ids, (picture,) = sync.image_probe(vlm_tokenizer)
    other = data.task_rows("shapes", "train", 1)[0]["images"][0]
    a = rollout.probe_logprobs(hf, ids, image_prompts(ids, [picture]))
    b = rollout.probe_logprobs(hf, ids, image_prompts(ids, [other]))
    assert a.shape == b.shape == (len(image_prompts(ids, [picture]).input_ids) - 1,)
    assert (a - b).abs().max() > 1e-3


# -----------------------------------------------------------------------------
# the engine on image prompts (vLLM, CPU, float32, engine core in its own process as on CPU by default)


@pytest.fixture(scope="module")
def engine(vlm_dir):
    import rollout
    engine = rollout.Engine(vlm_dir, dtype="float32", own_process=True, kv_cache_tokens=16384)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def image_batch(vlm_tokenizer):
    """Three image prompts: two task rows, and one with two pictures of other sizes."""
    from PIL import Image
    rows = data.task_rows("shapes", "test", 2)
    prompts = [data.chat_prompt_ids(vlm_tokenizer, r["messages"]) for r in rows]
    images = [r["images"] for r in rows]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Same as"}, {"type": "image"},
                                        {"type": "text", "text": "?"}]}]
    prompts.append(data.chat_prompt_ids(vlm_tokenizer, two))
    images.append([rows[0]["images"][0].resize((150, 90)), Image.new("RGB", (60, 200), "blue")])
    return prompts, images


def trainer_logprobs(model, inputs, response_ids, temperature):
    """log_softmax(logits / T) of the response tokens after an image prompt, as the trainer computes them."""
    ids = torch.tensor([inputs.input_ids + list(response_ids)])
    types = torch.tensor([inputs.mm_token_type_ids + [0] * len(response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                       mm_token_type_ids=types).logits[0, len(inputs.input_ids) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_on_image_prompts_match_the_trainer(engine, hf, image_prompts, image_batch, temperature):
    prompts, images = image_batch
    out = engine.generate(prompts, n=3, temperature=temperature, max_tokens=12, seed=1, images=images)
    worst = 0.0
    for prompt, pictures, samples in zip(prompts, images, out):
        inputs = image_prompts(prompt, pictures)
        for s in samples:
            # the engine expanded the image tokens exactly as the trainer does
            assert s.prompt_ids == inputs.input_ids
            assert len(s.logprobs) == len(s.response_ids) > 0
            worst = max(worst, (torch.tensor(s.logprobs) - trainer_logprobs(hf, inputs, s.response_ids,
                                                                             temperature)).abs().max().item())
    print(f"engine vs trainer, generated tokens on image prompts at T={temperature}: max |diff| {worst:.2e} nats")
    assert worst < TOL
    # the pictures were used: the same ids with other pictures give other log-probs
    s = out[0][0]
    swapped = image_prompts(prompts[0], images[1])
    assert (torch.tensor(s.logprobs) - trainer_logprobs(hf, swapped, s.response_ids, temperature)).abs().max() > 1e-3


@pytest.mark.slow
def test_engine_scores_image_sequences_like_the_trainer(engine, hf, image_prompts, vlm_tokenizer):
    import rollout
    import sync
    ids, pictures = sync.image_probe(vlm_tokenizer)
    inputs = image_prompts(ids, pictures)
    (scores,) = engine.score([ids], [pictures])
    assert len(scores) == len(inputs.input_ids) - 1
    assert (torch.tensor(scores) - rollout.probe_logprobs(hf, ids, inputs)).abs().max() < TOL
    with pytest.raises(ValueError, match="2 prompts but 1 image lists"):
        engine.score([ids, ids], [pictures])


@pytest.mark.slow
def test_weight_sync_of_the_vision_tower_is_proven_by_the_image_probe(engine, hf, image_prompts, vlm_tokenizer):
    import rollout
    import sync
    ids, pictures = sync.image_probe(vlm_tokenizer)
    inputs = image_prompts(ids, pictures)
    text_probe = sync.probe_ids(vlm_tokenizer)
    # noise on the vision tower only: the text probe cannot see it, the image probe must
    new = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if "visual" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    assert torch.equal(rollout.probe_logprobs(new, text_probe), rollout.probe_logprobs(hf, text_probe))
    target = rollout.probe_logprobs(new, ids, inputs)
    before = torch.tensor(engine.score([ids], [pictures])[0])
    assert (target - before).abs().max() > 1e-3

    def state_of(model):
        return sync.engine_state(model, {k: v.detach() for k, v in model.state_dict().items()})

    assert engine.expected_keys == set(state_of(new))
    assert any(k.startswith("visual.") for k in engine.expected_keys)
    try:
        result = engine.update_weights(state_of(new), ids, target, TOL, probe_images=pictures)
        assert result.probe_max_abs_diff < TOL
        # a sync that left the vision tower behind fails the image probe
        stale = {k: v for k, v in state_of(hf).items() if "visual" in k}
        stale.update({k: v for k, v in state_of(new).items() if "visual" not in k})
        with pytest.raises(rollout.EngineError, match="did not arrive"):
            engine.update_weights(stale, ids, target, TOL, probe_images=pictures)
        # the probe is scored with its picture: the trainer's log-probs of another length are refused
        with pytest.raises(rollout.EngineError, match="scored"):
            engine.update_weights(state_of(new), ids, target[:-1], TOL, probe_images=pictures)
    finally:
        engine.update_weights(state_of(hf), ids, rollout.probe_logprobs(hf, ids, inputs), TOL, probe_images=pictures)


@pytest.mark.slow
def test_two_rank_group_and_file_syncs_leave_the_engine_with_the_same_weights(vlm_dir, tmp_path):
    """Two-rank torchrun (FSDP2 shards, tests/dist_sync.py): after each of two changes of every
    weight (vision tower included), the second while the engine generates in the background,
    the loop's sync (sync.sync_engine) through the weight group and through the file leave the
    engine with the same parameters to the bit, each proven by the image probe."""
    from test_rollout import check_group_vs_file, run_dist_sync
    r0, r1 = run_dist_sync(tmp_path, vlm_dir, "group_vs_file")
    check_group_vs_file(r0, r1)
    assert any(k.startswith("visual.") or ".visual." in k for k in r0["group_vs_file"][0]["group"]["params"])


# -----------------------------------------------------------------------------
# the training loop on image prompts: the trainer's forward (CausalLM via microbatch.pack),
# SDPO's teacher contexts, a two-rank run


@pytest.fixture(scope="module")
def policy(vlm_dir):
    import run
    from policy import load_policy
    cfg = run.parse_config([])
    return load_policy(vlm_dir, cfg, 1, torch.device("cpu")).eval()


def loop_logprobs(policy, seqs, response_lens, images, temperature=1.0):
    """Response log-probs [N] as the loop computes them: microbatch.pack then the policy's forward."""
    import chunked_head
    packed = microbatch.pack(policy, seqs, response_lens, 0, torch.device("cpu"), images=images)
    with torch.no_grad():
        return microbatch.forward(policy, packed, lambda h, w: chunked_head.logprobs_and_entropy_from_hidden(
            h, w, packed.targets, temperature)[0])


def test_trainer_batches_pictures_as_the_hf_forward_sees_one_sequence(vlm_tokenizer, image_prompts, hf, policy,
                                                                      image_batch):
    """Three prompts (one with two pictures of other sizes), unexpanded and expanded, in one
    right-padded batch: each response's log-probs equal transformers' own forward of that
    sequence alone (pixel_values, mm_token_type_ids), the independent computation."""
    prompts, images = image_batch
    responses = [vlm_tokenizer("Answer: 2", add_special_tokens=False)["input_ids"],
                 vlm_tokenizer("Answer: red square", add_special_tokens=False)["input_ids"],
                 vlm_tokenizer("no", add_special_tokens=False)["input_ids"]]
    expanded = [image_prompts(p, im).input_ids for p, im in zip(prompts, images)]
    seqs = [prompts[0] + responses[0], expanded[1] + responses[1], prompts[2] + responses[2]]
    got = loop_logprobs(policy, seqs, [len(r) for r in responses], images, temperature=0.7)
    expected = torch.cat([trainer_logprobs(hf, image_prompts(p, im), r, 0.7)
                          for p, im, r in zip(prompts, images, responses)])
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < TOL
    # each sequence's pictures, not its neighbours': swapping them changes the log-probs
    swapped = loop_logprobs(policy, seqs[:2], [len(r) for r in responses[:2]], images[1::-1])
    assert (swapped - got[:len(swapped)]).abs().max() > 1e-3


def test_image_tokens_the_policy_generated_are_text(vlm_tokenizer, image_prompts, hf, policy):
    """A response holding <|image_pad|> (the tiny model samples it): the pictures go on the
    prompt's runs of image tokens only, and the response's is embedded as a token, as vLLM does."""
    row = data.task_rows("shapes", "test", 1)[0]
    prompt = data.chat_prompt_ids(vlm_tokenizer, row["messages"])
    pad = image_prompts.image_token_id
    response = vlm_tokenizer("Answer: ", add_special_tokens=False)["input_ids"] + [pad, pad]
    got = loop_logprobs(policy, [prompt + response], [len(response)], [row["images"]])
    inputs = image_prompts(prompt, row["images"])
    # transformers' forward puts features on every image token and so refuses this sequence ...
    with pytest.raises(Exception, match="do not match"):
        trainer_logprobs(hf, inputs, response, 1.0)
    # ... but its tokens before the generated image token are scored the same, and the
    # prefix through it is causal: the first two response log-probs do not see it
    expected = trainer_logprobs(hf, inputs, response[:-2], 1.0)
    assert (got[:len(response) - 2] - expected).abs().max() < TOL
    assert torch.isfinite(got).all()
    with pytest.raises(ValueError, match="runs of"):  # a half-expanded picture is refused
        image_prompts.expand([t for token in prompt for t in ([token] * 8 if token == pad else [token])], row["images"])


def test_teacher_context_keeps_the_picture(vlm_tokenizer, image_prompts, policy):
    import sdpo
    rows = data.task_rows("shapes", "test", 2)
    row = rows[0]
    responses = [vlm_tokenizer(row["reference"], add_special_tokens=False)["input_ids"] + [vlm_tokenizer.eos_token_id],
                 vlm_tokenizer("Answer: 7", add_special_tokens=False)["input_ids"] + [vlm_tokenizer.eos_token_id]]
    cfg = sdpo.SdpoConfig()
    batch = sdpo.build_teacher_batch(vlm_tokenizer, [row, row], responses, [row["reference"], "Answer: 7"],
                                     [1.0, 0.0], ["", "wrong"], cfg)
    assert batch.demo_index == [None, 0] and batch.mask == [0, 1]
    ids = batch.input_ids[1]
    assert ids[len(ids) - len(responses[1]):] == responses[1]  # the student's response ids, unchanged
    text = vlm_tokenizer.decode(ids[:len(ids) - len(responses[1])])
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text.count(marker) == 1 and f"Correct solution:\n\n{row['reference']}" in text
    # the same as a text prompt holding the picture's placeholder where the picture was
    question = "".join(marker if p["type"] == "image" else p["text"] for p in row["messages"][-1]["content"])
    assert text == vlm_tokenizer.decode(sdpo.teacher_prompt_ids(
        vlm_tokenizer, [{"role": "user", "content": question}], row["reference"], None, cfg))
    # the teacher forward (a shared prefix asked for: the fallback) sees the picture
    packed = microbatch.pack(policy, [ids], [len(responses[1])], 0, torch.device("cpu"), images=[row["images"]],
                             shared_prefix=True)
    assert packed.prefix is None and int(packed.image_mask.sum()) == image_prompts.tokens_per_image(row["images"][0])
    with_picture = loop_logprobs(policy, [ids], [len(responses[1])], [row["images"]])
    other_picture = loop_logprobs(policy, [ids], [len(responses[1])], [rows[1]["images"]])
    assert (with_picture - other_picture).abs().max() > 1e-3


@pytest.mark.slow
def test_engine_rollouts_score_the_same_in_the_trainer(engine, vlm_tokenizer, policy, image_batch):
    """Engine log-probs of sampled tokens on image prompts against the loop's old-log-prob
    pass (microbatch.response_logprobs: micro-batches of mixed prompts, right-padded)."""
    import run
    prompts, images = image_batch
    rows = [{"uid": str(i), "images": im} for i, im in enumerate(images)]
    worst, generated_image_tokens = 0.0, 0
    for temperature in (1.0, 0.7):
        out = engine.generate(prompts, n=4, temperature=temperature, max_tokens=24, seed=3, images=images)
        rollouts = [microbatch.Rollout(row=row, prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                                       rollout_logprobs=s.logprobs, text=s.text, truncated=s.truncated)
                    for row, samples in zip(rows, out) for s in samples]
        trainer = microbatch.response_logprobs(policy, rollouts, vlm_tokenizer.pad_token_id, run.Dist(0, 1, torch.device("cpu")),
                                               micro_batch=5, temperature=temperature)
        for r, lp in zip(rollouts, trainer):
            worst = max(worst, (torch.tensor(r.rollout_logprobs) - torch.tensor(lp)).abs().max().item())
            generated_image_tokens += r.response_ids.count(ImagePrompts(engine.model_dir).image_token_id)
    print(f"engine vs the loop's trainer forward on image prompts: max |diff| {worst:.2e} nats "
          f"({generated_image_tokens} generated image tokens)")
    assert worst < TOL


@pytest.mark.slow
def test_two_rank_torchrun_sdpo_on_the_picture_task(tmp_path):
    """FSDP2 over two ranks with the vision tower sharded, uneven micro-batches (an idle rank
    runs the tower on a blank picture), every sync proven by the image probe, the figures of
    the one-rank run."""
    from test_run import SMALL, _metrics, _run, check_agrees_with_one_rank, check_two_rank_run
    # 16 rollouts in mini-batches of 6/5/5 and micro-batches of 2: one rank runs fewer
    # micro-batches and must still join FSDP's and the teacher's collectives; the one-rank run
    # of the same flags gives the same figures (the text model's path is the same code without
    # the tower: tests/test_faults.py's engine-kill run compares it so)
    flags = SMALL + ["--data.task=shapes", "--algo=sdpo", "--train.mini_batches=3", "--train.micro_batch=2",
                     "--sdpo.teacher_micro_batch=2"]
    out, alone = str(tmp_path / "sdpo"), str(tmp_path / "alone")
    proc = _run(flags + [f"--log.out_dir={out}"], nproc=2, timeout=600)
    steps = check_two_rank_run(proc, out)
    _run(flags + [f"--log.out_dir={alone}"], timeout=600)
    check_agrees_with_one_rank(_metrics(out), _metrics(alone), 2)
    assert all(r["rollout/mismatch_kl"] < 1e-4 for r in steps)
    from transformers import AutoModelForImageTextToText
    AutoModelForImageTextToText.from_pretrained(os.path.join(out, "final"))
    ImagePrompts(os.path.join(out, "final"))  # with its image processor: it can be trained on again


class SeeingEngine:
    """Answers each shapes question right when its picture is the row's, except on the rows it
    misreads, and "2" (the answer to some count questions, never to a colour or position one) for
    any other picture and on those rows."""

    def __init__(self, tokenizer, rows, misread=()):
        self.tokenizer = tokenizer
        self.answers = {row["images"][0].tobytes(): row["answer"] for i, row in enumerate(rows) if i not in misread}
        self.seen = []  # the pictures of each call, prompt by prompt

    def generate(self, prompts, n, temperature, max_tokens, seed, images=None):
        from rollout import Sample
        out = []
        self.seen.append(images)
        for p, pictures in zip(prompts, images):
            text = "Answer: " + self.answers.get(pictures[0].tobytes(), "2")
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append([Sample(p, ids, [-1.0] * len(ids), text, False) for _ in range(n)])
        return out


def test_blind_check_scores_the_rows_with_blank_pictures_and_pairs_the_gap(vlm_tokenizer):
    """--eval_only --blind: the same rows with every picture white and the same size; a model
    that reads the picture loses what the picture told it, row by row, and the gap's standard
    error is that of the rows' differences (paired: the rows it misreads score alike both ways)."""
    from flags import parse_config
    from evaluate import blind_check, evaluate
    rows = data.task_rows("shapes", "test", 12)
    # pictures of different sizes: each blank one must take its own picture's
    rows = [dict(row, images=[im.resize((im.width + i, im.height + 2 * i)) for im in row["images"]])
            for i, row in enumerate(rows)]
    cfg = parse_config(["--data.task=shapes", "--rollout.eval_k=2", "--eval_only=True", "--blind=True"])
    misread = (0, 3, 6, 9)
    engine = SeeingEngine(vlm_tokenizer, rows, misread)
    seen, seeing = evaluate(engine, vlm_tokenizer, rows, cfg)
    originals = [im for pictures in engine.seen[-1] for im in pictures]
    got = blind_check(engine, vlm_tokenizer, rows, cfg, seeing)
    blanks = [im for pictures in engine.seen[-1] for im in pictures]
    assert [im.size for im in blanks] == [im.size for im in originals] == [im.size for row in rows for im in row["images"]]
    assert len({im.size for im in blanks}) == len(rows)
    assert all(im.getextrema() == ((255, 255),) * 3 for im in blanks)  # white, every channel
    blind = [float(row["answer"] == "2") for row in rows]  # a blind "2" is right there
    seeing = [float(i not in misread or row["answer"] == "2") for i, row in enumerate(rows)]
    assert seen["eval/success_rate"] == pytest.approx(statistics.mean(seeing)) and min(seeing) == 0
    assert got["eval/success_rate_blind"] == pytest.approx(statistics.mean(blind))
    gaps = [s - b for s, b in zip(seeing, blind)]
    assert got["eval/seeing_minus_blind"] == pytest.approx(statistics.mean(gaps))
    paired = statistics.stdev(gaps) / len(rows) ** 0.5
    unpaired = (statistics.variance(seeing) / len(rows) + statistics.variance(blind) / len(rows)) ** 0.5
    assert got["eval/seeing_minus_blind_stderr"] == pytest.approx(paired)
    assert abs(paired - unpaired) > 0.01  # the rows tell the two apart
    with pytest.raises(ValueError, match="--blind: the held-out rows have no pictures"):
        blind_check(engine, vlm_tokenizer, data.task_rows("strops", "test", 2), cfg, [1.0, 1.0])
    with pytest.raises(ValueError, match="--blind is a measurement of --eval_only"):
        parse_config(["--data.task=shapes", "--blind=True"])
