"""The default job: SDPO on the string-program task (strops), the tiny model, CPU.

A 200-step warm start: copying a shown solution forms after ~100-150 mostly-demonstration
steps; at 200 the bare student is at ~29% held-out and the demonstration teacher at ~98%,
with room for 40 RL steps to gain (at 300: 33%, and 40 SDPO steps gained 0.2-2 points;
docs/LOG.md). Measured: 29.0% -> 35.1% held-out, +6.1 +- 0.8 (python run.py, ~4 min; 30.6% -> 34.9%
on another machine, whose warm start differs).
"""
BASE = "tiny"
FLAGS = {
    "train.warm_start_steps": 200,
}
