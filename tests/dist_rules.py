"""A GPU run's rules at two ranks on a CPU, under torchrun (run by tests/test_gpu_rules.py, not collected by pytest):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 --master_port=PORT \
        tests/dist_rules.py OUT_DIR

With every collective held to the process group a GPU node would get (tests/collectives.py),
each rank reduces a step's statistics (update.reduce_stats), runs one SDPO update (the
teacher's forward count: the ranks' shares differ) and one step of GAD's discriminator, and
then three waits for rank 0 that
outlast the group's timeout, set to TIMEOUT_S for them (NCCL's watchdog would abort a wait in
a collective that long; gloo raises): a rank0_call; the policy's load while rank 0 alone reads
the checkpoint; and a weight sync's first pass while rank 0 waits for the engine before it sends
(sync.PolicySource.follow). Each rank writes each part's outcome to
OUT_DIR/rank<r>.json: "ok", or the error it raised.
"""
import json
import os
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from conftest import exit_now  # noqa: E402

TIMEOUT_S = 3


def statistics(d):
    from update import reduce_stats
    return reduce_stats({"actor/pg_clipfrac": (d.rank + 1.0, 2.0)}, [0.5], d.world)["actor/pg_clipfrac"]


def sdpo_update(d):
    import torch

    import run
    import tiny_models
    from microbatch import Models
    from objectives import OBJECTIVES
    from policy import shard
    from teacher import Teacher
    from test_run import NoSchedule, _policy, _rollouts
    tiny = tiny_models.tiny_model_dir()
    tokenizer = run.load_tokenizer(tiny)
    cfg = run.parse_config(["--algo=sdpo", "--train.mini_batches=1", "--train.micro_batch=2",
                            "--sdpo.teacher_micro_batch=2", "--rollout.n=3"])
    policy = shard(_policy(tiny, seed=3), d.world, d.device)
    teacher = Teacher("ema", 0.05, shard(_policy(tiny), d.world, d.device))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    rollouts = _rollouts(tokenizer, "sdpo", n_prompts=3, n=3)  # 9: the ranks' shares differ
    metrics, _ = run.update_policy(cfg, OBJECTIVES["sdpo"], run.Trainer(Models(policy, teacher=teacher), optimizer,
                                                                         NoSchedule()), rollouts, 0,
                                   tokenizer.pad_token_id, d)
    return metrics["actor/loss"]


def discriminator_step(d):
    import discriminator
    import tiny_models
    critic = discriminator.Critic(discriminator.load(tiny_models.tiny_model_dir(), 0, d.world, d.device),
                                  1e-3, 0.0, 1e9)
    groups = [(2, [5, 6, 7, 8], [[5, 6, 9], [5, 6, 10, 11]]), (2, [5, 7, 7], [[5, 7, 8]]),
              (2, [5, 8, 9], [[5, 8, 8, 8], [5, 8, 1]])]  # three groups: one rank takes two
    return critic.train_step(groups, 0, d, 8).metrics["gad/d_loss"]


def rank0_outlasts_the_timeout(d):
    import torch.distributed as dist

    from distributed import rank0_call
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=TIMEOUT_S))
    return rank0_call(d, lambda: time.sleep(3 * TIMEOUT_S) or "rank 0's result")


class SlowRead:
    """A model class whose from_pretrained (rank 0's read of the checkpoint) outlasts the timeout."""

    def __init__(self, cls):
        self.cls = cls

    def __getattr__(self, name):
        return getattr(self.cls, name)

    def from_pretrained(self, *args, **kwargs):
        time.sleep(2 * TIMEOUT_S)
        return self.cls.from_pretrained(*args, **kwargs)


def policy_load_outlasts_the_timeout(d):
    import policy
    import run
    import tiny_models
    real = policy._auto_class
    policy._auto_class = lambda model_dir: SlowRead(real(model_dir))
    try:
        model = policy.load_policy(tiny_models.tiny_model_dir(), run.parse_config([]), d.world, d.device)
    finally:
        policy._auto_class = real
    return sum(p.full_tensor().double().sum().item() for p in model.parameters())


class Follower:
    """A rank's trainer engine that is not the sender: it gathers what rank 0 sends."""
    source = None
    gathered = 0

    def send_weights(self):
        self.gathered += sum(1 for _ in self.source)


def sync_outlasts_the_timeout(d):
    import torch

    import sync
    import tiny_models
    from policy import shard
    from test_run import _policy
    source = sync.PolicySource(shard(_policy(tiny_models.tiny_model_dir()), d.world, d.device), d, torch.float32)
    if d.rank != 0:
        follower = Follower()
        source.follow(follower)
        return follower.gathered
    time.sleep(2 * TIMEOUT_S)  # rank 0 waits for the engine's batch before it syncs
    source.begin_pass()
    gathered = sum(1 for _ in source)
    source.done()
    return gathered


def main(out_dir, d):
    outcomes = {}
    for part in (statistics, sdpo_update, discriminator_step, rank0_outlasts_the_timeout,
                 policy_load_outlasts_the_timeout, sync_outlasts_the_timeout):
        try:
            outcomes[part.__name__] = ["ok", part(d)]
        except Exception as e:  # recorded: the test shows which part broke which rule
            outcomes[part.__name__] = [f"{type(e).__name__}: {e}", None]
    with open(os.path.join(out_dir, f"rank{d.rank}.json"), "w") as f:
        json.dump(outcomes, f)


if __name__ == "__main__":
    import collectives
    collectives.check()
    import run
    d = run.setup_distributed()
    main(sys.argv[1], d)
    exit_now()  # the group may be broken where a part failed: no end_distributed
