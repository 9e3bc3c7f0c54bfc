"""The quiz: arithmetic lines whose feedback marks which lines are wrong, so that SDPO's
feedback teacher knows what the bare prompt does not (docs/results.md).

Warm start: copying what a context shows forms only with half the examples feedback contexts
and lines the model cannot all compute, and the student's success climbs steeply (1% at step
550, 87% at 1,000 in one build), so the warm start stops at an estimated 30% held-out success
(target 0.3), inside the band where RL has room, and its first 300 steps show every prompt as a
teacher context, so that copying forms before the facts do (target reached at step 860).
RL: each objective at the best rate of an lr grid on this warm start (40 steps, seed 0):
GRPO 6e-5 (56.6%; 3e-5 49.9, 1.2e-4 51.1), SDPO 1.2e-4 (64.1%; 6e-5 59.3, 2.4e-4 61.6), the rest
3e-5; SDPO with reverse KL, the paper's choice with rich feedback (66.7% vs JSD 64.1% at 40
steps). Over 80 steps and 3 seeds: SDPO 76.9% vs GRPO 65.9%, GRPO's final reached in 0.50 of
its generations (python bench/learning.py).
"""
BASE = "tiny"
FLAGS = {
    "train.warm_start_steps": 2000,  # at most: the target stops it
    "train.warm_start_demo_frac": 0.3,
    "train.warm_start_feedback_frac": 0.5,
    "train.warm_start_target": 0.3,
    "train.warm_start_context_steps": 300,
    "optim.lr": 3e-5,
    "sdpo.alpha": 1.0,
    "gad.teacher_steps": 2000,  # GAD's self-made teacher: 46% on its training prompts after 1,000, 99.8% after 2,000
}
BY_ALGO = {
    "sdpo": {"optim.lr": 1.2e-4},
    "grpo": {"optim.lr": 6e-5},
    # the discriminator at 150 steps against the warm start (critic alone, seed 0): d_acc over 25-step
    # windows 0.62-0.76 reading the mean of the response's states, 0.53-0.69 reading the last token;
    # at lr 1e-4 the same order with smaller score gaps (d_loss 0.64 vs 0.60), at 1e-3 it swings
    "gad": {"gad.lr": 3e-4, "gad.pool": "mean"},
}
