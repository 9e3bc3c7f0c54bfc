"""Pinned gradients and metrics of every objective on a fixed batch (tests/golden.json).

    python tests/golden.py          # rewrite tests/golden.json from the current code

The numbers were first written by the loop as it was before the objectives were split out
of run.py (commit 95aa211), and the objectives table gave the same ones; they were rewritten
by the table when the tiny model's recipe changed (version 2: the strops prompt names its
ops, so the tokenizer, the model and the batch changed), and again (version 3, 2026-11-27)
under a recorder that steps (tests/test_loop.py's SteppingRecorder), on a batch whose engine
log-probs are the start's plus noise, so that the second mini-batch runs off ratio 1 and
the clips and IS weights act; tests/test_loop.py checks these steps against an independent
computation, these pins keep today's numbers. tests/test_objectives.py checks
that the code of today gives the same ones. A gradient is pinned by, per parameter tensor, its sum,
its sum of squares and its dot product with a fixed random vector: a change anywhere in a
tensor moves the last one.
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PATH = os.path.join(ROOT, "tests", "golden.json")

# (name, flags): every objective and the SDPO variants whose loss path differs
CASES = [
    ("sdpo", ["--algo=sdpo"]),
    ("sdpo-full-reverse-unchunked", ["--algo=sdpo", "--sdpo.distill=full", "--sdpo.alpha=1.0", "--sdpo.chunked=False"]),
    ("sdpo-token", ["--algo=sdpo", "--sdpo.distill=token"]),
    ("sdpo-no-is-correction", ["--algo=sdpo", "--rollout.is_correction=False"]),
    ("sdpo-trust-region", ["--algo=sdpo", "--sdpo.teacher=trust-region"]),
    ("grpo", ["--algo=grpo"]),
    ("gspo", ["--algo=gspo"]),
    ("hybrid", ["--algo=hybrid"]),
    ("sft", ["--algo=sft"]),
    # mini-batches of whole prompts (the default since 2026-11-27; pinned when it became so)
    ("sdpo-prompt-mini-batches", ["--algo=sdpo", "--train.shuffle_samples=False"]),
    ("grpo-prompt-mini-batches", ["--algo=grpo", "--train.shuffle_samples=False"]),
]
# The cases before the last two were pinned with mini-batches of single shuffled samples.
COMMON = ["--train.mini_batches=2", "--train.micro_batch=4", "--sdpo.topk=8", "--sdpo.chunk_size=7",
          "--train.shuffle_samples=True"]


def fingerprint(grads: dict) -> dict:
    """name -> [sum, sum of squares, dot with a fixed random vector] of each gradient."""
    out = {}
    for name, g in sorted(grads.items()):
        g = g.double().flatten()
        probe = torch.randn(g.numel(), generator=torch.Generator().manual_seed(len(name)), dtype=torch.float64)
        out[name] = [g.sum().item(), (g * g).sum().item(), (g * probe).sum().item()]
    return out


def record(step_fn) -> dict:
    """step_fn(flags) -> (list of per-optimizer-step gradient dicts, metrics dict)."""
    results = {}
    for name, flags in CASES:
        grads, metrics = step_fn(COMMON + flags)  # a case's own flags win
        results[name] = {"grads": [fingerprint(g) for g in grads],
                         "metrics": {k: v for k, v in sorted(metrics.items())
                                     if isinstance(v, (int, float)) and not k.startswith("time/")}}
    return results


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_objectives import new_loop_step
    with open(PATH, "w") as f:
        json.dump(record(lambda flags: new_loop_step(flags, stepping=True)), f, indent=1)
    print(f"wrote {PATH}")
