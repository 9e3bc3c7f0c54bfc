"""The training loop's pieces: flags, teacher EMA, loss masking, micro-batch invariance,
contained reward failures, and short real runs (single process and two-rank torchrun)."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

import checkpoint
import data
import feedback
import microbatch
import objectives
import packing
import run
import tiny_models
import warm_start
from microbatch import Models
from objectives import OBJECTIVES, grpo, hybrid, sdpo as sdpo_objective
from rollout import Sample
from teacher import Teacher
from evaluate import (context_entropies, paired_gain, right_minus_wrong, row_success, stderr, teacher_gap,
                      teacher_gap_warnings)
from logger import DEMO_RIGHT, DEMO_WRONG, FLAT_TEACHER_METRIC, FLAT_TEACHER_NATS, RIGHT_MINUS_WRONG
from policy import CausalLM, load_policy, lr_factor
from feedback import reward_function
from update import add_stats, rank_micro_batches, rank_share, reduce_stats, step_counts
from warm_start import reference_success

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")
ONE_PROCESS = run.Dist(0, 1, CPU)


# ----------------------------------------------------------------------------------------
# flags


def _sweep():
    import yaml
    with open(os.path.join(ROOT, "sweeps", "sdpo_alpha_topk.yaml")) as f:
        return yaml.safe_load(f)


def _sweep_grid():
    """The shipped sweep's grid points, as `wandb agent` passes them: --name=value each."""
    import itertools
    params = _sweep()["parameters"]
    choices = [p["values"] if "values" in p else [p["value"]] for p in params.values()]
    return [[f"--{n}={v}" for n, v in zip(params, combo)] for combo in itertools.product(*choices)]


def test_sweep_file_command_lines_parse():
    assert _sweep()["program"] == "run.py"
    grid = _sweep_grid()
    assert len(grid) == 12
    for point in grid:
        cfg = run.parse_config(point)
        values = dict(a[2:].split("=", 1) for a in point)  # Python's str() of each value, as the agent passes it
        assert cfg.algo.name == values["algo"]
        assert cfg.sdpo.alpha == float(values["sdpo.alpha"])
        assert cfg.sdpo.topk == int(values["sdpo.topk"])
        assert cfg.sdpo.teacher_rate == float(values["sdpo.teacher_rate"])
        assert cfg.sdpo.add_tail is True
        assert cfg.log.wandb_mode == "online"


def test_runs_without_out_dir_get_a_folder_each_and_latest_links_the_newest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(checkpoint.time, "strftime", lambda fmt: "20261127-120000")  # two starts in one second
    cfg = run.parse_config(["--algo=grpo", "--data.task=/data/My Set.v2.jsonl"])
    first, second = run.run_dir(cfg), run.run_dir(cfg)
    assert re.fullmatch(r"runs/\d{8}-\d{6}-grpo-My_Set", first) and second == first + "-2"
    assert os.path.realpath("runs/latest") == os.path.realpath(second)
    assert run.run_dir(run.parse_config([f"--log.out_dir={tmp_path}/mine"])) == f"{tmp_path}/mine"
    os.makedirs(os.path.join(first, "checkpoint-3", ".metadata"))
    assert run.run_dir(run.parse_config([f"--train.resume={first}"])) == first  # resuming: the run's own folder


@pytest.mark.slow
def test_the_sweeps_first_two_points_run_back_to_back_each_in_its_own_folder(tmp_path):
    """What a user's second `python run.py` and a sweep agent's second run do: start, in a new
    folder with its own wandb run (offline here: no network), runs/latest the newest."""
    small = [a for a in SMALL if not a.startswith("--log.wandb_mode")] + ["--log.wandb_mode=offline"]
    dirs = []
    for point in _sweep_grid()[:2]:
        agent_args = [a for a in point if not a.startswith("--log.wandb_mode")]  # online needs the network
        proc = _run(agent_args + small, cwd=tmp_path)
        dirs.append(re.search(r"^out_dir: (.+)$", proc.stdout, re.M).group(1))
    assert dirs[0] != dirs[1] and all(d.startswith("runs/") for d in dirs)
    assert os.path.realpath(tmp_path / "runs" / "latest") == os.path.realpath(tmp_path / dirs[1])
    for d, point in zip(dirs, _sweep_grid()[:2]):
        assert [r["step"] for r in _metrics(tmp_path / d)] == [0, 1, 2]
        with open(tmp_path / d / "config.json") as f:
            saved = json.load(f)
        assert f"--sdpo.teacher_rate={saved['sdpo']['teacher_rate']}" in point  # the agent's values
        assert saved["sdpo"]["topk"] == 16 and saved["log"]["out_dir"] == d  # flags after the agent's win
        assert os.path.isdir(tmp_path / d / "wandb")
        assert undocumented_metrics(k for r in _metrics(tmp_path / d) for k in r) == []


def test_user_errors_print_their_message_alone_and_exit_non_zero(tmp_path, monkeypatch, capsys):
    """A flag, a data file, a model path, a used out_dir, a checkpoint, a reward's setup: one
    message naming it, no traceback, exit status 2 for a flag, 1 otherwise; --debug raises."""
    monkeypatch.chdir(tmp_path)
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text("")
    cases = [(["--optim.lr=-0.001"], 2, "--optim.lr=-0.001: must be > 0"),
             (["--optim.lrr=1"], 2, "--optim.lrr=1; did you mean --optim.lr?"),
             (["--train.steps=two"], 2, "--train.steps"),
             (["--data.reward=nope"], 2, "--data.reward: unknown reward function 'nope'"),
             ([f"--data.task={tmp_path / 'none.jsonl'}"], 1, f"{tmp_path / 'none.jsonl'}: no such file"),
             ([f"--model.path={tmp_path / 'none'}"], 1, f"--model.path {tmp_path / 'none'}: no such directory"),
             ([f"--log.out_dir={used}"], 1, f"--log.out_dir {used} holds an earlier run"),
             ([f"--train.resume={tmp_path}"], 1, f"--train.resume {tmp_path}: neither a checkpoint")]
    for argv, status, message in cases:
        assert run.cli(argv) == status, argv
        err = capsys.readouterr().err
        assert message in err and err.startswith("error: ") and "Traceback" not in err, err
        assert len(err.strip().splitlines()) <= 3, err
    assert sorted(os.listdir(tmp_path)) == ["used"]  # the runs stopped at the start left no empty folder
    with pytest.raises(data.FlagError):
        run.cli(["--optim.lr=-0.001", "--debug"])
    monkeypatch.setenv("SDPO_DEBUG", "1")
    with pytest.raises(data.PathError):
        run.cli([f"--log.out_dir={used}"])


@pytest.mark.slow
def test_a_bad_flag_on_the_command_line_prints_three_lines_at_most():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "--optim.lr=-0.001"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "error: --optim.lr=-0.001: must be > 0"


def test_help_shows_the_values_this_run_uses(capsys):
    """The recipe is chosen before --help prints: its defaults are the run's, recipe included."""
    for argv, recipe, lr in ((["--help"], "strops", "0.0001"),
                             (["--algo=grpo", "--data.task=quiz", "-h"], "quiz", "6e-05"),
                             (["--recipe=pretrained", "--help"], "pretrained", "1e-06")):
        with pytest.raises(SystemExit) as stop:
            run.parse_config(argv)
        assert stop.value.code == 0
        text = capsys.readouterr().out
        assert f"recipe {recipe} (" in text
        help_lr = re.search(r"--optim\.lr FLOAT.*?\(default: ([^)]+)\)", text, re.S).group(1)
        assert help_lr == lr == str(run.parse_config([a for a in argv if a not in ("-h", "--help")]).optim.lr)


METRIC_NAMESPACES = ("reward", "response", "actor", "is", "rollout", "sdpo", "dpo", "gad", "sync", "time", "throughput",
                     "async", "warm_start", "eval", "ttt", "best_of_k", "reference")


def undocumented_metrics(keys) -> list:
    """The keys (a `*` stands for a variable part) without a row in docs/metrics.md."""
    import fnmatch
    with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
        rows = [line.split("|")[1] for line in f if line.startswith("| `")]
    documented = [k for cell in rows for k in re.findall(r"`([^`]+)`", cell)]
    return sorted(k for k in set(keys) if k != "step" and not any(
        fnmatch.fnmatchcase(k, d) or fnmatch.fnmatchcase(d, k) for d in documented))


