"""The SDPO teacher and the DPO reference: copies of the policy's network.

Teachers (--sdpo.teacher; their formulas: docs/loop.md, The formulas): ema, frozen, trust-region,
live. A teacher is consumed as final hidden states plus an LM-head weight, so that the loss
computes teacher logits chunk by chunk (chunked_head.sdpo_topk_loss_from_hidden); the
trust-region lerp of logits is exact in that form: one matmul of the concatenated hidden states
[(1−r)·h_ref, r·h_student] with the concatenated heads [W_ref, W_student]. The EMA moves each
rank's own FSDP2 shards (no gather), only after a finite optimizer step.
"""
import torch

from distributed import full_tensor, local_tensor, reshard

KINDS = ("ema", "frozen", "trust-region", "live")


class Teacher:
    """Holds the teacher network (a sharded copy of the initial policy, or none for 'live').

    copy: a module built like the policy (same wrapper, same sharding) holding the initial
    weights; required for ema, frozen and trust-region.
    """

    def __init__(self, kind: str, rate: float, copy=None):
        if kind not in KINDS:
            raise ValueError(f"unknown teacher {kind!r}; choose from {KINDS}")
        if kind != "live" and copy is None:
            raise ValueError(f"the {kind} teacher needs a copy of the initial policy")
        self.kind, self.rate, self.copy = kind, 0.0 if kind == "frozen" else rate, copy
        if copy is not None:
            copy.requires_grad_(False)
            copy.eval()
        self._head = None  # the copy's full LM-head weight, gathered once per update

    @torch.no_grad()
    def update(self, policy, stepped: bool) -> bool:
        """EMA step after a training step; skipped unless an optimizer step was taken."""
        if self.kind != "ema" or not stepped or self.rate == 0.0:
            return False
        reshard(self.copy)
        reshard(policy)
        for teacher_p, student_p in zip(self.copy.parameters(), policy.parameters()):
            local_tensor(teacher_p).lerp_(local_tensor(student_p).to(teacher_p.dtype), self.rate)
        self._head = None
        return True

    @property
    def reads_policy(self) -> bool:
        """Whether the teacher's outputs change with the policy's current weights (live,
        trust-region): those must be computed for each micro-batch, not once per update."""
        return self.kind in ("live", "trust-region")

    def state_dict(self) -> dict | None:
        """The copy's weights; None for the live teacher, which has none (a checkpoint keeps nothing)."""
        return None if self.copy is None else self.copy.state_dict()

    def load_state_dict(self, state: dict):
        self.copy.load_state_dict(state)
        self._head = None  # gathered again from the restored weights

    def networks(self) -> list:
        return [] if self.copy is None else [self.copy]

    def head_weight_source(self):
        """The copy's LM-head weight, whole (every rank calls this at the same point)."""
        if self._head is None and self.copy is not None:
            reshard(self.copy)
            self._head = full_tensor(self.copy.hf.lm_head.weight).detach()
        return self._head

    @torch.no_grad()
    def hidden(self, policy, forward, n: int, micro_batch: int, calls: int = 0) -> torch.Tensor:
        """Teacher final hidden states at the response positions of n teacher sequences,
        [N, H'] (H' = 2H for trust-region), micro_batch sequences at a time.

        forward(model, indices, head) runs a model on the sequences at indices and returns
        head(hidden, W). calls: under FSDP every rank must run as many forwards as the others
        (each is a collective); those beyond this rank's own get indices [] (the caller runs
        a dummy sequence) and are dropped.
        """
        chunks = [range(i, min(i + micro_batch, n)) for i in range(0, n, micro_batch)]
        parts = []
        for part in chunks + [range(0)] * max(calls - len(chunks), 0):
            if self.kind == "trust-region":
                ref = forward(self.copy, part, _hidden_only)
                student = forward(policy, part, _hidden_only)
                parts.append(torch.cat([(1 - self.rate) * ref.float(), self.rate * student.float()], dim=-1))
            else:
                parts.append(forward(policy if self.kind == "live" else self.copy, part, _hidden_only))
        parts = parts[:len(chunks)]
        reshard(self.copy)  # a no-op for the live teacher's None
        return torch.cat(parts) if parts else torch.zeros(0)

    def hidden_size(self, policy) -> int:
        """Width of `hidden`'s output."""
        size = policy.hf.config.get_text_config().hidden_size
        return 2 * size if self.kind == "trust-region" else size

    def head_weight(self, student_weight: torch.Tensor) -> torch.Tensor:
        """The teacher LM head matching `hidden`, given the student's (whole) head weight."""
        if self.kind == "live":
            return student_weight.detach()
        if self.kind == "trust-region":
            return torch.cat([self.head_weight_source().float(), student_weight.detach().float()], dim=-1)
        return self.head_weight_source()


class Reference:
    """A frozen copy of the policy for log-ratios against it (DPO): the initial policy, replaced
    by the policy of the moment after every `every` training steps (SPIN: each iteration's
    reference is the previous iteration's model); 0: never.

    model: a module built like the policy (same wrapper, same sharding), holding the
    initial weights. Refreshing copies each rank's own FSDP2 shards (no gather).
    """

    def __init__(self, model, every: int = 0):
        if every < 0:
            raise ValueError(f"the reference refresh interval must be >= 0 steps, got {every}")
        self.model, self.every = model, every
        model.requires_grad_(False)
        model.eval()

    @torch.no_grad()
    def refresh(self, policy, steps_done: int) -> bool:
        """Copy the policy's weights after training step `steps_done` (1-based) when it is a
        multiple of `every`; returns whether it did."""
        if not self.every or steps_done % self.every:
            return False
        reshard(self.model)
        reshard(policy)
        for reference_p, policy_p in zip(self.model.parameters(), policy.parameters()):
            local_tensor(reference_p).copy_(local_tensor(policy_p))
        return True

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict):
        self.model.load_state_dict(state)

    def networks(self) -> list:
        return [self.model]


def _hidden_only(hidden, weight):
    return hidden.detach()
