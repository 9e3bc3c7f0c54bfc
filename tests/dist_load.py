"""Sharded loading on two ranks under torchrun (run by tests/test_load.py, not collected by pytest):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 --master_port=PORT \
        tests/dist_load.py MODEL_DIR OUT_DIR

Each rank loads the model twice: by policy.load_policy (rank 0 reads the checkpoint, the
other rank builds on the meta device, the weights arrive by broadcast in pieces of a few
rows, and rank 1 records the largest piece it received) and the way every rank
loaded it before (each reads the whole float32 checkpoint, then shards it), and takes the
gradient of one loss on the same sequence through each; rank 0 writes both models' full
weights, buffers and gradients (result.pt), and a copy_policy copy's weights, which the test
compares.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from conftest import exit_now  # noqa: E402


def main(model_dir, out_dir, d):
    import torch

    import packing
    import losses
    import run
    from policy import CausalLM, _auto_class, _vision, copy_policy, load_policy, shard
    from distributed import full_tensor

    cfg = run.Config()
    tokenizer = run.load_tokenizer(model_dir)
    ids = tokenizer("a sequence to take the gradient of, long enough for several tokens")["input_ids"]
    packed = packing.pack([ids], [len(ids) - 1], run.pad_token_id(tokenizer), d.device)

    def weights_and_grads(model):
        loss = model(packed, lambda h, w: -losses.token_logprobs(h @ w.T, packed.targets).mean())
        loss.backward()
        return ({n: full_tensor(p).detach().clone() for n, p in model.named_parameters()},
                {n: b.detach().clone() for n, b in model.named_buffers()},
                {n: full_tensor(p.grad).detach().clone() for n, p in model.named_parameters()})

    import policy
    read_anywhere = policy._auto_class
    if d.rank != 0:  # rank 1 builds from the config alone: reading the checkpoint fails it

        class ConfigOnly:
            def __init__(self, auto):
                self.from_config = auto.from_config

            def from_pretrained(self, *args, **kwargs):
                raise AssertionError(f"rank {d.rank} read the checkpoint")
        policy._auto_class = lambda path: ConfigOnly(read_anywhere(path))
    # pieces of a few rows, that straddle the ranks' shard boundaries; rank 1 records the largest it received
    policy.LOAD_CHUNK_BYTES = 6000
    broadcast, received, total = policy.dist.broadcast, [0], [0]

    def recording(tensor, *args, **kwargs):
        received[0] = max(received[0], tensor.numel() * tensor.element_size())
        total[0] += tensor.numel() * tensor.element_size()
        return broadcast(tensor, *args, **kwargs)
    policy.dist.broadcast = recording
    sharded = load_policy(model_dir, cfg, d.world, d.device)
    policy.dist.broadcast = broadcast
    copy = copy_policy(sharded, model_dir, cfg, d.world, d.device)
    policy._auto_class = read_anywhere
    largest = [max(p.numel() * p.element_size() for p in sharded.parameters())]  # float32: the checkpoint's too
    # every distinct tensor once (a tied LM head with its embedding), then the buffers
    distinct = sum(p.numel() * p.element_size() for p in sharded.parameters()) + \
        sum(b.numel() * b.element_size() for b in sharded.hf.buffers())
    pieces = [None] * d.world
    torch.distributed.all_gather_object(pieces, received[0])
    copied = {n: full_tensor(p).detach().clone() for n, p in copy.named_parameters()}
    copied_buffers = {n: b.detach().clone() for n, b in copy.named_buffers()}
    new = weights_and_grads(sharded)
    # the way every rank loaded before: the whole float32 checkpoint on each, then sharded
    hf = _auto_class(model_dir).from_pretrained(model_dir, dtype=torch.float32)
    old = weights_and_grads(shard(CausalLM(hf, _vision(model_dir)).to(d.device), d.world, d.device))
    if d.rank == 0:
        torch.save({"new": new, "old": old, "copy": (copied, copied_buffers),
                    "sharded": all(hasattr(p, "to_local") for p in sharded.parameters()),
                    "largest_piece_rank1": pieces[1], "largest_tensor": largest[0],
                    "broadcast_bytes": total[0], "distinct_bytes": distinct},
                   os.path.join(out_dir, "result.pt"))


if __name__ == "__main__":
    import run
    d = run.setup_distributed()
    main(sys.argv[1], sys.argv[2], d)
    run.end_distributed(d)
    exit_now()
