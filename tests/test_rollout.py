"""
Tests for rollout.py against a real vLLM engine (CPU, float32, the tiny model).

The engine's numbers are checked against a float32 HF forward of the same weights (the
trainer's view): per-token log-probs of generated tokens, prompt scores, greedy decoding
after a weight sync. One in-process engine serves the in-process tests and one own-process
engine the own-process tests (each class-scoped, closed when its class is done, so that at
most one engine holds memory at a time); the last test runs the sync under torchrun with two
FSDP2 ranks (tests/dist_sync.py).
Run: python -m pytest tests/test_rollout.py   (about 3 minutes on 2 CPU cores)
"""

import copy
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import data
import rollout
from sync import probe_ids  # not `import sync`: this file's sync() helper takes that name

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# An in-process engine leaves variables in os.environ (LOCAL_WORLD_SIZE, LD_PRELOAD, VLLM_*):
# subprocesses get the environment from before any engine started.
CLEAN_ENV = dict(os.environ)
KV_TOKENS = 32768  # of KV cache (128 MB for the tiny model in float32): plenty, and two engines fit
TOL = 1e-4
MAX_TOKENS = 24  # of the shared in-process batch


# -----------------------------------------------------------------------------
# helpers: the trainer's side, computed with the HF model


@pytest.fixture(scope="module")
def eos_dir(tiny_dir, tokenizer, tmp_path_factory):
    """The tiny model with its EOS embedding row pushed towards the mean final hidden state.

    The random tiny model gives EOS a probability of about 1/1000 per token, so its responses
    practically never finish; this copy gives EOS about 5% per token (responses of ~20 tokens),
    so that a short generation holds both finished and truncated responses.
    """
    import shutil
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    rows = data.task_rows("arith", "train", 8) + data.task_rows("strops", "train", 8)
    seqs = [data.chat_prompt_ids(tokenizer, r["messages"]) + tokenizer(r["reference"], add_special_tokens=False)["input_ids"]
            for r in rows]
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        hidden = torch.cat([model.model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in seqs])
        direction = hidden.mean(0) / hidden.mean(0).norm()
        model.model.embed_tokens.weight[eos] += 0.4 * direction
        p_eos = torch.cat([model(input_ids=torch.tensor([s])).logits[0].softmax(-1)[:, eos] for s in seqs]).mean()
    assert 0.01 < p_eos < 0.3, p_eos
    out = str(tmp_path_factory.mktemp("eos") / "model")
    shutil.copytree(tiny_dir, out)
    model.save_pretrained(out)
    return out


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    yield model
    for k, v in model.state_dict().items():  # no test may leave the shared model changed
        assert torch.equal(v, original[k]), k


@pytest.fixture(scope="module")
def prompts(tokenizer):
    rows = data.task_rows("arith", "test", 2) + data.task_rows("strops", "test", 2)
    return [data.chat_prompt_ids(tokenizer, r["messages"]) for r in rows]


@pytest.fixture(scope="module")
def long_prompt(tokenizer):
    """A prompt over two KV-cache blocks (128 tokens on CPU): only full blocks are prefix-cached."""
    rows = data.task_rows("strops", "train", 12)
    text = "\n".join(r["messages"][0]["content"] for r in rows)
    ids = data.chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])
    assert len(ids) > 300
    return ids


@pytest.fixture(scope="module")
def probe(tokenizer):
    return probe_ids(tokenizer)


def state_of(model):
    """The full HF-named state dict a sync sends (lm_head.weight included for the tied model)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def perturbed(model, seed, scale=0.05):
    """A copy of model with Gaussian noise added to every weight."""
    copy_ = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy_.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return copy_


@torch.no_grad()
def trainer_logprobs(model, prompt_ids, response_ids, temperature):
    """log_softmax(logits / T) of the response tokens, as the trainer computes them."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


@torch.no_grad()
def hf_greedy(model, prompt_ids, max_tokens, eos):
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == eos:
            break
    return ids[len(prompt_ids):]


def greedy(engine, prompts, max_tokens=8):
    return [o[0].response_ids for o in engine.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens, seed=0)]


