"""The picture task (shapes) on the tiny vision-language model.

Warm start: the default 300 steps with 70% demonstration contexts left the tiny VLM blind
(held-out 29.6%, about a guess; 26.4% with every picture blank after 1,000 steps at 20%
demonstrations, position questions 28.9% seeing vs 28.9% blind). Scene questions ("name every
shape in reading order: its colour, kind and place") give each picture a dense description
to learn from: with them among the questions, 1,000 steps at 20% demonstrations reached
count 99.6% / colour 54.7% / position 39.5% against 23.8% / 22.7% / 24.2% with blank
pictures (128 held-out rows of each kind; docs/data.md, "The picture task").
"""
BASE = "tiny"
FLAGS = {
    "data.shapes_questions": "count,colour,position,scene",
    "train.warm_start_steps": 1000,
    "train.warm_start_demo_frac": 0.2,
}
