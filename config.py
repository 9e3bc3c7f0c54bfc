"""The run's configuration: every knob is a flag (tyro), `--section.name value` or
`--section.name=value` as wandb sweep agents pass them; `python run.py --help` lists them.

The flags' defaults are the pretrained-model preset: what a run on a model you bring
(`--model.path DIR`) should start from (the comments say where each value comes from). The tiny
model the project builds needs other values: its recipe and the tasks' (README, Configuration).
"""
import dataclasses
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Annotated, Literal

import data
import feedback
import losses
import objectives
import sdpo
import tasks
import tiny_models
from data import FlagError

# The values the run prints beside its recipe's own: what decides how hard an update pushes
HEADLINE = ("optim.lr", "optim.warmup_steps", "train.mini_batches", "algo.eps_low", "algo.eps_high", "algo.kl_coef",
            "sdpo.alpha", "sdpo.topk", "sdpo.teacher_rate", "sdpo.include_environment_feedback", "rollout.max_tokens")


@dataclass
class ModelConfig:
    path: str = ""  # a local HF model directory; empty: the tiny model built from the task corpus
    tiny: tiny_models.TinyModelConfig = field(default_factory=tiny_models.TinyModelConfig)
    gradient_checkpointing: bool = False


@dataclass
class DataConfig(tasks.TaskConfig):
    task: str = "strops"  # a synthetic task (arith, strops) or a .jsonl/.parquet file
    eval_path: str = ""  # held-out file (default: the task's test split / a hash split of the file)
    fields: str = ""  # column mapping for files, e.g. prompt=question,answer=solution
    # reward function: math, strops, code, mc, quiz, shapes, module:function or path/file.py:function; empty: a
    # synthetic task's own, a data file's `reward` column (a file with neither is refused)
    reward: str = ""
    reward_kwargs: str = ""  # JSON keyword arguments of the reward function, e.g. '{"cpu_seconds": 10}' (code)
    allow_weak_sandbox: bool = False  # run model-written code even where the sandbox cannot isolate it
    # (no bubblewrap, no namespaces: README, The code sandbox); without it --data.reward code refuses
    train_rows: int = 4000  # rows drawn from a synthetic task
    # held-out rows (a synthetic task: at most this many, fewer where its split has fewer). The rows are
    # the draws: more rows, a smaller standard error of a gain (docs/results.md)
    eval_rows: int = 2048
    max_prompt_len: int = 1024


@dataclass
class RolloutConfig:
    placement: Literal["colocated", "separate"] = "colocated"
    engine_process: Literal["auto", "inprocess", "own"] = "auto"
    dtype: str = ""  # engine dtype; empty: float32 on CPU (exact sync checks), bfloat16 on GPU
    n: int = 8  # samples per prompt
    temperature: float = 1.0
    # A chat model's direct answer (no long reasoning) fits in 256, TRL's default (a truncated
    # answer scores 0: docs/results.md, the real pretrained model)
    max_tokens: int = 256
    gpu_memory_utilization: float = 0.3  # GPU memory fraction (on CPU only without kv_cache_tokens)
    kv_cache_tokens: int = 0  # on CPU: tokens the engine's KV cache holds; 0: sized from the run's batches
    max_model_len: int = 2048
    sync_tol: float = 0.0  # max |engine - trainer| probe log-prob (nats) after a sync; 0: 1e-3 for a
    # float32 engine, 1.0 for bfloat16 (docs/sync.md)
    is_correction: bool = True  # truncated IS weights for the engine-vs-trainer mismatch (and the staleness
    # of --train.off_policy_steps 1)
    is_cap: float = 2.0
    is_level: Literal["token", "sequence"] = "token"
    eval_temperature: float = 0.6
    eval_k: int = 4  # avg@k
    # The held-out evaluation's sampling seed, not --train.seed: runs of every training seed then
    # start from the same step-0 figure and differ by what training did (docs/loop.md)
    eval_seed: int = 0
    rpc_timeout_s: float = 600.0  # longest wait for a weight load into the engine
    # How a weight sync reaches an engine in its own process (sync.py, docs/sync.md): "group", a process
    # group with its workers (gloo on CPU, NCCL on GPUs), buckets in the engine's dtype; "file", one
    # safetensors file of the full state dict in /dev/shm
    sync: Literal["group", "file"] = "group"
    sync_bucket_mb: int = 512  # the group path's largest bucket (a bigger tensor travels alone)
    sync_addr: str = ""  # host:port the engine's workers reach trainer rank 0 at; empty: this machine, a free port
    # On CPU: cores the engine's worker computes on (vLLM binds one OpenMP thread to each).
    # 0: every core in the synchronous loop (the trainer waits meanwhile), half of them with
    # --train.off_policy_steps 1 (the trainer works beside it). Ignored by a GPU engine.
    cpu_threads: int = 0


