"""The picture task (shapes) on the tiny vision-language model: RL on picture quizzes.

RL asks picture quizzes (data.py's "quiz" kind): up to three count and position questions
about one picture, answered one per line, all of which must be right, whose feedback marks
each line right or wrong, information the prompt does not hold. Colour questions are left out
of the quizzes: shown the answer as a demonstration, the tiny model's teacher cannot copy a
colour word as it copies counts and places, so it could not teach them.
Warm start: all five kinds (scene questions, "name every shape in reading order", a dense
description of each picture: without them the tiny VLM stayed about blind), 2,000 steps whose
first 300 show every prompt as a teacher context so that copying forms before the answers do,
then 20% demonstrations and 30% feedback contexts. RL: one rate for SDPO and GRPO, JSD.
The measurements behind each value: docs/data.md ("The picture quiz", "Measured on the picture
task").
"""
BASE = "tiny"
FLAGS = {
    "data.shapes_questions": "quiz",
    "data.shapes_quiz_kinds": "count,position",
    "data.shapes_warm_start_questions": "count,colour,position,scene,quiz",
    "train.warm_start_feedback_frac": 0.3,
    "train.warm_start_steps": 2000,
    "train.warm_start_demo_frac": 0.2,
    "train.warm_start_context_steps": 300,
    "optim.lr": 3e-5,
}
