"""Weight sync: the trainer's weights into the vLLM engine after every update, and the proof.

Two ways to move them (--rollout.sync; how each works and costs: docs/sync.md):
- group (default): vLLM's weight-transfer API. Every trainer rank runs a trainer engine of vLLM's
  (`nccl` to an engine on a GPU of its own, `ipc` to one on a trainer's GPU) or of ours (`sdpo_gloo`
  on CPU, vllm_plugins/sdpo_transfer.py) over `PolicySource`, which gathers the FSDP2 shards one
  tensor at a time; rank 0 sends, and drives the engine's start/update/finish_weight_update
  (layer-wise reload): no file, and no full state dict on any host.
- file: rank 0 gathers the whole state dict and writes one safetensors file, which the engine reads.

Then the proof: every tensor's digest as the engine's loader took it must equal the trainer's
(group path), and the engine's log-probs of a fixed probe must match the trainer's within
--rollout.sync_tol; `rollout.Engine.update_weights` does the load, the cache resets and the proof.
"""
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import chunked_head
import microbatch
from distributed import RANK0_WAIT, Dist, full_tensor, rank0_call, reshard
from policy import CausalLM, pad_token_id, tensor_identity


# ----------------------------------------------------------------------------------------
# what the engine loads: the model's tensors under their checkpoint names


def engine_state(hf_model, state: dict) -> dict:
    """A model's state dict under the names of its checkpoint, which the engine loads:
    transformers 5 renames some models' weights on loading (Qwen2.5-VL: `visual.*` becomes
    `model.visual.*`, `model.layers.*` becomes `model.language_model.layers.*`) and back on
    saving. A tied LM head gets its `lm_head.weight` (see checkpoint_keys)."""
    from transformers.core_model_loading import revert_weight_conversion
    state = revert_weight_conversion(hf_model, dict(state))
    if hf_model.config.get_text_config().tie_word_embeddings and state and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def checkpoint_config(model_dir: str) -> dict:
    """The checkpoint's config.json."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def checkpoint_keys(model_dir: str) -> set[str]:
    """Keys a full sync must carry: the checkpoint's, plus lm_head.weight of a tied model,
    which HF does not save but vLLM's layerwise reload waits for."""
    from safetensors import safe_open
    config = checkpoint_config(model_dir)
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False))
    keys = {"lm_head.weight"} if tied else set()
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                keys.update(f.keys())
    return keys


def full_state_dict(model: CausalLM, world: int) -> dict:
    """The whole HF-named state dict on rank 0 (every rank calls this), float32 on CPU."""
    if world == 1:
        state = {k: v.detach() for k, v in model.hf.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model.hf, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return engine_state(model.hf, state)  # the engine's names, and a tied lm_head.weight


def write_sync_file(directory: str, state_dict: dict):
    """The state dict as directory/model.safetensors, replaced whole (the file path)."""
    from safetensors.torch import save_file
    tensors, seen = {}, set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.data_ptr() in seen:  # tied weights share storage; safetensors refuses that
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    path = os.path.join(directory, "model.safetensors")
    save_file(tensors, path + ".tmp")
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------------------
# the group path: vLLM's weight-transfer API, trainer side


def transfer_module():
    """vllm_plugins/sdpo_transfer.py, its engines registered with vLLM's factories (this process's too)."""
    from processes import PLUGIN_DIR
    if PLUGIN_DIR not in sys.path:
        sys.path.insert(0, PLUGIN_DIR)
    import sdpo_transfer
    sdpo_transfer.register()
    return sdpo_transfer


def transfer_backend(placement: str, served: bool, cuda: bool, in_process: bool = False) -> str:
    """The trainer side's backend, the same on every rank (docs/sync.md, How the weights travel):
    ours `sdpo_local` to an engine in this process (the tensors themselves), vLLM's `nccl` to an
    engine on a GPU of its own (separate, or served), vLLM's `ipc` to an engine process on a
    trainer's GPU (colocated), ours `sdpo_gloo` to an engine process on CPU."""
    if in_process:
        return "sdpo_local"
    if not cuda:
        return "sdpo_gloo"
    return "nccl" if placement == "separate" or served else "ipc"


# the engine's backend for each trainer side's: the same protocol, with the proof
WORKER_BACKEND = {"sdpo_gloo": "sdpo_gloo", "nccl": "sdpo_nccl", "ipc": "sdpo_ipc", "sdpo_local": "sdpo_local"}


def trainer_init_info(backend: str, rank: int, bucket_bytes: int, timeout_s: float, host: str = "",
                      port: int = 0, world_size: int = 0):
    """The trainer engine's init info on `rank` (rank 0 sends: host:port, where it opens the group
    of world_size = 1 + the engine's workers; the other ranks only gather)."""
    if backend == "sdpo_gloo":
        return transfer_module().GlooTrainerInitInfo(host, port, world_size, bucket_bytes, timeout_s, rank=rank)
    if backend == "sdpo_local":
        return transfer_module().LocalTrainerInitInfo(bucket_bytes, rank=rank)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        return NCCLTrainerInitInfo(host, port, world_size, packed=True, packed_buffer_size_bytes=bucket_bytes,
                                   rank=rank)
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=bucket_bytes, rank=rank)


