"""What a run would hold in memory, before anything loads: `python run.py --plan` (docs/scale.md).

From the model's config.json (no weights read: the parameter count from the safetensors files'
headers where the directory has them, else from the config's dimensions), the flags and this
node's devices, per GPU (on a CPU machine, per process). P parameters, W trainer ranks (FSDP2
shards), H hidden size, q = heads x head_dim, k = KV heads x head_dim, I the MLP's width, L
decoder layers, V vocabulary; R the root unit's parameters (embedding, an untied LM head, the
final norm), Y one decoder layer's; w the width of an activation, r of the residual stream
(w = 2, bf16 on GPUs; 4, float32 on a CPU; r = 2 under FSDP2 on GPUs, else 4: one process keeps
float32 weights under bf16 autocast).

A trainer rank:
- parameters 4P/W, gradients 4P/W, AdamW's two moments 8P/W (float32 shards);
- a copy of the policy's shards, 4P/W, for the SDPO teacher (ema, frozen, trust-region; not
  live) and for a reference (DPO, SPIN, GAD's KL); GAD's discriminator its own 16P'/W;
- the unsharded working set: under FSDP2 the root unit and two decoder layers gathered at
  width w, w(R + 2Y), and the root's float32 gradient before its reduce-scatter, 4R; in one
  process on a GPU autocast's bf16 copy of the weights, 2P;
- activations: B sequences (--train.micro_batch) of S tokens, the longest a sequence can be
  (--data.max_prompt_len + --rollout.max_tokens, at most --rollout.max_model_len), a token
  keeping per decoder layer A = 8H + w(2H + 2q + 2k + 4I) bytes (the two RMSNorms' float32
  inputs and their outputs, q, k, v and the attention output, the MLP's gate, up, activation
  and product): B S L A; with --model.gradient_checkpointing B S (L r H + A) (each layer's
  input, and one layer recomputed); plus the chunked head's float32 logits, log-softmax and
  gradient, 12 c V (c = --train.head_chunk_size).
A trainer rank may fill TRAINER_SHARE of its GPU (the rest: the CUDA context, NCCL's buffers,
the allocator's fragmentation), less the engine's share where the engine shares it (colocated).

The engine, on each of its T GPUs (--rollout.tensor_parallel; separate: the T after the
trainers', colocated: trainer rank 0's) or in its process on a CPU, holds its budget,
--rollout.gpu_memory_utilization x the GPU's memory (on a CPU the weights, activations and a KV
cache of --rollout.kv_cache_tokens, or at most rollout.CPU_KV_CACHE_BYTES), of which:
- weights eP/T (e: 2 bytes in bf16 on GPUs, 4 in float32 on a CPU: sync.engine_dtype);
- activations of its profiling forward and sampler: N e (H + q + 2k + 2I) + 12 M V, for N
  batched tokens and M sequences (vLLM 0.32's offline defaults, engine_batch);
- the KV cache, the rest: a token takes 2 L ceil(KV heads / T) head_dim e bytes on each GPU;
  it holds the budget's rest / that many tokens, that / S sequences of the longest length.
vLLM refuses a KV cache of fewer than --rollout.max_model_len tokens.

A sync moves eP bytes from trainer rank 0 to the engine at every step.
"""
from __future__ import annotations

import glob
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

import objectives
import sync
from errors import FlagError

if TYPE_CHECKING:
    from config import Config

TRAINER_SHARE = 0.9  # the part of a trainer's GPU, or of a CPU machine's memory, the plan fills at most
GB = 1e9


@dataclass
class ModelShape:
    """What the plan needs of a model (model_shape)."""
    name: str
    params: int  # all of them (a vision tower's too)
    root: int  # embedding, untied LM head, final norm
    layer: int  # the largest decoder layer
    layers: int
    hidden: int
    q: int  # heads x head_dim
    kv: int  # KV heads x head_dim
    kv_heads: int
    head_dim: int
    mlp: int  # the MLP's intermediate width (a MoE layer's: all its experts')
    vocab: int
    counted: str  # where params comes from


@dataclass
class Node:
    """The devices the plan is for: GPUs (0: a CPU machine), each one's bytes, the host's, and
    torchrun's ranks (all of them, and this node's)."""
    gpus: int
    gpu_bytes: int
    host_bytes: int
    ranks: int = 1
    local_ranks: int = 1
    gpu_name: str = ""


