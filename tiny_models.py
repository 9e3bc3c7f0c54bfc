"""The tiny models the project builds (no --model.path), their cache keyed by their source, their recipe.

The tiny text model: a byte-level BPE trained on the tasks' text and a small Qwen2 with random
weights; the tiny VLM: a Qwen2.5-VL with the text model's dimensions and a two-block vision tower.
Both are written as ordinary HF directories that transformers and vLLM load, cached under a hash
of their config and of the code that builds them (source_hash).
"""
import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

from config import TinyModelConfig
from image_prompts import VISION_TOKENS
from tasks import TASKS, TaskConfig, task_rows
from tasks.strops import OPS

# The tiny model's recipe (flags.recipe_flags): its flag values on a task without a recipe of its
# own, and under every task's own. Its parameters take far larger steps than a pretrained model's:
# a pretrained model's rate would barely move it (docs/results.md). Its warm start
# (--train.warm_start_*) shows it feedback contexts, so its teacher reads feedback, unlike a weak
# pretrained model's (--sdpo.include_environment_feedback, sdpo.py).
RECIPE = {
    "optim.lr": 1e-4,
    "optim.warmup_steps": 2,
    "sdpo.include_environment_feedback": True,
}

# ----------------------------------------------------------------------------------------
# The tiny default model

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_TASKS = ("arith", "strops", "quiz")  # the tasks whose text the tokenizer is trained on
# The source a tiny model's build runs: this file (the model, and the tasks' text its tokenizer is
# trained on) and the modules it imports (the tasks' generators). Their code is part of the cache key (source_hash).
TINY_SOURCES = ("tiny_models.py", "errors.py", "feedback/__init__.py", "tasks/__init__.py", *(f"tasks/{name}.py" for name in TASKS))
PROJECT_DIR = os.path.dirname(os.path.abspath(__file__))


def source_hash(files) -> str:
    """A hash of the code in files (paths relative to the project's directory, or absolute), for
    the key of a cache entry built by running it: an edit to that code changes it, an edit to a
    comment, a docstring, the layout or any other file does not. Python files are hashed as
    their syntax tree without docstrings, other files byte for byte."""
    digest = hashlib.sha1()
    for name in files:
        path = os.path.join(PROJECT_DIR, name)
        stat = os.stat(path)
        digest.update(_code_digest(path, stat.st_mtime_ns, stat.st_size))
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=64)
def _code_digest(path: str, mtime_ns: int, size: int) -> bytes:
    """source_hash's part for one file (cached while the file is unchanged: parsing takes ~0.1 s)."""
    import ast
    with open(path, "rb") as f:
        text = f.read()
    if path.endswith(".py"):
        tree = ast.parse(text)
        for node in ast.walk(tree):  # docstrings: the first statement of a body, a string
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        text = ast.dump(tree).encode()
    return hashlib.sha1(text).digest()


def _tokenizer_corpus(seed: int) -> list[str]:
    """Text the tokenizer is trained on: prompts and answers of both tasks, and the SDPO
    reprompt and feedback vocabulary, so that teacher contexts tokenise compactly."""
    texts = []
    # fixed: the tokenizer must not move with the task defaults, nor with a task added to the
    # table (its text is tokenised byte by byte where BPE has no merges for it)
    corpus_tasks = TaskConfig(strops_max_ops=2, quiz_ops="+-*", quiz_max=12)
    for task in TOKENIZER_TASKS:
        for split, n in (("train", 300), ("test", 30)):
            for row in task_rows(task, split, n, seed=seed, cfg=corpus_tasks):
                texts += [m["content"] for m in row["messages"]] + [row["reference"]]
    texts += ["<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_start|>system\n"] * 50
    # Repeated so that BPE merges them: a teacher context spelled letter by letter is twice as long.
    texts += [
        "Correct solution:", "Correctly solve the original question.",
        "The following is feedback from your unsuccessful earlier attempt:",
        "Your previous response was too long and truncated before it finished, so no final answer could be "
        "graded. Try again with a shorter response.",
        "Your answer is incorrect.", "Input:", "Output:", "Expected:", "Unknown op", "Valid ops:",
        "Wrong Answer: 2 of 4 tests failed.", "Time limit exceeded", "Runtime error", "Format Error:",
        "Wrong Answer: 2 of 4 results are wrong.", "is right.", "is not",
        " ".join(sorted(OPS)),
    ] * 20
    return texts


def _train_tokenizer(texts: list[str], vocab_size: int, special_tokens: list[str], chat_template: str):
    """A byte-level BPE trained on texts, as an HF tokenizer (EOS <|im_end|>, pad <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    # Single-digit tokens: arithmetic is learnable digit by digit, whatever BPE merges.
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    return tokenizer


def _text_config(cfg: TinyModelConfig, tokenizer) -> dict:
    """The language model's dimensions and special ids, shared by the text model and the VLM."""
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
                head_dim=cfg.hidden_size // cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
                tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos, pad_token_id=pad)


def _save_with_generation_config(model, tokenizer, out_dir: str):
    from transformers import GenerationConfig
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=eos).save_pretrained(out_dir)


