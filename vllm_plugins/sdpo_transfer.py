"""vLLM plugin of the sdpo project: the proof of every weight transfer, and a gloo transfer for CPU.

The weight sync goes through vLLM 0.32's own weight-transfer API (vllm/distributed/weight_transfer/):
a trainer engine (`TrainerWeightTransferEngine`) on every trainer rank, and the engine's workers'
`init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update`, with
layer-wise reload set up at start and finalised at finish. This module adds, registered with vLLM's
factories (`register`, vLLM's general-plugin hook: the dist-info beside this file declares it, and
the engine puts this directory on PYTHONPATH, processes.use_plugins):

- worker backends `sdpo_nccl` and `sdpo_ipc`: vLLM's `nccl` and `ipc` engines (GPU), plus
  `ProvenLoads`: each tensor handed to vLLM's loader is digested where it lands, in the engine's
  process, and a layer that layer-wise reload leaves waiting for weights is named at finish
  (vLLM itself keeps such a layer's old weights with only a warning);
- `sdpo_gloo`, both sides: the same protocol over a gloo group, for CPU (tests and the default
  job run the trainer/worker calls a GPU run makes), with the same proof;
- `WeightProof`, the worker extension (`worker_extension_cls="sdpo_transfer.WeightProof"`, or
  `vllm serve --worker-extension-cls sdpo_transfer.WeightProof`): what the trainer reads back in
  one `collective_rpc` after an update (`sdpo_weight_proof`), and a new trainer's session
  (`sdpo_begin_session`: the tied-weight aliases, a half-done update of a trainer that died closed).

A digest (`digest`) is the sum of the tensor's bytes read as 64-bit integer words, modulo 2**64,
and its size: exact whatever the order of the sum, the device or the thread count, so the trainer's
and the engine's are compared with ==, in any dtype (a float64 sum differs in its last bits when
summed in another order). Docs: docs/sync.md.
"""
import contextlib
import datetime
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group, \
    stateless_init_torch_distributed_process_group
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightTransferEngine, \
    WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine, NCCLWeightTransferEngine

ALIGN = 64  # bytes: every tensor in a gloo bucket starts at a multiple, so it can be viewed in any dtype


def digest(tensor: torch.Tensor) -> list[int]:
    """[sum of the tensor's bytes read as 64-bit integer words modulo 2**64, its bytes]: integer
    sums wrap alike on every device, so the sum is exact in any order; one read of the tensor. (A
    stale, missing or corrupted tensor changes the sum unless the change happens to add up to a
    multiple of 2**64; a float sum would hide small changes in its rounding.)"""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = data.numel()
    if nbytes % 8:
        data = torch.cat([data, data.new_zeros(8 - nbytes % 8)])
    elif data.data_ptr() % 8:  # a view at an odd offset into a packed buffer
        data = data.clone()
    return [signed64(int(data.view(torch.int64).sum())), nbytes]


def signed64(x: int) -> int:
    return (x + 2 ** 63) % 2 ** 64 - 2 ** 63


