"""The picture task (shapes) on the tiny vision-language model: RL on picture quizzes.

RL asks picture quizzes (data.py's "quiz" kind): up to three count and position questions
about one picture, answered one per line, all of which must be right, whose feedback marks
each line right or wrong: the teacher shown it solves 77.0% of held-out quizzes against 56.5%
bare, information the prompt does not hold (docs/data.md, "The picture quiz").
Colour questions are left out of the quizzes: shown the answer as a demonstration, the tiny
model's teacher gives a colour word -1.2 to -2.0 nats (about a guess among four) where counts
and places copy at -0.00, so it could not teach them (512 held-out quizzes with colours: 45.5%
shown the reference, 36.2% bare).
Warm start: all five kinds (scene questions, "name every shape in reading order", give each
picture a dense description; without them the tiny VLM stayed about blind), 2,000 steps whose
first 300 show every prompt as a teacher context so that copying forms before the answers do,
then 20% demonstrations and 30% feedback contexts (the text quiz's recipe shows half its
prompts feedback): 53.0% held-out with the pictures, 11.3% with blank ones, 99.95% shown a
demonstration; 13 minutes to build.
RL: 3e-5 (seed 0, 40 steps of 16 x 8, paired gain in points: SDPO +1.0 at 3e-5 and at 1e-4,
-1.0 at 3e-4; forward KL +0.0 and reverse KL +0.2 at 1e-4, so the recipe keeps JSD; GRPO
+2.4 +- 0.6 at 3e-5, +3.3 +- 0.9 at 1e-4, within each other's error: one rate for both).
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
