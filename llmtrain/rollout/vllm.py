"""rollout.engine=vllm: vLLM colocated in the training processes (TRL's vllm_mode="colocate"), and its glue: the
requests for the keyed rows of llmtrain.rollout.local.generate (vllm_requests) and their answers read back as
Completions with the sampled tokens' log-probs (from_vllm). vllm is imported when a VLLMEngine is built, so this
module and its tests run without it (tests/rollout/test_grpo_vllm.py: a fake vllm module).

What VLLMEngine follows: vLLM 0.10.2 / 0.11 (the versions TRL 0.24-0.26 pin) as TRL v0.24.0's
trl/trainer/grpo_trainer.py uses it (GRPOTrainer.__init__'s colocated LLM, _move_model_to_vllm, the colocate
branch of generation), and vLLM's engine arguments (docs.vllm.ai/en/v0.10.2/configuration/engine_args.html):
  * one vllm.LLM per training process: distributed_executor_backend="external_launcher" (vLLM joins the training's
    torch.distributed world instead of starting workers), tensor_parallel_size 1 (each rank its own engine and its
    own rows), gpu_memory_utilization (rollout.vllm_gpu_memory_utilization), max_num_seqs = a rank's rows per call,
    max_model_len = the prompt and completion budgets, max_num_batched_tokens 4096 (TRL: vLLM V1's memory profiler
    is misled by the default), logprobs_mode="processed_logprobs" (the sampled token's log-prob after temperature
    and top-k / top-p: the drift guard's), seed train.seed (every request brings its own seed anyway).
  * its model: a directory holding only the policy's Hugging Face config (output_dir/.vllm-config/rank<r>, each
    run rewrites it), load_format="dummy" (no weights read: the first push brings them), skip_tokenizer_init (prompts
    go in as token ids, completions come back as ids: detokenize False), dtype the training's compute dtype.
  * update_weights: every tensor of the gathered full weights (a tied one once), broadcast from rank 0, goes by its
    Hugging Face name through the model's own loader,
    llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)]), which fuses
    q/k/v into qkv_proj and gate/up into gate_up_proj as a checkpoint load does; then llm.reset_prefix_cache()
    (cached prefixes were computed with the old weights).
  * sleep mode (rollout.vllm_enable_sleep_mode: vLLM's enable_sleep_mode): asleep except from a push to the end of the
    generate that follows it, so training has the memory: llm.sleep(level=1) (weights offloaded to the CPU, KV
    cache dropped) after building and after each generate, llm.wake_up() before a push. Level 1 as in TRL 0.24:
    level 2 (TRL 0.26) also discards buffers such as the RoPE caches, which no push restores
    (vllm-project/vllm#16564, #29341).
  * fingerprint (llmtrain.rollout.sync): vLLM's parameters are fused and padded (qkv_proj, gate_up_proj, the
    vocabulary rounded up to a multiple of 64), so each Hugging Face name is read through a view of them (hf_view):
    a name vLLM keeps, its first rows; a member of the model's packed_modules_mapping (q_proj -> qkv_proj, ...),
    its rows of the fused tensor, after those of the members before it. These are the trainer tensor's elements,
    so the fingerprint is exactly sync's, in the copy's dtype: a stale copy is caught as with transformers, on the
    weights vLLM samples with (not on what was sent). A family whose names vLLM maps otherwise stops the check
    with one line naming the parameter.
vLLM on a server of its own (rollout.vllm_server_url): llmtrain.rollout.vllm_server, which shares this module's
requests, the reading of completions, the layout and the fingerprint. Not built: LoRA as a vLLM adapter (the adapters
are merged into the pushed weights), tensor parallelism inside a colocated vLLM.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM

from llmtrain.config import RunError
from llmtrain.rollout.engine import Completions, EngineSetup, Sampling
from llmtrain.rollout.local import CompletionGrid, as_completions, from_lists, sample_seed
from llmtrain.rollout.section import RolloutSection
from llmtrain.rollout.sync import fingerprint


def vllm_requests(prompts: list[list[int]], keys: list[tuple[int, ...]], sampling: Sampling,
                  eos_ids: list[int]) -> list[tuple[dict, dict]]:
    """The vLLM requests of generate's rows: (TokensPrompt, SamplingParams keyword arguments) each, one
    completion per request seeded from its key (vLLM's per-request generator: reproducible by key, not the
    local sampler's tokens), the sampled token's log-prob returned (logprobs=0; an LLM built with
    logprobs_mode="processed_logprobs" gives it after temperature and top-k / top-p, as generate's), stopping
    at every EOS id, token ids only (detokenize False). Plain dicts: vllm is imported by whoever calls it."""
    params = {"n": 1, "temperature": sampling.temperature, "top_p": sampling.top_p,
              "top_k": sampling.top_k or -1, "max_tokens": sampling.max_tokens, "logprobs": 0,
              "stop_token_ids": sorted(set(eos_ids)), "detokenize": False}
    return [({"prompt_token_ids": list(p)}, {**params, "seed": sample_seed(*key)}) for p, key in zip(prompts, keys)]


def from_vllm(outputs: list, eos_ids: list[int], pad_id: int) -> CompletionGrid:
    """Completions (with log-probs) from vLLM's RequestOutputs in request order: each one's first
    CompletionOutput's token ids and the sampled token's Logprob at each position (cut_at_eos)."""
    tokens, logps = [], []
    for request in outputs:
        out = request.outputs[0]
        tokens.append(list(out.token_ids))
        logps.append(None if out.logprobs is None else [p[t].logprob for p, t in zip(out.logprobs, out.token_ids)])
    return cut_at_eos(tokens, logps, eos_ids, pad_id)


def cut_at_eos(tokens: list[list[int]], logps: list[list[float] | None], eos_ids: list[int],
               pad_id: int) -> CompletionGrid:
    """Completions with log-probs from what vLLM sampled (a row's token ids and each one's log-prob): each row up
    to and including its first EOS, truncated when no EOS was sampled (finish_reason "length")."""
    eos, kept, kept_logps = set(eos_ids), [], []
    for ids, row_logps in zip(tokens, logps):
        n = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        if row_logps is None or len(row_logps) < n:
            raise ValueError("vLLM returned a completion without a log-prob per token; sample with logprobs=0")
        kept.append(ids[:n])
        kept_logps.append(row_logps[:n])
    done = from_lists(kept, [not (row and row[-1] in eos) for row in kept], pad_id)
    grid = torch.zeros(done.ids.shape)
    for i, row in enumerate(kept_logps):
        grid[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return done._replace(logps=grid)


class Layout(NamedTuple):
    """A policy's tensors as vLLM loads them: by Hugging Face name."""
    shapes: dict[str, tuple[int, ...]]  # every name of the state dict (a tied weight under each of its names)
    pushed: list[str]                   # the names a push sends: a tied weight once, by its first name
    architecture: str                   # the model's class name (config.architectures: how vLLM picks its own)


def hf_layout(model_config) -> Layout:
    """The Layout of a Hugging Face config's model (built on meta: names and shapes only). torch.device("meta") is
    per thread, unlike accelerate's init_empty_weights, which patches nn.Module for every thread: two threads in it
    at once can leave it patched (a server answering two ranks' checks at once did)."""
    with torch.device("meta"):
        shaped = AutoModelForCausalLM.from_config(copy.deepcopy(model_config))
    shaped.tie_weights()
    tensors = shaped.state_dict(keep_vars=True)
    first = {}
    for name, t in tensors.items():
        first.setdefault(id(t), name)
    return Layout({name: tuple(t.shape) for name, t in tensors.items()}, list(first.values()), type(shaped).__name__)


def vllm_fingerprint(model: nn.Module, shapes: dict[str, tuple[int, ...]], names: list[str]) -> dict[str, float]:
    """sync.fingerprint of vLLM's model (its fused, padded parameters read by Hugging Face names through hf_view) in
    its own dtype: the weights vLLM samples with."""
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied lm_head.weight by its own name too
    packed = getattr(model, "packed_modules_mapping", {})  # vLLM's models with fused layers declare it
    dtype = next(iter(params.values())).dtype
    return fingerprint({n: hf_view(params, packed, shapes, n) for n in names}, names, dtype)


def hf_view(params: dict[str, torch.Tensor], packed: dict[str, list[str]], shapes: dict[str, tuple[int, ...]],
            name: str) -> torch.Tensor:
    """The elements of vLLM's parameters (`params`, by vLLM's names) that hold the Hugging Face tensor `name` of
    shape shapes[name]: its first rows of the parameter of the same name (a padded vocabulary), or, for a member of
    `packed` (the model's packed_modules_mapping: fused name -> the Hugging Face modules it stacks), its rows of the
    fused parameter after those of the members before it."""
    tensor, offset, parts = params.get(name), 0, name.split(".")
    member = {m: (fused, members) for fused, members in packed.items() for m in members}
    for i, part in enumerate(parts if tensor is None else []):
        if part in member:
            fused, members = member[part]
            renamed = lambda module: ".".join([*parts[:i], module, *parts[i + 1:]])  # noqa: E731
            tensor = params.get(renamed(fused))
            offset = sum(shapes[renamed(m)][0] for m in members[:members.index(part)])
            break
    view = None if tensor is None else tensor[offset:offset + shapes[name][0]]
    if view is None or tuple(view.shape) != shapes[name]:
        raise RunError(f"rollout.engine=vllm: no vLLM parameter holds {name} {list(shapes[name])} (this family's names "
                       "are not mapped by llmtrain/rollout/vllm.py's hf_view): the weight-sync check cannot read it")
    return view


class VLLMEngine:
    """vLLM colocated in each training process, on its own copy of the policy (the module's docstring)."""
    copies_weights = True

    def __init__(self, section: RolloutSection, setup: EngineSetup):
        import vllm  # here: optional and CUDA only (llmtrain.rollout.section.check_engine refused a run without it)

        layout = hf_layout(setup.model_config)
        self.shapes, self.pushed = layout.shapes, layout.pushed
        config = copy.deepcopy(setup.model_config)
        config.architectures = [layout.architecture]  # vLLM picks its model class by it (an inline config has none)
        directory = Path(setup.workdir) / ".vllm-config" / f"rank{dist.get_rank()}"  # rewritten by the next run
        directory.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(directory)
        self.weights_dtype, self.device, self.sleep_mode = setup.dtype, setup.device, section.vllm_enable_sleep_mode
        self.eos, self.pad, self.params = sorted(set(setup.eos_ids)), setup.pad_id, vllm.SamplingParams
        self.llm = vllm.LLM(model=str(directory), load_format="dummy", skip_tokenizer_init=True,
                            dtype=str(setup.dtype).removeprefix("torch."), seed=setup.seed,
                            distributed_executor_backend="external_launcher", tensor_parallel_size=1,
                            gpu_memory_utilization=section.vllm_gpu_memory_utilization, max_model_len=setup.max_len,
                            max_num_seqs=setup.max_rows, max_num_batched_tokens=max(4096, setup.max_rows),
                            enable_sleep_mode=section.vllm_enable_sleep_mode, logprobs_mode="processed_logprobs")
        self.asleep = False
        self.sleep()

    def vllm_model(self) -> nn.Module:
        """vLLM's model in this process (external_launcher: the engine core runs here)."""
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def sleep(self) -> None:
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            torch.cuda.empty_cache()  # TRL: the training's cached blocks, before vLLM takes its memory back
            self.llm.wake_up()
            self.asleep = False

    def update_weights(self, step: int, full: dict[str, torch.Tensor]) -> None:
        self.wake()
        model = self.vllm_model()
        for name in self.pushed:
            tensor = (full[name].to(self.device, self.weights_dtype) if full else
                      torch.empty(self.shapes[name], dtype=self.weights_dtype, device=self.device))
            dist.broadcast(tensor, src=0)
            model.load_weights([(name, tensor)])
        self.llm.reset_prefix_cache()

    def fingerprint(self, names: list[str]) -> dict[str, float]:
        return vllm_fingerprint(self.vllm_model(), self.shapes, names)

    def generate(self, prompt_ids, keys, sampling) -> Completions:
        requests = vllm_requests(prompt_ids, keys, sampling, self.eos)
        self.wake()
        t0 = time.perf_counter()
        outputs = self.llm.generate([prompt for prompt, _ in requests],
                                    [self.params(**params) for _, params in requests], use_tqdm=False)
        seconds = time.perf_counter() - t0
        self.sleep()
        return as_completions(from_vllm(outputs, self.eos, self.pad), seconds)
