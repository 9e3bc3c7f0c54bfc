"""Weight sync: the trainer's weights into the vLLM engine after every update, and the proof.

Two ways to move them (--rollout.sync; how each works and costs: docs/sync.md):
- group (default): a torch.distributed group of trainer rank 0 and the engine's worker(s),
  gloo on CPU and NCCL on GPUs. Every trainer rank gathers the FSDP2 shards one tensor at a time
  (WeightStream); rank 0 sends them in buckets, which the worker (WeightReceiver, a vLLM worker
  extension) loads layer by layer as they arrive: no file, and no full state dict on any host.
- file: rank 0 gathers the whole state dict and writes one safetensors file, which the engine reads.
An engine in the trainer's own process takes the tensors directly, without either.

Then the engine scores a fixed probe sequence and must match the trainer's log-probs of it
within --rollout.sync_tol; `rollout.Engine.update_weights` does the load, the cache resets and the proof.
"""
import contextlib
import datetime
import json
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import chunked_head
import microbatch
from distributed import Dist, full_tensor, rank0_call, reshard
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
# the group path, trainer side


ALIGN = 64  # bytes: every tensor in a bucket starts at a multiple, so the worker can view it in any dtype


@dataclass
class Entry:
    names: list[str]  # checkpoint names loaded from this tensor (a tied LM head: two)
    source: str  # its key in the trainer's state dict
    shape: tuple
    offset: int  # bytes into its bucket
    nbytes: int


class WeightStream:
    """The policy's weights as buckets in the engine's dtype (`buckets`), which every trainer
    rank gathers together (each tensor an all-gather of its FSDP2 shards), for rank 0 to send.

    Rank 0 drives: the engine iterates `buckets()` once per load, as often as it loads (a probe
    miss loads once more), and calls `done()` at the end; the other ranks `follow()`, gathering
    whenever rank 0 starts a pass, so that every rank stays in step whatever the engine does.
    The buckets' layout (`plan`) is known on every rank without communication. Two bucket
    buffers are reused in turn: the engine must have sent bucket i-1 before it asks for bucket
    i+1 (Engine._stream_weights waits for each send before it takes the next bucket).
    """

    def __init__(self, model: CausalLM, d: Dist, dtype: torch.dtype, bucket_bytes: int):
        self.d, self.dtype, self.bucket_bytes = d, dtype, max(int(bucket_bytes), ALIGN)
        self.state = model.hf.state_dict()  # FSDP2: the ranks' shards (DTensors); nothing gathered
        self.buckets_plan = self._plan(model.hf)
        self.keys = {n for bucket in self.buckets_plan for e in bucket for n in e.names}
        self.bytes_per_pass = sum(e.nbytes for bucket in self.buckets_plan for e in bucket)
        self.bytes_moved = 0  # over every pass so far

    def _plan(self, hf) -> list[list[Entry]]:
        """Entries in state-dict order (layer by layer), packed into buckets."""
        identity, shared = tensor_identity(hf), {}  # one meta tensor per distinct tensor: a tied LM head is its embedding
        meta = {k: shared.setdefault(identity.get(k, id(v)), torch.empty(v.shape, dtype=v.dtype, device="meta"))
                for k, v in self.state.items()}
        key_of = {id(t): k for k, t in reversed(meta.items())}  # each tensor's first key
        named = engine_state(hf, meta)
        sources = {}  # state key -> checkpoint names, in the state dict's order
        for name, tensor in named.items():
            if id(tensor) not in key_of:
                raise ValueError(f"--rollout.sync group cannot stream {name!r}: transformers converts this model's "
                                 f"weights on saving (not only renames them); use --rollout.sync file")
            sources.setdefault(key_of[id(tensor)], []).append(name)
        buckets, current, used = [], [], 0
        for key in self.state:
            if key not in sources:
                continue
            shape = tuple(self.state[key].shape)
            nbytes = self.dtype.itemsize * torch.Size(shape).numel()
            start = -(-used // ALIGN) * ALIGN
            if current and start + nbytes > self.bucket_bytes:
                buckets.append(current)
                current, start = [], 0
            current.append(Entry(sources[key], key, shape, start, nbytes))
            used = start + nbytes
        if current:
            buckets.append(current)
        return buckets

    def plan(self) -> list:
        """What the worker needs to unpack each bucket (picklable): [(bytes, [(name, shape,
        offset, bytes), ...]), ...]."""
        return [(self.size(b), [(n, e.shape, e.offset, e.nbytes) for e in b for n in e.names])
                for b in self.buckets_plan]

    @staticmethod
    def size(bucket: list[Entry]) -> int:
        return bucket[-1].offset + bucket[-1].nbytes

    def _full(self, entry: Entry) -> torch.Tensor:
        """The whole tensor in the engine's dtype (a collective under FSDP2: every rank calls it),
        cast before the gather: half the bytes gathered at bf16."""
        return full_tensor(self.state[entry.source].detach().to(self.dtype))

    def _pass(self):
        """One gather of every tensor; on rank 0 yields each bucket as a flat uint8 tensor."""
        rank0 = self.d.rank == 0
        device = self.d.device
        buffers = [None, None]
        for i, bucket in enumerate(self.buckets_plan):
            nbytes = self.size(bucket)
            if len(bucket) == 1 and nbytes > self.bucket_bytes:  # travels alone, as gathered
                full = self._full(bucket[0])
                if rank0:
                    yield full.contiguous().reshape(-1).view(torch.uint8)
                del full
                continue
            if rank0:
                buf = buffers[i % 2]
                if buf is None:
                    buf = buffers[i % 2] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
            for e in bucket:
                full = self._full(e)
                if rank0:
                    buf[e.offset:e.offset + e.nbytes].copy_(full.contiguous().reshape(-1).view(torch.uint8))
                del full
            if rank0:
                if buf.is_cuda:  # another thread sends it, on another stream
                    torch.cuda.current_stream().synchronize()
                yield buf[:nbytes]
        self.bytes_moved += self.bytes_per_pass

    def buckets(self):
        """Rank 0: one pass; the other ranks gather along (see follow)."""
        if self.d.world > 1:
            dist.broadcast_object_list(["pass"], src=0)
        yield from self._pass()

    def tensors(self):
        """(checkpoint name, tensor) pairs of one pass, for an engine in this process (one rank)."""
        for bucket in self.buckets_plan:
            for e in bucket:
                full = self._full(e)
                for name in e.names:
                    yield name, full
        self.bytes_moved += self.bytes_per_pass

    def done(self):
        """Rank 0: no more passes."""
        if self.d.world > 1:
            dist.broadcast_object_list(["done"], src=0)

    def follow(self):
        """Ranks other than 0: gather along with each of rank 0's passes, until it is done."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] != "pass":
                return
            for _ in self._pass():
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def group_address(sync_addr: str) -> tuple[str, int]:
    """--rollout.sync_addr "host:port" (port 0 or none: a free one), or this machine."""
    host, _, port = sync_addr.partition(":")
    return host or "127.0.0.1", int(port or 0) or free_port()


def init_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float):
    """A process group of its own (vLLM's stateless one: it leaves torchrun's and vLLM's
    default groups alone). Rank 0, trainer rank 0, holds the rendezvous store at host:port."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group
    return stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend, timeout=datetime.timedelta(seconds=timeout_s))


