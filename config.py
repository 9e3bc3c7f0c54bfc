"""The run's configuration: every knob is a flag (tyro), `--section.name value` or
`--section.name=value` as wandb sweep agents pass them; `python run.py --help` lists them.

The flags' defaults are the pretrained-model preset: what a run on a model you bring
(`--model.path DIR`) should start from (the comments say where each value comes from). The tiny
model the project builds needs other values: its recipe and the tasks' (README, Configuration).

The ground floor of the house: it imports nothing of the project but errors.py. The flags a
table owns are written beside it and handed in: the tasks' difficulty flags (tasks.TaskConfig,
under --data) and the objectives' sections (objectives.Sections: --algo, --sdpo, --dpo, --gad).
flags.py puts them together into the run's Config, with the recipes and parse_config.
"""
import dataclasses
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from errors import FlagError

if TYPE_CHECKING:
    import objectives


# The tiny model the project builds (tiny_models.py) when no --model.path is given
@dataclass
class TinyModelConfig:
    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2  # head_dim 64: vLLM's CPU attention rejects smaller heads
    intermediate_size: int = 512
    max_position_embeddings: int = 2048


@dataclass
class ModelConfig:
    path: str = ""  # a local HF model directory; empty: the tiny model built from the task corpus
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    gradient_checkpointing: bool = False


@dataclass
class DataConfig:
    """The data's own flags (--data.*); the tasks' difficulty flags join them (flags.DataConfig)."""
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
    # The engine's share of each of its GPUs' memory (weights, activations, KV cache; on CPU of the
    # machine's, and only without kv_cache_tokens). 0: by placement, 0.9 separate (its GPUs alone;
    # the rest holds the weight sync's buffers), 0.3 colocated (beside the trainer)
    gpu_memory_utilization: float = 0.0
    kv_cache_tokens: int = 0  # on CPU: tokens the engine's KV cache holds; 0: sized from the run's batches
    max_model_len: int = 2048
    # GPUs the engine spreads over (vLLM's tensor parallelism; --rollout.placement separate: the
    # N GPUs after the trainers'). 1 on a CPU
    tensor_parallel: int = 1
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
    # http://HOST:PORT of an engine served by `vllm serve` (docs/sync.md, The engine as a service): the
    # run generates through it and syncs through its RL routes instead of starting vLLM; empty: its own
    engine: str = ""
    engine_public: bool = False  # accept a --rollout.engine that is not a private or loopback address
    # On CPU: cores the engine's worker computes on (vLLM binds one OpenMP thread to each).
    # 0: every core in the synchronous loop (the trainer waits meanwhile), half of them with
    # --train.off_policy_steps 1 (the trainer works beside it). Ignored by a GPU engine.
    cpu_threads: int = 0

    def memory_share(self) -> float:
        """--rollout.gpu_memory_utilization, or its value by placement."""
        return self.gpu_memory_utilization or (0.9 if self.placement == "separate" else 0.3)


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
    # Under torchrun: a collective that waits this long raises (a dead or hung rank). The other
    # ranks wait for rank 0's own work (generation, evaluation) without a limit (distributed.py)
    collective_timeout_min: float = 30.0


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
    # did not build, else the task's own (tasks/<task>.py), else tiny_models.py's; a name picks one (flags.recipe_name)
    recipe: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
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
    # Print what the run would hold in memory on each GPU (or, on a CPU, each process) from the
    # model's config.json, the flags and this node's devices, and exit: 2 where it cannot fit,
    # naming the flag to change (plan.py; docs/scale.md)
    plan: bool = False
    if TYPE_CHECKING:  # the sections the tables hand in: the run's Config is flags.Config
        data: DataConfig  # with the tasks' flags (tasks.TaskConfig)
        algo: objectives.AlgoConfig
        sdpo: objectives.sdpo.Flags
        dpo: objectives.dpo.Flags
        gad: objectives.gad.Flags


def parse_flags(default: Config, argv: list, description: str = "") -> Config:
    """tyro's parse of argv on default (an instance of the run's Config, flags.Config). A flag it
    rejects is a FlagError: the first lines of tyro's message (its full box with --debug or SDPO_DEBUG=1)."""
    import contextlib
    import io

    import tyro
    parse = lambda: tyro.cli(type(default), args=argv, default=default, description=description or None,
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


# Checked by check_config: each whole-number flag's least value; the flags that must be > 0; rates, 0 to 1
AT_LEAST = {"train.steps": 0, "train.prompts_per_step": 1, "train.mini_batches": 1, "train.micro_batch": 1,
            "rollout.n": 1, "rollout.max_tokens": 1, "rollout.eval_k": 1, "rollout.cpu_threads": 0,
            "train.cpu_threads": 0, "data.train_rows": 1, "data.eval_rows": 1,
            "train.warm_start_context_steps": 0, "train.warm_start_check_every": 1, "log.samples_per_step": 0,
            "rollout.tensor_parallel": 1}
POSITIVE = ("optim.lr", "rollout.temperature", "rollout.eval_temperature", "train.collective_timeout_min")
RATES = ("train.warm_start_target", "rollout.gpu_memory_utilization")


def check_config(cfg: Config):
    """Values of config.py's flags that would fail minutes later, after the engine's start, fail
    here, naming the flag (the tables' flags: flags.check_config)."""
    check_bounds(cfg, AT_LEAST, POSITIVE, RATES)
    for name in ("teacher_gap", "blind"):
        if getattr(cfg, name) and not cfg.eval_only:
            raise FlagError(f"--{name} is a measurement of --eval_only; add --eval_only")


def check_bounds(cfg: Config, at_least: dict | None = None, positive: tuple = (), rates: tuple = ()):
    """FlagError naming the first flag below its least value ({flag: least}), not > 0, or not a rate (0 to 1)."""
    for name, least in (at_least or {}).items():
        if flag_value(cfg, name) < least:
            raise FlagError(f"--{name}={flag_value(cfg, name)}: must be at least {least}")
    for name in positive:
        if not flag_value(cfg, name) > 0:
            raise FlagError(f"--{name}={flag_value(cfg, name)}: must be > 0")
    for name in rates:
        if not 0 <= flag_value(cfg, name) <= 1:
            raise FlagError(f"--{name}={flag_value(cfg, name)}: a rate, 0 to 1")


def apply_flags(cfg: Config, flags: dict, source: str) -> Config:
    """cfg with flags ({"section.name": value}) set; an unknown name is an error naming source."""
    for name, value in flags.items():
        section, _, key = name.rpartition(".")
        target = getattr(cfg, section, None) if section else cfg
        if target is None or not hasattr(target, key):
            raise FlagError(f"{source}: no flag --{name}")
        setattr(target, key, value)
    return cfg


def flag_value(cfg: Config, name: str):
    """The value of the flag --name ("section.key", or a top-level key)."""
    section, _, key = name.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, key)


def save_config(cfg: Config, out_dir: str):
    """<out_dir>/config.json: every resolved value, the recipe's name included."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=1)
