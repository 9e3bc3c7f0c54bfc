"""Two-rank weight sync under torchrun, the way run.py's train() does it (run by
tests/test_rollout.py, not collected by pytest):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 --master_port=PORT \
        tests/dist_sync.py OUT_DIR MODEL_DIR

Both ranks shard the tiny model with FSDP2 and take one optimizer step; rank 0 owns a
float32 engine (its own process, chosen automatically under torchrun), every rank gathers the
full state dict and computes the probe log-probs through the sharded model, rank 0 syncs.
Then a collective checks that the trainers' process group still works with the engine alive.
Each rank writes OUT_DIR/rank{N}.json; the test asserts on them.

    ... tests/dist_sync.py OUT_DIR MODEL_DIR group_vs_file

runs only the comparison of the two sync paths (two changes of every weight, each synced
through the group and then the file, the second while the engine generates): for the tiny
vision-language model, whose probe holds a picture (tests/test_vlm.py).
"""
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from conftest import exit_now  # noqa: E402


def main(out_dir, model_dir, d):
    """The sync of both ranks; each writes out_dir/rank{N}.json."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer

    import packing
    import chunked_head
    import losses
    import rollout
    import run
    import sync
    from policy import load_policy
    from sync import full_state_dict

    rank, world, device = d.rank, d.world, d.device
    result = {"rank": rank, "world": world}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    probe = sync.probe_ids(tokenizer)
    pad_id = tokenizer.pad_token_id

    # Engine first, as in run.train; rank0_call hands a failure on rank 0 to rank 1 as well.
    t0 = time.perf_counter()
    engine = run.rank0_call(d, lambda: rollout.Engine(
        model_dir, dtype="float32", kv_cache_tokens=32768), share=False)
    if rank == 0:
        result["engine_start_s"] = time.perf_counter() - t0
        result["own_process"] = engine.own_process
        # torchrun's variables were hidden from the engine only while it started
        result["env_restored"] = os.environ.get("RANK") == "0" and os.environ.get("WORLD_SIZE") == "2"
        result["engine_before"] = engine.score([probe])[0]

    policy = load_policy(model_dir, run.Config(), world, device)
    result["sharded"] = all(isinstance(p, DTensor) for p in policy.parameters())
    packed = packing.pack([probe], [len(probe) - 1], pad_id, device)

    def probe_logprobs():  # as run.train's sync(): through the sharded model, on every rank
        with torch.no_grad():
            head = lambda h, w: chunked_head.logprobs_and_entropy_from_hidden(h, w, packed.targets)[0]
            return policy(packed, head).cpu()

    before = probe_logprobs()
    # One AdamW step on the probe's NLL: every parameter moves by about lr, identically on both
    # ranks (FSDP2 reduce-scatters the gradient).
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.0)
    loss = policy(packed, lambda h, w: -losses.token_logprobs(h @ w.T, packed.targets).mean())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    after = probe_logprobs()
    result["trainer_before"], result["trainer_after"] = before.tolist(), after.tolist()

    state = full_state_dict(policy, world)  # every rank takes part; rank 0 gets the tensors
    result["state_keys"] = sorted(state)
    synced = run.rank0_call(d, lambda: engine.update_weights(state, probe, after, tol=1e-4))
    result["probe_max_abs_diff"] = synced.probe_max_abs_diff
    result["sync_s"] = synced.seconds
    if rank == 0:
        result["engine_after"] = engine.score([probe])[0]

    # Two more steps, each synced through the weight group (sync.py), then the same weights
    # through the file: the engine must score every sequence identically after either, and hold
    # the same parameters. In the second step the engine generates in the background meanwhile,
    # as with --train.off_policy_steps 1 (the sync waits for it).
    def step(_):
        loss = policy(packed, lambda h, w: -losses.token_logprobs(h @ w.T, packed.targets).mean())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result.update(group_vs_file(engine, policy, tokenizer, d, probe, step, first_version=2))

    # The trainers' process group still works with the engine (and its process) alive.
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    result["all_reduce"] = total.item()
    gathered = [None] * world
    dist.all_gather_object(gathered, after.tolist())
    result["ranks_agree"] = all(g == gathered[0] for g in gathered)

    if rank == 0:
        engine.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def group_vs_file(engine, policy, tokenizer, d, probe, change, first_version) -> dict:
    """Two changes of the weights (`change(step)`), each synced through the weight group and
    then through the file (the second while the engine generates in the background, as with
    --train.off_policy_steps 1): per step and path, the bytes moved, the probe's proof and, on
    rank 0, the engine's scores of three sequences and its parameters' digest."""
    import run
    import sync
    cfg = run.Config()
    cfg.rollout.sync_bucket_mb = 1  # several buckets, and tensors larger than one
    sequences = [probe, probe[: len(probe) // 2], list(reversed(probe))]
    rows = []
    for step in range(2):
        change(step)
        if d.rank == 0 and step == 1:
            engine.in_background(lambda: engine.generate([probe], n=4, temperature=1.0, max_tokens=16, seed=step),
                                 "generate ahead")
        row = {}
        for how in ("group", "file"):
            cfg.rollout.sync = how
            metrics = sync.sync_engine(cfg, engine, policy, tokenizer, d, version=first_version + step)
            row[how] = {"megabytes": metrics["sync/megabytes"], "probe_max_abs_diff": metrics["sync/probe_max_abs_diff"]}
            if d.rank == 0:
                row[how]["scores"] = engine.score(sequences)
                row[how]["params"] = engine.llm.collective_rpc("parameter_digest")[0]
        rows.append(row)
    # a tied tensor counts once
    return {"group_vs_file": rows, "distinct_megabytes": sum(p.numel() * 4 for p in policy.parameters()) / 1e6}


def main_group_vs_file(out_dir, model_dir, d):
    """Only the two paths compared, every weight (a vision tower's included) moved by noise."""
    import torch
    from transformers import AutoTokenizer

    import rollout
    import run
    import sync
    from distributed import local_tensor
    from policy import load_policy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = run.rank0_call(d, lambda: rollout.Engine(model_dir, dtype="float32", kv_cache_tokens=16384),
                            share=False)
    policy = load_policy(model_dir, run.Config(), d.world, d.device)

    def nudge(step):
        g = torch.Generator().manual_seed(100 * step + d.rank)  # each rank its own shards
        with torch.no_grad():
            for p in policy.parameters():
                local = local_tensor(p)
                local.add_(torch.randn(local.shape, generator=g) * 0.01)
    result = {"rank": d.rank, "world": d.world,
              **group_vs_file(engine, policy, tokenizer, d, sync.probe_ids(tokenizer), nudge, first_version=1)}
    if d.rank == 0:
        engine.close()
    with open(os.path.join(out_dir, f"rank{d.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the entry point must be guarded
    import run
    d = run.setup_distributed()
    (main_group_vs_file if sys.argv[3:] == ["group_vs_file"] else main)(sys.argv[1], sys.argv[2], d)
    run.end_distributed(d)
    exit_now()
