"""The policy: the module (an HF causal LM whose forward ends in the loss's head), FSDP2 sharding, the Trainer.

The Trainer holds the policy, the optional models an objective asks for, AdamW and its schedule;
the distributed setup they run under (torchrun: gloo on CPU, NCCL on GPUs) is distributed.py's."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import image_prompts
import packing
from distributed import RANK0_WAIT, Dist, local_tensor
from microbatch import Models

if TYPE_CHECKING:
    from config import Config


class CausalLM(torch.nn.Module):
    """An HF causal LM whose forward ends in a caller's head(hidden [N, H], lm_head weight).

    The head runs inside forward so that FSDP2 has the root's (possibly tied) LM-head
    weight unsharded while the loss uses it, and reduce-scatters its gradient after.
    """

    def __init__(self, hf, vision: image_prompts.ImagePrompts | None = None):
        super().__init__()
        self.hf = hf
        self.vision = vision  # a vision-language model's image processor; None for a text model
        self.sharded = False  # FSDP2 (set by shard)

    def forward(self, packed: packing.Packed, head):
        """Hidden states at packed's response positions, through head. packed.prefix: prompts
        shared by several sequences (packing.pack_shared_prefix), run once, their KV cache
        copied to each sequence's row. packed.images: the sequences' pictures (see embed)."""
        if packed.images and self.vision is None:
            raise ValueError("sequences with images need a vision-language model")
        weight = self.hf.lm_head.weight
        if self.sharded or weight.device.type != "cuda" or weight.dtype != torch.float32:
            return head(self.response_hidden(packed), weight)
        # One process leaves the model unsharded, so FSDP2's MixedPrecisionPolicy (bf16 parameters)
        # never applies, and it trained in float32, measurably slower (bench/results/gpu.md).
        # bf16 autocast over the network, and the head in bf16 as FSDP2 runs it; parameters,
        # gradients and AdamW stay float32.
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = self.response_hidden(packed)
        return head(hidden.to(torch.bfloat16), weight.to(torch.bfloat16))

    def response_hidden(self, packed: packing.Packed) -> torch.Tensor:
        """The last hidden states [N, H] at packed's response positions."""
        if self.vision is not None:
            if packed.prefix is not None:
                raise ValueError("a vision-language model runs without a shared prefix (microbatch.pack)")
            hidden = self.hf.model(attention_mask=packed.attention_mask, **self.embed(packed)).last_hidden_state
            return hidden.flatten(0, 1)[packed.hidden_index]
        past, seen = None, None  # the KV cache so far, and which of its positions hold tokens
        for ids, mask, rows in packed.prefix or []:  # shared prompts, level by level (pack_shared_prefix)
            past, seen = self._extend(ids, mask, past, seen)
            past.reorder_cache(rows)
            seen = seen[rows]
        hidden = self._extend(packed.input_ids, packed.attention_mask, past, seen, last=True)
        return hidden.flatten(0, 1)[packed.hidden_index]

    def _extend(self, ids, mask, past, seen, last: bool = False):
        """Run ids [B, L] (mask [B, L]) after a KV cache of the same B rows (None: from the
        start; seen: its positions' mask). Returns the last hidden states, or (the extended
        cache, its mask). A row continues at its count of real tokens so far: a left-padded
        first level, right-padded later ones."""
        if seen is None:
            positions = None if last else (mask.cumsum(1) - 1).clamp(min=0)
        else:
            positions = seen.sum(1, keepdim=True) + torch.arange(ids.shape[1], device=ids.device)
            mask = torch.cat([seen, mask], dim=1)
        out = self.hf.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                            use_cache=not last or past is not None)
        return out.last_hidden_state if last else (out.past_key_values, mask)

    def embed(self, packed: packing.Packed) -> dict:
        """A vision-language model's inputs: token embeddings with the vision tower's outputs
        in place of the pictures' tokens (packed.image_mask), and Qwen2-VL's 3-D rope
        positions. Built here rather than by the HF forward, which would put picture features
        on every image token, including ones the policy generated in a response; vLLM embeds
        those as text, and so does this."""
        model, ids = self.hf.model, packed.input_ids
        embeds = model.get_input_embeddings()(ids)
        if not packed.images and not self.sharded:
            return {"inputs_embeds": embeds}
        # FSDP2: each vision-tower block's all-gather and gradient reduce-scatter are
        # collectives, so a rank whose sequences have no picture (an idle rank, a text row)
        # runs the tower too, on a blank picture, and keeps it in the graph with weight 0.
        pictures = (packed.image_mask, packed.images) if packed.images else self.vision.blank()
        pixels = self.vision.pixel_inputs(*pictures)
        grid = pixels["image_grid_thw"].to(ids.device)
        features = model.get_image_features(pixels["pixel_values"].to(ids.device), grid).pooler_output
        if not packed.images:
            return {"inputs_embeds": embeds + 0.0 * features[0].sum()}
        embeds = embeds.masked_scatter(packed.image_mask[..., None].to(ids.device),
                                       torch.cat(features).to(embeds.dtype))
        positions, _ = model.get_rope_index(ids, mm_token_type_ids=packed.image_mask.long().to(ids.device),
                                            image_grid_thw=grid, attention_mask=packed.attention_mask)
        return {"inputs_embeds": embeds, "position_ids": positions}