# ----------------------------------------------------------------------------------------
# the group path, engine side


class WeightReceiver:
    """vLLM worker extension (`LLM(worker_extension_cls="sync.WeightReceiver")`): its methods
    join the worker's, for `collective_rpc`. The worker joins trainer rank 0's weight group
    (`init_weight_group`), then loads the buckets it receives (`receive_weights`)."""

    def init_weight_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float):
        self._sdpo_weight_group = init_group(host, port, 1 + self.rank, world_size, backend, timeout_s)

    def receive_weights(self, plan: list, dtype: str) -> int:
        """Receive plan's buckets (WeightStream.plan) and load them as they arrive; returns the
        bytes received. The views into a bucket live until vLLM has loaded their layer."""
        group, dtype, received = self._sdpo_weight_group, getattr(torch, dtype), 0

        def weights():
            nonlocal received
            for nbytes, entries in plan:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                group.broadcast(buf, 0).wait()
                received += nbytes
                for name, shape, offset, size in entries:
                    yield name, buf[offset:offset + size].view(dtype).view(shape)
        self.reload_weights(weights_iterator=weights())
        if not torch.cuda.is_available():
            # each load re-creates and re-packs every layer's weights: hand the memory it freed back
            # to the system (docs/sync.md, Engine memory over a long run)
            import ctypes
            with contextlib.suppress(OSError, AttributeError):  # not glibc
                ctypes.CDLL("libc.so.6").malloc_trim(0)
        return received

    def parameter_digest(self) -> dict:
        """name -> sha256 of the bytes of each of the model's parameters and buffers (tests compare
        engines by it; on CPU the linear layers' packed copies are what vLLM keeps as buffers)."""
        import hashlib
        model = self.model_runner.get_model()
        tensors = dict(model.named_parameters())
        tensors.update(model.named_buffers())
        return {name: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                                     if t.numel() else b"").hexdigest() for name, t in tensors.items()}


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
    """Load the policy's weights (the version-th) into the engine and prove it: the engine's
    log-probs of a fixed probe must match the trainer's within --rollout.sync_tol. Also times
    the waits: the trainer's for a batch the engine generates ahead, and the engine's, idle
    since its last generation."""
    t0 = time.perf_counter()
    dtype = engine_dtype(cfg, d.device)
    if cfg.rollout.sync == "group":
        weights = WeightStream(policy, d, getattr(torch, dtype), cfg.rollout.sync_bucket_mb * 2 ** 20)
    else:
        weights = full_state_dict(policy, d.world)
    probe, pictures, probe_lp = probe_logprobs(policy, tokenizer, d)
    tol = cfg.rollout.sync_tol or (1e-3 if dtype == "float32" else 1.0)

    def load():
        try:
            return engine.update_weights(weights, probe, probe_lp.cpu(), tol, version, probe_images=pictures)
        finally:
            if isinstance(weights, WeightStream):
                weights.done()  # the other ranks stop following
    if isinstance(weights, WeightStream) and d.rank != 0:
        weights.follow()
    result = rank0_call(d, load)
    moved = weights.bytes_moved if isinstance(weights, WeightStream) else \
        sum(t.numel() * t.element_size() for t in weights.values())
    return {"sync/seconds": time.perf_counter() - t0 - result.waited_s, "sync/probe_max_abs_diff": result.probe_max_abs_diff,
            "time/wait_rollout_s": result.waited_s, "time/wait_sync_s": result.engine_idle_s,
            "sync/reloads": result.reloads, "sync/megabytes": moved / 1e6}