def project_sources() -> list:
    """Every Python file of the project, its packages' too (tasks/, feedback/, objectives/), less
    the tests, the benches and vLLM's plugins."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        top = os.path.relpath(folder, ROOT).split(os.sep)[0]
        subfolders[:] = [s for s in subfolders if not s.startswith((".", "__"))]
        if top not in ("tests", "bench", "vllm_plugins", "runs"):
            found += [os.path.join(folder, name) for name in files if name.endswith(".py")]
    return sorted(found)


def test_every_metric_the_code_names_is_documented():
    """Each key a module logs (a string literal in a metric namespace; an f-string's fields as `*`)
    has its row in docs/metrics.md; the end-to-end runs check what they logged the same way."""
    names = "|".join(METRIC_NAMESPACES)
    keys = set()
    sources = project_sources()
    assert {"objectives/sdpo.py", "tasks/quiz.py", "feedback/__init__.py"} <= {os.path.relpath(p, ROOT) for p in sources}
    for path in sources:
        with open(path) as f:
            source = f.read()
        keys |= set(re.findall(rf'(?<!\w)"((?:{names})/[\w@.]+)"', source))
        keys |= {re.sub(r"\{[^}]*\}", "*", k) for k in re.findall(rf'f"((?:{names})/[\w@.{{}} +*]+)"', source)}
    assert len(keys) > 80  # the scan finds them
    assert undocumented_metrics(keys) == []


def test_algo_flag_and_nested_flags():
    cfg = run.parse_config(["--algo", "hybrid", "--algo.lam=0.25", "--sdpo.add_tail=false",
                            "--data.strops_max_ops=3", "--train.micro_batch", "4", "--eval_only=True"])
    assert (cfg.algo.name, cfg.algo.lam, cfg.sdpo.add_tail) == ("hybrid", 0.25, False)
    assert (cfg.data.strops_max_ops, cfg.train.micro_batch, cfg.eval_only) == (3, 4, True)
    with pytest.raises(data.FlagError, match="invalid choice 'ppo' for argument '--algo'"):
        run.parse_config(["--algo=ppo"])


# ----------------------------------------------------------------------------------------
# teacher


def _policy(tiny_dir, seed=None):
    policy = load_policy(tiny_dir, run.Config(), 1, CPU)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return policy


def test_ema_moves_teacher_by_exactly_rate_times_difference(tiny_dir):
    policy, copy = _policy(tiny_dir, seed=1), _policy(tiny_dir)
    before = [p.detach().clone() for p in copy.parameters()]
    teacher = Teacher("ema", 0.05, copy)
    assert not teacher.update(policy, stepped=False)  # no optimizer step: no move
    for p, b in zip(copy.parameters(), before):
        assert torch.equal(p, b)
    assert teacher.update(policy, stepped=True)
    moved = 0
    for p, b, s in zip(copy.parameters(), before, policy.parameters()):
        torch.testing.assert_close(p - b, 0.05 * (s.detach() - b), rtol=0, atol=1e-7)
        moved += int((p != b).any())
    assert moved == len(before)


def test_frozen_teacher_never_moves_and_live_needs_no_copy(tiny_dir):
    policy, copy = _policy(tiny_dir, seed=2), _policy(tiny_dir)
    before = [p.detach().clone() for p in copy.parameters()]
    frozen = Teacher("frozen", 0.05, copy)
    assert frozen.rate == 0.0 and not frozen.update(policy, stepped=True)
    assert all(torch.equal(p, b) for p, b in zip(copy.parameters(), before))
    Teacher("live", 0.0)
    with pytest.raises(ValueError):
        Teacher("ema", 0.05)


# ----------------------------------------------------------------------------------------
# the loss of a batch


def _rollouts(tokenizer, algo, n_prompts=3, n=4, seed=0, no_success=False):
    """Canned rollouts with uneven lengths, as prepare_rollouts would leave them."""
    fields = {"sdpo": sdpo_objective.Fields, "hybrid": hybrid.Fields}.get(algo, grpo.Fields)
    g = torch.Generator().manual_seed(seed)
    rows = data.task_rows("strops", "train", n_prompts, seed=seed)
    out = []
    for row in rows:
        prompt = data.chat_prompt_ids(tokenizer, row["messages"])
        for j in range(n):
            length = int(torch.randint(2, 12, (1,), generator=g))
            response = torch.randint(3, len(tokenizer), (length,), generator=g).tolist()
            reward = 0.0 if no_success else float(j == 0)
            r = microbatch.Rollout(row=row, prompt_ids=prompt, response_ids=response,
                            rollout_logprobs=(-torch.rand(length, generator=g) * 5).tolist(),
                            text="", truncated=False, reward=reward, fields=fields())
            r.fields.advantage = float(torch.randn(1, generator=g))  # drawn for every objective: the same rollouts
            out.append(r)
    if algo in ("sdpo", "hybrid"):
        import sdpo
        fb = [] if no_success else ["Wrong Answer: input abc expected cba"] * len(out)
        tb = sdpo.build_teacher_batch(tokenizer, [r.row for r in out], [r.response_ids for r in out],
                                      [tokenizer.decode(r.response_ids) for r in out], [r.reward for r in out],
                                      fb or [""] * len(out), sdpo.SdpoConfig(include_environment_feedback=True))
        for r, ids, m in zip(out, tb.input_ids, tb.mask):
            r.fields.teacher_ids, r.fields.sdpo_mask = ids, float(m)
    return out


class GradRecorder:
    """Stands in for the optimizer: keeps the gradient of each step instead of stepping."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def step(self):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


class NoSchedule:
    def step(self):
        pass

    def get_last_lr(self):
        return [0.0]


def _update(cfg, trainer, rollouts, pad_id, objective=None, step=0):
    """run.update_policy on one process; returns (metrics, stepped)."""
    return run.update_policy(cfg, objective or OBJECTIVES[cfg.algo.name], trainer, rollouts, step, pad_id, ONE_PROCESS)


def _grads(tiny_dir, tokenizer, algo, micro_batch, mini_batches=1, teacher_kind="ema", token_budget=0,
           share_prompt_prefix=True, **sdpo_flags):
    cfg = run.parse_config([f"--algo={algo}", f"--train.micro_batch={micro_batch}",
                            f"--train.micro_batch_tokens={token_budget}", f"--train.share_prompt_prefix={share_prompt_prefix}",
                            f"--train.mini_batches={mini_batches}", f"--sdpo.teacher={teacher_kind}",
                            "--sdpo.topk=8", "--sdpo.chunk_size=7"] + [f"--sdpo.{k}={v}" for k, v in sdpo_flags.items()])
    torch.manual_seed(0)
    policy = _policy(tiny_dir, seed=3)
    teacher = Teacher(teacher_kind, cfg.sdpo.teacher_rate, _policy(tiny_dir) if teacher_kind != "live" else None)
    recorder = GradRecorder(policy)
    rollouts = _rollouts(tokenizer, algo)
    metrics, _ = _update(cfg, run.Trainer(Models(policy, teacher=teacher), recorder, NoSchedule()), rollouts,
                         tokenizer.pad_token_id)
    return recorder.grads, metrics


@pytest.mark.parametrize("algo,flags", [("sdpo", {}), ("sdpo", {"chunked": False, "alpha": 1.0}),
                                        ("sdpo", {"distill": "token"}), ("sdpo", {"loss_agg": "seq_mean_token_mean"}),
                                        ("grpo", {}), ("gspo", {}), ("hybrid", {})])
def test_micro_batch_size_does_not_change_gradients(tiny_dir, tokenizer, algo, flags):
    one, metrics_one = _grads(tiny_dir, tokenizer, algo, 1, **flags)
    four, metrics_four = _grads(tiny_dir, tokenizer, algo, 4, **flags)
    assert len(one) == len(four) == 1
    total = sum(g.abs().sum() for g in one[0].values())
    assert total > 0  # the loss reaches the weights
    for name in one[0]:
        torch.testing.assert_close(one[0][name], four[0][name], rtol=1e-4, atol=1e-7, msg=name)
    assert metrics_one.keys() == metrics_four.keys()
    for key in (k for k in metrics_one if not k.startswith("time/")):
        assert metrics_one[key] == pytest.approx(metrics_four[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("algo", ["sdpo", "grpo"])
def test_a_token_budget_packs_by_length_without_changing_gradients(tiny_dir, tokenizer, algo):
    """Micro-batches filled shortest first up to 250 padded tokens (3 of these ~75-token
    sequences, so 4 micro-batches of 12 sequences, in another order) give one sequence at a time's gradient."""
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in _rollouts(tokenizer, algo)]
    micro = rank_micro_batches([[i] for i in range(len(lengths))], 12, run.Dist(0, 1, CPU), lengths, 250)
    assert len(micro) == 4 and all(len(m) * max(lengths[i] for i in m) <= 250 for m in micro)
    assert [lengths[i] for m in micro for i in m] == sorted(lengths)
    one, metrics_one = _grads(tiny_dir, tokenizer, algo, 1)
    packed, metrics_packed = _grads(tiny_dir, tokenizer, algo, 12, token_budget=250)
    for name in one[0]:
        torch.testing.assert_close(one[0][name], packed[0][name], rtol=1e-4, atol=1e-7, msg=name)
    for key in (k for k in metrics_one if not k.startswith("time/")):
        assert metrics_one[key] == pytest.approx(metrics_packed[key], rel=1e-4, abs=1e-7), key


def test_shared_prefix_forward_matches_the_plain_forward(tiny_dir):
    """Each distinct prompt run once with its KV cache reused gives every sequence the same
    hidden states at its response positions as running the sequences one by one."""
    model = CausalLM(_policy(tiny_dir, seed=1).hf.eval())
    g = torch.Generator().manual_seed(0)
    long, short = torch.randint(5, 1000, (30,), generator=g).tolist(), torch.randint(5, 1000, (7,), generator=g).tolist()
    seqs, lens = [], []
    for prompt in (long, short, long, long, [9], short):  # shared, distinct, and a one-token prompt
        r = int(torch.randint(1, 6, (1,), generator=g))
        seqs.append(prompt + torch.randint(5, 1000, (r,), generator=g).tolist())
        lens.append(r)
    packed = packing.pack_shared_prefix(seqs, lens, 0, CPU)
    assert packed.prefix[-1][0].shape[0] == 3  # three distinct prompts, each run once
    identity = lambda hidden, weight: hidden
    with torch.no_grad():
        shared = model(packed, identity)
        one_by_one = torch.cat([model(packing.pack([s], [r], 0, CPU), identity) for s, r in zip(seqs, lens)])
    assert shared.shape == (sum(lens), model.hf.config.hidden_size)
    torch.testing.assert_close(shared, one_by_one, rtol=1e-4, atol=1e-5)


def test_grouped_prompts_run_their_common_part_once_and_match_the_plain_forward(tiny_dir):
    """With group keys (SDPO's teacher prompts: a question, then each sample's demonstration
    and feedback), a group's distinct prompts run their common part once, then each its rest
    after it; every sequence's hidden states are those of running it alone."""
    model = CausalLM(_policy(tiny_dir, seed=1).hf.eval())
    g = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(5, 1000, (n,), generator=g).tolist()
    question, other, demo = tokens(20), tokens(9), tokens(6)
    prompts = [(question + demo + tokens(3), "a"), (question + demo + tokens(11), "a"), (question + tokens(2), "a"),
               (other, "b"), (other, "b"), (other + tokens(4), "b"), ([7], "c")]
    seqs, lens, groups = [], [], []
    for prompt, group in prompts + prompts[:2]:  # the first two prompts again: shared whole
        r = int(torch.randint(1, 6, (1,), generator=g))
        seqs.append(prompt + tokens(r))
        lens.append(r)
        groups.append(group)
    packed = packing.pack_shared_prefix(seqs, lens, 0, CPU, groups=groups)
    (stem_ids, stem_mask, _), (rest_ids, _, _) = packed.prefix
    assert stem_ids.shape[0] == 3 and rest_ids.shape[0] == 6  # a stem per group; each distinct prompt's rest once
    # the question; "b": its shorter prefix (8 tokens) less the token its rest keeps; "c": none
    assert stem_mask.sum(1).tolist() == [20, 7, 0]
    identity = lambda hidden, weight: hidden
    with torch.no_grad():
        shared = model(packed, identity)
        one_by_one = torch.cat([model(packing.pack([s], [r], 0, CPU), identity) for s, r in zip(seqs, lens)])
    torch.testing.assert_close(shared, one_by_one, rtol=1e-4, atol=1e-5)


def test_old_logprobs_with_shared_prompts_match_the_plain_forward(tiny_dir, tokenizer):
    """A group's prompt run once for its samples (--train.share_prompt_prefix) gives the same
    per-token log-probs as each sequence alone, in micro-batches that split a group."""
    policy = _policy(tiny_dir, seed=1)
    rollouts = _rollouts(tokenizer, "grpo")
    shared, plain = (microbatch.response_logprobs(policy, rollouts, tokenizer.pad_token_id, run.Dist(0, 1, CPU), 5,
                                                  0.7, shared_prefix=share) for share in (True, False))
    assert [len(s) for s in shared] == [len(r.response_ids) for r in rollouts]
    torch.testing.assert_close(torch.tensor(sum(shared, [])), torch.tensor(sum(plain, [])), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algo", ["grpo", "sdpo", "hybrid"])
def test_a_shared_prompt_in_the_gradient_forward_gives_the_same_gradients(tiny_dir, tokenizer, algo):
    """The gradient forward runs a prompt several of its micro-batch's samples share once
    (--train.share_prompt_prefix); its KV cache takes the gradient of every sequence that
    reads it, so the gradient is that of each sequence run in full."""
    rollouts = _rollouts(tokenizer, algo)
    packed = microbatch.micro_batch(None, rollouts[:8], {}, tokenizer.pad_token_id, CPU, None, 1, shared_prefix=True).packed
    assert packed.prefix[-1][0].shape[0] < 8  # the 8 samples share prompts: fewer prefix rows than sequences
    shared, metrics_shared = _grads(tiny_dir, tokenizer, algo, 8)
    plain, metrics_plain = _grads(tiny_dir, tokenizer, algo, 8, share_prompt_prefix=False)
    assert sum(g.abs().sum() for g in plain[0].values()) > 0
    for name in plain[0]:
        torch.testing.assert_close(shared[0][name], plain[0][name], rtol=1e-4, atol=1e-7, msg=name)
    for key in (k for k in metrics_plain if not k.startswith("time/")):
        assert metrics_shared[key] == pytest.approx(metrics_plain[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("teacher_kind", ["ema", "trust-region"])
def test_shared_teacher_prefix_gives_the_same_gradients(tiny_dir, tokenizer, teacher_kind):
    shared, metrics_shared = _grads(tiny_dir, tokenizer, "sdpo", 4, teacher_kind=teacher_kind)
    plain, metrics_plain = _grads(tiny_dir, tokenizer, "sdpo", 4, teacher_kind=teacher_kind, share_teacher_prefix=False)
    assert metrics_shared["sdpo/divergence"] > 0
    assert metrics_shared["sdpo/divergence"] == pytest.approx(metrics_plain["sdpo/divergence"], rel=1e-4)
    for name in plain[0]:
        torch.testing.assert_close(shared[0][name], plain[0][name], rtol=1e-4, atol=1e-7, msg=name)


def test_a_statistic_nothing_counted_towards_is_not_logged():
    """(sum, count) statistics become means; one whose count is 0 (a teacher gap of right
    answers in a step without one) is left out rather than logged as 0; maxima stay maxima."""
    stats = {}
    for part in ({"a": (3.0, 2.0), "gap": (0.0, 0.0), "ratio_max": 1.5}, {"a": (1.0, 2.0), "ratio_max": 4.0}):
        add_stats(stats, part)
    out = reduce_stats(stats, [0.5, 1.5], 1)
    assert out == {"actor/loss": 1.0, "a": 1.0, "ratio_max": 4.0}


def test_rank_shares_are_contiguous_and_cover_everything():
    items = list(range(11))
    shares = [rank_share(items, r, 3) for r in range(3)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert [rank_share([1], r, 2) for r in range(2)] == [[1], []]


def test_mini_batches_take_several_optimizer_steps(tiny_dir, tokenizer):
    grads, metrics = _grads(tiny_dir, tokenizer, "sdpo", 4, mini_batches=3)
    assert len(grads) == 3 and metrics["actor/skipped_steps"] == 0


@pytest.mark.parametrize("algo", ["sdpo", "hybrid"])
def test_the_eos_diagnostic_is_the_teachers_log_prob_of_stopping_minus_the_students(tiny_dir, tokenizer, algo):
    """sdpo/teacher_minus_student_logprob_eos, against each model's own forward: at the last token
    of every answer that ended (a truncated one has no EOS) and has a teacher context."""
    cfg = run.parse_config([f"--algo={algo}", "--sdpo.topk=8"])
    policy, teacher_model = _policy(tiny_dir, seed=1), _policy(tiny_dir, seed=2)
    rollouts = _rollouts(tokenizer, algo)
    rollouts[1].truncated = True
    mb = microbatch.micro_batch(None, rollouts, step_counts(rollouts, OBJECTIVES[algo]), tokenizer.pad_token_id,
                                CPU, None, 1)
    _, stats = OBJECTIVES[algo].loss(mb, Models(policy, teacher=Teacher("ema", 0.05, teacher_model)), cfg)

    def last_token_logprob(model, ids):
        with torch.no_grad():
            logits = model.hf(input_ids=torch.tensor([ids])).logits[0, -2].float()
        return torch.log_softmax(logits, -1)[ids[-1]].item()
    gaps = [last_token_logprob(teacher_model, r.fields.teacher_ids) - last_token_logprob(policy, r.prompt_ids + r.response_ids)
            for r in rollouts if r.fields.sdpo_mask > 0 and not r.truncated]
    assert 0 < len(gaps) < sum(r.fields.sdpo_mask > 0 for r in rollouts)
    total, count = stats["sdpo/teacher_minus_student_logprob_eos"]
    assert count == len(gaps) and total == pytest.approx(sum(gaps), abs=1e-4)


def test_the_demonstration_diagnostic_splits_right_and_wrong_samples(tiny_dir, tokenizer):
    """sdpo/teacher_minus_student_logprob_demo_right / _demo_wrong, against each model's own
    forward: the teacher-minus-student log-prob summed over every response token of the samples
    whose teacher context is a demonstration, split by the sample's own success."""
    cfg = run.parse_config(["--algo=sdpo", "--sdpo.topk=8"])
    policy, teacher_model = _policy(tiny_dir, seed=1), _policy(tiny_dir, seed=2)
    rollouts = _rollouts(tokenizer, "sdpo")
    for i, r in enumerate(rollouts):
        r.reward = float(i % 4 in (0, 1))  # two successes a group: each demonstrates for the other
        r.text, r.feedback = tokenizer.decode(r.response_ids), "Wrong Answer: input abc expected cba"
    sdpo_objective.prepare_teacher_contexts(rollouts, tokenizer, cfg)
    mb = microbatch.micro_batch(None, rollouts, step_counts(rollouts, OBJECTIVES["sdpo"]), tokenizer.pad_token_id,
                                CPU, None, 1)
    _, stats = OBJECTIVES["sdpo"].loss(mb, Models(policy, teacher=Teacher("ema", 0.05, teacher_model)), cfg)

    def response_logprobs(model, ids, length):
        with torch.no_grad():
            logits = model.hf(input_ids=torch.tensor([ids])).logits[0, -length - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[-length:])[:, None]).squeeze(1)
    for name, right in (("demo_right", True), ("demo_wrong", False)):
        chosen = [r for r in rollouts if r.fields.teacher_context == "demonstration" and (r.reward >= 0.5) == right]
        gaps = [response_logprobs(teacher_model, r.fields.teacher_ids, len(r.response_ids))
                - response_logprobs(policy, r.prompt_ids + r.response_ids, len(r.response_ids)) for r in chosen]
        total, count = stats[f"sdpo/teacher_minus_student_logprob_{name}"]
        assert len(chosen) == 6 and count == sum(len(g) for g in gaps)
        assert total == pytest.approx(sum(g.sum().item() for g in gaps), abs=1e-4)
    both = [stats[f"sdpo/teacher_minus_student_logprob_{k}"] for k in ("demo_right", "demo_wrong", "demo")]
    assert both[0][1] + both[1][1] == both[2][1] and both[0][0] + both[1][0] == pytest.approx(both[2][0], abs=1e-4)


def test_seq_mean_token_mean_is_the_mean_over_every_sample_of_its_token_mean(tiny_dir, tokenizer):
    """--sdpo.loss_agg=seq_mean_token_mean, by hand: each sample's token mean of the per-token loss
    (the token_mean loss of that sample alone), summed over the samples with a teacher context and
    divided by all the step's samples, the 4 without a context counting 0 (lasgroup/SDPO's and
    TRL's aggregation); computed in two micro-batches with the step's counts."""
    flags = ["--algo=sdpo", "--sdpo.topk=8"]
    token_cfg, seq_cfg = run.parse_config(flags), run.parse_config(flags + ["--sdpo.loss_agg=seq_mean_token_mean"])
    models = Models(_policy(tiny_dir, seed=1), teacher=Teacher("ema", 0.05, _policy(tiny_dir, seed=2)))
    rollouts = _rollouts(tokenizer, "sdpo")
    for r in rollouts[:4]:  # the first prompt's samples: no teacher context
        r.fields.sdpo_mask = 0.0
    pad = tokenizer.pad_token_id

    def loss(part, cfg, counts):
        with torch.no_grad():
            return sdpo_objective.sdpo_loss(microbatch.micro_batch(None, part, counts, pad, CPU, None, 1), models, cfg)[0].item()
    means = [loss([r], token_cfg, step_counts([r], OBJECTIVES["sdpo"])) for r in rollouts if r.fields.sdpo_mask > 0]
    counts = step_counts(rollouts, OBJECTIVES["sdpo"])
    got = loss(rollouts[:5], seq_cfg, counts) + loss(rollouts[5:], seq_cfg, counts)
    assert got == pytest.approx(sum(means) / len(rollouts), rel=1e-5)
    assert abs(got - sum(means) / len(means)) > 1e-3 * abs(got)  # not over the distilled samples only
    assert abs(got - loss(rollouts, token_cfg, counts)) > 1e-3 * abs(got)  # nor token_mean


def test_seq_mean_token_mean_refuses_a_flag_that_changes_its_count():
    for clash in ("--train.mask_truncated=True", "--algo.loss_agg_mode=token-mean"):
        with pytest.raises(data.FlagError, match=f"--sdpo.loss_agg=seq_mean_token_mean .* {clash.split('=')[0]}"):
            run.parse_config(["--algo=sdpo", "--sdpo.loss_agg=seq_mean_token_mean", clash])


def test_no_success_and_no_feedback_gives_zero_sdpo_loss(tiny_dir, tokenizer):
    cfg = run.parse_config(["--algo=sdpo", "--sdpo.topk=8"])
    policy = _policy(tiny_dir)
    teacher = Teacher("ema", 0.05, _policy(tiny_dir))
    rollouts = _rollouts(tokenizer, "sdpo", no_success=True)
    assert all(r.fields.sdpo_mask == 0.0 for r in rollouts)
    counts = step_counts(rollouts, OBJECTIVES["sdpo"])
    assert counts["tokens"] == 0 and counts["sequences"] == 0
    mb = microbatch.micro_batch(None, rollouts, counts, tokenizer.pad_token_id, CPU, None, 1)
    loss, stats = sdpo_objective.sdpo_loss(mb, Models(policy, teacher=teacher), cfg)
    assert torch.isfinite(loss) and loss.item() == 0.0
    loss.backward()
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and g.abs().max() == 0 for g in grads)


@pytest.mark.parametrize("algo", ["sdpo", "grpo", "hybrid"])
def test_a_batch_with_nothing_to_learn_runs_no_forward(tiny_dir, tokenizer, algo):
    """Known before any forward (no teacher context; every group tied): the old log-probs and
    every micro-batch are skipped, not computed and then found to give a zero gradient."""
    cfg = run.parse_config([f"--algo={algo}", "--sdpo.topk=8", "--train.mini_batches=2"])
    policy = _policy(tiny_dir)
    teacher = Teacher("ema", 0.5, _policy(tiny_dir)) if algo in ("sdpo", "hybrid") else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    trainer = run.Trainer(Models(policy, teacher=teacher), optimizer,
                          torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    rollouts = _rollouts(tokenizer, algo, no_success=True)
    for r in rollouts:
        r.fields.advantage = 0.0  # every group tied
    forwards = []
    policy.register_forward_hook(lambda module, args, out: forwards.append(1))
    metrics, stepped = _update(cfg, trainer, rollouts, tokenizer.pad_token_id)
    assert not stepped and metrics["actor/skipped_steps"] == 2 and forwards == []
    if algo != "sdpo":  # one sample that can move the weights: its optimizer step runs
        rollouts[0].fields.advantage = 0.5
        metrics, stepped = _update(cfg, trainer, rollouts, tokenizer.pad_token_id)
        assert forwards and stepped and metrics["actor/skipped_steps"] == 1


@pytest.mark.parametrize("algo", ["sdpo", "grpo"])
def test_a_batch_with_nothing_to_learn_takes_no_optimizer_step(tiny_dir, tokenizer, algo):
    """No teacher context (SDPO) or all rewards tied (GRPO): AdamW must not move the weights
    (its weight decay and momentum would, with a zero gradient) and the EMA must not follow."""
    cfg = run.parse_config([f"--algo={algo}", "--sdpo.topk=8", "--optim.weight_decay=0.1", "--train.mini_batches=2"])
    policy, copy = _policy(tiny_dir, seed=4), _policy(tiny_dir)
    teacher = Teacher("ema", 0.5, copy) if algo == "sdpo" else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.1)
    trainer = run.Trainer(Models(policy, teacher=teacher), optimizer,
                          torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    rollouts = _rollouts(tokenizer, algo, no_success=True)
    for r in rollouts:
        r.fields.advantage = 0.0  # every group tied
    before = [p.detach().clone() for p in policy.parameters()]
    teacher_before = [p.detach().clone() for p in copy.parameters()]
    metrics, stepped = _update(cfg, trainer, rollouts, tokenizer.pad_token_id)
    if teacher is not None:
        teacher.update(policy, stepped)
    assert not stepped and metrics["actor/skipped_steps"] == 2
    assert all(torch.equal(p, b) for p, b in zip(policy.parameters(), before))
    assert all(torch.equal(p, b) for p, b in zip(copy.parameters(), teacher_before))


def test_nonfinite_losses_skip_steps_then_stop(tiny_dir, tokenizer):
    import dataclasses
    cfg = run.parse_config(["--algo=grpo", "--train.max_nonfinite_steps=2", "--train.mini_batches=1"])
    policy = _policy(tiny_dir)
    recorder = GradRecorder(policy)
    real = OBJECTIVES["grpo"].loss
    nan_objective = dataclasses.replace(OBJECTIVES["grpo"], loss=lambda *a: (lambda l, s: (l * float("nan"), s))(*real(*a)))
    rollouts = _rollouts(tokenizer, "grpo")
    trainer = run.Trainer(Models(policy), recorder, NoSchedule())
    _, stepped = _update(cfg, trainer, rollouts, tokenizer.pad_token_id, objective=nan_objective)
    assert not stepped and recorder.grads == [] and trainer.nonfinite_streak == 1
    with pytest.raises(FloatingPointError, match="not finite for 2 optimizer steps"):
        _update(cfg, trainer, rollouts, tokenizer.pad_token_id, objective=nan_objective, step=1)


# ----------------------------------------------------------------------------------------
# scoring: a reward function that raises fails its rollouts, not the run


class CannedEngine:
    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts, n, temperature, max_tokens, seed, images=None):
        out = []
        for p in prompts:
            samples = []
            for j in range(n):
                text = self.texts[j % len(self.texts)]
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                samples.append(Sample(p, ids, [-1.0] * len(ids), text, False))
            out.append(samples)
        return out


def test_raising_reward_function_fails_the_rollout_not_the_run(tokenizer, tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "def reward(response, row, truncated):\n"
        "    if 'boom' in response:\n"
        "        raise KeyError('no such field')\n"
        "    return {'score': 1.0, 'feedback': 'fine'}\n")
    cfg = run.parse_config([f"--data.reward={tmp_path / 'my_reward.py'}:reward"])
    rows = data.task_rows("strops", "train", 2)
    rollouts = run.generate_and_score(CannedEngine(tokenizer, ["Program: reverse", "boom"]), tokenizer, rows, cfg,
                                      seed=0, n=2, temperature=1.0)
    assert [r.reward for r in rollouts] == [1.0, 0.0, 1.0, 0.0]
    assert rollouts[0].feedback == "fine" and rollouts[0].reward_error == ""
    assert "KeyError" in rollouts[1].reward_error and "my_reward.py" in rollouts[1].reward_error
    assert rollouts[1].feedback == ""


def test_a_step_whose_every_reward_raised_stops_the_run_naming_the_reward_and_a_row(tokenizer, tmp_path):
    (tmp_path / "broken.py").write_text("def reward(response, row, truncated):\n    return row['difficulty']\n")
    cfg = run.parse_config([f"--data.reward={tmp_path / 'broken.py'}:reward", "--rollout.n=2"])
    rows = data.task_rows("strops", "train", 2)
    with pytest.raises(data.UserError, match=r"step 4: all 4 rewards raised.*broken.py:reward.*"
                                             r"strops, train.*KeyError: 'difficulty'"):
        run.prepare_rollouts(CannedEngine(tokenizer, ["a", "b"]), tokenizer, rows, cfg, OBJECTIVES["sdpo"], 3)


def test_code_reward_refuses_a_weak_sandbox_unless_accepted(tmp_path, monkeypatch, capsys):
    from feedback.code import sandbox
    monkeypatch.setattr(sandbox, "_isolation", sandbox.Isolation(None, False, ("no bubblewrap here (test)",)))
    monkeypatch.setattr(sandbox, "_weak_accepted", False)
    monkeypatch.setattr(sandbox, "_announced", False)
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"prompt": "Add.", "tests": [{"input": "1 2", "output": "3"}]}) + "\n")
    with pytest.raises(sandbox.SandboxUnavailable, match=r"(?s)no bubblewrap here \(test\).*allow_weak_sandbox"):
        run.load_data(run.parse_config([f"--data.task={path}", "--data.reward=code"]))
    with pytest.warns(RuntimeWarning, match="weak code sandbox"):
        rows, _ = run.load_data(run.parse_config([f"--data.task={path}", f"--data.eval_path={path}",  # one row: no split
                                                  "--data.reward=code", "--data.allow_weak_sandbox=True"]))
    assert rows[0]["reward"] == "code" and "WARNING: weak code sandbox" in capsys.readouterr().err


def test_prepare_rollouts_scores_advantages_and_teacher_contexts(tokenizer):
    cfg = run.parse_config(["--algo=hybrid", "--rollout.n=3"])  # hybrid: both advantages and teacher contexts
    rows = data.task_rows("strops", "train", 2)
    # the first sample solves nothing, the second is the reference of whichever row
    engine = CannedEngine(tokenizer, ["Program: nonsense", rows[0]["reference"], "Program: reverse"])
    rollouts, metrics = run.prepare_rollouts(engine, tokenizer, rows, cfg, OBJECTIVES["hybrid"], 0)
    assert len(rollouts) == 6
    # row 0: only its reference passes; row 1: nothing does (row 0's reference is a wrong program there)
    assert [r.reward for r in rollouts] == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert rollouts[0].feedback  # strops feedback names a failing case
    # Dr. GRPO: reward minus the group's mean, not divided by its std
    assert [r.fields.advantage for r in rollouts] == pytest.approx([-1 / 3, 2 / 3, -1 / 3, 0, 0, 0], abs=1e-6)
    # row 0's failures are shown its success; the success has no other to see (not itself); row 1's
    # samples are shown their own feedback
    assert [r.fields.sdpo_mask for r in rollouts] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert [r.fields.teacher_context for r in rollouts] == ["demonstration", "", "demonstration"] + ["feedback"] * 3
    for r in rollouts:
        assert r.fields.teacher_ids[-len(r.response_ids):] == r.response_ids
    teacher_prompt = lambda r: tokenizer.decode(r.fields.teacher_ids[:-len(r.response_ids)])
    assert rows[0]["reference"] in teacher_prompt(rollouts[0]) and rollouts[0].feedback not in teacher_prompt(rollouts[0])
    assert rows[0]["reference"] not in teacher_prompt(rollouts[1])
    assert rollouts[4].feedback.strip() in teacher_prompt(rollouts[4])
    assert metrics["sdpo/teacher_coverage"] == pytest.approx(5 / 6)
    assert metrics["sdpo/feedback_used"] == pytest.approx(3 / 6)
    # --algo.norm_adv_by_std: divided by the group's unbiased std, sqrt(1/3) for (0, 1, 0)
    cfg = run.parse_config(["--algo=hybrid", "--rollout.n=3", "--algo.norm_adv_by_std=True"])
    rollouts, _ = run.prepare_rollouts(engine, tokenizer, rows, cfg, OBJECTIVES["hybrid"], 0)
    std = (1 / 3) ** 0.5
    assert [r.fields.advantage for r in rollouts] == pytest.approx([-1 / 3 / std, 2 / 3 / std, -1 / 3 / std, 0, 0, 0],
                                                            abs=1e-5)
    assert metrics["reward/success_rate"] == pytest.approx(sum(r.reward >= 0.5 for r in rollouts) / 6)
    # --sdpo.distill_successes=False: the success, shown its own answer, would be distilled; routed it
    # is not (its hybrid advantage is GRPO's alone), and nothing else changes
    flags = ["--algo=hybrid", "--rollout.n=3", "--sdpo.dont_reprompt_on_self_success=False"]
    shown, _ = run.prepare_rollouts(engine, tokenizer, rows, run.parse_config(flags), OBJECTIVES["hybrid"], 0)
    routed, _ = run.prepare_rollouts(engine, tokenizer, rows, run.parse_config(flags + ["--sdpo.distill_successes=False"]),
                                     OBJECTIVES["hybrid"], 0)
    assert [r.fields.sdpo_mask for r in shown] == [1.0] * 6
    assert [r.fields.sdpo_mask for r in routed] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert [r.fields.teacher_context for r in routed] == ["demonstration", "", "demonstration"] + ["feedback"] * 3
    assert [r.fields.advantage for r in routed] == [r.fields.advantage for r in shown]
    assert [r.fields.teacher_ids for i, r in enumerate(routed) if i != 1] == [r.fields.teacher_ids for i, r in enumerate(shown) if i != 1]


def test_samples_log_holds_one_sample_per_prompt_with_reward_and_feedback(tokenizer, tmp_path):
    cfg = run.parse_config(["--algo=sdpo", "--rollout.n=3", "--log.samples_per_step=2", f"--log.out_dir={tmp_path}",
                            "--log.wandb_mode=disabled"])
    rows = data.task_rows("strops", "train", 3)
    rollouts = run.generate_and_score(CannedEngine(tokenizer, ["Program: nonsense", rows[0]["reference"]]), tokenizer,
                                      rows, cfg, seed=0, n=3, temperature=1.0)
    logger = run.Logger(cfg, 0)
    logger.log_samples(1, rollouts)
    logger.log_samples(2, rollouts)
    logger.close()
    with open(tmp_path / "samples.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [(r["step"], r["uid"]) for r in records] == [(s, row["uid"]) for s in (1, 2) for row in rows[:2]]
    assert records[0]["prompt"] == rows[0]["messages"][-1]["content"] and records[0]["response"] == "Program: nonsense"
    assert records[0]["reward"] == 0.0 and "Format Error" in records[0]["feedback"] and not records[0]["truncated"]


def test_the_samples_table_takes_prompts_with_pictures():
    from logger import samples_table
    row = data.task_rows("shapes", "train", 1)[0]
    text_row = data.task_rows("strops", "train", 1)[0]
    records = [{"step": 1, "prompt": r["messages"][-1]["content"], "response": "Answer: 2", "reward": 0.0}
               for r in (row, text_row)]
    table = samples_table(records)
    question = row["messages"][-1]["content"][1]["text"]
    assert table.data[0][1] == f"<image>{question}" and table.data[1][1] == text_row["messages"][-1]["content"]


def test_a_teacher_flatter_than_its_student_is_warned_once(tmp_path, capsys):
    cfg = run.parse_config([f"--log.out_dir={tmp_path}", "--log.wandb_mode=disabled"])
    logger = run.Logger(cfg, 0)
    logger.log(1, {FLAT_TEACHER_METRIC: FLAT_TEACHER_NATS - 0.01})  # one step just below: quiet
    assert "WARNING" not in capsys.readouterr().err
    logger.log(2, {FLAT_TEACHER_METRIC: 0.2})
    logger.log(3, {FLAT_TEACHER_METRIC: 0.3})
    logger.close()
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and f"step 2: {FLAT_TEACHER_METRIC}=+0.200" in err


def test_a_slightly_flatter_teacher_is_warned_when_it_stays_so(tmp_path, capsys):
    """The quiz near its ceiling: +0.003..+0.035 at every step, and SDPO lost 8 points."""
    cfg = run.parse_config([f"--log.out_dir={tmp_path}", "--log.wandb_mode=disabled"])
    logger = run.Logger(cfg, 0)
    # the default strops job's steps: all negative, one close to 0; then a window whose mean is -0.002
    for step, gap in enumerate([-0.129, -0.009, -0.04, -0.069, -0.1, 0.03, 0.03, 0.03, -0.07, -0.03], start=1):
        logger.log(step, {FLAT_TEACHER_METRIC: gap})
    assert "WARNING" not in capsys.readouterr().err
    for step, gap in enumerate([0.022, 0.026, 0.026, 0.023, 0.02, 0.03], start=11):
        logger.log(step, {FLAT_TEACHER_METRIC: gap})
    logger.close()
    err = capsys.readouterr().err
    # steps 10-14 (-0.03 and four positive steps) average +0.013: the first window above 0
    assert err.count("WARNING") == 1 and "step 14:" in err and "average over the last 5 steps" in err


def test_a_teacher_whose_right_minus_wrong_is_within_noise_of_0_is_warned(tmp_path, capsys):
    """Per-step values the runs logged: the default strops job and SmolLM2-135M's SDPO at the
    pretrained preset, where SDPO lost 7.4 points (bench/real_model.py --algos sdpo_demo); the
    warning reads right minus wrong against its standard error over 5 steps, not either side's sign."""
    cfg = run.parse_config([f"--log.out_dir={tmp_path}", "--log.wandb_mode=disabled"])
    logger = run.Logger(cfg, 0)
    # the default job: right answers about unchanged, wrong ones lowered ~0.5 nats
    default_job = [(-0.033, -0.549), (0.056, -0.579), (0.005, -0.608), (0.278, -0.543), (-0.036, -0.654),
                   (-0.254, -0.668), (-0.046, -0.546)]
    for step, (right, wrong) in enumerate(default_job, start=1):
        logger.log(step, {DEMO_RIGHT: right, DEMO_WRONG: wrong})
    # a teacher that lowers right answers a lot, and wrong ones more, every step: it tells them apart
    for step in range(8, 14):
        logger.log(step, {DEMO_RIGHT: -0.5 - 0.01 * step, DEMO_WRONG: -0.9})
    assert "WARNING" not in capsys.readouterr().err
    logger.close()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert RIGHT_MINUS_WRONG in records[0] and f"{RIGHT_MINUS_WRONG}_stderr" not in records[0]  # one step: no SE
    window = [r - w for r, w in default_job[2:7]]  # steps 3-7
    mean = sum(window) / 5
    assert records[6][RIGHT_MINUS_WRONG] == pytest.approx(mean)
    assert records[6][f"{RIGHT_MINUS_WRONG}_stderr"] == pytest.approx(
        (sum((d - mean) ** 2 for d in window) / 4 / 5) ** 0.5)
    # SmolLM2: steps 5 and 8 had no right sample shown a demonstration (no value logged)
    smollm2 = [(-0.219, -0.159), (-0.235, -0.232), (-0.137, -0.172), (-0.015, -0.322), (None, -0.226),
               (-0.219, -0.188), (-0.223, -0.168), (None, -0.149), (-0.134, -0.147)]
    logger = run.Logger(run.parse_config([f"--log.out_dir={tmp_path / 'smollm2'}", "--log.wandb_mode=disabled"]), 0)
    for step, (right, wrong) in enumerate(smollm2, start=1):
        logger.log(step, {DEMO_WRONG: wrong} if right is None else {DEMO_RIGHT: right, DEMO_WRONG: wrong})
    logger.close()
    err = capsys.readouterr().err
    # steps 1-4 and 6: right minus wrong -0.060, -0.003, +0.035, +0.307, -0.031: +0.050 ± 0.066
    assert err.count("WARNING") == 1 and "WARNING step 6:" in err and "=+0.050 ± 0.066 nats" in err
    # a teacher that raises right and wrong answers alike tells them apart no better: warned too
    logger = run.Logger(run.parse_config([f"--log.out_dir={tmp_path / 'alike'}", "--log.wandb_mode=disabled"]), 0)
    for step, right in enumerate([0.21, 0.19, 0.22, 0.18, 0.2], start=1):
        logger.log(step, {DEMO_RIGHT: right, DEMO_WRONG: 0.2})
    logger.close()
    assert "WARNING step 5:" in capsys.readouterr().err


def test_a_resumed_logger_takes_its_windows_back_from_the_records_it_keeps(tmp_path):
    """A run resumed from step 3 logs steps 4-6 as the uninterrupted run does: the windows over
    the last steps (right minus wrong and its SE, the flat-teacher gap) start from steps 1-3's
    records. Seen to fail without the replay in Logger.truncate (step 4's SE missing)."""
    steps = [{DEMO_RIGHT: 0.1 * s, DEMO_WRONG: -0.05 * s * s, FLAT_TEACHER_METRIC: 0.01 * s} for s in range(1, 7)]

    def logged(out, steps_run, resume_from=None):
        logger = run.Logger(run.parse_config([f"--log.out_dir={out}", "--log.wandb_mode=disabled"]), 0)
        if resume_from is not None:
            logger.truncate(resume_from)
        for step in steps_run:
            logger.log(step, steps[step - 1])
        logger.close()
        return [json.loads(line) for line in open(out / "metrics.jsonl")]

    whole = logged(tmp_path / "whole", range(1, 7))
    assert f"{RIGHT_MINUS_WRONG}_stderr" in whole[3]
    logged(tmp_path / "killed", range(1, 6))  # killed after step 5, its last checkpoint at step 3
    assert logged(tmp_path / "killed", range(4, 7), resume_from=3) == whole


def test_data_file_split_is_announced_and_an_empty_split_is_an_error(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(40)))
    cfg = run.parse_config([f"--data.task={path}", "--data.reward=math", "--data.heldout_percent=20"])
    train_rows, held_out = run.load_data(cfg, announce=True)
    assert len(train_rows) + len(held_out) == 40 and held_out
    assert not {r["uid"] for r in train_rows} & {r["uid"] for r in held_out}
    message = capsys.readouterr().err
    assert f"{len(train_rows)} train, {len(held_out)} held out" in message and "--data.eval_path" in message
    with pytest.raises(data.DataError, match="split into 40 train and 0 held out"):
        run.load_data(run.parse_config([f"--data.task={path}", "--data.reward=math", "--data.heldout_percent=0"]))


def test_lr_factor_warms_up_then_stays_or_decays_to_zero():
    flat = run.parse_config(["--optim.warmup_steps=4", "--train.steps=10", "--train.mini_batches=2"])
    assert [lr_factor(flat, s) for s in (0, 1, 3, 19)] == [0.25, 0.5, 1.0, 1.0]
    linear = run.parse_config(["--optim.warmup_steps=4", "--train.steps=10", "--train.mini_batches=2",
                               "--optim.decay=linear"])
    # 20 optimizer steps: warmup times (1 - s/20); the last step (s = 19) runs at 1/20 of the lr
    expected = [0.25 * 1.0, 0.5 * 0.95, 1.0 * 0.85, 1.0 * 0.5, 1.0 * 0.05]
    assert [lr_factor(linear, s) for s in (0, 1, 3, 10, 19)] == pytest.approx(expected)


def test_success_stderr_is_the_spread_of_per_row_success():
    """eval/success_stderr: the rows are the independent draws (a row's k samples are not)."""
    cfg = run.parse_config([])
    rollout = lambda reward: microbatch.Rollout(row={}, prompt_ids=[], response_ids=[], rollout_logprobs=[], text="",
                                         truncated=False, reward=reward)
    success_stderr = lambda rollouts, k: stderr(row_success(rollouts, k, cfg))
    # three rows of k=2 samples: per-row success 1, 0.5, 0 -> mean 0.5, sample std 0.5, stderr 0.5 / sqrt(3)
    rollouts = [rollout(r) for r in (1.0, 1.0, 0.0, 1.0, 0.0, 0.0)]
    assert success_stderr(rollouts, 2) == pytest.approx(0.5 / 3 ** 0.5)
    # the same six samples read as six rows of one: std sqrt(0.3), stderr sqrt(0.3 / 6)
    assert success_stderr(rollouts, 1) == pytest.approx((0.3 / 6) ** 0.5)
    assert success_stderr(rollouts[:2], 2) != success_stderr(rollouts[:2], 2)  # one row: nan


def test_paired_gain_is_the_mean_row_difference_with_its_own_standard_error():
    """Hand-worked: rows of very different difficulty, each a little better after; the
    paired standard error is that of the differences, far below the two evaluations' own."""
    import statistics
    before, after = [0.0, 0.25, 0.75, 1.0, 0.5], [0.25, 0.25, 1.0, 1.0, 0.75]
    gain, gain_stderr = paired_gain(after, before)
    assert gain == pytest.approx(0.15)  # (0.25 + 0 + 0.25 + 0 + 0.25) / 5
    assert gain_stderr == pytest.approx(statistics.stdev([0.25, 0, 0.25, 0, 0.25]) / 5 ** 0.5)
    assert gain_stderr < 0.5 * stderr(before) and gain_stderr < 0.5 * stderr(after)


def test_evaluation_samples_with_the_eval_seed_whatever_the_training_seed(tiny_dir, tokenizer, tmp_path,
                                                                          monkeypatch):
    """Runs of several training seeds evaluate the same rows with the same sampling seed, so
    their step-0 evaluations agree and a bench's seed spread is what training did."""
    seeds = []

    class SeedRecorder:
        def generate(self, prompts, n, temperature, max_tokens, seed, images=None):
            seeds.append(seed)
            return [[Sample(p, [tokenizer.eos_token_id], [-1.0], "", False)] * n for p in prompts]

        def close(self):
            pass

    monkeypatch.setattr(run, "start_engine", lambda *args, **kwargs: SeedRecorder())
    for train_seed in (0, 3):
        cfg = run.parse_config([f"--train.seed={train_seed}", "--train.steps=0", "--data.eval_rows=4",
                                "--rollout.eval_seed=11", f"--log.out_dir={tmp_path / str(train_seed)}",
                                "--log.wandb_mode=disabled", "--log.progress=False"])
        run.train(cfg, tiny_dir, ONE_PROCESS)
    assert seeds == [11, 11]


def test_a_run_pairs_its_gains_with_an_earlier_runs_step0_evaluation(tiny_dir, tokenizer, tmp_path, monkeypatch):
    """--train.eval_baseline: the step-0 evaluation written to eval_rows.jsonl by one run stands
    for the next run's (no generation for it; the same step-0 metrics logged), and a baseline of
    other rows or other sampling is refused naming what differs."""
    calls = []

    class RowEngine:  # every answer "0"
        def generate(self, prompts, n, temperature, max_tokens, seed, images=None):
            calls.append(len(prompts))
            return [[Sample(p, tokenizer.encode("0") + [tokenizer.eos_token_id], [-1.0, -1.0], "", False)] * n
                    for p in prompts]

        def close(self):
            pass

    monkeypatch.setattr(run, "start_engine", lambda *args, **kwargs: RowEngine())
    flags = ["--train.steps=0", "--data.eval_rows=6", "--rollout.eval_k=2",
             "--log.wandb_mode=disabled", "--log.progress=False"]
    first = tmp_path / "first"
    run.train(run.parse_config(flags + [f"--log.out_dir={first}"]), tiny_dir, ONE_PROCESS)
    [record] = [json.loads(line) for line in open(first / "eval_rows.jsonl")]
    assert record["step"] == 0 and len(record["success"]) == len(record["uids"]) == 6 and record["eval_k"] == 2
    assert calls == [6]
    second = tmp_path / "second"
    run.train(run.parse_config(flags + [f"--log.out_dir={second}", f"--train.eval_baseline={first}"]), tiny_dir,
              ONE_PROCESS)
    assert calls == [6]  # nothing generated for the second run's step 0
    assert _metrics(second)[0] == _metrics(first)[0]
    assert [json.loads(line) for line in open(second / "eval_rows.jsonl")] == [record]  # a baseline for the next
    for changed, field in (("--rollout.eval_k=3", "eval_k"), ("--rollout.eval_temperature=1.0", "eval_temperature"),
                           ("--data.eval_rows=5", "uids")):
        cfg = run.parse_config(flags + [changed, f"--log.out_dir={tmp_path / field}",
                                        f"--train.eval_baseline={first / 'eval_rows.jsonl'}"])
        with pytest.raises(ValueError, match=f"evaluated {field}="):
            run.train(cfg, tiny_dir, ONE_PROCESS)
    assert calls == [6]


# ----------------------------------------------------------------------------------------
# real runs (a vLLM engine; tens of seconds each)

REQUIRED_KEYS = ["reward/mean", "reward/success_rate", "rollout/mismatch_kl", "is/ratio_mean", "is/ratio_max",
                 "actor/entropy", "actor/grad_norm", "response/length_mean", "response/truncated_frac",
                 "sync/seconds", "sync/probe_max_abs_diff", "sync/reloads", "sync/megabytes", "time/rollout_s",
                 "time/teacher_s", "time/train_s", "time/step_s", "throughput/tokens_per_s", "eval/success_rate"]
SMALL = ["--train.warm_start_steps=0", "--train.steps=2", "--train.prompts_per_step=4", "--rollout.n=4",
         "--rollout.max_tokens=12", "--data.eval_rows=4", "--rollout.eval_k=2", "--train.eval_every=2",
         "--log.wandb_mode=disabled", "--log.progress=False", "--sdpo.topk=16"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _run(args, nproc=1, timeout=420, cwd=ROOT):
    """run.py, or under torchrun run.py's cli with every collective held to a GPU node's process
    group (tests/collectives.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "run.py")] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_free_port()}",
         os.path.join(ROOT, "tests", "collectives.py")]
    proc = subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


WALL_CLOCK = ("time/", "throughput/", "sync/seconds")  # figures of the clock, which no two runs share
CONSOLE_NOISE = ("reduce_op", "NUMA binding", "OMP_NUM_THREADS=", "Failed to load weights", "LD_PRELOAD", "INFO",
                 "force killing", "doesn't include CPU backend", "leaked shared_memory")


def check_two_rank_run(proc, out):
    """What every two-rank SDPO run must show (tests/test_vlm.py runs it, on the picture task,
    with uneven mini- and micro-batches): no engine message that means nothing to a user
    (docs/loop.md), every documented key a researcher watches, each sync proven by the probe,
    a gradient at each step, and a final model that loads."""
    for noise in CONSOLE_NOISE:
        assert noise not in proc.stdout + proc.stderr, noise
    steps = [r for r in _metrics(out) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for key in REQUIRED_KEYS + ["sdpo/teacher_coverage", "sdpo/divergence"]:
        assert key in steps[-1], key
    for r in steps:
        assert r["sync/probe_max_abs_diff"] < 1e-3  # the engine holds the trained weights
        assert r["actor/grad_norm"] > 0  # an untrained model solves little, but SDPO has feedback
    return steps


# the figures of a step's batch: the same rollouts give them exactly
OF_THE_BATCH = ("reward/", "response/", "async/", "eval/", "sdpo/groups_", "sdpo/samples_", "sdpo/success_",
                "sdpo/feedback_", "sdpo/teacher_coverage", "sync/megabytes", "sync/reloads", "actor/lr",
                "actor/skipped_steps")
# the engine against the trainer: rounding, which the two runs need not share; or, in a run that
# generates ahead, rounding plus the update made since the batch's weights, which they must
ENGINE_AGAINST_TRAINER = ("rollout/mismatch_kl", "sync/probe_max_abs_diff")


def check_agrees_with_one_rank(two, one, steps, exact=OF_THE_BATCH):
    """The steps up to `steps` of a two-rank run against the one-rank run of the same flags and seed.
    Rank 0's engine generates every batch from the same weights and seeds (generating ahead,
    batch 2 too comes from the start's weights), so the figures of the batches are equal, and
    the update's (losses, entropies, divergences, IS ratios, gradient norms) equal to float
    rounding: FSDP2 sums over two ranks in another order (exact: the keys' prefixes compared to
    the bit). Returns the compared steps."""
    two, one = ([r for r in records if r["step"] <= steps] for records in (two, one))
    assert [r["step"] for r in two] == [r["step"] for r in one] and two[-1]["step"] == steps
    for a, b in zip(two, one):
        keys = {k for k in a.keys() | b.keys() if not k.startswith(WALL_CLOCK)}
        assert keys == {k for k in b if not k.startswith(WALL_CLOCK)}, a["step"]
        for key in keys:
            if key.startswith(tuple(exact)):
                assert a[key] == b[key], (a["step"], key)
            elif key in ENGINE_AGAINST_TRAINER:
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), (a["step"], key)
            else:
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-7), (a["step"], key)
    assert any(r["actor/grad_norm"] > 0 for r in two[1:])
    return two


@pytest.mark.slow
@pytest.mark.extended  # resume equality of a synchronous run; test_faults' kill -9 and Ctrl-C resume async ones
def test_single_process_run_with_checkpoint_and_resume(tmp_path):
    """In-process engine; trust-region teacher and two mini-batches (old log-probs pass);
    a checkpoint after step 1 resumes to the same step-2 batch."""
    out = str(tmp_path / "a")
    args = SMALL + ["--algo=sdpo", "--sdpo.teacher=trust-region", "--train.mini_batches=2", "--train.save_every=1",
                    "--train.eval_every=0"]
    _run(args + [f"--log.out_dir={out}"])
    first = _metrics(out)
    assert [r["step"] for r in first] == [1, 2]
    assert os.path.isdir(os.path.join(out, "checkpoint-1"))
    resumed = str(tmp_path / "b")
    _run(args + [f"--log.out_dir={resumed}", f"--train.resume={os.path.join(out, 'checkpoint-1')}"])
    second = _metrics(resumed)
    assert [r["step"] for r in second] == [2]
    # same weights, optimizer state and teacher, same prompts and sampling seed: the same step 2,
    # every figure but the wall-clock ones, and the same final weights
    compared = {k: v for k, v in first[1].items() if not k.startswith(WALL_CLOCK)}
    assert {k: second[0].get(k) for k in compared} == compared
    assert second[0]["actor/grad_norm"] > 0
    from safetensors.torch import load_file
    whole, resumed_weights = (load_file(os.path.join(d, "final", "model.safetensors")) for d in (out, resumed))
    for name, tensor in whole.items():
        assert torch.equal(tensor, resumed_weights[name]), name


def test_test_time_self_distillation_screens_trains_each_hard_prompt_alone_and_counts_discoveries(
        tokenizer, tmp_path, monkeypatch):
    """--ttt_prompts, with a scripted engine (the loop's pieces faked, the bookkeeping real):
    held-out prompts solved in eval_k screening samples are left out; each hard one gets a
    fresh trainer from the initial weights, best-of-k draws train.steps x n samples, and SDPO
    steps run until a first success; discovery@k counts the prompts solved within k."""
    reward = tmp_path / "yes.py"
    reward.write_text("def reward(response, row, truncated):\n    return float(response.strip() == 'yes')\n")
    cfg = run.parse_config(["--algo=sdpo", "--ttt_prompts=2", "--train.steps=3", "--rollout.n=2", "--rollout.eval_k=2",
                            f"--data.reward={reward}:reward"])
    rows = data.task_rows("strops", "test", 4)
    script = [  # each generate call: the answers of each of its prompts
        [["yes", "no"], ["no", "no"], ["no", "yes"], ["no", "no"]],  # screening: rows 1 and 3 are hard
        [["no", "no", "no", "no", "yes", "no"]],  # row 1, best-of-6: found at 5
        [["no", "no"]], [["no", "yes"]],  # row 1, SDPO steps: a success in step 2's second sample (4)
        [["no"] * 6],  # row 3, best-of-6: none
        [["no", "no"]], [["no", "no"]], [["no", "no"]],  # row 3: none in 3 steps
    ]
    asked = []

    class ScriptedEngine:
        def generate(self, prompts, n, temperature, max_tokens, seed, images=None):
            answers = script[len(asked)]
            asked.append((len(prompts), n))
            assert [len(a) for a in answers] == [n] * len(prompts)
            ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            return [[Sample(p, ids(t), [-1.0] * len(ids(t)), t, False) for t in texts] for p, texts in zip(prompts, answers)]

    class Log:
        records = []

        def log(self, step, metrics):
            self.records.append((step, metrics))
    calls = {"build_trainer": 0, "learn": []}

    def build_trainer(*args):
        import types
        calls["build_trainer"] += 1
        return types.SimpleNamespace(models=Models(policy=None))
    monkeypatch.setattr(run, "build_trainer", build_trainer)
    monkeypatch.setattr(run, "sync_engine", lambda *args, version: {"sync/probe_max_abs_diff": 0.0, "version": version})
    monkeypatch.setattr(run, "learn", lambda cfg, objective, trainer, engine, tokenizer, rollouts, step, d:
                        calls["learn"].append((rollouts[0].row["uid"], step)) or {})
    logger = Log()
    summary = run.test_time_self_distillation(cfg, OBJECTIVES["sdpo"], "model", ScriptedEngine(), tokenizer, rows,
                                              logger, ONE_PROCESS)
    assert asked == [(4, 2), (1, 6), (1, 2), (1, 2), (1, 6), (1, 2), (1, 2), (1, 2)]
    assert calls["build_trainer"] == 2  # each hard prompt from the initial weights
    assert calls["learn"] == [(rows[1]["uid"], 0), (rows[3]["uid"], 0), (rows[3]["uid"], 1), (rows[3]["uid"], 2)]
    assert [(step, m["ttt/prompt"], m["ttt/discovered_at"], m["best_of_k/discovered_at"])
            for step, m in logger.records[:-1]] == [(1, 0, 4, 5), (2, 1, -1, -1)]
    assert logger.records[-1] == (3, summary)
    assert summary == {"ttt/prompts": 2, "ttt/discovery@2": 0.0, "ttt/discovery@4": 0.5, "ttt/discovery@6": 0.5,
                       "best_of_k/discovery@2": 0.0, "best_of_k/discovery@4": 0.0, "best_of_k/discovery@6": 0.5}


@pytest.mark.slow
@pytest.mark.extended
def test_test_time_self_distillation_mode(tmp_path):
    """--ttt_prompts: held-out prompts the model fails in eval_k samples, each trained on
    alone from the initial weights; discovery@k agrees with the per-prompt records."""
    reward = tmp_path / "coin.py"
    reward.write_text("def reward(response, row, truncated):\n    return float(len(response) % 2 == 1)\n")
    out = str(tmp_path / "ttt")
    _run(SMALL + ["--ttt_prompts=3", "--train.steps=2", "--rollout.n=4", "--data.eval_rows=12",
                  f"--data.reward={reward}:reward", f"--log.out_dir={out}"])
    records = _metrics(out)
    per_prompt, summary = records[:-1], records[-1]
    assert 1 <= summary["ttt/prompts"] == len(per_prompt) <= 3
    for kind in ("ttt", "best_of_k"):
        found = [r[f"{kind}/discovered_at"] for r in per_prompt]
        assert all(f == -1 or 1 <= f <= 8 for f in found)
        for k in (4, 8):
            assert summary[f"{kind}/discovery@{k}"] == sum(0 < f <= k for f in found) / len(found)
    assert all(r["sync/probe_max_abs_diff"] < 1e-3 for r in per_prompt)


class CopyingEngine:
    """Answers with the demonstration when its prompt shows one, else with a wrong program."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    def generate(self, prompts, n, temperature, max_tokens, seed, images=None):
        out = []
        for p in prompts:
            self.prompts.append(self.tokenizer.decode(p))
            shown = self.prompts[-1].split("Correct solution:\n\n")
            text = shown[1].split("\n")[0] if len(shown) > 1 else "Program: nonsense"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append([Sample(p, ids, [-1.0] * len(ids), text, False) for _ in range(n)])
        return out


def test_teacher_gap_scores_the_model_shown_a_demonstration_and_feedback(tokenizer):
    cfg = run.parse_config(["--rollout.eval_k=2"])
    rows = data.task_rows("strops", "test", 5)
    engine = CopyingEngine(tokenizer)
    gap = teacher_gap(engine, tokenizer, rows, cfg)
    assert gap["eval/success_rate_with_demonstration"] == 1.0 and gap["eval/rows_with_demonstration"] == 5
    assert gap["eval/success_rate_with_feedback"] == 0.0 and gap["eval/rows_with_feedback"] == 5
    demo_prompts, feedback_prompts = engine.prompts[:5], engine.prompts[5:]
    assert all(row["reference"] in p and "Correctly solve the original question." in p
               for row, p in zip(rows, demo_prompts))
    assert all("feedback from your unsuccessful earlier attempt" in p and "Expected:" in p for p in feedback_prompts)


def test_teacher_gap_warns_where_a_context_adds_nothing_or_is_flatter():
    """The measured cases (docs/results.md): the default quiz warns of nothing; near its ceiling both
    contexts score below the bare student; SmolLM2's feedback teacher is worse and flatter."""
    default_quiz = {"eval/success_rate": 0.387, "eval/success_stderr": 0.03, "eval/success_rate_with_demonstration": 0.994,
                    "eval/success_rate_with_feedback": 0.658, "eval/teacher_minus_student_entropy": -0.070}
    assert teacher_gap_warnings(default_quiz) == []
    near_ceiling = {"eval/success_rate": 0.879, "eval/success_stderr": 0.02, "eval/success_rate_with_demonstration": 0.676,
                    "eval/success_rate_with_feedback": 0.795, "eval/teacher_minus_student_entropy": 0.021}
    got = teacher_gap_warnings(near_ceiling)
    assert len(got) == 3 and "shown a demonstration solves 67.6%" in got[0] and "bare student's 87.9%" in got[0]
    assert "shown a feedback solves 79.5%" in got[1] and "+0.021 nats" in got[2]
    # within two standard errors above the bare student is no better than it
    within = dict(default_quiz, **{"eval/success_rate_with_feedback": 0.387 + 0.059})
    assert len(teacher_gap_warnings(within)) == 1
    assert teacher_gap_warnings(dict(within, **{"eval/success_rate_with_feedback": 0.387 + 0.061})) == []
    assert teacher_gap_warnings({"eval/success_rate": 0.3}) == []  # no --teacher_gap: nothing to judge


def test_right_minus_wrong_is_the_difference_of_the_per_sample_means_with_its_standard_error():
    got = right_minus_wrong([0.1, 0.3], [-0.2, 0.0, -0.1])
    assert got["eval/teacher_gap_right_minus_wrong"] == pytest.approx(0.3)
    # the sample variances 0.02 and 0.01, over 2 and 3 samples
    assert got["eval/teacher_gap_right_minus_wrong_stderr"] == pytest.approx((0.02 / 2 + 0.01 / 3) ** 0.5)
    assert right_minus_wrong([0.1], [0.0, 0.2]) == {}  # one right sample: no standard error


def test_teacher_gap_warns_where_the_teacher_likes_right_and_wrong_answers_alike():
    """Not the sign: a teacher below the student on both kinds, right well above wrong, is fine;
    right minus wrong within two standard errors of 0, or below, warns."""
    base = {"eval/success_rate": 0.3, "eval/success_stderr": 0.02}
    apart = {"eval/teacher_gap_right_minus_wrong": 0.30, "eval/teacher_gap_right_minus_wrong_stderr": 0.05}
    assert teacher_gap_warnings({**base, **apart}) == []
    for gap in (0.09, -0.2):
        got = teacher_gap_warnings({**base, **apart, "eval/teacher_gap_right_minus_wrong": gap})
        assert len(got) == 1 and f"eval/teacher_gap_right_minus_wrong={gap:+.3f} ± 0.050" in got[0]


def test_eval_only_teacher_gap_prints_its_warnings_and_logs_the_gap(tiny_dir, tokenizer, tmp_path, capsys):
    """The engine copies a shown demonstration and otherwise fails: the feedback context adds
    nothing (0% against the bare 0%), which --eval_only --teacher_gap says on stderr."""
    cfg = run.parse_config([f"--log.out_dir={tmp_path}", "--log.wandb_mode=disabled", "--rollout.eval_k=2",
                            "--rollout.n=2", "--eval_only=True", "--teacher_gap=True"])
    logger = run.Logger(cfg, 0)
    got = run.evaluate_only(cfg, tiny_dir, CopyingEngine(tokenizer), tokenizer, data.task_rows("strops", "test", 4),
                            logger, ONE_PROCESS)
    logger.close()
    assert (got["eval/success_rate"], got["eval/success_rate_with_demonstration"]) == (0.0, 1.0)
    err = capsys.readouterr().err
    assert "WARNING: the model shown a feedback solves 0.0%" in err and "shown a demonstration" not in err
    with open(tmp_path / "metrics.jsonl") as f:
        assert json.loads(f.readline())["eval/success_rate_with_feedback"] == 0.0


def test_context_entropies_match_a_plain_forward(tiny_dir, tokenizer):
    """Student and teacher entropies and log-probs on the model's samples, against the HF
    model's full logits at each response position, computed here sequence by sequence."""
    cfg = run.parse_config(["--algo=sdpo", "--rollout.n=3", "--rollout.temperature=0.7", "--train.micro_batch=2"])
    rows = data.task_rows("strops", "train", 2)
    engine = CannedEngine(tokenizer, ["Program: nonsense", rows[0]["reference"], "Program: reverse | upper"])
    got = context_entropies(engine, tokenizer, rows, cfg, tiny_dir, CPU)

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    def scores(prompt, response):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1] / 0.7
        logp = logits.log_softmax(-1)
        return logp.gather(-1, torch.tensor(response)[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    rollouts = run.generate_and_score(engine, tokenizer, rows, cfg, 0, 3, 0.7)
    import sdpo
    tb = sdpo.build_teacher_batch(tokenizer, [r.row for r in rollouts], [r.response_ids for r in rollouts],
                                  [r.text for r in rollouts], [r.reward for r in rollouts],
                                  [r.feedback for r in rollouts], cfg.sdpo)
    kinds = {"demonstration": [], "feedback": []}
    for r, ids, m, j in zip(rollouts, tb.input_ids, tb.mask, tb.demo_index):
        if m:
            kinds["demonstration" if j is not None else "feedback"].append(
                (scores(r.prompt_ids, r.response_ids), scores(ids[:-len(r.response_ids)], r.response_ids)))
    assert kinds["demonstration"] and kinds["feedback"]  # row 0 has a success, row 1 none
    student_all = torch.cat([scores(r.prompt_ids, r.response_ids)[1] for r in rollouts])
    assert got["eval/entropy_student"] == pytest.approx(student_all.mean().item(), rel=1e-4)
    for kind, pairs in kinds.items():
        cat = lambda who, what: torch.cat([p[who][what] for p in pairs])
        assert got[f"eval/entropy_student_on_{kind}"] == pytest.approx(cat(0, 1).mean().item(), rel=1e-4)
        assert got[f"eval/entropy_teacher_{kind}"] == pytest.approx(cat(1, 1).mean().item(), rel=1e-4)
        assert got[f"eval/teacher_minus_student_logprob_{kind}"] == pytest.approx(
            (cat(1, 0) - cat(0, 0)).mean().item(), rel=1e-4, abs=1e-5)
    every = [p for pairs in kinds.values() for p in pairs]
    diff = torch.cat([t[1] - s[1] for s, t in every]).mean().item()
    assert got["eval/teacher_minus_student_entropy"] == pytest.approx(diff, rel=1e-4, abs=1e-5)


WARM_START = """
import sys, torch
sys.path.insert(0, {root!r})
import run
cfg = run.parse_config(["--data.task=quiz", "--train.warm_start_steps=3", "--log.progress=False"])
print(run.resolve_model(cfg, run.Dist(0, 1, torch.device("cpu"))))
"""


@pytest.mark.slow
def test_warm_start_weights_do_not_depend_on_the_thread_count(tmp_path):
    """From an empty cache, one thread and two build the same tokenizer and tiny model, bit for
    bit, and the same warm start up to float rounding: CPU kernels may split a sum differently
    with the thread count (bit for bit on the AMD machines this was first run on; on an Intel
    Xeon 3 quiz steps differ by at most 1.4e-6 in a weight, and the data order not at all)."""
    from safetensors.torch import load_file
    dirs = []
    for threads, hash_seed in (("1", "1"), ("2", "2")):
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "RAYON_NUM_THREADS": threads,
               "PYTHONHASHSEED": hash_seed, "SDPO_CACHE": str(tmp_path / f"cache{threads}")}
        proc = subprocess.run([sys.executable, "-c", WARM_START.format(root=ROOT)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        dirs.append(proc.stdout.strip().splitlines()[-1])
    tiny = [d.split("-sft-")[0] for d in dirs]  # <cache>/tiny-<recipe>-sft-<recipe>/final
    with open(os.path.join(tiny[0], "tokenizer.json")) as a, open(os.path.join(tiny[1], "tokenizer.json")) as b:
        assert a.read() == b.read()
    one, two = (load_file(os.path.join(d, "model.safetensors")) for d in dirs)
    initial = load_file(os.path.join(tiny[0], "model.safetensors"))
    assert one.keys() == two.keys()
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    assert not all(torch.equal(one[k], initial[k]) for k in one)  # the warm start trained something


@pytest.fixture
def warm_start_calls(monkeypatch, tmp_path):
    """The configs of the warm starts resolve_model trains (training faked: each writes an
    empty final/config.json under a tiny model dir in tmp_path)."""
    calls = []

    def fake_train(cfg, model_dir, d):
        calls.append(cfg)
        os.makedirs(os.path.join(cfg.log.out_dir, "final"))
        open(os.path.join(cfg.log.out_dir, "final", "config.json"), "w").close()

    monkeypatch.setattr(run, "train", fake_train)
    monkeypatch.setattr(tiny_models, "tiny_model_dir", lambda cfg=None: str(tmp_path / "tiny"))
    return calls


def test_warm_start_is_plain_sft_and_shared_across_rl_flags(warm_start_calls):
    """The warm start ignores RL-only flags and the eval/TTT modes (a mode inherited by
    the warm start would evaluate instead of training it), and its cache key agrees."""
    calls = warm_start_calls
    first = run.resolve_model(run.parse_config(["--eval_only=True", "--ttt_prompts=4", "--optim.lr=0.5",
                                                "--train.seed=7", "--train.mini_batches=8", "--data.eval_rows=9",
                                                "--optim.eps=1e-4"]),
                              ONE_PROCESS)
    warm = calls[0]
    assert (warm.algo.name, warm.eval_only, warm.ttt_prompts) == ("sft", False, 0)
    assert (warm.optim.lr, warm.optim.eps, warm.train.seed, warm.train.mini_batches) == (2e-3, 1e-8, 0, 1)
    assert warm.train.steps == 200 and warm.train.prompts_per_step == 32
    assert run.resolve_model(run.parse_config([]), ONE_PROCESS) == first and len(calls) == 1  # cached
    run.resolve_model(run.parse_config(["--train.warm_start_lr=1e-3"]), ONE_PROCESS)
    assert len(calls) == 2  # a flag the warm start reads makes a new one


def test_a_failed_warm_start_leaves_no_cache_entry(monkeypatch, tmp_path):
    """A warm start that fails (or is stopped) part-way leaves no directory for a later run to
    take as built: the next run builds it anew."""
    built = []

    def fails_midway(cfg, model_dir, d):
        built.append(cfg.log.out_dir)
        os.makedirs(cfg.log.out_dir)
        (open(os.path.join(cfg.log.out_dir, "metrics.jsonl"), "w")).close()
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "train", fails_midway)
    monkeypatch.setattr(tiny_models, "tiny_model_dir", lambda cfg=None: str(tmp_path / "tiny"))
    with pytest.raises(KeyboardInterrupt):
        run.resolve_model(run.parse_config([]), ONE_PROCESS)
    assert built and not os.path.exists(built[0])


def test_warm_start_recipe_is_the_tasks_where_a_flag_is_unset(warm_start_calls, tmp_path):
    """Each task has its warm-start recipe; a flag overrides its one value, and the cache key
    of an unset flag is that of the flag set to the recipe's value."""
    calls = warm_start_calls
    warm = lambda train: (train.warm_start_steps, train.warm_start_demo_frac, train.warm_start_feedback_frac,
                          train.warm_start_target, train.warm_start_context_steps)
    recipe = lambda flags: warm(run.parse_config(flags).train)
    assert recipe([]) == (200, 0.7, 0.1, 0.0, 0) and recipe(["--data.task=arith"]) == (300, 0.7, 0.1, 0.0, 0)
    assert recipe(["--data.task=quiz"]) == (2000, 0.3, 0.5, 0.3, 300)
    assert recipe(["--data.task=quiz", "--train.warm_start_demo_frac=0.0"]) == (2000, 0.0, 0.5, 0.3, 300)
    quiz = run.resolve_model(run.parse_config(["--data.task=quiz"]), ONE_PROCESS)
    warm = calls[0]
    assert (warm.train.steps, warm.train.warm_start_demo_frac, warm.train.warm_start_feedback_frac,
            warm.train.warm_start_target, warm.train.warm_start_context_steps) == (2000, 0.3, 0.5, 0.3, 300)
    explicit = ["--data.task=quiz", "--train.warm_start_steps=2000", "--train.warm_start_demo_frac=0.3",
                "--train.warm_start_feedback_frac=0.5", "--train.warm_start_target=0.3",
                "--train.warm_start_context_steps=300"]
    assert run.resolve_model(run.parse_config(explicit), ONE_PROCESS) == quiz and len(calls) == 1
    run.resolve_model(run.parse_config(["--data.task=quiz", "--train.warm_start_target=0"]), ONE_PROCESS)
    assert calls[1].train.warm_start_target == 0 and len(calls) == 2  # every step: another warm start
    strops = run.resolve_model(run.parse_config(["--train.warm_start_steps=300"]), ONE_PROCESS)
    assert strops != quiz and calls[2].train.steps == 300 and len(calls) == 3
    # the feedback's wording is in the quiz's key (its warm start shows feedback), in no other task's
    values = run.resolve_model(run.parse_config(["--data.task=quiz", "--data.quiz_feedback=values"]), ONE_PROCESS)
    assert values != quiz and calls[3].data.quiz_feedback == "values" and len(calls) == 4
    assert run.resolve_model(run.parse_config(["--train.warm_start_steps=300", "--data.quiz_feedback=values"]),
                             ONE_PROCESS) == strops and len(calls) == 4
    assert run.resolve_model(run.parse_config(["--train.warm_start_steps=0"]), ONE_PROCESS) == str(tmp_path / "tiny")


def test_reference_success_is_the_probability_of_sampling_the_reference(tiny_dir, tokenizer):
    """reference_success against a slow loop over rows with the HF model: the mean of
    prod_t softmax(logits_t / T)[reference_t] at the evaluation temperature, EOS included."""
    from transformers import AutoModelForCausalLM
    cfg = run.parse_config(["--data.task=quiz", "--rollout.eval_temperature=0.6"])
    # one- and two-token references: an untrained model gives them a probability far from 0
    rows = [{**row, "reference": text} for row, text in zip(data.task_rows("quiz", "test", 3), ["1", "a:2", "="])]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    expected = []
    for row in rows:
        prompt = data.chat_prompt_ids(tokenizer, row["messages"])
        reference = tokenizer(row["reference"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + reference])).logits[0, len(prompt) - 1:-1]
        logprob = sum((logits[t] / 0.6).log_softmax(-1)[token].item() for t, token in enumerate(reference))
        expected.append(torch.tensor(logprob).exp().item())
    policy = load_policy(tiny_dir, cfg, 1, CPU)
    got = reference_success(cfg, policy, tokenizer, rows, ONE_PROCESS)
    assert 0 < got < 1 and got == pytest.approx(sum(expected) / 3, rel=1e-4)
    hotter = run.parse_config(["--data.task=quiz", "--rollout.eval_temperature=1.0"])
    assert reference_success(hotter, policy, tokenizer, rows, ONE_PROCESS) != pytest.approx(got, rel=1e-2)


def test_warm_start_stops_at_the_first_check_that_reaches_its_target(tiny_dir, tmp_path, monkeypatch):
    """An SFT run with --train.warm_start_target ends at the first check (every
    --train.warm_start_check_every steps) whose estimate reaches it, logs each estimate, and
    saves the weights of that step; the checks read held-out rows past the first 2,048."""
    estimates, seen = iter([0.10, 0.29, 0.30, 0.90]), []

    def fake_estimate(cfg, policy, tokenizer, rows, d, prompts=None):
        if prompts is None:  # the bare student's (the target's); the demonstration's is logged beside it
            seen.append(rows)
            return next(estimates)
        assert len(prompts) == len(rows) and all(len(p) > len(data.chat_prompt_ids(tokenizer, r["messages"]))
                                                  for p, r in zip(prompts, rows))
        return 1.0

    monkeypatch.setattr(warm_start, "reference_success", fake_estimate)
    out = str(tmp_path / "warm")
    cfg = run.parse_config(["--algo=sft", "--data.task=quiz", "--train.steps=20", "--train.prompts_per_step=2",
                            "--train.mini_batches=1", "--train.warm_start_target=0.3", "--train.warm_start_check_every=2",
                            "--data.train_rows=16",
                            "--log.wandb_mode=disabled", "--log.progress=False", f"--log.out_dir={out}"])
    run.train(cfg, tiny_dir, ONE_PROCESS)
    records = _metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r.get("warm_start/reference_success") for r in records] == [None, 0.10, None, 0.29, None, 0.30]
    assert [r.get("warm_start/reference_success_with_demonstration") for r in records][1::2] == [1.0] * 3
    assert os.path.exists(os.path.join(out, "final", "model.safetensors"))
    evaluated = {row["uid"] for row in data.task_rows("quiz", "test", 2048, cfg=cfg.data)}
    assert len(seen[0]) == 256 and not evaluated & {row["uid"] for row in seen[0]}
    with pytest.raises(data.FlagError, match="warm_start_target=1.5: a rate, 0 to 1"):
        run.parse_config(["--train.warm_start_target=1.5"])


def test_the_first_context_steps_show_every_prompt_as_a_teacher_context(tokenizer):
    """--train.warm_start_context_steps: before it, demonstrations and feedback in the recipe's
    proportions (0.3 : 0.5) and no bare prompt; from it on, the recipe's shares with bare prompts."""
    cfg = run.parse_config(["--data.task=quiz", "--train.warm_start_context_steps=2"])
    rows = data.task_rows("quiz", "train", 400)
    bare = lambda step: sum(r.prompt_ids == data.chat_prompt_ids(tokenizer, r.row["messages"], cfg.data.max_prompt_len)
                            for r in run.sft_rollouts(tokenizer, rows, cfg, step)) / len(rows)
    demos = lambda step: sum("Correct solution" in tokenizer.decode(r.prompt_ids)
                             for r in run.sft_rollouts(tokenizer, rows, cfg, step)) / len(rows)
    assert bare(0) == bare(1) == 0 and 0.3 < demos(1) < 0.45  # 0.375 expected
    assert 0.14 < bare(2) < 0.26 and 0.24 < demos(2) < 0.36
    # SFT on plain prompts (GAD's SeqKD baseline under the quiz recipe): no contexts, also before the step
    plain = run.parse_config(["--data.task=quiz", "--algo=sft", "--train.warm_start_demo_frac=0",
                              "--train.warm_start_feedback_frac=0"])
    assert plain.train.warm_start_context_steps == 300
    assert all(r.prompt_ids == data.chat_prompt_ids(tokenizer, r.row["messages"], plain.data.max_prompt_len)
               for r in run.sft_rollouts(tokenizer, rows[:20], plain, 0))


def test_rl_learning_rate_and_sdpo_alpha_are_the_tasks_where_the_flags_are_unset():
    lr = lambda *flags: run.parse_config(list(flags)).optim.lr
    assert lr() == lr("--data.task=arith") == lr("--data.task=arith", "--algo=grpo") == 1e-4
    # quiz: the objective's own (SDPO is the default --algo), else the task's
    assert lr("--data.task=quiz") == lr("--data.task=quiz", "--algo=sdpo") == 1.2e-4
    assert lr("--data.task=quiz", "--algo=grpo") == 6e-5 and lr("--data.task=quiz", "--algo=dpo") == 3e-5
    assert lr("--data.task=quiz", "--optim.lr=1e-4") == 1e-4 and lr("--optim.lr=2e-5") == 2e-5
    assert lr("--data.task=quiz", "--algo=grpo", "--optim.lr=2e-5") == 2e-5
    alpha = lambda *flags: run.parse_config(list(flags)).sdpo.alpha
    assert alpha() == alpha("--data.task=arith") == 0.5 and alpha("--data.task=quiz") == 1.0
    assert alpha("--data.task=quiz", "--sdpo.alpha=0.5") == 0.5 and alpha("--sdpo.alpha=0") == 0.0


def test_a_model_of_ones_own_gets_the_pretrained_preset_and_the_run_says_so(tiny_dir, tmp_path):
    """--model.path: the flags' defaults (lr 1e-6, demonstrations only), never the tiny model's 1e-4;
    a tiny model the project built keeps its task's recipe; --recipe picks one by name; a flag on
    the command line wins over any recipe."""
    import shutil
    own = tmp_path / "released-model"  # the tiny model's files under another chat template: not ours
    shutil.copytree(tiny_dir, own)
    (own / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert run.parse_config([f"--model.path={tiny_dir}", "--data.task=quiz"]).recipe == "quiz"
    tiny_dir = str(own)
    cfg = run.parse_config([f"--model.path={tiny_dir}", "--data.task=quiz"])
    assert cfg.recipe == "pretrained" and cfg.optim.lr == 1e-6 and cfg.optim.warmup_steps == 10
    assert cfg.sdpo.include_environment_feedback is False and cfg.sdpo.alpha == 0.5
    assert run.describe(cfg).startswith("recipe: pretrained (the flags' defaults") and "--optim.lr=1e-06" in run.describe(cfg)
    tiny = run.parse_config([f"--model.path={tiny_dir}", "--recipe=tiny"])
    assert (tiny.recipe, tiny.optim.lr, tiny.sdpo.include_environment_feedback) == ("tiny", 1e-4, True)
    assert run.parse_config([f"--model.path={tiny_dir}", "--recipe=quiz", "--algo=grpo"]).optim.lr == 6e-5
    assert run.parse_config(["--optim.lr=3e-6", "--recipe=quiz"]).optim.lr == 3e-6
    default = run.parse_config([])
    assert default.recipe == "strops" and default.train.warm_start_steps == 200 and default.optim.lr == 1e-4
    assert "recipe: strops (tasks/strops.py): --optim.lr=0.0001" in run.describe(default)
    with pytest.raises(ValueError, match="--recipe nothing: no such recipe"):
        run.parse_config(["--recipe=nothing"])


def test_every_recipe_sets_known_flags_only(monkeypatch):
    import flags
    import tasks
    assert {"tiny", "strops", "quiz", "shapes"} <= set(flags.recipe_names())
    for name in flags.recipe_names():
        for algo in OBJECTIVES:
            flags.apply_flags(flags.Config(), flags.recipe_flags(name, algo), name)
    monkeypatch.setattr(tasks.TASKS["quiz"], "RECIPE", {"optim.learning_rate": 1e-5})
    with pytest.raises(ValueError, match="tasks/quiz.py: no flag --optim.learning_rate"):
        run.parse_config(["--recipe=quiz"])


@pytest.mark.parametrize("flag, message", [
    ("--train.prompts_per_step=0", "--train.prompts_per_step=0: must be at least 1"),
    ("--train.steps=-5", "--train.steps=-5: must be at least 0"),
    ("--optim.lr=-0.001", "--optim.lr=-0.001: must be > 0"),
    ("--rollout.n=0", "--rollout.n=0: must be at least 1"),
    ("--rollout.max_tokens=0", "--rollout.max_tokens=0: must be at least 1"),
    ("--rollout.temperature=-1", "--rollout.temperature=-1.0: must be > 0"),
    ("--data.reward=nosuch", "unknown reward function 'nosuch'"),
    ("--train.mini_batches=200", "--train.mini_batches=200: more optimizer steps than the 16 prompts"),
    ("--train.mini_batches=200 --train.shuffle_samples=True",
     "--train.mini_batches=200: more optimizer steps than the 128 samples"),
    ("--sdpo.teacher_rate=1.5", "--sdpo.teacher_rate=1.5: a rate"),
    ("--log.samples_per_step=-1", "--log.samples_per_step=-1: must be at least 0"),  # [:-1] took all but one
    ("--data.task=shapes --data.shapes_warm_start_questions=count,size",
     "--data.shapes_warm_start_questions=count,size: unknown kinds ['size']"),
])
def test_a_bad_flag_fails_at_parsing_naming_it(flag, message):
    """Each of these failed only after the engine's start (48-68 s), or never (steps -5: "done")."""
    with pytest.raises(ValueError, match=re.escape(message)):
        run.parse_config(flag.split())


def test_a_model_path_that_is_not_a_model_fails_at_parsing(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(Exception, match=f"--model.path {tmp_path}: no config.json"):
        run.parse_config([f"--model.path={tmp_path}"])


def test_reward_kwargs_reach_the_reward_function(tmp_path):
    (tmp_path / "limits.py").write_text("def reward(response, row, truncated, budget=1):\n    return float(budget)\n")
    cfg = run.parse_config([f"--data.reward={tmp_path / 'limits.py'}:reward", '--data.reward_kwargs={"budget": 7}'])
    assert feedback.score(reward_function(cfg, {"reward": "math"}), "", {"uid": "u"}, False).score == 7.0
    with pytest.raises(ValueError, match="not a JSON object"):
        reward_function(run.parse_config(["--data.reward_kwargs={budget: 7}"]), {"reward": "math"})


def test_staleness_is_logged_for_generated_batches_only(tokenizer):
    """A reference answer (SFT, the warm start, SPIN's chosen side) has no generating weights:
    step 7 of a warm start once logged async/staleness 7. A generated one's is step - version."""
    import objectives
    rows = data.task_rows("strops", "train", 8)
    cfg = run.parse_config(["--algo=sft", "--train.prompts_per_step=4"])
    rollouts, metrics = run.Batches(cfg, objectives.OBJECTIVES["sft"], None, tokenizer, rows, ONE_PROCESS).take(7)
    assert len(rollouts) == 4 and "async/staleness" not in metrics

    class Generated(run.Batches):
        def collect(self, step, d):
            sample = dict(row={}, prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], text="", truncated=False)
            return [microbatch.Rollout(**sample, policy_version=5),  # a SPIN batch: a sample and a reference
                    microbatch.Rollout(**sample, generated=False)], {}

    cfg = run.parse_config(["--algo=grpo"])
    assert Generated(cfg, objectives.OBJECTIVES["grpo"], None, tokenizer, rows, ONE_PROCESS).take(7)[1][
        "async/staleness"] == 2
