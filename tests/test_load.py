"""Sharded loading (policy.load_policy under torchrun) against every rank reading the whole
checkpoint, on the tiny model and the tiny VLM; copy_policy against the policy."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           os.path.join(ROOT, "tests", "dist_load.py"), model_dir, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(tmp_path / "result.pt")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "tiny_vlm"])
def test_sharded_loading_gives_todays_weights_buffers_and_first_gradients(model, tmp_path):
    import tiny_models
    model_dir = tiny_models.tiny_model_dir() if model == "tiny" else tiny_models.tiny_vlm_dir()
    result = _two_ranks(model_dir, tmp_path)
    assert result["sharded"]
    # rank 1 received the weights in pieces (policy.LOAD_CHUNK_BYTES, set to 6000 there), never a whole tensor
    assert 0 < result["largest_piece_rank1"] <= 6000 < result["largest_tensor"]
    assert result["broadcast_bytes"] == result["distinct_bytes"]  # a tied LM head travels once
    (new_w, new_b, new_g), (old_w, old_b, old_g) = result["new"], result["old"]
    assert new_w.keys() == old_w.keys() and new_b.keys() == old_b.keys() and new_g.keys() == old_g.keys()
    for name in old_w:  # loading copies float32 values: equal to the bit
        assert new_w[name].dtype == torch.float32, name
        assert torch.equal(new_w[name], old_w[name]), name
    for name in old_b:  # the rotary frequencies, which no state dict carries
        assert torch.equal(new_b[name], old_b[name]), name
    for name in old_g:
        assert torch.equal(new_g[name], old_g[name]), name
    copied, copied_buffers = result["copy"]
    for name in old_w:
        assert torch.equal(copied[name], old_w[name]), name
    for name in old_b:
        assert torch.equal(copied_buffers[name], old_b[name]), name


def test_copy_policy_holds_the_policys_current_weights_apart_from_them(tiny_dir):
    import run
    from policy import copy_policy, load_policy
    cpu = torch.device("cpu")
    policy = load_policy(tiny_dir, run.Config(), 1, cpu)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)  # not the checkpoint's weights: the copy must take the policy's
    copy = copy_policy(policy, tiny_dir, run.Config(), 1, cpu)
    for (name, a), (_, b) in zip(policy.named_parameters(), copy.named_parameters()):
        assert torch.equal(a, b), name
        assert a.data_ptr() != b.data_ptr(), name
    for (name, a), (_, b) in zip(policy.named_buffers(), copy.named_buffers()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)  # the copy does not move with the policy
    assert not torch.equal(next(policy.parameters()), next(copy.parameters()))