def bucket_plan(sizes: list[int], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """The tensors of byte sizes `sizes`, in order, as buckets of (index, offset in bytes) of at
    most bucket_bytes each (a larger tensor alone); both sides of the gloo transfer compute it."""
    buckets, current, used = [], [], 0
    for i, nbytes in enumerate(sizes):
        start = -(-used // ALIGN) * ALIGN
        if current and start + nbytes > bucket_bytes:
            buckets.append(current)
            current, start = [], 0
        current.append((i, start))
        used = start + nbytes
    return buckets + ([current] if current else [])


def nbytes_of(dtype_name: str, shape) -> int:
    return getattr(torch, dtype_name).itemsize * torch.Size(shape).numel()


# ----------------------------------------------------------------------------------------
# the engine's side: every update proven where it lands


def _layerwise_info(model):
    """(qualified name, vLLM's layer-wise reload state) of each layer that has one."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None:
            yield name, layer, info


def waiting_layers(model) -> list[str]:
    """Layers with parameters that layer-wise reload set up and that did not receive all their
    weights: vLLM's finalize would keep their old weights (none received) or process them partly
    loaded. (A layer of buffers alone, a rotary embedding's cache, is never loaded.)"""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    return [f"{name or type(layer).__name__} ({info.load_numel} of {info.load_numel_total} elements)"
            for name, layer, info in _layerwise_info(model)
            if info.can_load() and layer._parameters and not is_deferred_attention_layer(layer)
            and info.load_numel < info.load_numel_total]


class ProvenLoads:
    """Mixin for a worker-side WeightTransferEngine: records the digest of every tensor handed to
    the model's loader (`loaded`, under each of its names: `aliases` maps a tensor that travels once
    to the other names it loads under, the tied LM head), and at finish the layers still waiting
    for weights (`waiting`). A session left half done by a trainer that died (its update failed,
    so vLLM cleared the worker's flag, but the layers hold part of its weights) is finalised before
    a new one starts: the new update then overwrites every layer."""

    aliases: dict = {}

    def start_weight_update(self):
        if any(info.can_load() for _, _, info in _layerwise_info(self.model)):
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            finalize_layerwise_reload(self.model, self.model_config)
        self.loaded, self.waiting = {}, []
        super().start_weight_update()

    def receive_weights(self, update_info):
        load = self.model.load_weights

        def recording(weights):
            pairs = []
            for name, tensor in weights:
                tensor_digest = digest(tensor)
                for each in (name, *self.aliases.get(name, ())):
                    self.loaded[each] = tensor_digest
                    pairs.append((each, tensor))
            return load(pairs)
        self.model.load_weights = recording  # an instance attribute: vLLM's receive calls it
        try:
            super().receive_weights(update_info)
        finally:
            del self.model.load_weights

    def finish_weight_update(self):
        self.waiting = waiting_layers(self.model)
        super().finish_weight_update()


class ProvenNCCLWeightTransferEngine(ProvenLoads, NCCLWeightTransferEngine):
    """vLLM's nccl worker engine (GPU), proven."""


class ProvenIPCWeightTransferEngine(ProvenLoads, IPCWeightTransferEngine):
    """vLLM's ipc worker engine (trainer and engine on one GPU), proven."""


class WeightProof:
    """vLLM worker extension: its methods join the worker's, for `collective_rpc` (and the served
    engine's `/collective_rpc`, whose arguments are strings)."""

    def _proven_engine(self):
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, ProvenLoads):
            raise RuntimeError(f"the engine's weight transfer ({type(engine).__name__}) has no proof: start it "
                               f"with a --weight-transfer-config backend of sdpo_gloo, sdpo_nccl or sdpo_ipc")
        return engine

    def sdpo_begin_session(self, aliases_json: str = "{}") -> dict:
        """A trainer connects: a weight update a dead trainer left open is finished (the new one
        overwrites every layer), the aliases are set; returns what the trainer checks its model against."""
        engine = self._proven_engine()
        if self._weight_update_active:
            self.finish_weight_update()
        engine.aliases = json.loads(aliases_json)
        config = self.model_config.hf_config
        text = config.get_text_config()
        return {"architectures": list(getattr(config, "architectures", None) or []),
                "vocab_size": getattr(text, "vocab_size", None), "hidden_size": getattr(text, "hidden_size", None),
                "num_hidden_layers": getattr(text, "num_hidden_layers", None),
                "dtype": str(self.model_config.dtype).split(".")[-1],
                "logprobs_mode": str(self.model_config.logprobs_mode),
                "max_model_len": self.model_config.max_model_len}

    def sdpo_weight_proof(self) -> dict:
        """The last update as this worker's loader took it: {"loaded": name -> digest, "waiting": layers}."""
        engine = self._proven_engine()
        return {"loaded": getattr(engine, "loaded", {}), "waiting": getattr(engine, "waiting", [])}

    def sdpo_parameter_digest(self) -> dict:
        """name -> sha256 of the bytes of each of the model's parameters and buffers (tests compare
        engines by it; on CPU vLLM keeps a linear layer's packed copy, not its weight)."""
        import hashlib
        model = self.model_runner.get_model()
        tensors = dict(model.named_parameters())
        tensors.update(model.named_buffers())
        return {name: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                                     if t.numel() else b"").hexdigest() for name, t in tensors.items()}


