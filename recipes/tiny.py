"""The tiny model the project builds (no --model.path), on a task without a recipe of its own.

Its 1.2M parameters take far larger steps than a pretrained model's: the default job gains
~4 points in 40 steps at 1e-4, where a pretrained model's 1e-6 would barely move it. Its warm
start (--train.warm_start_*, 300 steps by default) shows it feedback contexts, so its teacher
reads feedback, unlike a weak pretrained model's (config.py, --sdpo.include_environment_feedback).
"""
FLAGS = {
    "optim.lr": 1e-4,
    "optim.warmup_steps": 2,
    "sdpo.include_environment_feedback": True,
}
