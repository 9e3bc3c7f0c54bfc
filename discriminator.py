"""GAD's discriminator (the GAD paper, arXiv 2511.10643): a copy of the student's backbone with a scalar head.

D(prompt, response) = w · h + b, h the backbone's final hidden state at the sequence's last real
token (--gad.pool last) or the mean of the response's (--gad.pool mean); no dropout, so that the
score a reward is read from is the score the loss trains. Its Bradley–Terry step and how its
pre-update scores become the student's rewards: docs/gad.md.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import losses
from distributed import from_every_rank, full_tensor, reshard


class Discriminator(torch.nn.Module):
    """A causal backbone (HF base model, no LM head) and a scalar head on the last real token's
    hidden state (pool "last") or the mean of the response tokens' (pool "mean")."""

    def __init__(self, backbone, seed: int = 0, pool: str = "last"):
        super().__init__()
        self.backbone, self.pool = backbone, pool
        self.head = torch.nn.Linear(backbone.config.hidden_size, 1)
        # A fresh head, the same on every rank whatever else consumed the global RNG.
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.head.weight.normal_(0.0, backbone.config.initializer_range, generator=g)
            self.head.bias.zero_()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                response_starts: torch.Tensor | None = None) -> torch.Tensor:
        """Scores [B] of padded sequences input_ids [B, L] (left- or right-padded; mask [B, L]):
        positions count real tokens only, so that padding on either side gives the same score.
        response_starts [B]: each prompt's length in real tokens (pool "mean" reads the tokens after it)."""
        positions = (attention_mask.cumsum(1) - 1).clamp(min=0)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=positions).last_hidden_state
        if self.pool == "mean":
            response = (attention_mask.bool() & (positions >= response_starts[:, None])).to(hidden.dtype)
            pooled = (hidden * response[..., None]).sum(1) / response.sum(1, keepdim=True).clamp(min=1)
            return self.head(pooled).squeeze(-1).float()
        width = attention_mask.shape[1]
        last = (attention_mask * torch.arange(1, width + 1, device=attention_mask.device)).argmax(1)
        return self.head(hidden[torch.arange(len(last), device=last.device), last]).squeeze(-1).float()


def load(path: str, seed: int, world: int, device, pool: str = "last"):
    """The backbone of the HF model in path (a causal LM's directory works: its LM head is
    dropped) with dropout off, a fresh head, FSDP2-sharded like the policy."""
    from transformers import AutoConfig, AutoModel
    config = AutoConfig.from_pretrained(path)
    for name in list(vars(config)):
        if "dropout" in name and isinstance(getattr(config, name), float):
            setattr(config, name, 0.0)
    backbone = AutoModel.from_pretrained(path, config=config, dtype=torch.float32)
    model = Discriminator(backbone, seed, pool).to(device)
    if world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
            if device.type == "cuda" else {}
        for layer in backbone.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
    return model


@dataclass
class Update:
    """One discriminator step: every scored sequence's pre-update score, and the metrics."""
    scores: list  # one float per sequence given, in order
    metrics: dict


