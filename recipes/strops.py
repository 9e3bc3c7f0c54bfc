"""The default job: SDPO on the string-program task (strops), the tiny model, CPU.

A 200-step warm start: copying a shown solution forms after mostly-demonstration steps, and at
200 the bare student leaves room for 40 RL steps to gain, where a longer warm start left
little. What the default job measures, and the warm starts compared: docs/results.md (The
default job) and docs/LOG.md.
"""
BASE = "tiny"
FLAGS = {
    "train.warm_start_steps": 200,
}