def max_diff(a, b):
    return (torch.as_tensor(a, dtype=torch.float32) - torch.as_tensor(b, dtype=torch.float32)).abs().max().item()


def sync(engine, model, probe, tol=TOL):
    return engine.update_weights(state_of(model), probe, rollout.probe_logprobs(model, probe), tol)


@pytest.fixture
def restore(hf, probe):
    """Yields a list to put the engine in; afterwards the engine gets the original weights back."""
    engines = []
    yield engines
    for engine in engines:
        result = sync(engine, hf, probe)
        assert result.probe_max_abs_diff < TOL


# -----------------------------------------------------------------------------
# checks of the sync (weight_sync on both placements, its failure modes on one)


def check_weight_sync(engine, hf, probe, prompts, tokenizer):
    prompts = [prompts[0], prompts[-1]]
    before_scores, before_greedy = engine.score([probe])[0], greedy(engine, prompts)
    assert max_diff(before_scores, rollout.probe_logprobs(hf, probe)) < TOL
    new = perturbed(hf, seed=1)
    target = rollout.probe_logprobs(new, probe)
    assert max_diff(target, before_scores) > 0.1  # the perturbation is visible in the probe

    result = sync(engine, new, probe)
    assert result.probe_max_abs_diff < TOL
    assert result.seconds > 0
    after_scores = engine.score([probe])[0]
    assert max_diff(after_scores, target) < TOL
    assert max_diff(after_scores, before_scores) > 0.1
    # greedy decoding from the same prompts (the long one's KV blocks were cached under the old
    # weights) follows the new weights: the prefix cache was reset
    after_greedy = greedy(engine, prompts)
    assert after_greedy != before_greedy
    assert after_greedy == [hf_greedy(new, p, 8, tokenizer.eos_token_id) for p in prompts]


def check_incomplete_state_dict(engine, hf, probe):
    new = perturbed(hf, seed=2)
    state = state_of(new)
    del state["lm_head.weight"]
    with pytest.raises(rollout.EngineError, match="lm_head.weight"):
        engine.update_weights(state, probe, rollout.probe_logprobs(new, probe), TOL)
    # refused before loading anything: the engine still has the old weights
    assert max_diff(engine.score([probe])[0], rollout.probe_logprobs(hf, probe)) < TOL


def check_silent_non_update_is_caught(engine, hf, probe, monkeypatch):
    # Without the key check, vLLM accepts a state dict that lacks the tied lm_head.weight and
    # does not load it completely, without an error: only the probe shows it.
    monkeypatch.setattr(engine, "expected_keys", set())
    new = perturbed(hf, seed=3)
    state = state_of(new)
    del state["lm_head.weight"]
    with pytest.raises(rollout.EngineError, match="did not arrive"):
        engine.update_weights(state, probe, rollout.probe_logprobs(new, probe), TOL)
    # a NaN probe from the trainer never passes either
    with pytest.raises(rollout.EngineError, match="did not arrive"):
        engine.update_weights(state_of(hf), probe, torch.full((len(probe) - 1,), float("nan")), TOL)
    # and a complete sync afterwards repairs the engine
    assert sync(engine, new, probe).probe_max_abs_diff < TOL


def check_a_lost_load_is_repeated(engine, hf, probe, monkeypatch):
    """The first reload is lost (the engine keeps its weights): the probe sees it, the load is
    repeated, and the result counts it; the engine then holds the new weights."""
    real_rpc, calls = engine.llm.collective_rpc, []

    def lose_the_first_reload(method, *args, **kwargs):
        calls.append(method)
        return None if calls.count("reload_weights") == 1 else real_rpc(method, *args, **kwargs)

    monkeypatch.setattr(engine.llm, "collective_rpc", lose_the_first_reload)
    new = perturbed(hf, seed=4)
    result = sync(engine, new, probe)
    assert calls.count("reload_weights") == 2 and result.reloads == 1
    assert result.probe_max_abs_diff < TOL
    assert max_diff(engine.score([probe])[0], rollout.probe_logprobs(new, probe)) < TOL
    assert sync(engine, hf, probe).reloads == 0  # a load that takes is not repeated