class Critic:
    """The discriminator, its optimizer and how many steps it has trained (checkpointed)."""

    def __init__(self, model: Discriminator, lr: float, weight_decay: float, grad_clip: float, betas=(0.9, 0.999)):
        self.model, self.grad_clip, self.steps = model, grad_clip, 0
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)

    def score(self, seqs: list[list[int]], pad_id: int, device, starts: list[int] | None = None) -> torch.Tensor:
        """Scores [B] of token-id sequences (their responses start at starts), without gradient."""
        with torch.no_grad():
            scores = self.model(*right_pad(seqs, pad_id, device), start_positions(starts, seqs, device))
        reshard(self.model)
        return scores

    def train_step(self, groups: list, pad_id: int, d, micro_batch: int, repeats: int = 1) -> Update:
        """One Bradley–Terry step over groups: (prompt length, teacher ids, [student ids, ...]) per
        prompt, each sequence the prompt's ids and a response's; with repeats > 1, that many
        optimizer steps on the same groups (the scores and metrics are the first's: held out).

        Every rank takes a share of the groups (FSDP2: as many forwards each); the loss of a
        micro-batch is its pairs' summed −logσ(D_t − D_s) over the step's global pair count.
        Returns the pre-update scores of every sequence (teacher first, then its students, group
        by group) on every rank, and the gad/ metrics of docs/gad.md (d_acc: held out).
        """
        update = self.optimizer_step(groups, pad_id, d, micro_batch)
        for _ in range(repeats - 1):
            self.optimizer_step(groups, pad_id, d, micro_batch)
        self.steps += 1
        return update

    def optimizer_step(self, groups: list, pad_id: int, d, micro_batch: int) -> Update:
        """train_step's one optimizer step (it does not count in self.steps)."""
        self.model.train()
        mine = list(range(len(groups)))[d.rank::d.world]
        per_call = max(1, micro_batch // (1 + max((len(s) for _, _, s in groups), default=1)))
        calls = max(1, math.ceil(math.ceil(len(groups) / d.world) / per_call))
        pairs = sum(len(students) for _, _, students in groups)
        # d_loss, teacher above student (pairs whose texts differ), teacher score, student score,
        # pairs whose texts differ
        local, sums = {}, torch.zeros(5, dtype=torch.float64)
        for c in range(calls):
            part = mine[c * per_call:(c + 1) * per_call]
            if d.world > 1:  # reduce-scatter the gradient once, after the last micro-batch
                self.model.set_requires_gradient_sync(c == calls - 1)
            if not part:  # FSDP2's collectives: a rank with fewer groups runs a zero loss
                (self.model(*right_pad([[pad_id]], pad_id, d.device), start_positions([0], [[pad_id]], d.device)).sum()
                 * 0.0).backward()
                continue
            loss_sum = self.pair_losses({g: groups[g] for g in part}, pad_id, d.device, sums, local)
            (loss_sum / max(pairs, 1) * d.world).backward()  # FSDP2 averages gradients over ranks
        local = {g: scores for part in from_every_rank(local, d.world) for g, scores in part.items()}
        if d.world > 1:
            dist.all_reduce(sums)
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        reshard(self.model)
        pairs, teachers = max(pairs, 1), max(len(groups), 1)  # one teacher a group
        metrics = {"gad/d_loss": sums[0].item() / pairs, "gad/identical_frac": 1.0 - sums[4].item() / pairs,
                   **({"gad/d_acc": sums[1].item() / sums[4].item()} if sums[4].item() else {}),
                   "gad/teacher_score": sums[2].item() / teachers, "gad/student_score": sums[3].item() / pairs,
                   "gad/d_grad_norm": grad_norm, "gad/d_skipped_steps": float(not math.isfinite(grad_norm))}
        return Update([s for g in range(len(groups)) for s in local[g]], metrics)

    def pair_losses(self, groups: dict, pad_id: int, device, sums: torch.Tensor, local: dict):
        """The summed −logσ(D_t − D_s) of the pairs of groups ({index: train_step's group}), in one
        forward. Adds each group's figures to sums (train_step's) and its pre-update scores to local."""
        seqs = [s for _, teacher, students in groups.values() for s in [teacher, *students]]
        starts = [prompt for prompt, _, students in groups.values() for _ in range(1 + len(students))]
        scores = self.model(*right_pad(seqs, pad_id, device), start_positions(starts, seqs, device))
        loss_sum, start = 0.0, 0
        for g, (_, teacher_ids, student_ids) in groups.items():
            n = len(student_ids)
            teacher, students = scores[start], scores[start + 1:start + 1 + n]
            loss, _ = losses.discriminator_loss(teacher.expand(n), students)
            loss_sum = loss_sum + loss * n  # the mean over its n pairs, back to a sum
            # A student text identical to the teacher's scores the same: no discriminator can
            # order the pair, so accuracy counts the pairs whose texts differ.
            distinct = torch.tensor([s != teacher_ids for s in student_ids])
            above = (teacher.detach() > students.detach())[distinct].sum().item()
            sums += torch.tensor([loss.item() * n, above, teacher.item(), students.sum().item(),
                                  distinct.sum().item()], dtype=torch.float64)
            local[g] = scores[start:start + 1 + n].detach().tolist()
            start += 1 + n
        return loss_sum

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "steps": torch.tensor(self.steps)}

    def load_state_dict(self, state: dict):
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.steps = int(state["steps"])

    def networks(self) -> list:
        return [self.model]


def start_positions(starts: list[int] | None, seqs: list, device) -> torch.Tensor:
    """Response starts [B] (0 where not given: the whole sequence is the response)."""
    return torch.tensor(starts if starts is not None else [0] * len(seqs), dtype=torch.long, device=device)


def right_pad(seqs: list[list[int]], pad_id: int, device):
    """Right-padded input ids and attention mask [B, L] on device."""
    pad = torch.nn.utils.rnn.pad_sequence
    ids = pad([torch.tensor(s, dtype=torch.long) for s in seqs], batch_first=True, padding_value=pad_id)
    mask = pad([torch.ones(len(s), dtype=torch.long) for s in seqs], batch_first=True)
    return ids.to(device), mask.to(device)
