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

Both record the order of the two process groups during the group path's syncs (`record_order`:
every rank's gathers of the FSDP2 shards on the default group, rank 0's sends on the weight
group), which `order_violations` checks; the first also makes syncs that silently drop a tensor
and a bucket (`proof_cases`), which the engine's proof must name.
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
    events = record_order(engine, d)
    result.update(group_vs_file(engine, policy, tokenizer, d, probe, step, first_version=2))
    result["order"] = events
    result["proof"] = proof_cases(engine, policy, tokenizer, d, step, first_version=4)

    # The trainers' process group still works with the engine (and its process) alive.
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    result["all_reduce"] = total.item()
    gathered = [None] * world
    dist.all_gather_object(gathered, after.tolist())
    result["ranks_agree"] = all(g == gathered[0] for g in gathered)

    if rank == 0:
        result["weight_group_closed"] = close_recording_the_weight_group(engine)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def close_recording_the_weight_group(engine) -> bool:
    """engine.close(), on rank 0: whether it destroyed the weight group its trainer engine held
    (the workers' side ends with the engine's process; a served engine's: ServedEngine.close)."""
    import sync
    module, transfer = sync.transfer_module(), engine._transfer
    transfer.group = getattr(transfer.group, "group", transfer.group)  # record_order's wrapper off
    real, destroyed = module.stateless_destroy_torch_distributed_process_group, []
    module.stateless_destroy_torch_distributed_process_group = lambda group: (real(group), destroyed.append(group))
    try:
        engine.close()
    finally:
        module.stateless_destroy_torch_distributed_process_group = real
    return len(destroyed) == 1 and engine._transfer is None


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
                row[how]["params"] = engine.llm.collective_rpc("sdpo_parameter_digest")[0]
        rows.append(row)
    # a tied tensor counts once
    return {"group_vs_file": rows, "distinct_megabytes": sum(p.numel() * 4 for p in policy.parameters()) / 1e6}


DROPPED = "model.layers.1.mlp.down_proj.weight"


def proof_cases(engine, policy, tokenizer, d, change, first_version) -> dict:
    """Syncs that silently leave tensors out: the policy source yields every tensor but one (in
    float32, the engine's dtype), then every tensor but those of one bucket (cast to bfloat16, where
    the probe's tolerance is a nat). What each rank's sync raised, and the probe after a full sync."""
    import torch
    import run
    import sync
    from rollout import EngineError
    cfg = run.Config()
    real, out = sync.PolicySource, {}

    class Dropping(sync.PolicySource):  # the engine is not told of them either: only its proof can notice
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if drop_bucket:
                sizes = [self.dtype.itemsize * torch.Size(m.shape).numel() for m in self.meta]
                bucket = sync.transfer_module().bucket_plan(sizes, self.bucket_bytes)[2]
                dropped = {self.meta[i].name for i, _ in bucket}
            else:
                dropped = {DROPPED}
            keep = [i for i, m in enumerate(self.meta) if m.name not in dropped]
            self.entries, self.meta = [self.entries[i] for i in keep], [self.meta[i] for i in keep]
            out.setdefault("dropped", {})["bucket" if drop_bucket else "tensor"] = sorted(dropped)

    for i, (drop_bucket, dtype) in enumerate([(False, "float32"), (True, "bfloat16")]):
        change(i)
        cfg.rollout.sync_bucket_mb, cfg.rollout.dtype = 1, dtype
        sync.PolicySource = Dropping
        try:
            sync.sync_engine(cfg, engine, policy, tokenizer, d, version=first_version + i)
            out["bucket" if drop_bucket else "tensor"] = "no error"
        except EngineError as e:
            out["bucket" if drop_bucket else "tensor"] = str(e)
        finally:
            sync.PolicySource = real
    cfg.rollout.dtype = "float32"
    out["repaired_probe_diff"] = sync.sync_engine(cfg, engine, policy, tokenizer, d, first_version + 2)[
        "sync/probe_max_abs_diff"]
    return out


def record_order(engine, d) -> list:
    """Records, from now on, each FSDP2 gather of the group path (sync.full_tensor: every rank, on
    the default group) and rank 0's sends on the weight group (the trainer engine's gloo group):
    ("gather" | "send", start, end, shape or bytes), on the machine's monotonic clock."""
    import time
    import sync
    events = []
    real_full = sync.full_tensor

    def gather(t):
        t0 = time.monotonic()
        out = real_full(t)
        events.append(("gather", t0, time.monotonic(), list(out.shape)))
        return out
    sync.full_tensor = gather
    if d.rank == 0:
        real_open = type(engine)._transfer_weights

        def opened(self, source):  # the group exists once the first transfer has opened it
            result = real_open(self, source)
            group = self._transfer.group
            if not isinstance(group, Recorded):
                self._transfer.group = Recorded(group, events)
            return result
        type(engine)._transfer_weights = opened
    return events


class Recorded:
    """A process group whose broadcasts are recorded (as sends, each waited for where it is
    issued: the order of the thread that issues them is what is recorded)."""

    def __init__(self, group, events):
        self.group, self.events = group, events

    def broadcast(self, tensor, root):
        import time
        t0 = time.monotonic()
        self.group.broadcast(tensor, root).wait()
        self.events.append(("send", t0, time.monotonic(), tensor.numel()))
        return Done()

    def __getattr__(self, name):
        return getattr(self.group, name)


class Done:
    def is_completed(self):
        return True

    def wait(self, *args):
        return True


def order_violations(rank_events: list[list]) -> list[str]:
    """What breaks the order a sync must keep across the two groups (docs/sync.md, The order of
    the two groups), from each rank's record_order events: on rank 0, a gather on the default group
    while a send on the weight group is under way (the interleaving NCCL can deadlock on:
    huggingface/trl#7103, #6798); or ranks that gathered other tensors, or in another order. (A
    gather completes on rank 0 only once every rank has given its shard, so without the first,
    each tensor was gathered by every rank before rank 0 handed it to the transfer.)"""
    problems = []
    gathers = [[e for e in events if e[0] == "gather"] for events in rank_events]
    sends = [e for e in rank_events[0] if e[0] == "send"]
    if not sends or not gathers[0]:
        problems.append(f"{len(gathers[0])} gathers and {len(sends)} sends recorded on rank 0")
    for g in gathers[0]:
        for s in sends:
            if g[1] < s[2] and s[1] < g[2]:
                problems.append(f"rank 0 gathered a tensor {g[3]} on the default group at {g[1]:.4f}-{g[2]:.4f} s "
                                f"while it sent {s[3]} bytes on the weight group at {s[1]:.4f}-{s[2]:.4f} s")
    shapes = [[g[3] for g in rank] for rank in gathers]
    if any(s != shapes[0] for s in shapes[1:]):
        problems.append("the ranks gathered other tensors, or in another order")
    return problems


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
    events = record_order(engine, d)
    result = {"rank": d.rank, "world": d.world,
              **group_vs_file(engine, policy, tokenizer, d, sync.probe_ids(tokenizer), nudge, first_version=1),
              "order": events}
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