def load_policy(model_dir: str, cfg: Config, world: int, device, from_rank0: bool | None = None):
    """The HF model in model_dir as a CausalLM on device, float32, FSDP2-sharded when world > 1.

    One process reads the checkpoint and moves it to the device. Under torchrun rank 0 alone
    reads it (in its own dtype, on the CPU) and broadcasts it piece by piece into every rank's
    own shards of an empty_policy (broadcast_weights): no rank but 0 ever holds a whole tensor
    (docs/scale.md, Loading). from_rank0: the broadcast path also at world 1 (a bench's one-rank
    process group); default world > 1."""
    if not (world > 1 if from_rank0 is None else from_rank0):
        hf = _auto_class(model_dir).from_pretrained(model_dir, dtype=torch.float32)
        if cfg.model.gradient_checkpointing:
            hf.gradient_checkpointing_enable()
        return shard(CausalLM(hf, _vision(model_dir)).to(device), world, device)
    model = empty_policy(model_dir, cfg, world, device)
    full, buffers = {}, {}
    if dist.get_rank() == 0:  # the checkpoint in its own dtype (bf16 for most real models): half the float32 bytes
        source = _auto_class(model_dir).from_pretrained(model_dir, dtype="auto")
        full, buffers = source.state_dict(), dict(source.named_buffers())
    broadcast_weights(model.hf, full, device)
    del full
    # buffers outside the state dict (rotary frequencies) were left uninitialised by to_empty
    for name, buffer in model.hf.named_buffers():
        if dist.get_rank() == 0:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)
    return model


def tensor_identity(module) -> dict:
    """State-dict name -> an id shared by the names of one tensor (a tied LM head and its
    embedding), the same on every rank: the module's own parameters and buffers, since a state
    dict detaches each anew under each name."""
    identity = {n: id(t) for n, t in module.named_parameters(remove_duplicate=False)}
    identity.update({n: id(t) for n, t in module.named_buffers(remove_duplicate=False)})
    return identity


LOAD_CHUNK_BYTES = 64 << 20  # at most this much of a tensor in flight at a time while loading (a row at least)