@dataclass
class Plan:
    """Bytes a trainer rank and the engine hold (per GPU, or per process on a CPU), by part."""
    trainer: dict = field(default_factory=dict)
    trainer_cap: int = 0  # what a trainer rank may fill (TRAINER_SHARE, less a colocated engine's)
    engine: dict = field(default_factory=dict)  # none where the run has no engine (SFT)
    engine_budget: int = 0  # --rollout.gpu_memory_utilization of a GPU (on a CPU the parts' sum)
    # the KV cache: a token's bytes on each GPU, the tokens it holds, and the sequences of the
    # longest length (sequence_tokens) those make
    kv_token_bytes: int = 0
    kv_tokens: int = 0
    sequences: int = 0
    sequence_tokens: int = 0
    sync_bytes: int = 0  # from trainer rank 0 to the engine at every step
    lines: list = field(default_factory=list)  # as --plan prints them
    refusal: str = ""  # where it cannot fit, what to change; empty where it fits


def model_shape(config: dict, name: str = "", params: int = 0) -> ModelShape:
    """The shape of the HF decoder that config describes (its text model's, for a VLM); params:
    a count read elsewhere (safetensors headers), else counted from the config's dimensions."""
    text = config.get("text_config", config)
    H, L, V = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or H // heads
    kv_heads = text.get("num_key_value_heads") or heads
    q, kv = heads * head_dim, kv_heads * head_dim
    experts = text.get("num_experts") or text.get("num_local_experts") or 0
    mlp = experts * text.get("moe_intermediate_size", text["intermediate_size"]) if experts else \
        text["intermediate_size"]
    bias = (q + 2 * kv) if text.get("attention_bias", text.get("model_type") == "qwen2") else 0
    layer = H * (q + 2 * kv) + q * H + 3 * H * mlp + H * experts + 2 * H + bias
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    root = V * H * (1 if tied else 2) + H
    return ModelShape(name, params or root + L * layer, root, layer, L, H, q, kv, kv_heads, head_dim, mlp, V,
                      "safetensors headers" if params else "config.json")


