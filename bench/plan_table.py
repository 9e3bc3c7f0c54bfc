"""docs/scale.md's table of planned runs, from plan.plan (what `python run.py --plan` prints):

    python bench/plan_table.py            # print the table
    python bench/plan_table.py --write    # and put it into docs/scale.md, between its markers

Qwen3-8B's and Qwen2.5-32B's config.json values (their parameter counts as the config counts
them), nodes of 80 GB GPUs (80e9 bytes each) or 2 TB hosts; the flags of each row on the
pretrained preset (the flags' defaults: SDPO with an EMA teacher). tests/test_plan.py checks
that docs/scale.md holds this table. Not a measurement: arithmetic (plan.py's docstring).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "vocab_size": 151936,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
            "attention_bias": False, "tie_word_embeddings": False}
QWEN25_32B = {"model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 152064,
              "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648,
              "tie_word_embeddings": False}
README_FLAGS = ["--rollout.placement=separate", "--train.micro_batch=4"]  # README, GPU
# (model, its config, GPUs a node, nodes, trainer ranks a node, flags)
ROWS = [("8B", QWEN3_8B, 8, 1, 7, README_FLAGS),
        ("8B", QWEN3_8B, 8, 1, 7, ["--rollout.placement=separate"]),
        ("8B", QWEN3_8B, 1, 1, 1, []),
        ("32B", QWEN25_32B, 8, 1, 7, README_FLAGS),
        ("32B", QWEN25_32B, 8, 2, 7, README_FLAGS + ["--model.gradient_checkpointing=True"]),
        ("32B", QWEN25_32B, 8, 2, 6, README_FLAGS + ["--model.gradient_checkpointing=True",
                                                   "--rollout.tensor_parallel=2"])]
BEGIN, END = "<!-- plan table: bench/plan_table.py -->", "<!-- end of the plan table -->"


def planned(model, config, gpus, nodes, per_node, flags):
    import plan
    from flags import parse_config
    cfg = parse_config(["--recipe=pretrained", "--model.path=", *flags])
    node = plan.Node(gpus=gpus, gpu_bytes=80 * 10 ** 9, host_bytes=2 * 10 ** 12, ranks=nodes * per_node,
                     local_ranks=per_node, gpu_name="GPU")
    return cfg, plan.plan(cfg, plan.model_shape(config, model), node)


def row(model, config, gpus, nodes, per_node, flags) -> str:
    from plan import gb
    cfg, p = planned(model, config, gpus, nodes, per_node, flags)
    launch = (f"`--nnodes {nodes}` " if nodes > 1 else "") + (f"`--nproc_per_node {per_node}`" if per_node > 1 else
                                                              "`python run.py`")
    shown = " ".join(f"`{f.replace('=', ' ')}`" for f in flags if f != "--rollout.placement=separate")
    shards = sum(v for k, v in p.trainer.items() if k not in ("unsharded units", "activations"))
    held = (f"{gb(sum(p.trainer.values()))} of {gb(p.trainer_cap)}: shards {gb(shards)}, unsharded "
            f"{gb(p.trainer['unsharded units'])}, activations {gb(p.trainer['activations'])}")
    verdict = "refused: " + p.refusal.rsplit(": ", 1)[-1] if p.refusal else "fits"
    where = f"{nodes} nodes x " if nodes > 1 else ""
    return (f"| {model} | {where}{gpus} x 80 GB | {f'{launch} {cfg.rollout.placement} {shown}'.strip()} | {held} | "
            f"{p.kv_tokens:,} tokens = {p.sequences:,} sequences | {gb(p.sync_bytes)} | {verdict} |")


def table() -> str:
    lines = [BEGIN, "| model | node | launch and flags | a trainer GPU holds | the engine's KV cache (a GPU) "
             "| a sync moves | the plan |", "|---|---|---|---|---|---:|---|"]
    return "\n".join(lines + [row(*r) for r in ROWS] + [END])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace the table in docs/scale.md")
    args = parser.parse_args()
    text = table()
    print(text)
    if args.write:
        path = os.path.join(ROOT, "docs", "scale.md")
        doc = open(path).read()
        start, end = doc.index(BEGIN), doc.index(END) + len(END)
        with open(path, "w") as f:
            f.write(doc[:start] + text + doc[end:])


if __name__ == "__main__":
    main()