@dataclass
class AlgoConfig:
    # the choices are the rows of objectives.OBJECTIVES
    name: Annotated[Literal[tuple(objectives.OBJECTIVES)],
                    __import__("tyro").conf.arg(name="algo", prefix_name=False)] = "sdpo"
    lam: float = 0.9  # hybrid: A = lam * A_grpo + (1 - lam) * A_sdpo
    norm_adv_by_std: bool = False  # GRPO's advantage divided by the group's std; off: Dr. GRPO, as in the SDPO runs
    eps_low: float = 0.2  # PPO clip
    eps_high: float = 0.2  # 0.28 for DAPO's clip-higher
    gspo_eps_low: float = 3e-4  # GSPO clips a sequence-level ratio: far narrower ranges
    gspo_eps_high: float = 4e-4
    kl_coef: float = 0.001  # GAD: weight of the KL to the initial policy (the GAD paper's: k3, 0.001)
    kl_type: Literal[tuple(k + p for k in losses.KL_KINDS for p in ("", "+"))] = "k3"  # "+": k2's gradient
    kl_in_reward: bool = False  # GAD: subtract kl_coef * the sequence's KL from the reward instead of a loss term
    loss_agg_mode: Literal["auto", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "auto"  # auto: seq-mean-token-mean for GSPO, else token-mean


@dataclass
class SdpoArgs(sdpo.SdpoConfig):
    distill: Literal["topk", "full", "token"] = "topk"
    # token_mean: the mean over the optimizer step's distilled tokens; seq_mean_token_mean: the mean
    # over all of its samples of each one's token mean, a sample without a teacher context counting 0
    # (lasgroup/SDPO's and TRL's). Which, and why the default: docs/loop.md, SDPO's aggregation
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    topk: int = 100
    add_tail: bool = True
    # 0 forward KL, 1 reverse KL, between: generalized JSD. 0.5: the paper's choice without rich
    # feedback (Table 12); reverse KL (1.0) is its choice with rich feedback (tasks/quiz.py)
    alpha: float = 0.5
    is_clip: float = 2.0
    chunked: bool = True  # top-K loss from hidden states, never materialising [tokens, vocab]
    chunk_size: int = 512
    teacher: Literal["ema", "frozen", "trust-region", "live"] = "ema"
    teacher_rate: float = 0.05
    teacher_micro_batch: int = 32
    share_teacher_prefix: bool = True  # a group's question, then each distinct teacher prompt, once (KV cache)


@dataclass
class DpoConfig:
    """Online DPO (pairs among a prompt's samples) and SPIN (the row's reference over each sample)."""
    pairs: Literal["best_worst", "all"] = "best_worst"  # per prompt: best sample over worst, or every pair
    # with a reward difference
    chosen: Literal["sample", "reference"] = "sample"  # reference: SPIN, the row's reference is always chosen
    loss_type: Literal[losses.DPO_KINDS] = "sigmoid"  # sigmoid, ipo (length-normalised log-probs), hinge, robust
    beta: float = 0.1
    label_smoothing: float = 0.0  # ε of sigmoid (conservative DPO) and robust; < 0.5
    ref_update_every: int = 0  # the reference becomes the policy every N steps (SPIN's iterations); 0: never
    reference_free: bool = False  # no reference model: the log-ratios are the policy's log-probs alone


@dataclass
class GadConfig:
    """GAD (--algo gad): the discriminator and the two stages (docs/gad.md)."""
    disc_path: str = ""  # a local HF directory for the discriminator's backbone; empty: the student's start
    # The discriminator's AdamW lr (the paper's 1e-6 is for 8B models); weight decay and betas are --optim's
    lr: float = 1e-4
    grad_clip: float = 1.0  # the discriminator's gradient-norm clip
    # the discriminator's optimizer steps on each rollout batch; the rewards and gad/d_acc are the
    # scores before the first (more steps a batch did not help on the quiz: docs/gad.md)
    disc_steps: int = 1
    # what the scalar head reads: the last real token's hidden state, or the mean of the response tokens'
    pool: Literal["last", "mean"] = "last"
    policy_loss: Literal["ppo", "gspo"] = "ppo"  # the student's clipped surrogate
    warmup_steps: int = 0  # stage 1: SFT of the student on the teacher's responses while the discriminator trains
    critic_warmup: int = 0  # then this many steps train only the discriminator
    # On a synthetic task the rows have no teacher_response: the project makes a black-box teacher,
    # the tiny model after this many SFT steps on the task's references (the student's start has
    # train.warm_start_steps), and writes its sampled text to a JSONL file (cached, docs/gad.md).
    teacher_steps: int = 1000
    # the discriminator's score has no fixed scale: GAD's advantages are divided by the group's std
    norm_adv_by_std: bool = True
    teacher_temperature: float = 0.6  # the self-made teacher's sampling temperature
    # "constant": every sample's reward is 0 (the control: the same stages, SFT warmup and KL to the start,
    # with no signal from the discriminator, which still trains and logs d_acc; docs/gad.md)
    reward: Literal["discriminator", "constant"] = "discriminator"


@dataclass
class OptimConfig:
    lr: float = 1e-6  # AdamW's peak rate; for a pretrained model 1e-6 (TRL, verl, the paper's Table 12)
    warmup_steps: int = 10  # the paper's (Table 12)
    decay: Literal["none", "linear"] = "none"  # linear: to 0 at train.steps (the warm start always decays)
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8  # AdamW's; larger damps the steps of parameters whose gradient is ~0 and noisy


@dataclass
class TrainConfig:
    steps: int = 40
    prompts_per_step: int = 16
    mini_batches: int = 4  # optimizer steps per rollout batch (paper Table 12: 1 without feedback, 32 with rich)
    # Mini-batches split the step's prompts, each with all its samples (verl's, and the paper's
    # "32 optimizer steps, mini-batch 1" of Table 12: one question's group a step); True: they
    # split single samples, shuffled across prompts (this project's layout before 2026-11-27)
    shuffle_samples: bool = False
    micro_batch: int = 32  # sequences per forward/backward on each rank
    # > 0: each rank's micro-batches are filled in order of length up to this many padded
    # tokens (sequences x the longest), micro_batch sequences at most: less padding when
    # lengths vary. The gradient is the same (the loss is normalised by the step's counts).
    micro_batch_tokens: int = 0
    # On CPU: each rank's torch threads once the engine runs. 0: the cores (divided among the
    # node's ranks) that the engine does not compute on beside it: all of them in the synchronous
    # loop, the other half with --train.off_policy_steps 1 while a generation runs (docs/async.md)
    cpu_threads: int = 0
    share_prompt_prefix: bool = True  # a prompt several rollouts of a forward share runs once (KV cache reuse)
    # True: a truncated sample (it hit --rollout.max_tokens) contributes no loss and no count to the
    # loss's normalisation in any objective; GRPO's group statistics still include it (TRL's
    # mask_truncated_completions; docs/loop.md, Truncated samples)
    mask_truncated: bool = False
    # GRPO/GSPO/DPO/SFT/GAD log-probs from hidden states this many rows of logits at a time, never
    # [tokens, vocab] (chunked_head.token_logprobs_from_hidden); 0: plain autograd on the full logits
    head_chunk_size: int = 512
    seed: int = 0
    # The tiny model's built-in SFT on the task's references (cached; the recipes set these per task)
    warm_start_steps: int = 300
    # > 0: the warm start ends early, at the first check (every warm_start_check_every steps)
    # where the bare student's held-out success, estimated without sampling
    # (warm_start.reference_success), reaches this: a step count alone lands where float rounding
    # takes it (docs/LOG.md, 2026-11-25)
    warm_start_target: float = 0.0
    warm_start_check_every: int = 10
    # The first this many warm-start steps show every prompt as a teacher context (the shares
    # above, rescaled to sum to 1): copying what a context shows forms before the facts are
    # learnt, instead of in a race with them (tasks/quiz.py)
    warm_start_context_steps: int = 0
    warm_start_batch: int = 32
    warm_start_lr: float = 2e-3
    warm_start_seed: int = 0  # one warm start serves every RL seed
    # its micro_batch_tokens: teacher contexts beside plain prompts leave much of a batch padding
    warm_start_micro_batch_tokens: int = 4096
    # Shares of warm-start examples whose prompt is a teacher context (sdpo.py's templates)
    # with the reference as the correct solution, or with a wrong attempt's feedback: they
    # teach the tiny model to use what SDPO's teacher is shown.
    warm_start_demo_frac: float = 0.7
    warm_start_feedback_frac: float = 0.1
    eval_every: int = 40  # and at the start and the end; 0: never
    # an earlier run's out_dir (its eval_rows.jsonl): its step-0 evaluation of the same model and
    # held-out rows stands for this run's, which is skipped, and the gains pair with it (sweeps)
    eval_baseline: str = ""
    # 1: the engine generates the next batch, with the weights before this update, while the
    # trainer learns from this one (one step stale; the engine correction covers it: docs/async.md)
    off_policy_steps: Literal[0, 1] = 0
    save_every: int = 0  # torch.distributed.checkpoint every N steps; 0: only the final HF model
    resume: str = ""  # a checkpoint directory written by save_every, or a run's out_dir (its latest one)
    max_nonfinite_steps: int = 3  # consecutive optimizer steps with a NaN/inf loss before stopping


@dataclass
class LogConfig:
    # empty: a new folder per run, runs/<date>-<time>-<algo>-<task> under the working directory
    # (runs/latest links to the newest; with --train.resume: the resumed run's folder). A folder
    # given here that holds an earlier run is refused unless resuming or --log.overwrite=True
    out_dir: str = ""
    overwrite: bool = False  # replace an earlier run's records in out_dir (else the run refuses to start there)
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "sdpo"
    run_name: str = ""
    progress: bool = True
    # Generated samples (prompt, response, reward, feedback) logged each step to
    # <out_dir>/samples.jsonl and to the wandb run as a table, one per prompt from the first; 0: none
    samples_per_step: int = 4


@dataclass
class Config:
    # the values on top of the flags' defaults: auto picks pretrained for a --model.path the project
    # did not build, else the task's own (tasks/<task>.py), else tiny_models.py's; a name picks one (config.recipe_name)
    recipe: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sdpo: SdpoArgs = field(default_factory=SdpoArgs)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    gad: GadConfig = field(default_factory=GadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    debug: bool = False  # a user error (a flag, a data file, a path) shows its traceback too (or SDPO_DEBUG=1)
    eval_only: bool = False  # evaluate --model.path (avg@k, length, truncation) and exit
    teacher_gap: bool = False  # with eval_only: also success with the reference as a demonstration / with feedback,
    # and teacher vs student entropy on the model's own samples (context_entropies)
    # with eval_only on image prompts: also with every picture blank (white, the same size), the
    # blind check: what the model gets from the pictures is the gap, paired row by row
    blind: bool = False
    # Test-time self-distillation (paper section 5): train on each of this many held-out prompts
    # that the initial model fails, alone, and compare discovery with best-of-k; 0: off
    ttt_prompts: int = 0


def parse_config(argv=None) -> Config:
    """Flags -> Config: the recipe's values (recipe_flags) on the flags' defaults, then the command
    line on top. Booleans take a value (--sdpo.add_tail=False), as sweep agents pass them.
    Every value is resolved here and checked (check_config) before any work starts. `--help`
    comes after the recipe is chosen, so it shows the values this run uses."""
    argv = sys.argv[1:] if argv is None else list(argv)
    argv = [re.sub(r"=(true|false)$", lambda m: "=" + m.group(1).capitalize(), a, flags=re.I) for a in argv]
    argv = ["--debug=True" if a == "--debug" else a for a in argv]
    # which model, task, objective and recipe: they choose the recipe
    asked = parse_flags(Config(), [a for a in argv if a not in ("-h", "--help")])
    name = recipe_name(asked)
    flags = recipe_flags(name, asked.algo.name)
    cfg = parse_flags(apply_flags(Config(), flags, recipe_source(name)), argv, help_text(name, flags))
    cfg.recipe = name
    check_config(cfg)
    return cfg


def parse_flags(default: Config, argv: list, description: str = "") -> Config:
    """tyro's parse of argv on default. A flag it rejects is a FlagError: the first lines of
    tyro's message (its full box with --debug or SDPO_DEBUG=1)."""
    import contextlib
    import io

    import tyro
    parse = lambda: tyro.cli(Config, args=argv, default=default, description=description or None,
                             config=(tyro.conf.FlagConversionOff,))
    if debugging(argv):
        return parse()
    box = io.StringIO()
    try:
        with contextlib.redirect_stderr(box):
            return parse()
    except SystemExit as e:
        if not e.code:  # --help: printed to stdout
            raise
        raise FlagError(tyro_error(box.getvalue())) from None


def tyro_error(box: str) -> str:
    """tyro's error box, condensed: its first paragraph and, for an unknown flag, the suggestion.
    The box is drawn with lines (a terminal) or, where rich thinks it cannot, as a title over rules."""
    frame = [line.strip().strip("│|").strip() for line in box.strip().splitlines()]
    border = lambda row: row.startswith(("╭", "╰")) or not row.strip("─-")  # a border or a rule
    groups = itertools.groupby(filter(None, frame), border)  # blank rows ignored
    paragraphs = [list(rows) for is_border, rows in groups if not is_border]
    paragraphs = paragraphs[0 if frame and frame[0].startswith("╭") else 1:]  # less the title
    if not paragraphs:
        return box.strip() or "the flags cannot be parsed"
    meant = next((p[1].split()[0] for p in paragraphs if len(p) > 1 and p[0].startswith("Perhaps you meant")), "")
    return (" ".join(paragraphs[0]) + (f"; did you mean {meant}?" if meant else "")
            + "\n(python run.py --help lists the flags)")


def debugging(argv=None) -> bool:
    """--debug on the command line or SDPO_DEBUG=1: a user error shows its traceback too."""
    argv = sys.argv[1:] if argv is None else argv
    return os.environ.get("SDPO_DEBUG", "") not in ("", "0") or any(
        re.fullmatch(r"--debug(=true|=1)?", a, flags=re.I) for a in argv)


def help_text(name: str, flags: dict) -> str:
    """`--help`'s heading: which recipe the defaults below include, and how to see another's."""
    source = "the flags' own defaults, for a pretrained model" if name == "pretrained" else \
        f"{recipe_source(name)}: " + " ".join(f"--{k}={v}" for k, v in flags.items())
    return (f"Train a causal LM with SDPO, GRPO, GSPO, the hybrid, DPO/SPIN, GAD or SFT (README). The defaults "
            f"below are this run's: recipe {name} ({source}). Other flags choose another recipe: --model.path, "
            f"--data.task, --algo, --recipe NAME (pretrained, {', '.join(recipe_names())}).")


def recipe_names() -> list[str]:
    """The recipes --recipe takes besides pretrained: the tiny model's and each task's own."""
    return sorted(["tiny", *(name for name in tasks.TASKS if tasks.recipe(name, "") is not None)])


def recipe_source(name: str) -> str:
    """Where the recipe called name is written."""
    return "tiny_models.py" if name == "tiny" else f"tasks/{name}.py"


# Checked by check_config: each whole-number flag's least value; the flags that must be > 0; rates, 0 to 1
AT_LEAST = {"train.steps": 0, "train.prompts_per_step": 1, "train.mini_batches": 1, "train.micro_batch": 1,
            "rollout.n": 1, "rollout.max_tokens": 1, "rollout.eval_k": 1, "rollout.cpu_threads": 0,
            "train.cpu_threads": 0, "data.train_rows": 1, "data.eval_rows": 1, "sdpo.topk": 1,
            "dpo.ref_update_every": 0, "gad.disc_steps": 1, "gad.warmup_steps": 0, "gad.critic_warmup": 0,
            "train.warm_start_context_steps": 0, "train.warm_start_check_every": 1, "log.samples_per_step": 0}
POSITIVE = ("optim.lr", "rollout.temperature", "rollout.eval_temperature", "dpo.beta", "gad.lr", "gad.grad_clip")
RATES = ("sdpo.teacher_rate", "train.warm_start_target")


def check_config(cfg: Config):
    """Values that would fail minutes later, after the engine's start, fail here, naming the flag."""
    c = cfg
    for name, least in AT_LEAST.items():
        if flag_value(c, name) < least:
            raise FlagError(f"--{name}={flag_value(c, name)}: must be at least {least}")
    for name in ("teacher_gap", "blind"):
        if getattr(c, name) and not c.eval_only:
            raise FlagError(f"--{name} is a measurement of --eval_only; add --eval_only")
    for name in POSITIVE:
        if not flag_value(c, name) > 0:
            raise FlagError(f"--{name}={flag_value(c, name)}: must be > 0")
    for name in RATES:
        if not 0 <= flag_value(c, name) <= 1:
            raise FlagError(f"--{name}={flag_value(c, name)}: a rate, 0 to 1")
    if not 0 <= c.dpo.label_smoothing < 0.5:
        raise FlagError(f"--dpo.label_smoothing={c.dpo.label_smoothing}: must be at least 0 and below 0.5")
    if c.dpo.reference_free and c.dpo.ref_update_every:
        raise FlagError("--dpo.reference_free has no reference to refresh: drop --dpo.ref_update_every")
    if c.sdpo.loss_agg != "token_mean" and (c.algo.loss_agg_mode != "auto" or c.train.mask_truncated):
        clash = "--algo.loss_agg_mode" if c.algo.loss_agg_mode != "auto" else "--train.mask_truncated"
        raise FlagError(f"--sdpo.loss_agg={c.sdpo.loss_agg} divides by every sample of an optimizer step, and "
                        f"{clash} changes which count: drop one of the two")
    objective = objectives.OBJECTIVES[c.algo.name]  # a unit of the split: a prompt's samples, or a sample
    single = c.train.shuffle_samples and not (objective.keep_prompts_together or objective.references)
    units = c.train.prompts_per_step * (c.rollout.n if single else 1)
    if c.train.mini_batches > units:
        raise FlagError(f"--train.mini_batches={c.train.mini_batches}: more optimizer steps than the {units} "
                         f"{'prompts' if units == c.train.prompts_per_step else 'samples'} of a step")
    tasks.check_flags(c.data)  # else a task's flag would fail only once rows are drawn
    if c.data.reward:
        try:
            feedback.get_reward_fn(c.data.reward)
        except ValueError as e:  # it names the reward
            raise FlagError(f"--data.reward: {e}") from None
    if c.model.path:
        data.check_model_dir(c.model.path)


def recipe_name(cfg: Config) -> str:
    """--recipe, or for auto: pretrained for a --model.path the project did not build (the flags'
    defaults), else the task's own (tasks/<task>.py) where it has one, else tiny. A tiny model
    passed as --model.path (a warm start the benches reuse, a run's final model) keeps its task's."""
    if cfg.recipe != "auto":
        if cfg.recipe != "pretrained" and cfg.recipe not in recipe_names():
            raise FlagError(f"--recipe {cfg.recipe}: no such recipe (known: pretrained, {', '.join(recipe_names())})")
        return cfg.recipe
    if cfg.model.path and not tiny_models.built_here(cfg.model.path):
        return "pretrained"
    return cfg.data.task if tasks.recipe(cfg.data.task, "") is not None else "tiny"


def recipe_flags(name: str, algo: str) -> dict:
    """A recipe's flag values: a task's are the tiny model's, then its RECIPE, then its
    RECIPE_BY_ALGO[algo] (tasks.recipe)."""
    if name == "pretrained":
        return {}
    if name == "tiny":
        return dict(tiny_models.RECIPE)
    return {**recipe_flags("tiny", algo), **tasks.recipe(name, algo)}


def apply_flags(cfg: Config, flags: dict, source: str) -> Config:
    """cfg with flags ({"section.name": value}) set; an unknown name is an error naming source."""
    for name, value in flags.items():
        section, _, key = name.rpartition(".")
        target = getattr(cfg, section, None) if section else cfg
        if target is None or not hasattr(target, key):
            raise FlagError(f"{source}: no flag --{name}")
        setattr(target, key, value)
    return cfg


def describe(cfg: Config) -> str:
    """The recipe and the values that decide a run's updates, as the run prints them."""
    flags = recipe_flags(cfg.recipe, cfg.algo.name)
    source = "the flags' defaults, for a pretrained model" if cfg.recipe == "pretrained" else recipe_source(cfg.recipe)
    names = list(flags) + [n for n in HEADLINE if n not in flags]
    return f"recipe: {cfg.recipe} ({source}): " + " ".join(f"--{n}={flag_value(cfg, n)}" for n in names)


def flag_value(cfg: Config, name: str):
    """The value of the flag --name ("section.key", or a top-level key)."""
    section, _, key = name.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, key)


def save_config(cfg: Config, out_dir: str):
    """<out_dir>/config.json: every resolved value, the recipe's name included."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=1)