# -----------------------------------------------------------------------------
# in-process engine


class TestInProcess:
    """On the EOS-prone copy of the tiny model (see eos_dir)."""

    @pytest.fixture(scope="class")
    def hf(self, eos_dir):
        yield from load_hf(eos_dir)

    @pytest.fixture(scope="class")
    def engine(self, eos_dir):
        engine = rollout.Engine(eos_dir, dtype="float32", own_process=False, kv_cache_tokens=KV_TOKENS)
        yield engine
        engine.close()

    @pytest.fixture(scope="class")
    def batch(self, engine, prompts):
        """4 prompts x 8 samples at temperature 1: some finish with EOS, some are cut off."""
        return engine.generate(prompts, n=8, temperature=1.0, max_tokens=MAX_TOKENS, seed=0)

    def test_engine_is_in_process(self, engine):
        """vLLM's engine core runs in this process (its in-process client), with no processes to watch."""
        assert engine.own_process is False and engine.processes == {}
        assert type(engine.llm.llm_engine.engine_core).__name__ == "InprocClient"
        assert engine.expected_keys >= {"lm_head.weight", "model.embed_tokens.weight"}

    def test_generate_shapes(self, batch, prompts, tokenizer):
        eos = tokenizer.eos_token_id
        assert len(batch) == len(prompts)
        for prompt, samples in zip(prompts, batch):
            assert len(samples) == 8
            for s in samples:
                assert s.prompt_ids == prompt
                assert 0 < len(s.response_ids) <= MAX_TOKENS
                assert len(s.logprobs) == len(s.response_ids)
                assert all(lp <= 0.0 and lp > -1e4 for lp in s.logprobs)
                assert eos not in s.response_ids[:-1]
                if s.truncated:
                    assert len(s.response_ids) == MAX_TOKENS and s.response_ids[-1] != eos
                else:
                    assert s.response_ids[-1] == eos
                text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
                # vLLM holds back the bytes of a UTF-8 character left incomplete at the end
                # (cut off by max_tokens, or followed by EOS: the random model emits stray bytes)
                assert s.text == text or (text.startswith(s.text)
                                          and set(text[len(s.text):]) == {"\ufffd"}), (s.text, text)
            assert len({tuple(s.response_ids) for s in samples}) > 4  # n samples, not n copies of one

    def test_truncation_flag(self, engine, batch, prompts, tokenizer):
        flags = [s.truncated for samples in batch for s in samples]
        assert any(flags) and not all(flags)  # the batch has both kinds
        out = engine.generate(prompts[:2], n=2, temperature=1.0, max_tokens=3, seed=0)
        for s in (s for samples in out for s in samples):
            assert s.truncated and len(s.response_ids) == 3
        # Regenerate the batch with max_tokens = the length of a finished response: the same seeds
        # give the same tokens, cut at the new limit; the response whose EOS is exactly the last
        # allowed token is not truncated.
        finished = [s for samples in batch for s in samples if not s.truncated]
        limit = sorted(len(s.response_ids) for s in finished)[len(finished) // 2]
        again = engine.generate(prompts, n=8, temperature=1.0, max_tokens=limit, seed=0)
        at_limit = 0
        for samples, old_samples in zip(again, batch):
            for s, old in zip(samples, old_samples):
                assert s.response_ids == old.response_ids[:limit]
                if len(old.response_ids) < limit or (len(old.response_ids) == limit and not old.truncated):
                    assert not s.truncated
                    at_limit += len(old.response_ids) == limit
                else:
                    assert s.truncated and len(s.response_ids) == limit
        assert at_limit >= 1
        assert len({s.truncated for samples in again for s in samples}) == 2

    def test_seeding(self, engine, prompts):
        def ids(seed):
            return [[s.response_ids for s in o] for o in engine.generate(prompts[:2], n=3, temperature=1.0,
                                                                         max_tokens=12, seed=seed)]
        a, b, c = ids(5), ids(5), ids(6)
        assert a == b
        assert a != c
        assert all(x != y for x, y in zip(a[0], c[0]))

    def test_samples_of_different_prompts_are_independent(self, engine, prompts):
        out = engine.generate([prompts[0], prompts[0]], n=4, temperature=1.0, max_tokens=16, seed=0)
        first, second = [s.response_ids for s in out[0]], [s.response_ids for s in out[1]]
        assert not set(map(tuple, first)) & set(map(tuple, second))

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_generation_logprobs_match_the_trainer(self, engine, hf, prompts, batch, temperature):
        out = batch if temperature == 1.0 else engine.generate(prompts, n=2, temperature=temperature,
                                                               max_tokens=24, seed=1)
        worst = 0.0
        for samples in out:
            for s in samples:
                worst = max(worst, max_diff(s.logprobs, trainer_logprobs(hf, s.prompt_ids, s.response_ids,
                                                                         temperature)))
        assert worst < TOL
        # the temperature matters: log-probs at T=1 of the same tokens are different
        if temperature != 1.0:
            s = out[0][0]
            assert max_diff(s.logprobs, trainer_logprobs(hf, s.prompt_ids, s.response_ids, 1.0)) > 0.01

    def test_score_matches_probe_logprobs(self, engine, hf, probe, prompts, batch):
        sample = batch[1][0]
        seqs = [probe, sample.prompt_ids + sample.response_ids, prompts[0]]
        scores = engine.score(seqs)
        for seq, sc in zip(seqs, scores):
            assert len(sc) == len(seq) - 1
            assert max_diff(sc, rollout.probe_logprobs(hf, seq)) < TOL
        assert engine.score(seqs) == scores  # again, with the prefixes cached
        assert engine.score([probe])[0] == scores[0]  # alone, not in a batch
        # score is at temperature 1: the response part equals the sampler's log-probs at T=1
        assert max_diff(scores[1][-len(sample.response_ids):], sample.logprobs) < TOL

    def test_weight_sync(self, engine, hf, probe, prompts, long_prompt, tokenizer, restore):
        # the sync's failure modes do not depend on where the engine runs: TestOwnProcess
        # checks them on the placement torchrun uses
        restore.append(engine)
        check_weight_sync(engine, hf, probe, prompts + [long_prompt], tokenizer)

    def test_the_loops_sync_hands_the_tensors_over_through_vllms_api(self, engine, eos_dir, tokenizer, restore):
        """The loop's sync (group path) to an engine in this process: vLLM's start/update/finish
        with the policy's tensors themselves (sdpo_local, a bucket at a time), proven by the
        digests of every checkpoint key and by the probe."""
        import run
        import sync
        from distributed import Dist
        from policy import load_policy
        restore.append(engine)
        d, cfg = Dist(0, 1, torch.device("cpu")), run.Config()
        cfg.rollout.sync_bucket_mb = 1  # several update_weights calls
        policy = load_policy(eos_dir, cfg, 1, d.device)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        metrics = sync.sync_engine(cfg, engine, policy, tokenizer, d, version=1)
        assert metrics["sync/probe_max_abs_diff"] < TOL and metrics["sync/reloads"] == 0
        assert type(engine._transfer).__name__ == "LocalTrainerWeightTransferEngine"
        proof = engine.client().rpc("sdpo_weight_proof")[0]
        assert set(proof["loaded"]) == sync.checkpoint_keys(eos_dir) and proof["waiting"] == []
        assert max_diff(engine.score([probe_ids(tokenizer)])[0], sync.probe_logprobs(policy, tokenizer, d)[2]) < TOL


# -----------------------------------------------------------------------------
# engine core in its own process (what torchrun and the separate placement use)


ENGINE_CORE = min(os.sched_getaffinity(0))  # the own-process engine below keeps to it, as beside an async trainer


class TestOwnProcess:
    """On the tiny model itself."""

    @pytest.fixture(scope="class")
    def hf(self, tiny_dir):
        yield from load_hf(tiny_dir)

    @pytest.fixture(scope="class")
    def engine(self, tiny_dir):
        engine = rollout.Engine(tiny_dir, dtype="float32", own_process=True, kv_cache_tokens=KV_TOKENS,
                                cpu_cores=[ENGINE_CORE])
        yield engine
        sync_dir = engine._sync_dir
        engine.close()
        assert sync_dir is None or not os.path.exists(sync_dir)  # close removes the shared-memory file

    def test_generate_and_logprobs(self, engine, hf, prompts, tokenizer):
        assert engine.own_process is True
        out = engine.generate(prompts[:2], n=3, temperature=0.7, max_tokens=16, seed=4)
        assert [len(o) for o in out] == [3, 3]
        for samples in out:
            for s in samples:
                assert len(s.logprobs) == len(s.response_ids) > 0
                assert s.truncated == (s.response_ids[-1] != tokenizer.eos_token_id)
                assert max_diff(s.logprobs, trainer_logprobs(hf, s.prompt_ids, s.response_ids, 0.7)) < TOL
        again = engine.generate(prompts[:2], n=3, temperature=0.7, max_tokens=16, seed=4)
        assert [[s.response_ids for s in o] for o in again] == [[s.response_ids for s in o] for o in out]

    @pytest.mark.skipif("VLLM_CPU_OMP_THREADS_BIND" in os.environ, reason="the user's binding wins")
    def test_every_thread_of_the_engine_keeps_to_its_cores(self, engine, prompts):
        # vLLM binds its worker's OpenMP threads alone; its scheduler and other threads would
        # otherwise run on the trainer's cores (processes.pin_threads)
        engine.generate(prompts[:1], n=1, temperature=1.0, max_tokens=4, seed=0)  # threads made since keep to it too
        threads = [int(t) for pid in engine.processes for t in os.listdir(f"/proc/{pid}/task")]
        assert len(engine.processes) >= 1 and len(threads) > len(engine.processes)
        assert {t: os.sched_getaffinity(t) for t in threads} == {t: {ENGINE_CORE} for t in threads}

    def test_weight_sync(self, engine, hf, probe, prompts, long_prompt, tokenizer, restore):
        restore.append(engine)
        check_weight_sync(engine, hf, probe, prompts + [long_prompt], tokenizer)
        # the weights travelled through a safetensors file in shared memory
        assert engine._sync_dir is not None
        assert os.path.exists(os.path.join(engine._sync_dir, "model.safetensors"))
        if os.path.isdir("/dev/shm"):
            assert engine._sync_dir.startswith("/dev/shm/")

    def test_incomplete_state_dict_is_refused(self, engine, hf, probe):
        check_incomplete_state_dict(engine, hf, probe)

    def test_silent_non_update_is_caught_by_the_probe(self, engine, hf, probe, monkeypatch, restore):
        restore.append(engine)
        check_silent_non_update_is_caught(engine, hf, probe, monkeypatch)

    def test_a_load_that_did_not_take_is_loaded_once_more(self, engine, hf, probe, monkeypatch, restore):
        restore.append(engine)
        check_a_lost_load_is_repeated(engine, hf, probe, monkeypatch)


# -----------------------------------------------------------------------------
# two FSDP2 ranks under torchrun, engine on rank 0


def test_a_tied_lm_head_travels_once(tiny_dir):
    """The group path sends each distinct tensor once: the tied LM head with its embedding,
    loaded under both names (a state dict detaches a tied tensor anew under each name)."""
    import run
    import sync
    from distributed import Dist
    from policy import load_policy
    cpu = torch.device("cpu")
    policy = load_policy(tiny_dir, run.Config(), 1, cpu)
    source = sync.PolicySource(policy, Dist(0, 1, cpu), torch.float32)
    assert source.bytes_per_pass == 4 * sum(p.numel() for p in policy.parameters())
    names = [m.name for m in source.metadata()]
    tied = {"model.embed_tokens.weight", "lm_head.weight"}
    (travels,) = tied & set(names)  # one of the two names travels, the engine loads it under both
    assert source.aliases == {travels: sorted(tied - {travels})}
    assert source.keys == sync.checkpoint_keys(tiny_dir)
    assert [name for name, _ in source] == names  # one pass yields what metadata() declares, in its order
    expected = source.expected_digests()
    assert expected["lm_head.weight"] == expected["model.embed_tokens.weight"] and set(expected) == source.keys


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dist_sync(tmp_path, model_dir, *mode) -> tuple[dict, dict]:
    """tests/dist_sync.py under two-rank torchrun: what each rank wrote."""
    env = {**CLEAN_ENV, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           os.path.join("tests", "dist_sync.py"), str(tmp_path), model_dir, *mode]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun timed out after 300 s; output tail:\n{(e.stdout or b'')[-3000:]}\n{(e.stderr or b'')[-3000:]}")
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    return r0, r1


def check_group_vs_file(r0, r1):
    """Two steps, each synced through the weight group and then through the file (the second
    while the engine generates in the background): the engine scores every sequence and holds
    every parameter identically after either, and the group moves no more bytes than the file."""
    previous = None
    for row in r0["group_vs_file"]:
        group, file = row["group"], row["file"]
        assert group["probe_max_abs_diff"] < TOL and file["probe_max_abs_diff"] < TOL
        assert group["scores"] == file["scores"]
        assert group["params"] == file["params"] and len(group["params"]) > 10
        assert previous is None or group["scores"] != previous  # each step changed the weights
        previous = group["scores"]
        assert 0 < group["megabytes"] <= file["megabytes"]
        assert group["megabytes"] == r0["distinct_megabytes"]  # a tied head travels once under FSDP2 too
    assert [row["group"]["megabytes"] for row in r1["group_vs_file"]] == \
        [row["group"]["megabytes"] for row in r0["group_vs_file"]]
    from dist_sync import order_violations
    assert order_violations([r0["order"], r1["order"]]) == []


def test_two_rank_torchrun_sync(tiny_dir, tmp_path):
    r0, r1 = run_dist_sync(tmp_path, tiny_dir)
    assert r0["own_process"] is True  # chosen automatically under torchrun
    assert r0["env_restored"]
    assert r0["sharded"] and r1["sharded"]
    assert "lm_head.weight" in r0["state_keys"] and "model.embed_tokens.weight" in r0["state_keys"]
    # the optimizer step changed the trainer's probe, identically on both ranks
    assert max_diff(r0["trainer_after"], r0["trainer_before"]) > 0.05
    assert r0["trainer_after"] == r1["trainer_after"] and r0["ranks_agree"]
    # the engine started from the checkpoint, and after the sync holds the stepped weights
    assert max_diff(r0["engine_before"], r0["trainer_before"]) < TOL
    assert r0["probe_max_abs_diff"] < TOL and r1["probe_max_abs_diff"] == r0["probe_max_abs_diff"]
    assert max_diff(r0["engine_after"], r0["trainer_after"]) < TOL
    assert max_diff(r0["engine_after"], r0["engine_before"]) > 0.05
    # the trainers' all-reduce still works after the engine started: 1 + 2
    assert r0["all_reduce"] == r1["all_reduce"] == 3.0
    assert r0["weight_group_closed"]  # the engine's close destroyed rank 0's side of the weight group
    check_group_vs_file(r0, r1)  # two more steps, each synced both ways
    # a sync that silently leaves out a tensor, or a bucket in bf16, is named on every rank
    for r in (r0, r1):
        proof = r["proof"]
        assert proof["dropped"]["tensor"] == ["model.layers.1.mlp.down_proj.weight"]
        assert "never loaded 1 tensors, e.g. ['model.layers.1.mlp.down_proj.weight']" in proof["tensor"], proof["tensor"]
        assert "model.layers.1.mlp.down_proj (0 of" in proof["tensor"]  # and the layer keeps its old weights
        dropped = proof["dropped"]["bucket"]
        assert len(dropped) > 1 and f"never loaded {len(dropped)} tensors, e.g. {dropped[:5]}" in proof["bucket"], \
            proof["bucket"]
        assert proof["repaired_probe_diff"] < TOL
