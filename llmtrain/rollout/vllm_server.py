"""rollout.engine=vllm with rollout.vllm_server_url: generation on a vLLM server with GPUs of its own (TRL's
vllm_mode="server"); the trainer keeps the loss, the rewards and the optimizer. It speaks to vLLM's own server
(`vllm serve`, started as docs/grpo.md shows) as TRL 1.16's trl/generation/vllm_client.py does:

  * generation: vLLM's OpenAI-compatible POST /v1/completions, one request per row with its own seed (from its
    key: the colocated engine's vllm_requests, vLLM's per-request generator), sent concurrently (the server batches
    them): the prompt as token ids, return_token_ids, logprobs=0 (the sampled token's log-prob; the server runs with
    --logprobs-mode processed_logprobs: after temperature and top-k / top-p, the drift guard's);
  * weights (VLLM_SERVER_DEV_MODE=1, --weight-transfer-config '{"backend": "nccl"}'): rank 0 joins the server's
    workers in a NCCL group as its rank 0 (POST /init_weight_transfer_engine while vLLM's trainer side joins), then
    after each update POSTs /start_weight_update, /update_weights (the names, dtypes and shapes of what follows)
    while it broadcasts the tensors in that order, /finish_weight_update and /reset_prefix_cache (cached prefixes
    were computed with the old weights); every rank waits for it (a barrier) before the next generation;
  * the weight-sync check: POST /collective_rpc runs llmtrain.rollout.vllm_worker.WeightCheck's methods in every
    server worker (--worker-extension-cls): the dtype of its weights (what a push sends and the fingerprint is
    taken in) and its fingerprint of the weights it samples with.
The NCCL side is vLLM's trainer side (NcclTransport: vllm imported when the engine is built, TRL's switch at vLLM
0.28); the engine takes any Transport (tests/rollout/test_grpo_vllm_server.py: gloo, against a fake server).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from llmtrain import distributed
from llmtrain.config import RunError
from llmtrain.rollout.engine import Completions, EngineSetup, Sampling
from llmtrain.rollout.local import as_completions
from llmtrain.rollout.section import RolloutSection
from llmtrain.rollout.vllm import cut_at_eos, hf_layout, vllm_requests

CONCURRENT = 64  # completion requests in flight per rank (TRL's default generation concurrency)
EXTENSION = "llmtrain.rollout.vllm_worker.WeightCheck"


class Server:
    """A vLLM server's HTTP routes, JSON in and out, each answer awaited `timeout` seconds at most."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout

    def call(self, route: str, body: dict | None = None):
        """GET `route` (no body) or POST `body`; its JSON answer (None for an empty one), or a one-line RunError."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as e:
            detail = " ".join(e.read().decode(errors="replace").split())[:300]
            raise RunError(f"rollout.vllm_server_url: {route} at {self.url} answered {e.code}: {detail}") from None
        except OSError as e:  # refused, reset, timed out (URLError is an OSError)
            reason = getattr(e, "reason", e)
            raise RunError(f"rollout.vllm_server_url: {route} at {self.url} failed: {reason}") from None
        return json.loads(text) if text.strip() else None

    def wait(self) -> None:
        """Until /health answers; a server still starting is waited for up to `timeout` seconds."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self.call("/health")
                return
            except RunError as e:
                if time.monotonic() > deadline:
                    raise RunError(f"rollout.vllm_server_url: no vLLM server answered at {self.url} within "
                                   f"rollout.vllm_server_timeout={self.timeout:g} s ({e}); start it as docs/grpo.md "
                                   "shows, or raise the timeout") from None
            time.sleep(1.0)


