"""The vLLM rollout engine: start, generation with per-token log-probs, scoring, verified weight loads.

Rank 0 owns the engine: `colocated` on the trainers' device, or `separate` on the GPU after
theirs; its core runs in its own process except for a single process on a GPU (processes.py).
Every weight sync is proven by a probe the engine and the trainer both score (docs/sync.md).
Image prompts are token ids with one image token per picture; a Sample's prompt_ids are the
engine's expanded ids (image_prompts.ImagePrompts).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING

import torch

import data
import feedback
import served
import sync
from distributed import Dist, rank0_call
from microbatch import Rollout
from logger import status
from processes import (TORCHRUN_VARS, alive, cpu_split, descendants, engine_env, engine_in_own_process, patched_env,
                       quiet_vllm_logging, reap_directory, supervise, use_plugins)

if TYPE_CHECKING:
    from config import Config

MAX_IMAGES_PER_PROMPT = 4
KV_HEADROOM_TOKENS = 256  # two of vLLM's CPU KV blocks
MAX_CONCURRENT_SEQS = 256  # vLLM's default max_num_seqs
CPU_KV_CACHE_BYTES = 1 << 30


class EngineError(RuntimeError):
    """The engine died, timed out, or a weight sync did not arrive."""
    kept_across_ranks = True  # distributed.rank0_call raises it on every rank as an EngineError


@dataclass
class Sample:
    prompt_ids: list[int]  # as the model saw them: image tokens expanded
    response_ids: list[int]  # includes the EOS token when the response finished
    logprobs: list[float]  # engine log-probs of response_ids at the sampling temperature
    text: str
    truncated: bool  # no EOS before max_tokens
    policy_version: int = 0  # the version of the weights the engine held (Engine.update_weights)


@dataclass
class SyncResult:
    seconds: float  # loading and proving the weights, without waiting for a background job
    probe_max_abs_diff: float
    waited_s: float = 0.0  # the caller waited this long for the engine's background job to finish
    engine_idle_s: float = 0.0  # the engine stood idle this long between its last generation and the load
    reloads: int = 0  # loads repeated because the probe missed after the first


class Background:
    """fn() running in a daemon thread: Ctrl-C or an error in the trainer never waits for it."""

    def __init__(self, fn, name: str):
        self.value, self.error, self.done = None, None, threading.Event()
        self.thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.value = fn()
        except BaseException as e:  # handed to whoever waits for the result
            self.error = e
        finally:
            self.done.set()

    def result(self, timeout: float | None = None):
        """fn's return value, or its exception; EngineError after timeout seconds."""
        if not self.done.wait(timeout):
            raise EngineError(f"{self.thread.name} did not finish within {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.value


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """Bytes of KV cache one token takes in the engine: K and V of every layer."""
    config = sync.checkpoint_config(model_dir)
    text = config.get("text_config", config)  # vision-language configs nest the LM's
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads") or heads
    width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 2)
    return 2 * text["num_hidden_layers"] * kv_heads * head_dim * width


def _cpu_engine_args(model_dir: str, dtype: str, max_model_len: int, kv_cache_tokens: int) -> dict:
    """vLLM's arguments for a CPU engine. A seeded request caught mid-way through a chunked
    prefill makes vLLM rewind its torch.Generator, which CPU generators cannot do ("CPU
    Generator does not use offset"): whole prompts are prefilled instead."""
    args = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}
    if kv_cache_tokens:
        # vLLM holds one block back (its null block): without headroom a cache of exactly
        # max_model_len tokens is refused ("estimated maximum model length is 1920")
        tokens = max(kv_cache_tokens, max_model_len) + KV_HEADROOM_TOKENS
        args["kv_cache_memory_bytes"] = tokens * kv_bytes_per_token(model_dir, dtype)
    return args


