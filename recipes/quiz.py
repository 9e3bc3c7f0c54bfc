"""The quiz: arithmetic lines whose feedback marks which lines are wrong, so that SDPO's
feedback teacher knows what the bare prompt does not.

Warm start: copying what a context shows forms only with half the examples feedback contexts
and lines the model cannot all compute, and the student's success then climbs steeply, so the
warm start stops at an estimated held-out success of --train.warm_start_target, inside the band
where RL has room; its first 300 steps show every prompt as a teacher context, so that copying
forms before the facts do. RL: each objective at the best rate of an lr grid on this warm
start; SDPO with reverse KL, the paper's choice with rich feedback. The measurements behind
each value: docs/results.md (SDPO vs GRPO on the quiz) and docs/gad.md (GAD's values).
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
    "gad.teacher_steps": 2000,  # GAD's self-made teacher: well above the student (docs/gad.md)
}
BY_ALGO = {
    "sdpo": {"optim.lr": 1.2e-4},
    "grpo": {"optim.lr": 6e-5},
    # the discriminator reads the mean of the response's states, at the rate it separated best (docs/gad.md)
    "gad": {"gad.lr": 3e-4, "gad.pool": "mean"},
}