class Transport(Protocol):
    """The trainer's side of the weight transfer group (rank 0 of it; the server's workers follow)."""
    init_extra: dict    # what init_info adds for this transport
    update_extra: dict  # what each update_info adds

    def address(self) -> str:
        """This host's address, where the server's workers find the group."""

    def connect(self, init_info: dict) -> None:
        """Join the group (blocks until the workers have joined too)."""

    def send(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Broadcast each tensor to the workers, in order."""


class NcclTransport:
    """vLLM's trainer side of its NCCL weight transfer (vllm.distributed.weight_transfer), as TRL 1.16 drives it:
    vLLM 0.28 replaced NCCLWeightTransferEngine's static trainer_init / trainer_send_weights with nccl_common's
    trainer_init and packed_tensor's packed_nccl_broadcast_producer, and moved "packed" from each update's info
    to the init info."""

    def __init__(self):
        from importlib.metadata import version

        from packaging.version import Version

        self.stateful = Version(version("vllm")) >= Version("0.28.0")
        self.init_extra = {"packed": True} if self.stateful else {}
        self.update_extra = {} if self.stateful else {"packed": True}

    def address(self) -> str:
        from vllm.utils.network_utils import get_ip

        return get_ip()

    def connect(self, init_info: dict) -> None:
        if self.stateful:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
            trainer_init = NCCLWeightTransferEngine.trainer_init
        self.group = trainer_init(init_info)

    def send(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        if self.stateful:
            from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

            packed_nccl_broadcast_producer(iterator=tensors, group=self.group, src=0,
                                           post_iter_func=lambda item: item[1])
        else:
            from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerSendWeightsArgs,
                                                                      NCCLWeightTransferEngine)

            NCCLWeightTransferEngine.trainer_send_weights(
                iterator=tensors, trainer_args=NCCLTrainerSendWeightsArgs(group=self.group, packed=True))


class VLLMServerEngine:
    """Generation on a vLLM server; rank 0 pushes the weights to it (the module's docstring)."""
    copies_weights = True

    def __init__(self, section: RolloutSection, setup: EngineSetup, transport: Callable[[], Transport] = NcclTransport):
        self.server = Server(section.vllm_server_url, section.vllm_server_timeout)
        self.server.wait()
        self.model_name = self.server.call("/v1/models")["data"][0]["id"]
        layout = hf_layout(setup.model_config)
        self.shapes, self.pushed = layout.shapes, layout.pushed
        self.weights_dtype = getattr(torch, self.rpc("llmtrain_dtype")[0])
        self.eos, self.pad, self.device, self.transport = sorted(set(setup.eos_ids)), setup.pad_id, setup.device, None
        if dist.get_rank() == 0:
            self.transport = transport()
            self.connect(section.vllm_group_port)

    def rpc(self, method: str, *args: str) -> list:
        """Every server worker's answer to WeightCheck's `method` (string arguments only: /collective_rpc's)."""
        try:
            return self.server.call("/collective_rpc", {"method": method, "args": list(args)})["results"]
        except RunError as e:
            raise RunError(f"{e}; the weight-sync check needs the server started with VLLM_SERVER_DEV_MODE=1 and "
                           f"--worker-extension-cls {EXTENSION} (docs/grpo.md)") from None

    def connect(self, port: int) -> None:
        """Rank 0 joins the server's weight transfer group."""
        config = self.server.call("/server_info?config_format=json")["vllm_config"]
        if "weight_transfer_config" not in config or config["weight_transfer_config"] is None:  # older vLLM, or off
            raise RunError(f"rollout.vllm_server_url: the server at {self.server.url} has no weight transfer engine; "
                           "start it with --weight-transfer-config '{\"backend\": \"nccl\"}' (docs/grpo.md)")
        workers = self.server.call("/get_world_size")["world_size"]
        init = {"master_address": self.transport.address(), "master_port": port, "rank_offset": 1,
                "world_size": workers + 1, **self.transport.init_extra}
        self.alongside("/init_weight_transfer_engine", {"init_info": init}, lambda: self.transport.connect(init))

    def alongside(self, route: str, body: dict, collective: Callable[[], None]) -> None:
        """POST `route` while `collective` runs: the server's handler blocks in its side of the collective until
        ours joins. Ours runs in a daemon thread, so an error answer ends the run instead of a wait."""
        failed: list[BaseException] = []

        def run():
            try:
                collective()
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                failed.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.server.call(route, body)
        thread.join(self.server.timeout)
        if failed:
            raise failed[0]
        if thread.is_alive():
            raise RunError(f"rollout.vllm_server_url: {route} was answered, but the trainer's side of the weight "
                           f"transfer did not finish within rollout.vllm_server_timeout={self.server.timeout:g} s")

    def update_weights(self, step: int, full: dict[str, torch.Tensor]) -> None:
        if self.transport is not None:
            dtype = str(self.weights_dtype).removeprefix("torch.")
            info = {"names": self.pushed, "dtype_names": [dtype] * len(self.pushed),
                    "shapes": [list(self.shapes[n]) for n in self.pushed], **self.transport.update_extra}
            tensors = ((n, full[n].to(self.device, self.weights_dtype)) for n in self.pushed)
            self.server.call("/start_weight_update", {})
            self.alongside("/update_weights", {"update_info": info}, lambda: self.transport.send(tensors))
            self.server.call("/finish_weight_update", {})
            self.server.call("/reset_prefix_cache", {})
        dist.barrier()  # no rank samples before the server holds this step's weights

    def fingerprint(self, names: list[str]) -> dict[str, float]:
        """Collective: the first server worker's fingerprint that differs from the others' (every worker holds a
        whole copy), asked for by rank 0 and sent to every rank (one all-gather, not one request per rank)."""
        results = distributed.gather_objects(self.rpc("llmtrain_fingerprint", json.dumps(names))
                                             if dist.get_rank() == 0 else None)[0]
        return next((r for r in results if r != results[0]), results[0])

    def generate(self, prompt_ids, keys, sampling: Sampling) -> Completions:
        bodies = [{"model": self.model_name, "prompt": prompt["prompt_token_ids"], "return_token_ids": True,
                   **{k: v for k, v in params.items() if k != "detokenize"}}  # a SamplingParams field, not an API one
                  for prompt, params in vllm_requests(prompt_ids, keys, sampling, self.eos)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(min(CONCURRENT, len(bodies))) as pool:
            choices = [answer["choices"][0] for answer in pool.map(lambda b: self.server.call("/v1/completions", b),
                                                                   bodies)]
        seconds = time.perf_counter() - t0
        logps = [None if c["logprobs"] is None else c["logprobs"]["token_logprobs"] for c in choices]
        return as_completions(cut_at_eos([c["token_ids"] for c in choices], logps, self.eos, self.pad), seconds)
