"""One DPO update on two ranks under torchrun (run by tests/test_dpo.py, not collected by pytest):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 --master_port=PORT \
        tests/dist_dpo.py OUT_DIR

Both ranks shard the same policy and reference with FSDP2, pair the same canned rollouts and
run run.update_policy; rank 0 writes the full gradient of each optimizer step (grads.pt) and
the metrics (metrics.json), which the test compares with one process's.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from conftest import exit_now  # noqa: E402


def main(out_dir, d):
    """One DPO update of both ranks; rank 0 writes its gradients and metrics into out_dir."""
    import torch

    import run
    import tiny_models
    from microbatch import Models
    from objectives import OBJECTIVES
    from objectives.dpo import prepare_pairs
    from distributed import full_tensor
    from teacher import Reference
    from test_dpo import TWO_RANK_FLAGS, TWO_RANK_REWARDS, _scored, dpo_config
    from test_run import NoSchedule, _policy
    from policy import shard

    class FullGradRecorder:
        """The optimizer's stand-in: keeps each step's whole gradient (a collective per tensor)."""

        def __init__(self, model):
            self.model, self.grads = model, []

        def step(self):
            self.grads.append({n: full_tensor(p.grad).detach().clone() for n, p in self.model.named_parameters()
                               if p.grad is not None})

        def zero_grad(self, set_to_none=True):
            self.model.zero_grad(set_to_none=set_to_none)

    tiny = tiny_models.tiny_model_dir()
    tokenizer = run.load_tokenizer(tiny)
    cfg = dpo_config("--rollout.n=4", *TWO_RANK_FLAGS)
    torch.manual_seed(0)
    policy = shard(_policy(tiny, seed=3), d.world, d.device)
    reference = Reference(shard(_policy(tiny), d.world, d.device))
    recorder = FullGradRecorder(policy)
    rollouts = _scored(tokenizer, TWO_RANK_REWARDS)
    prepare_pairs(rollouts, tokenizer, cfg)
    metrics, _ = run.update_policy(cfg, OBJECTIVES["dpo"], run.Trainer(Models(policy, reference=reference), recorder,
                                                                        NoSchedule()), rollouts, 0,
                                   tokenizer.pad_token_id, d)
    if d.rank == 0:
        torch.save(recorder.grads, os.path.join(out_dir, "grads.pt"))
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    import run
    d = run.setup_distributed()
    main(sys.argv[1], d)
    run.end_distributed(d)
    exit_now()