class Engine:
    """A vLLM engine driven by rank 0.

    own_process: None chooses in-process for a single colocated process on a GPU, an engine-core
    process otherwise (always on CPU). dtype: "float32" matches a float32 trainer, "bfloat16" is
    what GPUs run (docs/sync.md: the probe tolerance that holds). kv_cache_tokens: on CPU, a KV
    cache for this many tokens (at least max_model_len) instead of gpu_memory_utilization's
    fraction of the machine (vLLM's default is gigabytes for a tiny model). cpu_cores: on CPU, the
    cores the worker binds its OpenMP threads to (None: all of this process's; vLLM's own choice
    is one core of two). sync_addr: "host:port" at which the workers reach this process for a
    weight sync through a process group (sync.py); empty: this machine, a free port.
    tensor_parallel: the GPUs one engine spreads over (vLLM's tensor parallelism; separate: the
    ones after the trainers', processes.engine_gpus).

    Each sample is stamped with the version of the weights that generated it. `in_background`
    runs a job that uses the engine (the next batch's generation) while the caller trains; any
    other call waits for that job first, so a generation never overlaps a weight load.
    """

    def __init__(self, model_dir: str, placement: str = "colocated", dtype: str = "auto",
                 gpu_memory_utilization: float = 0.3, max_model_len: int = 2048, seed: int = 0,
                 own_process: bool | None = None, rpc_timeout_s: float = 600.0, kv_cache_tokens: int = 0,
                 cpu_cores: list[int] | None = None, sync_addr: str = "", tensor_parallel: int = 1):
        quiet_vllm_logging()
        from vllm import LLM
        if placement not in ("colocated", "separate"):
            raise ValueError(f"placement must be 'colocated' or 'separate', got {placement!r}")
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if own_process is None:
            # On CPU an in-process engine binds the process's OpenMP threads, which makes its
            # generation many times slower and erratic beside the trainer (docs/results.md).
            own_process = world_size > 1 or placement == "separate" or not torch.cuda.is_available()
        if not own_process and world_size > 1:
            raise ValueError("an in-process engine under torchrun with several ranks hangs at start-up; "
                             "use own_process=True")
        env, bound = engine_env(placement, own_process, cpu_cores, tensor_parallel)
        self._init_state(model_dir, own_process, rpc_timeout_s, sync_addr)
        engine_args = {} if torch.cuda.is_available() else _cpu_engine_args(model_dir, dtype, max_model_len,
                                                                            kv_cache_tokens)
        self.vision = "vision_config" in sync.checkpoint_config(model_dir)
        if self.vision:  # images only: no video processor without torchvision, and no video budget to profile
            engine_args["limit_mm_per_prompt"] = {"image": MAX_IMAGES_PER_PROMPT, "video": 0}
        use_plugins(env)  # the engine's processes load vllm_plugins/: the proven weight transfer
        sync.transfer_module()  # registered here too: an engine in this process loads vLLM's plugins once
        transfer = {"backend": sync.WORKER_BACKEND[sync.transfer_backend(placement, False, torch.cuda.is_available(),
                                                                         in_process=not own_process)]}
        t0 = time.perf_counter()
        before = descendants() if own_process else set()
        with patched_env(env, TORCHRUN_VARS if own_process else ()):
            # this process's resource tracker, if it is not running yet, starts with the quiet
            # environment too: at exit it would warn of vLLM's shared-memory buffer
            resource_tracker.ensure_running()
            self.llm = LLM(
                model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel,
                # CUDA graphs (and vLLM's compilation) on a GPU; on a CPU eager, where vLLM would
                # otherwise compile the model with inductor at every start
                enforce_eager=not torch.cuda.is_available(),
                # Log-probs after temperature: the ones the sampler actually drew from, which
                # the trainer reproduces by dividing its logits by the same temperature.
                logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                use_tqdm_on_load=False,  # its bar at every weight sync would break the run's own
                worker_extension_cls="sdpo_transfer.WeightProof", weight_transfer_config=transfer, **engine_args)
        self.start_seconds = time.perf_counter() - t0
        # The engine core and its workers: watched during every call (see _call), and ended by a
        # reaper process when this one ends without closing the engine (processes.supervise).
        self.processes, self._reaper = supervise(before, bound) if own_process else ({}, None)

    name = "vLLM engine"  # in its error messages

    def _init_state(self, model_dir: str, own_process: bool, rpc_timeout_s: float, sync_addr: str):
        self.model_dir, self.own_process, self.rpc_timeout_s = model_dir, own_process, rpc_timeout_s
        self.weights_version = 0  # the checkpoint's weights
        self._background = None  # the job started by in_background, until someone waits for it
        self._idle_since = None  # when the last generation ended
        self.expected_keys = sync.checkpoint_keys(model_dir)
        self._sync_dir = None  # the file path's directory
        self.sync_addr, self._transfer, self.identity = sync_addr, None, None  # the group path's (sync.py)

    def _call(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs) into vLLM, its failures as EngineError. An own-process engine
        is watched while the call runs: when its process dies, vLLM notices but a generate
        call waits for outputs forever (vllm 0.32, kill -9 of the engine core)."""
        if not self.processes:
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # vLLM's EngineDeadError, TimeoutError, broken pipes ...
                raise EngineError(f"{self.name} failed during {what}: {type(e).__name__}: {e}") from e
        return self._wait(what, Background(lambda: fn(*args, **kwargs), name=f"vLLM {what}"))

    def _wait(self, what: str, job: Background, *watched: Background):
        """job's result (a Background thread that talks to the engine); EngineError as soon as it
        or a watched job fails, or an engine process dies."""
        try:
            while not job.done.wait(1.0):
                dead = [(pid, name) for pid, (process, name) in self.processes.items() if not alive(process)]
                if dead:
                    raise EngineError(f"vLLM engine process {dead[0][1]} (pid {dead[0][0]}) died during {what}")
                for other in watched:
                    if other.done.is_set() and other.error is not None:
                        other.result(0)
            return job.result(0)
        except EngineError:
            raise
        except Exception as e:  # vLLM's EngineDeadError, TimeoutError, broken pipes ...
            raise EngineError(f"{self.name} failed during {what}: {type(e).__name__}: {e}") from e

    def in_background(self, fn, name: str) -> Background:
        """Run fn(), which may call this engine, in a background thread (after any earlier job)."""
        self._finish_background()
        self._background = Background(fn, name)
        return self._background

    def generating_ahead(self) -> bool:
        """Whether a background job (the next batch's generation) is still running."""
        return self._background is not None and not self._background.done.is_set()

    def _finish_background(self) -> float:
        """Wait for the background job unless called from it, re-raising its error (its engine
        calls fail when the engine dies, see _call); returns the seconds waited."""
        job = self._background
        if job is None or job.thread is threading.current_thread():
            return 0.0
        t0 = time.perf_counter()
        job.result()
        self._background = None
        return time.perf_counter() - t0

    def _prompts(self, prompts: list[list[int]], images: list[list] | None) -> list:
        """vLLM prompts: token ids, with their pictures where there are any."""
        from vllm.inputs import TokensPrompt
        images = images or [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
        if any(images) and not self.vision:
            raise ValueError(f"{self.model_dir} is not a vision-language model, but prompts came with images")
        return [TokensPrompt(prompt_token_ids=list(p), multi_modal_data={"image": list(im)}) if im else
                TokensPrompt(prompt_token_ids=list(p)) for p, im in zip(prompts, images)]

    def generate(self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int,
                 seed: int, images: list[list] | None = None) -> list[list[Sample]]:
        """n samples for each prompt (token ids; images[i]: the pictures of prompt i, one image
        token each, or None). No top-p/top-k: training rollouts must be drawn from the full
        tempered distribution for the log-probs to be correct."""
        from vllm import SamplingParams
        self._finish_background()
        version = self.weights_version
        params = [SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=s, logprobs=0,
                                 top_p=1.0, top_k=0, min_p=0.0, skip_special_tokens=True)
                  for s in request_seeds(seed, len(prompts), n)]
        outputs = self._call("generate", self.llm.generate, self._prompts(prompts, images), params, use_tqdm=False)
        result = [[Sample(prompt_ids=list(out.prompt_token_ids), response_ids=list(c.token_ids),
                          logprobs=[step[token].logprob for token, step in zip(c.token_ids, c.logprobs)],
                          text=c.text, truncated=c.finish_reason == "length", policy_version=version)
                   for c in out.outputs] for out in outputs]
        self._idle_since = time.perf_counter()
        return result

    def score(self, sequences: list[list[int]], images: list[list] | None = None) -> list[list[float]]:
        """log p(token_t | tokens_<t) for t = 1.. of each sequence, at temperature 1; with
        images, over the sequence with its image tokens expanded."""
        from vllm import SamplingParams
        self._finish_background()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self._call("score", self.llm.generate, self._prompts(sequences, images), params, use_tqdm=False)
        return [[step[token].logprob for token, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
                for out in outputs]

    def update_weights(self, weights, probe_ids: list[int], trainer_probe_logprobs: torch.Tensor,
                       tol: float, version: int | None = None, probe_images: list | None = None) -> SyncResult:
        """Load weights into the engine, reset the prefix cache, and prove it. weights: a
        sync.PolicySource (vLLM's weight-transfer API: the group path) or a full HF-named state
        dict (through a file, or directly into an engine in this process).

        trainer_probe_logprobs: the probe's log-probs under the weights being synced
        (`probe_logprobs`; probe_images: its pictures, `sync.image_probe`). version: what later samples
        are stamped with (default: one more than now). Waits for a background job first. Raises
        EngineError when keys are missing, or when the proof fails twice: the engine's digests of
        what it loaded differ from the trainer's (group path), or the probe misses tol (max abs, nats).
        """
        waited = self._finish_background()
        t0 = time.perf_counter()
        idle = t0 - self._idle_since if self._idle_since is not None else 0.0
        missing = self.expected_keys - (set(weights) if isinstance(weights, dict) else weights.keys)
        if missing:
            # vLLM reloads layer by layer and keeps *every* old weight when one key is absent.
            raise EngineError(f"weight sync: state dict lacks {len(missing)} checkpoint keys, e.g. "
                              f"{sorted(missing)[:5]} (a tied lm_head.weight must be included)")
        if not isinstance(weights, dict):
            load = lambda: self._transfer_weights(weights)
        elif self.own_process:
            # Tensors cannot cross to the engine process by pickling (bf16 has no buffer
            # protocol), so they go through a safetensors file in shared memory.
            if self._sync_dir is None:
                self._sync_dir = tempfile.mkdtemp(prefix="sdpo-sync-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
                if self._reaper is not None:
                    reap_directory(self._reaper, self._sync_dir)
            sync.write_sync_file(self._sync_dir, weights)
            load = lambda: self._reload(weights_path=self._sync_dir)
        else:  # into this process: a fresh iterator for each load
            load = lambda: self._reload(weights_iterator=((k, v.detach()) for k, v in weights.items()))
        wrong, diff = self._load_and_prove(load, weights, probe_ids, probe_images, trainer_probe_logprobs)
        reloads = 0
        if wrong or not diff <= tol:  # NaN fails too; a miss is loaded once more (docs/sync.md: seen once)
            miss = "; ".join(wrong) or f"the engine's probe log-probs differ from the trainer's by {diff:.4g} nats " \
                                       f"(tolerance {tol})"
            print(f"weight sync: {miss}; loading the weights once more", file=sys.stderr, flush=True)
            reloads = 1
            wrong, diff = self._load_and_prove(load, weights, probe_ids, probe_images, trainer_probe_logprobs)
        if wrong:
            raise EngineError(f"weight sync did not arrive, also after loading it again: {'; '.join(wrong)}")
        if not diff <= tol:
            raise EngineError(f"weight sync did not arrive: engine and trainer probe log-probs differ by "
                              f"{diff:.4g} nats (tolerance {tol}), also after loading them again")
        self.weights_version = self.weights_version + 1 if version is None else version
        return SyncResult(seconds=time.perf_counter() - t0, probe_max_abs_diff=diff, waited_s=waited,
                          engine_idle_s=idle, reloads=reloads)

    def _reload(self, **kwargs):
        self._call("weight sync", self.llm.collective_rpc, "reload_weights", timeout=self.rpc_timeout_s, kwargs=kwargs)

    def client(self):
        """vLLM's weight-sync client protocol (and collective_rpc) for this engine."""
        return sync.LLMClient(self)

    def _transfer_weights(self, source):
        """One pass of vLLM's weight transfer (the other trainer ranks follow it, sync.PolicySource):
        rank 0's trainer engine drives the engine's start/update/finish_weight_update and sends. The
        trainer engine is made at the first sync (a group opened with the workers), and dropped
        when a pass fails (the next sync opens a new one)."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        if self._transfer is None:
            client = self.client()
            aliases = json.dumps(source.aliases)
            self.identity = client.rpc("sdpo_begin_session", aliases)[0]  # a half-done update is closed
            host, port = sync.group_address(self.sync_addr, self.transfer_host())
            init = sync.trainer_init_info(source.backend, 0, source.bucket_bytes, self.rpc_timeout_s, host, port,
                                          1 + self.workers())
            # under torchrun, torch's rendezvous would join torchrun's own store instead of opening one
            with patched_env({}, ["TORCHELASTIC_USE_AGENT_STORE"]):
                self._transfer = self._guarded("weight transfer set-up", lambda: WeightTransferTrainerFactory
                                               .trainer_init(init, client=client, source=source))
        self._transfer.source = source
        source.begin_pass()
        try:
            self._guarded("weight sync", self._transfer.send_weights)
        finally:
            source.finish_pass()  # after a failure: the other ranks' gathers complete, then every rank raises

    def _guarded(self, what: str, fn):
        """fn() of the transfer; a failure drops the trainer engine (its group is in an unknown state)."""
        try:
            return fn()
        except Exception as e:
            if self._transfer is not None:
                with contextlib.suppress(Exception):
                    self._transfer.shutdown()
            self._transfer = None
            if isinstance(e, EngineError):
                raise
            raise EngineError(f"{self.name} failed during {what}: {type(e).__name__}: {e}") from e

    def workers(self) -> int:
        """The engine's workers, which join the transfer's group after trainer rank 0."""
        return self.llm.llm_engine.vllm_config.parallel_config.world_size

    def transfer_host(self) -> str:
        """Where the engine's workers reach this process when --rollout.sync_addr does not say: this machine."""
        return "127.0.0.1"

    def _load_and_prove(self, load, weights, probe_ids: list[int], probe_images: list | None,
                        trainer_probe_logprobs: torch.Tensor) -> tuple[list[str], float]:
        """Load the weights (load()), empty the caches computed with the old ones; (what the
        workers' proof shows wrong, group path: sync.proof_problems; the engine's probe log-probs'
        max abs difference from the trainer's)."""
        load()
        wrong = [] if isinstance(weights, dict) else sync.proof_problems(weights, self.client().rpc("sdpo_weight_proof"))
        self._reset_caches()
        engine_probe = torch.tensor(self.score([probe_ids], [probe_images] if probe_images else None)[0])
        if engine_probe.shape != trainer_probe_logprobs.shape:
            raise EngineError(f"weight sync probe: the engine scored {len(engine_probe)} tokens, the trainer "
                              f"{len(trainer_probe_logprobs)} (image tokens expanded differently?)")
        return wrong, (engine_probe - trainer_probe_logprobs.detach().float().cpu()).abs().max().item()

    def _reset_caches(self):
        """The prefix cache (and a vision model's encoder cache) computed with the old weights."""
        if self._call("prefix cache reset", self._reset_prefix_cache) is False:
            # vLLM refuses while a request holds KV blocks: generations would read the old weights' cache
            raise EngineError("weight sync: vLLM did not reset its prefix cache (a request still holds KV blocks)")
        if self.vision:
            # vLLM keeps the vision tower's outputs per picture; after a reload they are stale, and
            # the reload empties the worker's copy but not the scheduler's ("Encoder cache miss").
            self._call("encoder cache reset", self.llm.llm_engine.reset_encoder_cache)

    def _reset_prefix_cache(self) -> bool:
        return self.llm.reset_prefix_cache()

    def close(self):
        if self._transfer is not None:
            with contextlib.suppress(Exception):
                self._transfer.shutdown()
            self._transfer = None
        if self._sync_dir:
            shutil.rmtree(self._sync_dir, ignore_errors=True)
            self._sync_dir = None
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown(timeout=2)
            self.llm = None
        if self._reaper is not None:
            self._reaper.stdin.close()  # it ends whatever shutdown left running, then exits
            with contextlib.suppress(Exception):
                self._reaper.wait(timeout=30)
            self._reaper = None


def request_seeds(seed: int, prompts: int, n: int) -> list[int]:
    """Each prompt's request seed: vLLM seeds sample j of a request with seed + j, so the prompts'
    seeds are n apart, and no two samples of a batch share a random stream."""
    return [seed * 1000003 + i * n for i in range(prompts)]


class ServedEngine(Engine):
    """An engine that `vllm serve` runs (served.py: --rollout.engine http://HOST:PORT), driven by
    rank 0 as an Engine is: generation and scoring through its completions API, the weight sync
    through vLLM's RL routes with the same trainer engines and proof. The server outlives the run
    (a sweep's next run reuses it warm): the run checks it serves the run's architecture, and it
    holds the run's weights from the first sync on, which the run makes before it generates."""

    def __init__(self, url: str, model_dir: str, dtype: str, rpc_timeout_s: float = 600.0, sync_addr: str = "",
                 public_ok: bool = False):
        t0 = time.perf_counter()
        self._init_state(model_dir, True, rpc_timeout_s, sync_addr)
        self.url, self.llm, self.processes, self._reaper, self.synced = url, None, {}, None, False
        self.name = f"the served vLLM engine at {url}"  # its calls fail as a gone server's, refused or reset
        config = sync.checkpoint_config(model_dir)
        self.vision = "vision_config" in config
        if self.vision:
            raise data.FlagError(f"--rollout.engine: image prompts do not travel through the completions API; "
                                 f"{model_dir} is a vision-language model: drop --rollout.engine")
        served.check_address(url, public_ok)
        self.server = self._call("connecting", served.Server, url, rpc_timeout_s)
        self.identity = self._call("connecting", self.server.rpc, "sdpo_begin_session", "{}")[0]
        served.check_identity(self.identity, config, dtype, url)
        self.start_seconds = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int,
                 seed: int, images: list[list] | None = None) -> list[list[Sample]]:
        self._finish_background()
        if images:
            raise ValueError("a served engine takes no images")
        if not self.synced:
            raise EngineError(f"the served engine at {self.url} holds the weights it had before this run until the "
                              f"run's first weight sync; a run that generates before one (--eval_only, test-time "
                              f"self-distillation) needs an engine of its own: drop --rollout.engine")
        version = self.weights_version
        outputs = self._call("generate", self.server.generate, prompts, n, temperature, max_tokens,
                             request_seeds(seed, len(prompts), n))
        result = [[Sample(prompt_ids=list(prompt), response_ids=ids, logprobs=logprobs, text=text,
                          truncated=finish == "length", policy_version=version)
                   for ids, logprobs, text, finish in samples] for prompt, samples in zip(prompts, outputs)]
        self._idle_since = time.perf_counter()
        return result

    def score(self, sequences: list[list[int]], images: list[list] | None = None) -> list[list[float]]:
        self._finish_background()
        return self._call("score", self.server.score, sequences)

    def update_weights(self, weights, *args, **kwargs) -> SyncResult:
        if isinstance(weights, dict):
            raise ValueError("a served engine takes its weights through vLLM's transfer API (a sync.PolicySource)")
        result = super().update_weights(weights, *args, **kwargs)
        self.synced = True
        return result

    def client(self):
        return self.server.client()

    def workers(self) -> int:
        return self._call("weight transfer set-up", self.server.workers)

    def transfer_host(self) -> str:
        return served.local_address(self.server.host, self.server.port)

    def _reset_prefix_cache(self) -> bool:
        return self.server.reset_prefix_cache()

    def close(self):
        """The trainer's side of the transfer, and the server's; the server itself stays up."""
        if self._transfer is not None:
            with contextlib.suppress(Exception):
                self.client().shutdown_weight_transfer_engine()
        super().close()


@torch.no_grad()
def probe_logprobs(model, ids: list[int], images=None) -> torch.Tensor:
    """The trainer's log p(token_t | tokens_<t), t = 1.., in float32 (every FSDP rank calls
    this). images: the probe's image_prompts.ImageInputs (then ids are ignored for images.input_ids)."""
    device = next(model.parameters()).device
    extra = {}
    if images is not None:
        ids = images.input_ids
        extra = {"pixel_values": images.pixel_values.to(device), "image_grid_thw": images.image_grid_thw.to(device),
                 "mm_token_type_ids": torch.tensor([images.mm_token_type_ids], device=device)}
    input_ids = torch.tensor([ids], device=device)
    logits = model(input_ids=input_ids, **extra).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[0, 1:, None]).squeeze(-1).cpu()


# ----------------------------------------------------------------------------------------
# The run's calls to the engine: rank 0 holds it, every rank takes part in a sync


def generate_and_score(engine, tokenizer, rows, cfg: Config, seed: int, n: int, temperature: float,
                       prompts: list | None = None):
    """Sample n responses per row and score them; one Rollout per sample, grouped by row.
    prompts: token ids to use instead of the rows' chat prompts."""
    prompts = prompts or [data.chat_prompt_ids(tokenizer, r["messages"], cfg.data.max_prompt_len) for r in rows]
    images = [r.get("images") for r in rows] if any(r.get("images") for r in rows) else None
    groups = engine.generate(prompts, n=n, temperature=temperature, max_tokens=cfg.rollout.max_tokens, seed=seed,
                             images=images)
    rollouts = [Rollout(row=row, prompt_ids=s.prompt_ids, response_ids=s.response_ids, rollout_logprobs=s.logprobs,
                        text=s.text, truncated=s.truncated, policy_version=s.policy_version)
                for row, samples in zip(rows, groups) for s in samples]
    rewards = feedback.score_batch(
        feedback.reward_function(cfg, rows[0]),
        [r.text for r in rollouts], [r.row for r in rollouts], [r.truncated for r in rollouts])
    for rollout, reward in zip(rollouts, rewards):
        rollout.reward, rollout.feedback, rollout.reward_error = reward.score, reward.feedback, reward.error
    return rollouts


def start_engine(cfg: Config, model_dir: str, tokenizer, rows: list, d: Dist):
    """Rank 0's vLLM engine (None on other ranks). Started before the trainer: an in-process
    engine sets up its own single-process distributed state."""
    # Generating ahead runs the engine beside the trainer's computation: in its own process,
    # not in a thread of the trainer's (the GIL, and on CPU the trainer's OpenMP threads).
    if cfg.rollout.engine:  # served by `vllm serve`, elsewhere or beside
        if cfg.rollout.sync == "file":
            raise data.FlagError("--rollout.sync file cannot reach a served engine (--rollout.engine): use "
                                 "--rollout.sync group")
        if d.device.type == "cpu":
            torch.set_num_threads(cpu_split(cfg)[2])
        status(d, f"engine: connecting to the served vLLM engine at {cfg.rollout.engine}")
        return rank0_call(d, lambda: ServedEngine(
            cfg.rollout.engine, model_dir, sync.engine_dtype(cfg, d.device), cfg.rollout.rpc_timeout_s,
            cfg.rollout.sync_addr, cfg.rollout.engine_public), share=False)
    own = engine_in_own_process(cfg, d.world, d.device.type == "cuda")
    cores = None
    if d.device.type == "cpu":  # before the engine starts: an in-process one forbids changing threads after
        cores, beside, alone = cpu_split(cfg)
        # a rank without the engine cannot see when its generation ends: it keeps to its share
        torch.set_num_threads(alone if d.rank == 0 else beside)
        status(d, f"cpu: the engine computes on cores {cores}; the trainer on {alone} threads a rank"
                  + (f", {beside} while the engine generates beside it" if beside != alone else ""))
    status(d, f"engine: starting vLLM on {model_dir} (tens of seconds on a CPU)")  # nothing else shows meanwhile
    return rank0_call(d, lambda: Engine(
        model_dir, placement=cfg.rollout.placement, dtype=sync.engine_dtype(cfg, d.device), seed=cfg.train.seed,
        gpu_memory_utilization=cfg.rollout.memory_share(), max_model_len=cfg.rollout.max_model_len,
        own_process=own, rpc_timeout_s=cfg.rollout.rpc_timeout_s, cpu_cores=cores, sync_addr=cfg.rollout.sync_addr,
        tensor_parallel=cfg.rollout.tensor_parallel,
        kv_cache_tokens=kv_cache_tokens(cfg, model_dir, tokenizer, rows, d.device)), share=False)


def kv_cache_tokens(cfg: Config, model_dir: str, tokenizer, rows: list, device) -> int:
    """Tokens of KV cache the run's generations need at once: vLLM runs at most
    MAX_CONCURRENT_SEQS sequences together, each a prompt and its response. Teacher-gap
    prompts carry a demonstration or feedback, so prompts are counted three times over. On
    CPU the cache is capped at CPU_KV_CACHE_BYTES: more concurrent sequences do not make a
    CPU generate faster, and too small a cache only makes vLLM schedule fewer at a time."""
    if cfg.rollout.kv_cache_tokens:
        return cfg.rollout.kv_cache_tokens
    longest = max(len(data.chat_prompt_ids(tokenizer, r["messages"], cfg.data.max_prompt_len)) for r in rows[:256])
    per_sequence = min(3 * longest + cfg.rollout.max_tokens, cfg.rollout.max_model_len)
    sequences = max(cfg.train.prompts_per_step * cfg.rollout.n, cfg.data.eval_rows * cfg.rollout.eval_k)
    need = min(sequences, MAX_CONCURRENT_SEQS) * per_sequence
    if device.type == "cpu":
        need = min(need, CPU_KV_CACHE_BYTES // kv_bytes_per_token(model_dir, sync.engine_dtype(cfg, device)))
    return need
