"""The picture task (shapes) on the tiny vision-language model.

Warm start: the default 300 steps with 70% demonstration contexts left the tiny VLM about
blind (held-out 29.6%, a guess's rate); 1,000 steps at 20% demonstrations, 34.1% against
26.4% with every picture blank, and position questions 28.9% either way. Scene questions ("name every
shape in reading order: its colour, kind and place") give each picture a dense description
to learn from: with them among the questions, 1,000 steps at 20% demonstrations reach 54.2%
held-out (all four kinds) against 12.8% with blank pictures (`--eval_only --blind`); by kind,
count 100% / colour 69.9% / position 48.0% against 12.9% / 22.7% / 16.4% blind (128
held-out rows of each; docs/data.md, "Measured on the picture task").
RL: 3e-5, the best of a grid on this warm start (40 steps of 16 x 8, seed 0, paired gain in
points): GRPO +2.1 +- 0.6 at 3e-5, +0.8 +- 0.7 at 1e-4, -1.4 +- 0.7 at 3e-4; SDPO +0.2 +- 0.4,
-0.4 +- 0.4, -3.6 +- 0.5.
"""
BASE = "tiny"
FLAGS = {
    "data.shapes_questions": "count,colour,position,scene",
    "train.warm_start_steps": 1000,
    "train.warm_start_demo_frac": 0.2,
    "optim.lr": 3e-5,
}
