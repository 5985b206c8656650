"""What the vLLM engine tests share (tests/rollout/test_grpo_vllm.py, test_grpo_vllm_server.py): a trainer Llama with
GQA and tied embeddings, vLLM's layout of it (FakeVLLMModel: fused q/k/v and gate/up, a padded vocabulary, its
loader by Hugging Face names), and a fake vLLM server (FakeServer: the HTTP routes VLLMServerEngine calls, weights
received over a gloo group, llmtrain's worker extension run on FakeVLLMModel)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from llmtrain.rollout.vllm_worker import WeightCheck

VOCAB, PADDED = 24, 64  # the trainer's vocabulary, and vLLM's padded to a multiple of 64
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def put(root: nn.Module, dotted: str, param: nn.Parameter) -> None:
    *path, leaf = dotted.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    root.register_parameter(leaf, param)


class FakeVLLMModel(nn.Module):
    """vLLM's Llama as its loader sees it: qkv_proj = [q; k; v] rows, gate_up_proj = [gate; up], the vocabulary
    padded to a multiple of 64 rows (PADDED for VOCAB), lm_head the embedding's parameter; load_weights takes
    Hugging Face names and copies each tensor into its rows, skipping the tied lm_head, as vLLM's
    LlamaForCausalLM.load_weights does."""
    packed_modules_mapping = PACKED

    def __init__(self, config, dtype: torch.dtype, events: list):
        super().__init__()
        self.events, h, hd = events, config.hidden_size, config.hidden_size // config.num_attention_heads
        self.rows = {"q_proj": config.num_attention_heads * hd, "k_proj": config.num_key_value_heads * hd,
                     "v_proj": config.num_key_value_heads * hd, "gate_proj": config.intermediate_size,
                     "up_proj": config.intermediate_size}
        empty = lambda *shape: nn.Parameter(torch.full(shape, float("nan"), dtype=dtype), requires_grad=False)  # noqa: E731
        put(self, "model.embed_tokens.weight", empty(-(-config.vocab_size // 64) * 64, h))
        for i in range(config.num_hidden_layers):
            layer = f"model.layers.{i}."
            put(self, layer + "self_attn.qkv_proj.weight", empty(sum(self.rows[m] for m in PACKED["qkv_proj"]), h))
            put(self, layer + "self_attn.o_proj.weight", empty(h, h))
            put(self, layer + "mlp.gate_up_proj.weight", empty(2 * config.intermediate_size, h))
            put(self, layer + "mlp.down_proj.weight", empty(h, config.intermediate_size))
            put(self, layer + "input_layernorm.weight", empty(h))
            put(self, layer + "post_attention_layernorm.weight", empty(h))
        put(self, "model.norm.weight", empty(h))
        put(self, "lm_head.weight", self.model.embed_tokens.weight)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            assert not self.events or self.events[-1] != "sleep", "load_weights on a sleeping engine"
            self.events.append(("load", name, tensor.dtype))
            if name.startswith("lm_head."):
                continue
            fused = next(((f, m) for f, members in PACKED.items() for m in members if f".{m}." in name), None)
            target, offset = (name, 0) if fused is None else (name.replace(fused[1], fused[0]), sum(
                self.rows[m] for m in PACKED[fused[0]][:PACKED[fused[0]].index(fused[1])]))
            params[target].data[offset:offset + tensor.shape[0]].copy_(tensor)


def trainer() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))




PAST_EOS = 2  # tokens a fake returns after an EOS for odd seeds (the engine must cut them)


def sampled(seed: int, max_tokens: int, stop_token_ids: list[int]) -> tuple[list[int], list[float]]:
    """A fake engine's completion of a request seeded `seed`: tokens drawn from the seed, the i-th with log-prob
    -0.5 i; it stops max_tokens in, or PAST_EOS tokens after the first stop id for odd seeds (at it for even)."""
    g = torch.Generator().manual_seed(seed)
    ids, stop = [], None
    while len(ids) < max_tokens and (stop is None or len(ids) < stop):
        ids.append(int(torch.randint(1, VOCAB, (1,), generator=g)))
        if ids[-1] in stop_token_ids and stop is None:
            stop = len(ids) + (PAST_EOS if seed % 2 else 0)
    return ids, [-0.5 * (i + 1) for i in range(len(ids))]


def each(work, items) -> list:
    """work(item) for every item at once, one thread each (the server's workers are processes of their own)."""
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(work, items))


