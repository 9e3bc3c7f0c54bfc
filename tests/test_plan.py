"""`python run.py --plan` (plan.py): what a trainer rank and the engine hold, against cases worked
by hand (8B on 8 x 80 GB separate, 8B on 1 x 80 GB colocated, 32B on 8 x 80 GB), docs/scale.md's
table, the README's GPU command on a mocked node, and the CPU machine's plan."""
import json
import os
import re
import shlex
import struct
import sys
from types import SimpleNamespace

import pytest
import torch

import plan
import run
from errors import FlagError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from plan_table import QWEN3_8B, QWEN25_32B, table  # noqa: E402

GPU = 80 * 10 ** 9  # a planned "80 GB" GPU, in bytes
QWEN3_8B_PARAMS = 8_190_735_360  # Qwen3-8B's safetensors: its q_norm and k_norm too, which the config does not count


def qwen3_8b_dir(tmp_path) -> str:
    """A Qwen3-8B directory without weights: config.json, a tokenizer file, and two safetensors
    files of headers alone (the shapes of Qwen3-8B's tensors, bf16, no data after them)."""
    H, I, V, layers = 4096, 12288, 151936, 36
    shapes = {"model.embed_tokens.weight": [V, H], "lm_head.weight": [V, H], "model.norm.weight": [H]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": [4096, H], p + "self_attn.k_proj.weight": [1024, H],
                       p + "self_attn.v_proj.weight": [1024, H], p + "self_attn.o_proj.weight": [H, 4096],
                       p + "self_attn.q_norm.weight": [128], p + "self_attn.k_norm.weight": [128],
                       p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H],
                       p + "mlp.down_proj.weight": [H, I], p + "input_layernorm.weight": [H],
                       p + "post_attention_layernorm.weight": [H]})
    names = sorted(shapes)
    for k, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in part:
            size = 2 * int(torch.tensor(shapes[name]).prod())
            header[name] = {"dtype": "BF16", "shape": shapes[name], "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header).encode()
        (tmp_path / f"model-{k + 1:05d}-of-00002.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    (tmp_path / "tokenizer.json").write_text("{}")
    return str(tmp_path)


def gpus(n: int, ranks: int, local: int | None = None) -> plan.Node:
    return plan.Node(gpus=n, gpu_bytes=GPU, host_bytes=2 * 10 ** 12, ranks=ranks, local_ranks=local or ranks)


def flags(*more) -> run.Config:
    return run.parse_config(["--recipe=pretrained", *more])


def test_8b_on_8_gpus_of_80_gb_separate_as_worked_by_hand(tmp_path):
    """The README's command: 7 trainer ranks (FSDP2), the engine on GPU 7, micro-batches of 4.
    P = 8,190,735,360 from the safetensors headers (no weights in the files: none read).
    A rank: 4P/7 = 4,680,420,205 each for parameters, gradients and the EMA teacher, 8P/7 =
    9,360,840,411 for AdamW; unsharded: the root R = 2 x 151,936 x 4,096 + 4,096 =
    1,244,663,808 and two layers of Y = 4,096 x 6,144 + 4,096^2 + 3 x 4,096 x 12,288 + 2 x 4,096
    = 192,946,176 in bf16, and R in float32: 2 (R + 2Y) + 4R = 8,239,767,552; activations: a
    token keeps A = 8 x 4,096 + 2 (2 x 4,096 + 2 x 4,096 + 2 x 1,024 + 4 x 12,288) = 167,936 a
    layer, 4 sequences x 1,280 tokens x 36 layers x A, plus the head's 12 x 512 x 151,936:
    31,887,458,304. Total 63,529,326,882 of 0.9 x 80e9.
    The engine: 0.9 x 80e9 = 72e9, of which 2P = 16,381,470,720 weights, 16,384 x 2 x (4,096 +
    4,096 + 2 x 1,024 + 2 x 12,288) + 12 x 1,024 x 151,936 = 3,007,840,256 activations, and the
    rest, 52,610,689,024, KV cache at 2 x 36 x 8 x 128 x 2 = 147,456 bytes a token: 356,789
    tokens, 278 sequences of 1,280."""
    m = plan.read_model(flags(f"--model.path={qwen3_8b_dir(tmp_path)}"))
    assert (m.params, m.counted, m.root, m.layer) == (QWEN3_8B_PARAMS, "safetensors headers", 1_244_663_808, 192_946_176)
    p = plan.plan(flags("--rollout.placement=separate", "--train.micro_batch=4"), m, gpus(8, 7))
    assert p.trainer == {"parameters": 4_680_420_205, "gradients": 4_680_420_205, "AdamW": 9_360_840_411,
                         "teacher copy": 4_680_420_205, "unsharded units": 8_239_767_552,
                         "activations": 31_887_458_304}
    assert sum(p.trainer.values()) == 63_529_326_882 and p.trainer_cap == 72 * 10 ** 9 and p.refusal == ""
    assert p.engine == {"weights": 16_381_470_720, "activations": 3_007_840_256, "KV cache": 52_610_689_024}
    assert (p.kv_token_bytes, p.kv_tokens, p.sequences, p.sync_bytes) == (147_456, 356_789, 278, 16_381_470_720)
    # at the default 32 sequences a micro-batch the activations are 8x: refused, naming the flag
    p = plan.plan(flags("--rollout.placement=separate"), m, gpus(8, 7))
    assert p.refusal.startswith("--train.micro_batch=32: a micro-batch's activations")
    assert p.refusal.endswith("lower --train.micro_batch to 5 or set --model.gradient_checkpointing=True")


def test_8b_on_one_gpu_of_80_gb_colocated_as_worked_by_hand():
    """One process: float32 parameters, gradients, teacher (4P each), AdamW (8P) and autocast's
    bf16 copy (2P): 22P = 180,196,177,920 against (0.9 - 0.3) x 80e9 = 48e9: refused. Separate,
    W ranks hold 20P/W + 8,239,767,552 unsharded + one sequence's activations (1,280 x 36 x
    167,936 + 933,494,784 = 8,671,985,664) within 72e9: W >= 163,814,707,200 / 55,088,246,784 =
    2.97, so 3. The engine beside it: 0.3 x 80e9 = 24e9 - 16,381,470,720 - 3,007,840,256 =
    4,610,689,024 of KV cache, 31,268 tokens."""
    m = plan.model_shape(QWEN3_8B, "Qwen3-8B")
    assert m.params == QWEN3_8B_PARAMS - 36 * 2 * 128  # the config does not count q_norm and k_norm
    p = plan.plan(flags(), m, gpus(1, 1))
    fixed = sum(v for k, v in p.trainer.items() if k != "activations")
    assert fixed == 22 * m.params and p.trainer_cap == 48 * 10 ** 9
    assert p.refusal == ("the trainer's weights, gradients, AdamW and copies alone (180.2 GB) exceed the 48.0 GB a "
                         "trainer GPU may fill: shard it over 3 trainer ranks or more (torchrun --nproc_per_node, "
                         "--nnodes) with --rollout.placement separate")
    assert p.kv_tokens == (24 * 10 ** 9 - 2 * m.params - 3_007_840_256) // 147_456 == 31_268


def test_32b_on_8_gpus_of_80_gb_as_worked_by_hand():
    """Qwen2.5-32B (q, k, v biases): Y = 5,120 x 7,168 + 5,120^2 + 3 x 5,120 x 27,648 + 2 x 5,120 +
    7,168 = 487,605,248, R = 2 x 152,064 x 5,120 + 5,120 = 1,557,140,480, P = R + 64Y =
    32,763,876,352. Seven ranks: 3 x 4P/7 + 8P/7 = 93,611,075,290 of shards and 2 (R + 2Y) + 4R =
    11,293,263,872 unsharded, 104.9 GB before any activation: refused, naming the ranks: with
    one sequence's activations (1,280 x 64 x 307,200 + 12 x 512 x 152,064 = 26,100,105,216),
    20P/W <= 72e9 - 11,293,263,872 - 26,100,105,216 needs W >= 18.9: 19. The engine on one GPU:
    72e9 - 2P - 4,083,154,944 = 2,389,092,352 bytes at 262,144 a token, 9,113 tokens; on two
    (--rollout.tensor_parallel 2): P + 2,975,858,688 on each, 276,643 tokens at 131,072."""
    m = plan.model_shape(QWEN25_32B, "Qwen2.5-32B")
    assert (m.params, m.layer, m.root) == (32_763_876_352, 487_605_248, 1_557_140_480)
    p = plan.plan(flags("--rollout.placement=separate", "--train.micro_batch=4"), m, gpus(8, 7))
    assert sum(v for k, v in p.trainer.items() if k not in ("unsharded units", "activations")) == 93_611_075_290
    assert p.trainer["unsharded units"] == 11_293_263_872
    assert p.refusal.endswith("shard it over 19 trainer ranks or more (torchrun --nproc_per_node, --nnodes)")
    assert (p.kv_tokens, p.sync_bytes) == (9_113, 2 * m.params)
    p = plan.plan(flags("--rollout.placement=separate", "--rollout.tensor_parallel=2"), m, gpus(8, 12, 6))
    assert (p.engine["weights"], p.kv_token_bytes, p.kv_tokens) == (m.params, 131_072, 276_643)
    # a longer model length than the engine's KV cache holds: vLLM would refuse it at start
    p = plan.plan(flags("--rollout.placement=separate", "--rollout.max_model_len=32768"), m, gpus(8, 7))
    assert p.refusal == ("the engine's KV cache holds 9,113 tokens, fewer than --rollout.max_model_len=32768 "
                         "(vLLM refuses it): use --rollout.tensor_parallel 2")


def test_docs_scale_holds_the_plans_table():
    """docs/scale.md's table is bench/plan_table.py's, from plan.plan (rerun it with --write)."""
    with open(os.path.join(ROOT, "docs", "scale.md")) as f:
        assert table() in f.read()


def readme_gpu_command() -> tuple[int, list[str]]:
    """(--nproc_per_node, run.py's flags) of the README's GPU command."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"## GPU\n.*?```bash\n(.*?)```", f.read(), re.S).group(1)
    line = next(c for c in block.replace("\\\n", " ").splitlines() if c.startswith("torchrun"))
    words = shlex.split(line, comments=True)
    nproc = int(next(w for w in words if w.startswith("--nproc_per_node=")).split("=")[1])
    return nproc, words[words.index("run.py") + 1:]


def test_the_readmes_gpu_command_plans_on_a_mocked_node_as_docs_scale_says(tmp_path, monkeypatch, capsys):
    nproc, argv = readme_gpu_command()
    assert "--plan" in argv and nproc == 7
    argv = [a.replace("path/to/Qwen3-8B", qwen3_8b_dir(tmp_path)) for a in argv]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=GPU, name="GPU"))
    for name, value in (("WORLD_SIZE", nproc), ("LOCAL_WORLD_SIZE", nproc), ("RANK", 0)):
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(run, "process_group", None)  # nothing past the plan may run
    run.main(argv)
    printed = capsys.readouterr().out
    row = next(r for r in table().splitlines() if "fits" in r and r.startswith("| 8B |"))
    for figure in ("63.5 GB of 72.0 GB", "356,789 tokens", "278 sequences", "16.4 GB"):
        assert figure in row
        assert figure.replace(" of ", " of the ") in printed if " of " in figure else figure in printed
    assert printed.rstrip().endswith("it fits")


def test_on_a_cpu_machine_the_plan_is_per_process_and_refuses_a_micro_batch_too_big(monkeypatch, capsys):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.cli(["--plan"]) == 0
    out, err = capsys.readouterr()
    assert "on a CPU machine of" in out and "trainer (its process)" in out and out.rstrip().endswith("it fits")
    assert err == ""
    assert run.cli(["--plan", "--train.micro_batch=100000", "--rollout.max_tokens=100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --train.micro_batch=100000: a micro-batch's activations") and \
        err.strip().count("\n") == 0 and "lower --train.micro_batch to" in err
    with pytest.raises(FlagError):
        run.main(["--plan", "--train.micro_batch=100000", "--debug"])