@torch.no_grad()
def broadcast_weights(hf, full: dict, device):
    """Rank 0's full tensors (full: its state dict, in the checkpoint's dtype; empty on the other
    ranks) into every rank's shards of hf, in the order of hf's state dict: each tensor in pieces
    of whole rows of at most LOAD_CHUNK_BYTES, each rank copying (and casting) the rows in its
    own shard. Not torch's set_model_state_dict(broadcast_from_rank0=True), which receives each
    tensor whole on every rank (docs/scale.md, Loading)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    state, identity = hf.state_dict(), tensor_identity(hf)
    kinds = [{k: v.dtype for k, v in full.items()}]
    dist.barrier(timeout=RANK0_WAIT)  # while rank 0 reads the checkpoint: not in a collective under the group's timeout
    dist.broadcast_object_list(kinds, src=0)
    if set(kinds[0]) != set(state):  # every rank raises alike
        raise ValueError(f"the checkpoint's tensors are not the model's: only in the checkpoint "
                         f"{sorted(set(kinds[0]) - set(state))[:5]}, only in the model {sorted(set(state) - set(kinds[0]))[:5]}")
    done = set()
    for key, target in state.items():
        tensor = identity.get(key, id(target))
        if tensor in done:  # a tied LM head: its embedding's tensor, loaded once
            continue
        done.add(tensor)
        dtype = kinds[0][key]
        shape = tuple(target.shape) or (1,)  # a scalar travels as one row (atleast_1d: a view of it)
        local = torch.atleast_1d(local_tensor(target))
        lo = 0  # FSDP2 shards dim 0: this rank's rows are [lo, lo + local rows)
        if isinstance(target, DTensor):
            lo = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)[1][0]
        row_bytes = max(1, math.prod(shape[1:])) * dtype.itemsize
        step = max(1, LOAD_CHUNK_BYTES // row_bytes)
        for a in range(0, shape[0], step):
            b = min(a + step, shape[0])
            if dist.get_rank() == 0:
                piece = torch.atleast_1d(full[key])[a:b].to(device).contiguous()
            else:
                piece = torch.empty((b - a, *shape[1:]), dtype=dtype, device=device)
            dist.broadcast(piece, src=0)
            start, end = max(a, lo), min(b, lo + local.shape[0])
            if start < end:
                local[start - lo:end - lo].copy_(piece[start - a:end - a])
            del piece


def empty_policy(model_dir: str, cfg: Config, world: int, device) -> CausalLM:
    """model_dir's architecture, FSDP2-sharded when world > 1, with uninitialised float32
    weights allocated on device: built on the meta device, sharded, then each rank's own
    shards allocated (to_empty). load_policy and copy_policy fill it."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        hf = _auto_class(model_dir).from_config(config, dtype=torch.float32)
    if cfg.model.gradient_checkpointing:
        hf.gradient_checkpointing_enable()
    model = shard(CausalLM(hf, _vision(model_dir)), world, device).to_empty(device=device)
    if not model.sharded:  # to_empty gives each module its own tensor, which unties a tied LM head (FSDP2 keeps it)
        model.hf.tie_weights()
    return model


@torch.no_grad()
def copy_policy(policy: CausalLM, model_dir: str, cfg: Config, world: int, device) -> CausalLM:
    """A copy of the policy built like it (same wrapper, same sharding) holding its current
    weights: each rank copies its own shards, with no read from disk and no collective (the
    SDPO teacher and the DPO reference start as the policy)."""
    copy = empty_policy(model_dir, cfg, world, device)
    for (_, target), (_, source) in zip(copy.named_parameters(), policy.named_parameters(), strict=True):
        local_tensor(target).copy_(local_tensor(source))
    for (_, target), (_, source) in zip(copy.named_buffers(), policy.named_buffers(), strict=True):
        target.copy_(source)
    return copy


def _auto_class(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # a bar per model loaded says nothing
    return AutoModelForImageTextToText if image_prompts.is_vision_language(model_dir) else AutoModelForCausalLM


def _vision(model_dir: str):
    """A vision-language model's image processor; None for a text model."""
    return image_prompts.ImagePrompts(model_dir) if image_prompts.is_vision_language(model_dir) else None


def shard(model: CausalLM, world: int, device):
    """FSDP2: one unit per decoder layer and per vision-tower block, then the root
    (embeddings, norm, LM head, the vision tower's patch embedding and merger)."""
    if world == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    kwargs = {"mp_policy": mp} if mp else {}
    visual = getattr(model.hf.model, "visual", None)
    for layer in list(model.hf.get_decoder().layers) + list(visual.blocks if visual is not None else []):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model.sharded = True
    return model


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@dataclass
class Trainer:
    """What the updates change: the models, the optimizer and its schedule."""
    models: Models
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    nonfinite_streak: int = 0  # consecutive optimizer steps skipped for a NaN/inf loss or gradient


def build_trainer(cfg: Config, objective, model_dir: str, d: Dist) -> Trainer:
    """Policy (FSDP2-sharded when world > 1), AdamW with linear warmup, and the objective's
    extra models (its row's build_models, given a copy of the initial policy to start from)."""
    policy = load_policy(model_dir, cfg, d.world, d.device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.optim.lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                                  weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    initial = lambda: copy_policy(policy, model_dir, cfg, d.world, d.device)  # before any update: the initial weights
    models = Models(policy, **objective.build_models(cfg, initial, model_dir, d))
    return Trainer(models, optimizer, scheduler)


def lr_factor(cfg: Config, step: int) -> float:
    """The learning rate's multiplier at optimizer step `step` (0-based): linear warmup, then
    constant or a linear decay that reaches 0 after the last of train.steps x mini_batches."""
    warmup = min(1.0, (step + 1) / max(cfg.optim.warmup_steps, 1))
    if cfg.optim.decay == "none":
        return warmup
    total = cfg.train.steps * cfg.train.mini_batches
    return warmup * max(0.0, 1.0 - step / total)