class FakeWorker(WeightCheck):
    """A vLLM worker with llmtrain's extension mixed in, as vLLM builds it: model_runner.model, model_config."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype):
        self.model_config = SimpleNamespace(hf_config=config)
        self.model_runner = SimpleNamespace(model=FakeVLLMModel(config, dtype, []))


class FakeServer:
    """`vllm serve` as VLLMServerEngine sees it, on 127.0.0.1 in threads of this process: /health, /v1/models,
    /v1/completions (sampled()), /server_info, /get_world_size, the weight transfer routes (the group: gloo, the
    workers' ranks after the trainer's 0, one thread each; each tensor announced by /update_weights received by
    every worker in order and loaded by those that are not `stale`), /reset_prefix_cache and /collective_rpc
    (the workers' methods; a worker without the extension has none). `calls` records (route, body) in order."""

    def __init__(self, config: LlamaConfig, workers: int = 1, stale: tuple[int, ...] = (),
                 weight_transfer: bool = True, extension: bool = True, failing: str | None = None,
                 dtype: torch.dtype = torch.bfloat16, policy: bool = False):
        self.workers = [FakeWorker(config, dtype) for _ in range(workers)]
        # policy: completions sampled from the pushed weights (a whole Hugging Face model in fp32, fed what the
        # first worker loads) instead of sampled()'s tokens
        self.policy = AutoModelForCausalLM.from_config(config).eval() if policy else None
        self.stale, self.weight_transfer, self.extension, self.failing = stale, weight_transfer, extension, failing
        self.calls: list[tuple[str, dict | None]] = []
        self.groups = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.answer(None)

            def do_POST(self):
                self.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def answer(self, body):
                route = self.path.split("?")[0]
                server.calls.append((route, body))
                try:
                    status, out = (500, {"error": "boom"}) if route == server.failing else (200, server.route(route,
                                                                                                             body))
                except Exception as e:  # noqa: BLE001 - vLLM answers 500 with the error
                    status, out = 500, {"error": f"{type(e).__name__}: {e}"}
                data = b"" if out is None else json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()

    def route(self, route: str, body: dict | None):
        if route == "/health":
            return None
        if route == "/v1/models":
            return {"data": [{"id": "policy"}]}
        if route == "/server_info":
            return {"vllm_config": {"weight_transfer_config": {"backend": "nccl"} if self.weight_transfer else None}}
        if route == "/get_world_size":
            return {"world_size": len(self.workers)}
        if route == "/init_weight_transfer_engine":
            info = body["init_info"]

            def join(i: int):
                store = dist.TCPStore(info["master_address"], info["master_port"], info["world_size"],
                                      is_master=False)
                return dist.ProcessGroupGloo(store, info["rank_offset"] + i, info["world_size"])
            self.groups = each(join, range(len(self.workers)))
            return {"message": "Weight transfer initialized"}
        if route == "/update_weights":
            info = body["update_info"]

            def receive(i: int):
                for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
                    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                    self.groups[i].broadcast([tensor], dist.BroadcastOptions()).wait()  # root 0: the trainer
                    if i not in self.stale:
                        self.workers[i].model_runner.model.load_weights([(name, tensor)])
                        if i == 0 and self.policy is not None:
                            self.policy.state_dict()[name].copy_(tensor)
            each(receive, range(len(self.workers)))
            return {"message": "Weights updated"}
        if route in ("/start_weight_update", "/finish_weight_update", "/reset_prefix_cache"):
            return {"success": True}
        if route == "/collective_rpc":
            if not self.extension:
                raise AttributeError(f"'Worker' object has no attribute '{body['method']}'")
            return {"results": [getattr(w, body["method"])(*body["args"]) for w in self.workers]}
        if route == "/v1/completions":
            ids, logps = (sampled(body["seed"], body["max_tokens"], body["stop_token_ids"]) if self.policy is None
                          else self.sample(body))
            return {"choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop",
                                 "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logps}}]}
        raise KeyError(route)

    @torch.no_grad()
    def sample(self, body: dict) -> tuple[list[int], list[float]]:
        """One completion from the policy: each token drawn from softmax(logits / temperature) by a generator
        seeded with the request's seed (no top-k / top-p), with its log-prob under that distribution."""
        assert body["top_p"] == 1 and body["top_k"] == -1 and body["n"] == 1 and body["logprobs"] == 0, body
        g, row, ids, logps = torch.Generator().manual_seed(body["seed"]), list(body["prompt"]), [], []
        while len(ids) < body["max_tokens"] and not (ids and ids[-1] in body["stop_token_ids"]):
            logp = torch.log_softmax(self.policy(torch.tensor([row + ids])).logits[0, -1] / body["temperature"], -1)
            ids.append(int(torch.multinomial(logp.exp(), 1, generator=g)))
            logps.append(logp[ids[-1]].item())
        return ids, logps


class GlooTransport:
    """VLLMServerEngine's Transport over gloo (NcclTransport's stand-in on a CPU): rank 0 of the group, the store's
    host; each tensor broadcast from it in order."""
    init_extra, update_extra = {}, {}

    def address(self) -> str:
        return "127.0.0.1"

    def connect(self, init_info: dict) -> None:
        store = dist.TCPStore(init_info["master_address"], init_info["master_port"], init_info["world_size"],
                              is_master=True)
        self.group = dist.ProcessGroupGloo(store, 0, init_info["world_size"])

    def send(self, tensors) -> None:
        for _, tensor in tensors:
            self.group.broadcast([tensor], dist.BroadcastOptions()).wait()