def build_tiny_model(out_dir: str, cfg: TinyModelConfig):
    """Write the tiny model (config, safetensors, tokenizer, chat template) into out_dir."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tokenizer = _train_tokenizer(_tokenizer_corpus(cfg.seed), cfg.vocab_size, SPECIAL_TOKENS, CHAT_TEMPLATE)
    config = Qwen2Config(**_text_config(cfg, tokenizer), rope_theta=10000.0, torch_dtype="float32")
    torch.manual_seed(cfg.seed)
    _save_with_generation_config(Qwen2ForCausalLM(config), tokenizer, out_dir)


def _cached_build(kind: str, build, cfg, cache_dir: str | None) -> str:
    """The directory build(dir, cfg) writes, cached under a hash of (kind, cfg, the code of
    TINY_SOURCES): built on first use and whenever its recipe or that code changes.

    Concurrent builders (torchrun ranks, parallel tests) each build into a temporary
    directory and rename it into place; the first rename wins and the others are dropped.
    """
    recipe = json.dumps({"source": source_hash(TINY_SOURCES), **cfg.__dict__}, sort_keys=True)
    cache_dir = cache_dir or os.environ.get("SDPO_CACHE", os.path.expanduser("~/.cache/sdpo"))
    path = os.path.join(cache_dir, kind + "-" + hashlib.sha1(recipe.encode()).hexdigest()[:12])
    if os.path.exists(os.path.join(path, "recipe.json")):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir, prefix=".build-")
    try:
        build(tmp, cfg)
        with open(os.path.join(tmp, "recipe.json"), "w") as f:  # written last: marks a complete build
            f.write(recipe)
        os.rename(tmp, path)
    except OSError:
        if not os.path.exists(os.path.join(path, "recipe.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_model_dir(cfg: TinyModelConfig | None = None, cache_dir: str | None = None) -> str:
    """The cached tiny model for cfg (see _cached_build)."""
    return _cached_build("tiny", build_tiny_model, cfg or TinyModelConfig(), cache_dir)


# ----------------------------------------------------------------------------------------
# The tiny vision-language model (its BPE also trained on the picture task's text)

# Qwen2.5-VL's template, less tools and video: an image part is <|vision_start|><|image_pad|><|vision_end|>.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class TinyVLMConfig(TinyModelConfig):
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_heads: int = 1  # vision head_dim 64, like the text side's
    vision_intermediate_size: int = 128
    vision_window: int = 56  # pixels a side of a window-attention window (Qwen2.5-VL: 112)
    image_pixels: int = 112 * 112  # every image is resized to about this area: 16 image tokens


def _vlm_tokenizer_corpus(seed: int) -> list[str]:
    texts = _tokenizer_corpus(seed)
    for split, n in (("train", 300), ("test", 30)):
        for row in task_rows("shapes", split, n, seed=seed):
            texts += [p["text"] for p in row["messages"][-1]["content"] if p["type"] == "text"] + [row["reference"]]
    return texts + ["<|vision_start|><|image_pad|><|vision_end|>"] * 50


def build_tiny_vlm(out_dir: str, cfg: TinyVLMConfig):
    """Write the tiny vision-language model (config, safetensors, tokenizer, chat template,
    image processor) into out_dir."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tokenizer = _train_tokenizer(_vlm_tokenizer_corpus(cfg.seed), cfg.vocab_size, SPECIAL_TOKENS + VISION_TOKENS,
                                 VLM_CHAT_TEMPLATE)
    head_dim = cfg.hidden_size // cfg.num_heads
    # mrope splits the rotary frequencies between time, height and width as Qwen2.5-VL does (16:24:24 of 64)
    section = [head_dim // 8, 3 * head_dim // 16, head_dim // 2 - head_dim // 8 - 3 * head_dim // 16]
    text = {**_text_config(cfg, tokenizer),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}}
    vision_start, vision_end, image_pad, video_pad = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(depth=cfg.vision_depth, hidden_size=cfg.vision_hidden_size, num_heads=cfg.vision_heads,
                           intermediate_size=cfg.vision_intermediate_size, out_hidden_size=cfg.hidden_size,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=cfg.vision_window,
                           fullatt_block_indexes=[cfg.vision_depth - 1]),
        image_token_id=image_pad, video_token_id=video_pad, vision_start_token_id=vision_start,
        vision_end_token_id=vision_end, tie_word_embeddings=True,
        eos_token_id=text["eos_token_id"], pad_token_id=text["pad_token_id"], bos_token_id=text["bos_token_id"])
    torch.manual_seed(cfg.seed)
    _save_with_generation_config(Qwen2_5_VLForConditionalGeneration(config), tokenizer, out_dir)
    Qwen2VLImageProcessorPil(min_pixels=cfg.image_pixels, max_pixels=cfg.image_pixels, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out_dir)


def tiny_vlm_dir(cfg: TinyVLMConfig | None = None, cache_dir: str | None = None) -> str:
    """The cached tiny vision-language model for cfg (see _cached_build)."""
    return _cached_build("tiny-vlm", build_tiny_vlm, cfg or TinyVLMConfig(), cache_dir)


def built_here(model_dir: str) -> bool:
    """Whether model_dir holds a tiny model this project built, or one trained from it (a warm
    start, a run's final model): its chat template is ours, which no released model's is."""
    try:
        with open(os.path.join(model_dir, "chat_template.jinja")) as f:
            return f.read() in (CHAT_TEMPLATE, VLM_CHAT_TEMPLATE)
    except OSError:
        return False