class PolicySource:
    """The policy's weights as vLLM's trainer engines take them (a `WeightSource`: `metadata()`
    without a gather, iteration gathering each tensor), every rank: the FSDP2 shards, cast to the
    engine's dtype before the gather (half the bytes at bf16), under the checkpoint's names, in
    state-dict order (layer by layer), each distinct tensor once: a tied LM head travels with its
    embedding and loads under both names (`aliases`, which the engine is told).

    Each tensor's gather has completed, on the default stream, before it is yielded, and on a GPU
    nothing of the transfer's is in flight while a rank gathers: vLLM's packed NCCL producer pulls
    this iterator from inside its own streams (docs/sync.md, The order of the two groups). Rank 0
    drives: `begin_pass()` before each pass of its trainer engine, `done()` at the end; the other
    ranks `follow()` with theirs. Rank 0 keeps the digest of each tensor it yields (`digests`),
    which the engine's proof must match."""

    def __init__(self, model: CausalLM, d: Dist, dtype: torch.dtype, backend: str = "sdpo_gloo",
                 bucket_bytes: int = 512 << 20):
        from vllm.distributed.weight_transfer.base import ParamMeta
        self.d, self.dtype = d, dtype
        self.backend, self.bucket_bytes = backend, bucket_bytes  # the trainer engines' (transfer_backend)
        self.state = model.hf.state_dict()  # FSDP2: the ranks' shards (DTensors); nothing gathered
        self.entries = self._plan(model.hf)  # (checkpoint names, state key) per distinct tensor
        self.meta = [ParamMeta(names[0], dtype, tuple(self.state[key].shape)) for names, key in self.entries]
        self.aliases = {names[0]: names[1:] for names, _ in self.entries if len(names) > 1}
        self.keys = {n for names, _ in self.entries for n in names}
        self.bytes_per_pass = sum(dtype.itemsize * torch.Size(m.shape).numel() for m in self.meta)
        self.bytes_moved = 0  # over every pass so far
        self.digests = {}  # rank 0, the last pass: name -> digest of what it yielded
        self.gathered = 0  # tensors of the current pass gathered so far

    def _plan(self, hf) -> list[tuple[list[str], str]]:
        identity, shared = tensor_identity(hf), {}  # one meta tensor per distinct tensor: a tied LM head is its embedding
        meta = {k: shared.setdefault(identity.get(k, id(v)), torch.empty(v.shape, dtype=v.dtype, device="meta"))
                for k, v in self.state.items()}
        key_of = {id(t): k for k, t in reversed(meta.items())}  # each tensor's first key
        sources = {}  # state key -> checkpoint names, in the state dict's order
        for name, tensor in engine_state(hf, meta).items():
            if id(tensor) not in key_of:
                raise ValueError(f"--rollout.sync group cannot stream {name!r}: transformers converts this model's "
                                 f"weights on saving (not only renames them); use --rollout.sync file")
            sources.setdefault(key_of[id(tensor)], []).append(name)
        return [(sources[key], key) for key in self.state if key in sources]

    def metadata(self) -> list:
        return self.meta

    def held_names(self):
        return None

    def __iter__(self):
        digest = transfer_module().digest if self.d.rank == 0 else None
        self.gathered = 0
        for (names, key) in self.entries:
            full = self._full(key)
            self.gathered += 1
            if digest is not None:
                self.digests[names[0]] = digest(full)
            yield names[0], full
            del full
        self.bytes_moved += self.bytes_per_pass

    def finish_pass(self):
        """Rank 0, after its trainer engine's pass failed: the gathers the pass had left, which the
        other ranks' passes wait in (a failed sync must not leave them in a collective)."""
        for _, key in self.entries[self.gathered:]:
            self._full(key)
        self.gathered = len(self.entries)

    def _full(self, key: str) -> torch.Tensor:
        """The whole tensor in the engine's dtype (a collective under FSDP2: every rank calls it)."""
        shard = self.state[key].detach()
        if shard.device.type != "cuda":
            return full_tensor(shard.to(self.dtype))
        torch.cuda.synchronize(shard.device)  # rank 0: the transfer's last broadcast has landed
        stream = torch.cuda.default_stream(shard.device)
        with torch.cuda.stream(stream):
            full = full_tensor(shard.to(self.dtype))
        stream.synchronize()
        return full

    def expected_digests(self) -> dict:
        """name -> digest of every name the engine loads (aliases included), from the last pass."""
        out = dict(self.digests)
        for name, others in self.aliases.items():
            out.update({other: self.digests[name] for other in others if name in self.digests})
        return out

    def begin_pass(self):
        """Rank 0, before each pass of its trainer engine: the other ranks start theirs."""
        self.gathered = 0
        if self.d.world > 1:
            self._tell(["pass"])

    def done(self):
        """Rank 0: no more passes."""
        if self.d.world > 1:
            self._tell(["done"])

    def follow(self, trainer_engine):
        """Ranks other than 0: a pass of trainer_engine (this rank's, not the sender) with each of
        rank 0's, until it is done."""
        trainer_engine.source = self
        while self._tell([None]) == "pass":
            trainer_engine.send_weights()

    @staticmethod
    def _tell(box: list):
        """Rank 0's word to the other ranks. They wait for it at a barrier without a time limit,
        not in the broadcast under the group's timeout: before a sync rank 0 may wait long for
        the engine (a batch generated ahead, a slow server), as in distributed.rank0_call."""
        dist.barrier(timeout=RANK0_WAIT)
        dist.broadcast_object_list(box, src=0)
        return box[0]