# ----------------------------------------------------------------------------------------
# sdpo_gloo: the same protocol over a gloo group (rank 0: the trainer's sender; then the workers)


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A gloo group of its own (vLLM's stateless one: torchrun's and vLLM's groups are left alone)."""
    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, "gloo",
                                                          timeout=datetime.timedelta(seconds=timeout_s))


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """The workers' side of the handshake: the group's address, their first rank, its size, and
    the bucket size the trainer groups tensors by (both sides cut the same buckets: bucket_plan)."""
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int
    timeout_s: float


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One update's tensors, in the order they travel."""
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooReceiver(WeightTransferEngine):
    """Worker side of sdpo_gloo: receives the buckets of an update over the gloo group and loads
    them with layer-wise reload (each layer re-created and, on CPU, re-packed once its tensors are in)."""
    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    group = None
    bucket_bytes = 0

    def init_transfer_engine(self, init_info):
        self.shutdown()  # a group a previous trainer left
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.bucket_bytes = init_info.bucket_bytes
        self.group = open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                init_info.timeout_s)

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)
        if not torch.cuda.is_available():
            # each update re-creates and re-packs every layer's weights: hand the memory it freed
            # back to the system (docs/sync.md, Engine memory over a long run)
            import ctypes
            with contextlib.suppress(OSError, AttributeError):  # not glibc
                ctypes.CDLL("libc.so.6").malloc_trim(0)

    def update_weights(self, update_info):
        self.receive_weights(self.parse_update_info(update_info))  # no accelerator to synchronize on CPU

    def receive_weights(self, update_info):
        """Each bucket is received by a thread while the one before it loads (the trainer then
        gathers the next tensors meanwhile): two buckets at most in this process."""
        if self.group is None:
            raise RuntimeError("sdpo_gloo weight transfer not initialized: call init_weight_transfer_engine first")
        entries = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
        sizes = [nbytes_of(dtype, shape) for _, dtype, shape in entries]
        buckets = bucket_plan(sizes, self.bucket_bytes)

        def receive(bucket):  # each tensor straight into its place: the sender does not pack
            last, offset = bucket[-1]
            buf = torch.empty(offset + sizes[last], dtype=torch.uint8, device=self.device)
            for work in [self.group.broadcast(buf[at:at + sizes[i]], 0) for i, at in bucket]:
                work.wait()
            return buf
        with ThreadPoolExecutor(1) as receiver:
            arriving = receiver.submit(receive, buckets[0]) if buckets else None
            for k, bucket in enumerate(buckets):
                buf = arriving.result()
                arriving = receiver.submit(receive, buckets[k + 1]) if k + 1 < len(buckets) else None
                # views into the bucket: they live until vLLM has loaded their layer
                self.model.load_weights([
                    (entries[i][0], buf[at:at + sizes[i]].view(getattr(torch, entries[i][1])).view(entries[i][2]))
                    for i, at in bucket])

    def shutdown(self):
        close_group(self)


def close_group(holder):
    if holder.group is not None:
        with contextlib.suppress(Exception):  # a group whose peer died
            stateless_destroy_torch_distributed_process_group(holder.group)
        holder.group = None


class GlooWeightTransferEngine(ProvenLoads, GlooReceiver):
    """sdpo_gloo's worker engine, proven."""


class Job:
    """fn() in a daemon thread; `check()` re-raises its error as soon as it has one."""

    def __init__(self, fn):
        self.value, self.error, self.done = None, None, threading.Event()
        threading.Thread(target=self._run, args=(fn,), daemon=True).start()

    def _run(self, fn):
        try:
            self.value = fn()
        except BaseException as e:  # handed to whoever waits
            self.error = e
        finally:
            self.done.set()

    def check(self):
        if self.done.is_set() and self.error is not None:
            raise self.error

    def result(self, *watched: "Job"):
        """fn's value once it returns; a watched job's error as soon as it fails."""
        while not self.done.wait(0.05):
            for job in watched:
                job.check()
        self.check()
        return self.value


# ----------------------------------------------------------------------------------------
# sdpo_local: an engine in the trainer's own process takes the tensors themselves


@dataclass
class LocalWeightTransferInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the worker is in the trainer's process."""


@dataclass
class LocalWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """A chunk of an update: the tensors themselves (an in-process collective_rpc passes them as they are)."""
    names: list[str]
    tensors: list


class LocalReceiver(WeightTransferEngine):
    """Worker side of sdpo_local: loads the tensors it is handed with layer-wise reload."""
    init_info_cls = LocalWeightTransferInitInfo
    update_info_cls = LocalWeightTransferUpdateInfo

    def init_transfer_engine(self, init_info):
        pass

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info):
        self.receive_weights(self.parse_update_info(update_info))  # the trainer's tensors: nothing in flight

    def receive_weights(self, update_info):
        self.model.load_weights(list(zip(update_info.names, update_info.tensors)))

    def shutdown(self):
        pass


class LocalWeightTransferEngine(ProvenLoads, LocalReceiver):
    """sdpo_local's worker engine, proven."""


@dataclass
class LocalTrainerInitInfo(TrainerInitInfo):
    """bucket_bytes: the most bytes of tensors handed over in one update_weights."""
    backend: ClassVar[str] = "sdpo_local"
    bucket_bytes: int = 512 << 20


