"""Token sequences as tensors: padding, responses packed flat (Packed), prompts shared across samples.

Every forward of the trainer reads a Packed batch: prompt+response sequences right-padded
[B, L], the response tokens' flat positions [N] (hidden_index) and targets, and, where the
samples of a prompt share it, the prompt laid out once (pack_shared_prefix).
"""
import os
from dataclasses import dataclass

import torch


def pad(seqs: list[list[int]], pad_id: int, min_width: int = 0, left: bool = True):
    """Padded [B, L] input ids and attention mask (LongTensor): on the left for prompt
    batches, on the right (left=False) for rows that continue a left-padded batch's cache."""
    width = max(max(len(s) for s in seqs), min_width)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            where = slice(width - len(s), None) if left else slice(0, len(s))
            ids[i, where] = torch.tensor(s)
            mask[i, where] = 1
    return ids, mask


def pack_responses(seqs: list[list[int]], response_lens: list[int], pad_id: int, device="cpu"):
    """Right-padded batch of prompt+response sequences, and where their responses are:
    (input_ids [B, L], attention_mask [B, L], hidden_index [N], targets [N], token_index [N]),
    as in Packed; R = max response length, N = sum(response_lens)."""
    width, resp_width = max(len(s) for s in seqs), max(max(response_lens), 1)
    hidden_index, token_index, targets = [], [], []
    for b, (s, r) in enumerate(zip(seqs, response_lens)):
        if r >= len(s):
            raise ValueError(f"sequence {b}: response length {r} leaves no prompt token (length {len(s)})")
        start = len(s) - r
        hidden_index += range(b * width + start - 1, b * width + len(s) - 1)
        token_index += range(b * resp_width, b * resp_width + r)
        targets += s[start:]
    ids, mask = pad(seqs, pad_id, left=False)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return ids.to(device), mask.to(device), as_long(hidden_index), as_long(targets), as_long(token_index)


@dataclass
class Packed:
    """Prompt+response sequences laid out for the model, and where their responses are.

    input_ids, attention_mask [B, L]; hidden_index [N]: positions in the flattened [B*L]
    hidden states that predict each response token; targets [N]: the response tokens;
    token_index [N]: their positions in the [B, R] right-padded response matrix (`shape`).
    prefix: None, or prompts shared by several sequences, run once (pack_shared_prefix): a
    chain of levels (ids [P, Lp], mask [P, Lp], rows: which of this level's P rows each row
    of the next level, or each sequence after the last level, extends).
    images: None, or each sequence's pictures (a list, maybe empty), in the order of their
    expanded image tokens; image_mask [B, L]: True at those tokens (not at image tokens the
    model generated). The model turns them into pixel inputs (ImagePrompts.pixel_inputs).
    """
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    hidden_index: torch.Tensor
    targets: torch.Tensor
    token_index: torch.Tensor
    shape: tuple
    prefix: list | None = None
    images: list | None = None
    image_mask: torch.Tensor | None = None


def pack(seqs: list[list[int]], response_lens: list[int], pad_id: int, device="cpu", images: list | None = None,
         image_masks: list | None = None) -> Packed:
    """Right-padded sequences whose last response_lens[i] tokens are the response.
    images, image_masks: each sequence's pictures and where their tokens are (see Packed)."""
    ids, mask, hidden_index, targets, token_index = pack_responses(seqs, response_lens, pad_id, device)
    packed = Packed(ids, mask, hidden_index, targets, token_index, (len(seqs), max(max(response_lens), 1)))
    if images and any(images):
        packed.images = [list(im or []) for im in images]
        packed.image_mask = torch.zeros_like(ids, dtype=torch.bool)
        for b, m in enumerate(image_masks):
            packed.image_mask[b, :len(m)] = torch.tensor(m, dtype=torch.bool)
    return packed


def pack_shared_prefix(seqs: list[list[int]], response_lens: list[int], pad_id: int, device="cpu",
                       groups: list | None = None) -> Packed:
    """Like pack() for sequences many of which share their prompt: each distinct prompt
    (less its last token) once, left-padded, as the prefix; every sequence's suffix (its
    prompt's last token and response, right-padded) attends to its prefix's KV cache.
    The response positions are the same as pack()'s: one hidden state per response token.

    groups: a key per sequence (its prompt row's uid, for SDPO's teacher prompts, which share
    the question and differ in demonstration and feedback): the distinct prompts of a group
    then run their longest common prefix once, then each its rest, right-padded: a chain of
    two prefix levels (what it saves: docs/loop.md)."""
    prompts, row, keys = {}, [], {}
    for s, r, g in zip(seqs, response_lens, groups or [None] * len(seqs)):
        row.append(prompts.setdefault(tuple(s[:len(s) - r - 1]), len(prompts)))
        keys.setdefault(row[-1], g)
    distinct = list(prompts)
    levels = []
    level = lambda ids, mask, rows: (ids.to(device), mask.to(device), torch.tensor(rows, dtype=torch.long, device=device))
    if groups is not None:
        members = {}
        for i, p in enumerate(distinct):
            members.setdefault(keys[i], []).append(p)
        # a group's common part, short of each member's last token: every rest keeps one
        cut = {g: max(0, min(len(os.path.commonprefix(ps)), min(map(len, ps)) - 1)) for g, ps in members.items()}
        stems = {}
        parent = [stems.setdefault(p[:cut[keys[i]]], len(stems)) for i, p in enumerate(distinct)]
        stem_ids, stem_mask = pad([list(p) for p in stems], pad_id, min_width=1)
        levels.append(level(stem_ids, stem_mask, parent))
        distinct_ids, distinct_mask = pad([list(p[cut[keys[i]]:]) for i, p in enumerate(distinct)], pad_id,
                                          min_width=1, left=False)
    else:
        distinct_ids, distinct_mask = pad([list(p) for p in distinct], pad_id, min_width=1)
    levels.append(level(distinct_ids, distinct_mask, row))
    packed = pack([s[len(s) - r - 1:] for s, r in zip(seqs, response_lens)], response_lens, pad_id, device)
    packed.prefix = levels
    return packed


def to_matrix(values, packed: Packed):
    """Per-token values [N] -> the [B, R] right-padded response matrix (zeros elsewhere)."""
    out = values.new_zeros(packed.shape[0] * packed.shape[1])
    return out.index_copy(0, packed.token_index, values).view(packed.shape)