class LLMClient:
    """vLLM's weight-sync client protocol (`VLLMWeightSyncClient`) over a rollout.Engine's LLM, in
    this process or in the engine's own (the offline LLM's RL calls, each watched: Engine._call),
    and `rpc` for the worker extension's methods (sdpo_transfer.WeightProof)."""

    def __init__(self, engine):
        self.engine = engine

    def rpc(self, method: str, *args, **kwargs) -> list:
        """collective_rpc into every worker: their results."""
        engine = self.engine
        return engine._call(f"weight sync ({method})", engine.llm.collective_rpc, method, timeout=engine.rpc_timeout_s,
                            args=args, kwargs=kwargs)

    def init_weight_transfer_engine(self, init_info: dict):
        self.rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self):
        self.rpc("start_weight_update")

    def update_weights(self, update_info):
        self.rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None):
        self.rpc("finish_weight_update")


def proof_problems(source: PolicySource, proofs: list) -> list[str]:
    """What the engine's workers' proofs (`sdpo_weight_proof`: the digest of each tensor as its
    loader took it, and the layers reload still waited for) show against what rank 0 sent: empty
    when every name arrived with the trainer's exact bytes and every layer was loaded whole."""
    expected, problems = source.expected_digests(), []
    for worker, proof in enumerate(proofs):
        loaded = proof["loaded"]
        missing = sorted(source.keys - set(loaded))  # every checkpoint key, whatever the source yielded
        differ = sorted(n for n in expected if n in loaded and list(loaded[n]) != list(expected[n]))
        if missing:
            problems.append(f"worker {worker} never loaded {len(missing)} tensors, e.g. {missing[:5]}")
        if differ:
            problems.append(f"worker {worker} loaded other bytes than the trainer sent for {len(differ)} tensors, "
                            f"e.g. {differ[:5]}")
        if proof["waiting"]:
            problems.append(f"worker {worker}: layer-wise reload still waited for weights of {len(proof['waiting'])} "
                            f"layers, which keep old ones: {proof['waiting'][:5]}")
    return problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def group_address(sync_addr: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """--rollout.sync_addr "host:port" (port 0 or none: a free one), or default_host."""
    host, _, port = sync_addr.partition(":")
    return host or default_host, int(port or 0) or free_port()


# ----------------------------------------------------------------------------------------
# the loop's sync: every rank


def engine_dtype(cfg, device) -> str:
    """The dtype the engine runs in and a sync sends: --rollout.dtype, else bfloat16 on a GPU, float32 on CPU."""
    # Never vLLM's "auto": it silently runs a float32 checkpoint in half precision.
    return cfg.rollout.dtype or ("bfloat16" if device.type == "cuda" else "float32")


def probe_ids(tokenizer) -> list[int]:
    """A fixed sequence the engine and the trainer both score after every sync."""
    messages = [{"role": "user", "content": "What is 12 + 30? Give the final answer as 'Answer: <number>'."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text + "12 + 30 = 42\nAnswer: 42", add_special_tokens=False)["input_ids"]


def image_probe(tokenizer) -> tuple[list[int], list]:
    """The probe of a vision-language model: a fixed picture, a question about it and an
    answer (ids with one image token), and the picture. A sync that missed the vision tower
    changes these log-probs."""
    from image_prompts import draw_shapes
    picture = draw_shapes([{"kind": "circle", "colour": "red", "cell": 0, "scale": 0.6, "dx": 0.0, "dy": 0.0},
                           {"kind": "square", "colour": "blue", "cell": 3, "scale": 0.5, "dx": 0.1, "dy": 0.0}],
                          size=112, grid=2)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the circle?"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text + "Answer: red", add_special_tokens=False)["input_ids"], [picture]


def probe_logprobs(policy, tokenizer, d: Dist):
    """The fixed probe (ids, pictures or None: image_probe for a vision-language model) and the
    trainer's log-probs of it: what the engine's must match after a sync."""
    probe, pictures = image_probe(tokenizer) if policy.vision is not None else \
        (probe_ids(tokenizer), None)
    scored = policy.vision.expand(probe, pictures)[0] if pictures else probe  # the engine scores the expanded ids
    packed = microbatch.pack(policy, [scored], [len(scored) - 1], pad_token_id(tokenizer), d.device,
                             images=[pictures] if pictures else None)
    with torch.no_grad():
        head = lambda h, w: chunked_head.logprobs_and_entropy_from_hidden(h, w, packed.targets)[0]
        probe_lp = microbatch.forward(policy, packed, head)
    reshard(policy)  # a no-grad forward leaves FSDP2's root unsharded
    return probe, pictures, probe_lp


def sync_engine(cfg, engine, policy, tokenizer, d: Dist, version: int) -> dict:
    """Load the policy's weights (the version-th) into the engine and prove it: the digests of
    what the engine loaded must equal the trainer's (group path), and the engine's log-probs of a
    fixed probe must match the trainer's within --rollout.sync_tol. Every rank calls it. Also times
    the waits: the trainer's for a batch the engine generates ahead, and the engine's, idle
    since its last generation."""
    t0 = time.perf_counter()
    dtype = engine_dtype(cfg, d.device)
    streamed = cfg.rollout.sync == "group"
    if streamed:
        backend = transfer_backend(cfg.rollout.placement, bool(cfg.rollout.engine), d.device.type == "cuda",
                                   in_process=getattr(engine, "own_process", True) is False)  # only with one rank
        weights = PolicySource(policy, d, getattr(torch, dtype), backend, cfg.rollout.sync_bucket_mb << 20)
    else:
        weights = full_state_dict(policy, d.world)
    probe, pictures, probe_lp = probe_logprobs(policy, tokenizer, d)
    tol = cfg.rollout.sync_tol or (1e-3 if dtype == "float32" else 1.0)

    def load():
        try:
            return engine.update_weights(weights, probe, probe_lp.cpu(), tol, version, probe_images=pictures)
        finally:
            if streamed:
                weights.done()  # the other ranks stop following
    if streamed and d.rank != 0:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        init = trainer_init_info(weights.backend, d.rank, weights.bucket_bytes, cfg.rollout.rpc_timeout_s)
        weights.follow(WeightTransferTrainerFactory.trainer_init(init, client=None, source=weights))
    result = rank0_call(d, load)
    moved = weights.bytes_moved if streamed else sum(t.numel() * t.element_size() for t in weights.values())
    return {"sync/seconds": time.perf_counter() - t0 - result.waited_s, "sync/probe_max_abs_diff": result.probe_max_abs_diff,
            "time/wait_rollout_s": result.waited_s, "time/wait_sync_s": result.engine_idle_s,
            "sync/reloads": result.reloads, "sync/megabytes": moved / 1e6}
