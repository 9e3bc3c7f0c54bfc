"""Step time of SDPO (and DPO) against GRPO on the default job, and of the asynchronous mode
(--train.off_policy_steps 1) against the synchronous loop; same seeds and steps, back to back.

    python bench/step.py [--steps 8] [--repeats 3] [extra run.py flags ...]

Each configuration runs as its own `run.py` process (the warm start is built once and cached
before any is timed). The first step of each run is dropped as warm-up (and, asynchronous,
the second: its batch was generated before the first update, not beside it); the figures are
means of time/*_s over the remaining steps. --repeats runs every configuration that many
times, interleaved (grpo, sdpo, ..., grpo, sdpo, ...), so that a change of load hits each
alike; the table shows the mean over repeats, the RESULT ratios the median of the
per-repeat ratios with their range. The paper measured SDPO at 1.058x GRPO's step time
without a code environment; the target here is <= 1.10.

Two rows per algorithm: `sync`, the default loop, and `async`, the one-step-off-policy mode.
On CPU the engine runs in its own process in both (rollout.Engine), so the difference is the
overlap alone. On a CPU machine the engine and the trainer share the cores, so the overlap gained is bounded by what
the two leave idle; the last lines project the split onto a node where they have a device
each (a model from the measured figures, not a measurement).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLIT = ["time/rollout_s", "time/teacher_s", "time/reference_s", "time/train_s", "sync/seconds",
         "time/wait_rollout_s", "time/wait_sync_s", "time/step_s"]
MODES = {"sync": [], "async": ["--train.off_policy_steps=1"]}


def run(algo: str, steps: int, extra: list[str], out_dir: str) -> list[dict]:
    cmd = [sys.executable, os.path.join(ROOT, "run.py"), f"--algo={algo}", f"--train.steps={steps}",
           "--train.eval_every=0", "--log.wandb_mode=disabled", "--log.progress=False",
           f"--log.out_dir={out_dir}"] + extra
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if json.loads(line)["step"] > 0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--algos", default="grpo,sdpo,dpo", help="synchronous rows; the ratios are to grpo")
    parser.add_argument("--async_algos", default="grpo,sdpo", help="also with --train.off_policy_steps 1; \"\" for none")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration, interleaved")
    args, extra = parser.parse_known_args()
    tmp = tempfile.mkdtemp(prefix="bench-step-")
    # Build (or find) the cached warm start outside the timed runs.
    run("grpo", 1, extra, os.path.join(tmp, "prime"))  # builds the tiny model and its warm start, if missing
    repeats = []  # per repeat: {(algo, mode): mean figures}
    algos, async_algos = ([a for a in names.split(",") if a] for names in (args.algos, args.async_algos))
    for repeat in range(args.repeats):
        means = {}
        for algo in dict.fromkeys(algos + async_algos):
            for mode, flags in MODES.items():
                if algo not in (algos if mode == "sync" else async_algos):
                    continue
                records = run(algo, args.steps, extra + flags, os.path.join(tmp, f"{algo}-{mode}-{repeat}"))
                records = records[2:] if mode == "async" else records[1:]
                m = {k: sum(r.get(k, 0.0) for r in records) / len(records) for k in SPLIT}
                m["tokens/s"] = sum(r["throughput/tokens_per_s"] for r in records) / len(records)
                means[algo, mode] = m
        repeats.append(means)
    means = {key: {k: sum(r[key][k] for r in repeats) / len(repeats) for k in figures}
             for key, figures in repeats[0].items()}
    columns = SPLIT + ["tokens/s"]
    print(f"{'':>14} " + " ".join(f"{k.split('/')[1]:>14}" for k in columns))
    for (algo, mode), m in means.items():
        print(f"{algo + ' ' + mode:>14} " + " ".join(f"{m[k]:14.3f}" for k in columns))
    step = lambda algo, mode, r: r[algo, mode]["time/step_s"]
    if len(repeats) > 1:
        print("step_s of each repeat: " + ", ".join(f"{algo} {mode} " + " ".join(f"{step(algo, mode, r):.3f}" for r in repeats)
                                                     for algo, mode in means))

    def ratio(name: str, numerator: tuple, denominator: tuple) -> str:
        """name=median over repeats of the step-time ratio, and its range when repeated."""
        values = [step(*numerator, r) / step(*denominator, r) for r in repeats]
        spread = f" {name}_range=[{min(values):.3f},{max(values):.3f}]" if len(values) > 1 else ""
        return f"{name}={statistics.median(values):.3f}{spread}"
    print("projection, engine and trainer on a device each (from the sync rows: "
          "async step = max(rollout, teacher + train) + sync):")
    for algo in algos:
        m = means[algo, "sync"]
        projected = max(m["time/rollout_s"], m["time/teacher_s"] + m["time/train_s"]) + m["sync/seconds"]
        print(f"  {algo}: {projected:.3f} s vs {m['time/step_s']:.3f} s synchronous "
              f"({projected / m['time/step_s']:.3f}x)")
    if "grpo" in algos:
        print("RESULT " + " ".join(ratio(f"{algo}_over_grpo_step_time", (algo, "sync"), ("grpo", "sync"))
                                   for algo in algos if algo != "grpo"))
    if "grpo" in async_algos and "grpo" in algos:
        print("RESULT " + ratio("grpo_async_over_sync_step_time", ("grpo", "async"), ("grpo", "sync")))
    if "sdpo" in async_algos and "sdpo" in algos:
        print("RESULT " + ratio("async_over_sync_step_time", ("sdpo", "async"), ("sdpo", "sync")) +
              f" wait_rollout_s={means['sdpo', 'async']['time/wait_rollout_s']:.3f}"
              f" wait_sync_s={means['sdpo', 'async']['time/wait_sync_s']:.3f}")


if __name__ == "__main__":
    main()