class OursTrainerEngine(TrainerWeightTransferEngine):
    """The trainer side of our backends: every rank iterates the source (each tensor an FSDP2
    all-gather, complete before it is yielded); the sender joins the workers at init (`join`) and
    ships the tensors between the workers' start and finish (`ship`)."""
    info = None

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        if engine.is_sender:
            engine.join(client)
        return engine

    def send_weights(self):
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # this rank's part of each gather
                pass
            return
        self.client.start_weight_update()
        self.ship(NCCLTrainerWeightTransferEngine._checked_iter(self.source, meta), meta)
        self.client.finish_weight_update()


class LocalTrainerWeightTransferEngine(OursTrainerEngine):
    """Trainer side of sdpo_local (one process: the trainer and its engine): the source's tensors,
    a bucket's worth at a time, handed to the engine's update_weights by reference."""
    init_info_cls = LocalTrainerInitInfo

    def join(self, client):
        client.init_weight_transfer_engine({})

    def ship(self, pairs, meta):
        names, tensors, held = [], [], 0
        for name, tensor in pairs:
            names.append(name)
            tensors.append(tensor)
            held += tensor.numel() * tensor.element_size()
            if held >= self.info.bucket_bytes:
                self.client.update_weights({"names": names, "tensors": tensors})
                names, tensors, held = [], [], 0
        if names:
            self.client.update_weights({"names": names, "tensors": tensors})


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Rank 0 (the sender) opens the group at master_address:master_port; world_size: 1 + the
    engine's workers; bucket_bytes: the largest bucket (a larger tensor travels alone)."""
    backend: ClassVar[str] = "sdpo_gloo"
    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 2
    bucket_bytes: int = 512 << 20
    timeout_s: float = 600.0


class GlooTrainerWeightTransferEngine(OursTrainerEngine):
    """Trainer side of sdpo_gloo: the sender broadcasts each tensor as gathered and waits for it to
    arrive before it takes the next, while the workers' update_weights receives them, a bucket's
    into one buffer. A failure stops the sending, not the iteration: the other ranks' gathers
    complete, then the sender raises."""
    init_info_cls = GlooTrainerInitInfo
    group = None

    def join(self, client):
        """The workers join while this process opens the group; a failure of either ends both."""
        info = self.info
        worker = GlooWeightTransferInitInfo(info.master_address, info.master_port, 1, info.world_size,
                                            info.bucket_bytes, info.timeout_s)
        joining = Job(lambda: client.init_weight_transfer_engine(asdict(worker)))
        opening = Job(lambda: open_group(info.master_address, info.master_port, 0, info.world_size, info.timeout_s))
        joining.result(opening)
        self.group = opening.result(joining)

    def ship(self, pairs, meta):
        info = GlooWeightTransferUpdateInfo([m.name for m in meta], [str(m.dtype).split(".")[-1] for m in meta],
                                            [list(m.shape) for m in meta])
        receiving = Job(lambda: self.client.update_weights(asdict(info)))
        error = self._broadcast(pairs, receiving)
        if error is not None:
            self.shutdown()  # in an unknown state; the next sync opens a new one
            raise error
        receiving.result()

    def _broadcast(self, pairs, receiving: Job):
        """Each tensor sent as soon as it is gathered and waited for before the next gather (the
        workers receive a bucket's tensors into one buffer: bucket_plan); the first error, after
        the whole pass. One gathered tensor at a time: its memory is reused by the next gather."""
        error = None
        for _, tensor in pairs:  # gathered by every rank, whatever happens here; _checked_iter counts
            if error is not None:
                continue
            try:
                self._send(tensor.contiguous().reshape(-1).view(torch.uint8), receiving)
            except Exception as e:  # raised after the pass: the other ranks' gathers go on meanwhile
                error = e
        return error

    def _send(self, part: torch.Tensor, receiving: Job):
        work, pause = self.group.broadcast(part, 0), 1e-5
        while not work.is_completed():  # the workers' failure ends the wait, not the group's timeout
            receiving.check()
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)  # most tensors are small: don't sleep a millisecond on each
        work.wait()

    def shutdown(self):
        close_group(self)


def register():
    """vLLM general plugin: the worker backends sdpo_gloo, sdpo_nccl, sdpo_ipc and sdpo_local, and
    the trainer sides of sdpo_gloo and sdpo_local (in every process vLLM starts, and in the
    trainer's; vLLM may run a plugin twice)."""
    workers = {"sdpo_gloo": "GlooWeightTransferEngine", "sdpo_nccl": "ProvenNCCLWeightTransferEngine",
               "sdpo_ipc": "ProvenIPCWeightTransferEngine", "sdpo_local": "LocalWeightTransferEngine"}
    for name, cls in workers.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, __name__, cls)
    for name, cls in {"sdpo_gloo": "GlooTrainerWeightTransferEngine", "sdpo_local": "LocalTrainerWeightTransferEngine"}.items():
        if name not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(name, __name__, cls)
