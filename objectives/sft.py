"""SFT: the rows' reference responses (`--algo sft`, and the tiny model's warm start: warm_start.py)."""
from microbatch import MicroBatch, Models, Objective, aggregate, policy_logprobs


def sft_loss(mb: MicroBatch, models: Models, cfg):
    """Negative log-likelihood of the reference tokens at temperature 1, token-mean."""
    logprobs, entropy = policy_logprobs(mb, models, cfg, temperature=1.0)
    loss = aggregate(mb, -mb.matrix(logprobs), mb.response_mask, cfg, "token-mean")
    return loss, {"actor/entropy": (entropy.sum().item(), float(entropy.numel()))}


OBJECTIVES = {
    "sft": Objective(loss=sft_loss, references=True),
}
