"""The tiny model the project builds (no --model.path), on a task without a recipe of its own.

Its parameters take far larger steps than a pretrained model's: a pretrained model's rate
would barely move it (docs/results.md). Its warm start (--train.warm_start_*) shows it feedback
contexts, so its teacher reads feedback, unlike a weak pretrained model's
(--sdpo.include_environment_feedback, sdpo.py).
"""
FLAGS = {
    "optim.lr": 1e-4,
    "optim.warmup_steps": 2,
    "sdpo.include_environment_feedback": True,
}