def read_model(cfg: Config) -> ModelShape:
    """--model.path's shape from its config.json and its safetensors headers (a few KB a
    file, no weights), or the tiny model's from its flags (nothing built)."""
    if not cfg.model.path:
        t = cfg.model.tiny
        return model_shape({"hidden_size": t.hidden_size, "num_hidden_layers": t.num_layers, "vocab_size": t.vocab_size,
                            "num_attention_heads": t.num_heads, "intermediate_size": t.intermediate_size,
                            "tie_word_embeddings": True}, "the tiny model (tiny_models.py)")
    params = 0
    for path in glob.glob(os.path.join(cfg.model.path, "*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        params += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return model_shape(sync.checkpoint_config(cfg.model.path), cfg.model.path, params)


def this_node() -> Node:
    """This node's devices as torch and the OS report them, and torchrun's ranks."""
    import psutil
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    props = torch.cuda.get_device_properties(0) if gpus else None
    return Node(gpus, props.total_memory if props else 0, psutil.virtual_memory().total,
                int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                props.name if props else "")


def activation_bytes(cfg: Config, m: ModelShape, node: Node, sequences: int) -> int:
    """The activations of one micro-batch of `sequences` of the longest length (docstring)."""
    w = 2 if node.gpus else 4
    r = 2 if node.gpus and node.ranks > 1 else 4
    tokens = sequences * longest_sequence(cfg)
    per_layer = 8 * m.hidden + w * (2 * m.hidden + 2 * m.q + 2 * m.kv + 4 * m.mlp)
    kept = m.layers * r * m.hidden + per_layer if cfg.model.gradient_checkpointing else m.layers * per_layer
    return tokens * kept + 12 * cfg.train.head_chunk_size * m.vocab


def longest_sequence(cfg: Config) -> int:
    return min(cfg.data.max_prompt_len + cfg.rollout.max_tokens, cfg.rollout.max_model_len)


def trainer_bytes(cfg: Config, m: ModelShape, node: Node, discriminator: ModelShape | None = None) -> dict:
    """A trainer rank's bytes by part (docstring)."""
    W, P = node.ranks, m.params
    held = objectives.OBJECTIVES[cfg.algo.name].held(cfg)  # the objective's extra models
    copies = [name for name, kind in held.items() if kind == "copy"]
    if node.ranks > 1:
        working = (2 if node.gpus else 4) * (m.root + 2 * m.layer) + 4 * m.root
    else:
        working = 2 * P if node.gpus else 0
    parts = {"parameters": 4 * P // W, "gradients": 4 * P // W, "AdamW": 8 * P // W,
             f"{' and '.join(copies)} cop{'ies' if len(copies) > 1 else 'y'}": len(copies) * 4 * P // W,
             "discriminator": 16 * discriminator.params // W if discriminator else 0,
             "unsharded units": working,
             "activations": activation_bytes(cfg, m, node, cfg.train.micro_batch)}
    return {k: v for k, v in parts.items() if v}


def engine_batch(node: Node) -> tuple[int, int]:
    """(tokens, sequences) vLLM 0.32 batches at most offline (its engine arguments' defaults:
    more on GPUs of 70 GiB and up; on a CPU the project's rollout._cpu_engine_args)."""
    if not node.gpus:
        return 8192, 256
    return (16384, 1024) if node.gpu_bytes >= 70 * 2 ** 30 else (8192, 256)


def engine_bytes(cfg: Config, m: ModelShape, node: Node) -> tuple[dict, int, int]:
    """(the engine's bytes by part on each of its GPUs or in its process, its budget, a KV
    token's bytes there)."""
    from rollout import CPU_KV_CACHE_BYTES
    T = cfg.rollout.tensor_parallel
    e = 2 if node.gpus else 4
    e = {"float32": 4, "float16": 2, "bfloat16": 2}.get(cfg.rollout.dtype, e)
    token = 2 * m.layers * math.ceil(m.kv_heads / T) * m.head_dim * e
    batched, seqs = engine_batch(node)
    parts = {"weights": e * m.params // T,
             "activations": batched * e * (m.hidden + m.q + 2 * m.kv + 2 * m.mlp) // T + 12 * seqs * m.vocab}
    if node.gpus:
        budget = int(cfg.rollout.memory_share() * node.gpu_bytes)
        parts["KV cache"] = budget - sum(parts.values())
    else:
        parts["KV cache"] = cfg.rollout.kv_cache_tokens * token if cfg.rollout.kv_cache_tokens else CPU_KV_CACHE_BYTES
        budget = sum(parts.values())
    return parts, budget, token


def plan(cfg: Config, m: ModelShape, node: Node, discriminator: ModelShape | None = None) -> Plan:
    """The bytes of a trainer rank and of the engine on this node (per GPU, per process on a
    CPU), the lines that say so, and where they cannot fit the flag to change."""
    p = Plan(trainer={} if cfg.eval_only else trainer_bytes(cfg, m, node, discriminator),
             sequence_tokens=longest_sequence(cfg))
    if cfg.eval_only or not objectives.OBJECTIVES[cfg.algo.name].references:  # else no engine (run.train)
        p.engine, p.engine_budget, p.kv_token_bytes = engine_bytes(cfg, m, node)
        p.kv_tokens = max(0, p.engine["KV cache"]) // p.kv_token_bytes
        p.sequences = p.kv_tokens // p.sequence_tokens
        p.sync_bytes = 0 if cfg.eval_only else p.engine["weights"] * cfg.rollout.tensor_parallel
    colocated = cfg.rollout.placement == "colocated" and node.gpus
    if node.gpus:
        p.trainer_cap = int((TRAINER_SHARE - (cfg.rollout.memory_share() if colocated else 0)) * node.gpu_bytes)
    else:  # every trainer process and the engine's share the machine
        p.trainer_cap = int((TRAINER_SHARE * node.host_bytes - p.engine_budget) / node.local_ranks)
    p.lines = describe(cfg, m, node, p)
    p.refusal = why_not(cfg, m, node, p, discriminator)
    return p


def why_not(cfg: Config, m: ModelShape, node: Node, p: Plan, discriminator: ModelShape | None) -> str:
    """Where the plan cannot fit, what to change (the first flag that would make it fit)."""
    r = cfg.rollout
    if p.engine and p.kv_tokens < r.max_model_len:
        more = next((t for t in (2, 4, 8) if t > r.tensor_parallel and t <= node.gpus
                     and engine_fits(cfg, m, node, t)), 0) if node.gpus else 0
        fix = (f"use --rollout.tensor_parallel {more}" if more else
               "raise --rollout.gpu_memory_utilization or lower --rollout.max_model_len" if node.gpus else
               "lower --rollout.max_model_len")
        return (f"the engine's KV cache holds {max(p.kv_tokens, 0):,} tokens, fewer than --rollout.max_model_len="
                f"{r.max_model_len} (vLLM refuses it): {fix}")
    total = sum(p.trainer.values())
    if total <= p.trainer_cap or not p.trainer:
        return ""
    fixed = total - p.trainer["activations"]
    where = f"{gb(p.trainer_cap)} a trainer {'GPU' if node.gpus else 'process'} may fill"
    if fixed > p.trainer_cap:  # more ranks to shard over
        return f"the trainer's weights, gradients, AdamW and copies alone ({gb(fixed)}) exceed the {where}: " + \
            more_ranks(cfg, m, node, discriminator)
    per_sequence = activation_bytes(cfg, m, node, 1) - activation_bytes(cfg, m, node, 0)
    fits = int((p.trainer_cap - fixed - activation_bytes(cfg, m, node, 0)) // per_sequence)
    fix = f"lower --train.micro_batch to {fits}" if fits >= 1 else "lower --rollout.max_tokens"
    if not cfg.model.gradient_checkpointing:
        fix += " or set --model.gradient_checkpointing=True"
    return (f"--train.micro_batch={cfg.train.micro_batch}: a micro-batch's activations ({gb(p.trainer['activations'])}) "
            f"take the trainer to {gb(total)}, over the {where}: {fix}")


def more_ranks(cfg: Config, m: ModelShape, node: Node, discriminator: ModelShape | None) -> str:
    """How many trainer ranks, each on a GPU of its own (the engine on another), would hold the
    shards, the working set and one sequence's activations."""
    import dataclasses
    cap = TRAINER_SHARE * (node.gpu_bytes if node.gpus else node.host_bytes)
    for ranks in range(2, 4097):
        wider = dataclasses.replace(node, ranks=ranks, local_ranks=min(ranks, max(node.gpus - 1, 1)))
        parts = trainer_bytes(cfg, m, wider, discriminator)
        if sum(parts.values()) - parts["activations"] + activation_bytes(cfg, m, wider, 1) <= cap:
            break
    where = " with --rollout.placement separate" if cfg.rollout.placement == "colocated" and node.gpus else ""
    return f"shard it over {ranks} trainer ranks or more (torchrun --nproc_per_node, --nnodes){where}"


def engine_fits(cfg: Config, m: ModelShape, node: Node, tensor_parallel: int) -> bool:
    import dataclasses
    wider = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, tensor_parallel=tensor_parallel))
    parts, _, token = engine_bytes(wider, m, node)
    return parts["KV cache"] // token >= cfg.rollout.max_model_len


def gb(n: int) -> str:
    return f"{n / GB:.1f} GB" if abs(n) >= GB / 10 else f"{n / 1e6:.1f} MB"


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def describe(cfg: Config, m: ModelShape, node: Node, p: Plan) -> list[str]:
    """The plan's lines, as `python run.py --plan` prints them."""
    r, T = cfg.rollout, cfg.rollout.tensor_parallel
    unit = f"{node.gpus} x {node.gpu_name or 'GPU'} of {gb(node.gpu_bytes)}" if node.gpus else \
        f"a CPU machine of {gb(node.host_bytes)}"
    if node.gpus and r.placement == "separate":
        first = node.local_ranks
        engine_at = f"GPU{'s' * (T > 1)} {first}" + (f"-{first + T - 1}" if T > 1 else "")
        trainers = "GPU 0" if node.local_ranks == 1 else f"GPUs 0-{node.local_ranks - 1}, each"
    else:
        engine_at = "GPU 0, beside trainer rank 0" if node.gpus else "its own process"
        trainers = ("GPU 0" if node.local_ranks == 1 else f"GPUs 0-{node.local_ranks - 1}, each") if node.gpus \
            else ("its process" if node.local_ranks == 1 else "each of its processes")
    dtype = "bfloat16" if node.gpus else "float32"
    parts = lambda d: ", ".join(f"{k} {gb(v)}" for k, v in d.items())
    lines = [f"plan: {m.name}: {count(m.params)} parameters ({m.counted}), {m.layers} layers; {node.ranks} "
             f"trainer rank{'s' * (node.ranks > 1)} on {unit}; --rollout.placement {r.placement}"]
    if p.trainer:
        lines.append(f"trainer ({trainers}): {parts(p.trainer)} (of {cfg.train.micro_batch} sequences of "
                     f"{p.sequence_tokens:,} tokens) = {gb(sum(p.trainer.values()))} of the {gb(p.trainer_cap)} it "
                     "may fill")
    if p.engine:
        lines.append(f"engine ({engine_at}): {gb(p.engine_budget)}: {parts(p.engine)} ({r.dtype or dtype}) = "
                     f"{p.kv_tokens:,} tokens at {p.kv_token_bytes:,} bytes = {p.sequences:,} sequences of "
                     f"{p.sequence_tokens:,} tokens")
    if p.sync_bytes:
        lines.append(f"sync: {gb(p.sync_bytes)} from trainer rank 0 to the engine at every step")
    return lines


def report_plan(cfg: Config) -> Plan:
    """`python run.py --plan`: this node's plan, printed (by rank 0 under torchrun); where it
    cannot fit, a FlagError (exit status 2) that says what to change."""
    import dataclasses
    m, discriminator = read_model(cfg), None
    if "discriminator" in objectives.OBJECTIVES[cfg.algo.name].held(cfg):  # GAD's: its backbone's, or the student's
        discriminator = read_model(dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, path=cfg.gad.disc_path))) if cfg.gad.disc_path else m
    result = plan(cfg, m, this_node(), discriminator)
    if os.environ.get("RANK", "0") == "0":
        print("\n".join(result.lines + ["" if result.refusal else "it fits"]).rstrip(), flush=True)
    if result.refusal:
        raise FlagError(result.refusal)
    return result
