"""Typed configuration: YAML file + dotted `key.sub=value` overrides -> dataclasses.

Every section is a dataclass; unknown keys, wrong types, bad choices and numbers outside their declared
range (ranged(): every numeric key has one) raise ConfigError naming the key (with the closest valid one),
before any process group or model exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml


class ConfigError(ValueError):
    """A user error in the configuration; the message names the key."""


class RunError(RuntimeError):
    """A failure during training that its one-line message explains (e.g. a reward function that raised):
    the run stops with exit 1 and that line, no traceback, saving nothing more."""


class Range(NamedTuple):
    """An interval of valid values, written "[1, inf)", "(0, inf)", "[0, 1)": a bracket includes its bound."""
    lo: float
    hi: float
    lo_closed: bool
    hi_closed: bool

    @classmethod
    def parse(cls, text: str) -> Range:
        m = re.fullmatch(r"([\[(])\s*(\S+?)\s*,\s*(\S+?)\s*([\])])", text)
        if not m:
            raise ValueError(f"range {text!r}: write it like [0, 1) or (0, inf)")
        lo, hi = (int(b) if re.fullmatch(r"-?\d+", b) else float(b) for b in m.group(2, 3))
        return cls(lo, hi, m.group(1) == "[", m.group(4) == "]")

    def __contains__(self, value: float) -> bool:  # written so that nan is outside every range
        return ((self.lo <= value) if self.lo_closed else (self.lo < value)) and \
            ((value <= self.hi) if self.hi_closed else (value < self.hi))

    def __str__(self) -> str:
        if self.hi == math.inf:
            return f"{'>=' if self.lo_closed else '>'} {self.lo}"
        return f"in {'[' if self.lo_closed else '('}{self.lo}, {self.hi}{']' if self.hi_closed else ')'}"


def ranged(interval: str, **field_kwargs: Any) -> Any:
    """A dataclass field whose value (each item, for a list; None passes) must lie in `interval` (Range.parse);
    load_config refuses any other, naming the key, the value and the range; --help-config shows it."""
    return field(metadata={"range": Range.parse(interval)}, **field_kwargs)


def input_path(path_of: typing.Callable[[str], str | None] = str, **field_kwargs: Any) -> Any:
    """A dataclass field naming a file or directory the run reads (each item, for a list; `path_of` gives the path
    within a value, None when it names none): no run writes where one lies (input_paths; checked at set-up)."""
    return field(metadata={"input": path_of}, **field_kwargs)


TEMPLATE_FILES = (".jinja", ".json")  # a data.chat_template ending so names a file; any other value is Jinja text


def template_file(value: str) -> str | None:
    return value if value.endswith(TEMPLATE_FILES) else None


@dataclass
class ModelConfig:
    path: str | None = input_path(default=None)
    """Local Hugging Face model directory (or hub id when online): config, weights, tokenizer."""
    config: dict | None = None
    """Inline Llama config (transformers LlamaConfig kwargs) for a randomly initialised model."""
    trust_remote_code: bool = False
    """Allow model code from the model directory (only for models you trust)."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    """Attention kernel passed to transformers (sdpa: packed rows skip the masked half;
    llmtrain/models/attention.py); a family without it (Gemma2: no sdpa) gets eager, logged."""
    freeze: list[Literal["vision_tower", "projector", "language_model"]] = field(
        default_factory=lambda: ["vision_tower"])
    """A vision-language model's parts left untrained (docs/vision.md); [] trains all three; with LoRA, the parts
    without adapters. Text models: unused."""


@dataclass
class TokenizerConfig:
    path: str | None = input_path(default=None)
    """Tokenizer directory; defaults to model.path."""


# data.format's choices: the names of llmtrain.data.formats.FORMATS (config imports nothing of llmtrain, so the
# names are repeated here; tests/data/test_formats.py checks the two agree).
FormatName = Literal["text", "instruction", "chat", "preference", "unpaired", "prompt"]


@dataclass
class SourceConfig:
    path: str = input_path(default="")
    """A file, glob or directory."""
    format: FormatName = "text"
    """How this source's records become tokens and labels."""
    weight: float = ranged("(0, inf)", default=1.0)
    """Relative sampling frequency among data.sources."""


@dataclass
class DataConfig:
    path: str = input_path(default="")
    """Training data: a file, a glob or a directory (jsonl/json/parquet/csv/txt); or use data.sources."""
    format: FormatName = "text"
    """text: raw documents; instruction: Alpaca-style records; chat: messages (OpenAI or ShareGPT style);
    preference: {prompt, chosen, rejected} pairs, text or messages (recipes/dpo.py); unpaired: {prompt, completion,
    label} rows, label true (desirable) or false, text or messages (recipes/kto.py); prompt: {prompt, ...}
    prompts, text or messages, the other columns passed to the reward functions (recipes/grpo.py)."""
    sources: list[SourceConfig] | None = None
    """Several sources mixed by weight: [{path, format, weight}, ...] (instead of data.path/format)."""
    chat_template: str | None = input_path(template_file, default=None)
    """The chat template the chat and preference formats render with: Jinja text, or a .jinja file, or a .json
    file with a chat_template key (a tokenizer_config.json); unset: the tokenizer's own, else llmtrain's
    default, whose markers that tokenizer learns as plain text (said at start-up)."""
    seq_len: int = ranged("[1, inf)", default=256)
    """Tokens per training row; longer examples are truncated (text: split)."""
    packing: bool = True
    """Pack several examples per row (each attends only to itself); else one per row, padded."""
    text_field: str = "text"
    """format=text: the field holding the document."""
    instruction_field: str = "instruction"
    """format=instruction: the task field."""
    input_field: str = "input"
    """format=instruction: the optional context field."""
    output_field: str = "output"
    """format=instruction: the response field (the trained part)."""
    prompt_template: str = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    """format=instruction: prompt for records with an input."""
    prompt_template_no_input: str = "### Instruction:\n{instruction}\n\n### Response:\n"
    """format=instruction: prompt for records without an input."""
    messages_field: str = "messages"
    """format=chat: list of {role, content}; ShareGPT `conversations` ({from, value}) is mapped to it."""
    train_on_prompt: bool = False
    """Also train on prompts / non-assistant turns (default: only responses carry a loss)."""
    strict: bool = False
    """Fail on the first bad record (naming file and line) instead of skipping and counting."""
    val_path: str | None = input_path(default=None)
    """Validation data (same format); else data.val_fraction of the training records is held out."""
    val_fraction: float = ranged("[0, 1)", default=0.0)
    """Fraction of training records held out for validation when data.val_path is not set."""
    streaming: bool = False
    """Read, tokenize and pack on the fly (IterableDataset + split_dataset_by_node); flat memory."""
    shuffle_buffer: int = ranged("[1, inf)", default=10000)
    """data.streaming: examples in the shuffle buffer."""


@dataclass
class HarnessConfig:
    tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks scored during and after training (names, task YAML files or folders of them;
    offline: their data must be local files, e.g. assets/eval/demo/); [] disables. Needs llmtrain[eval]."""
    every_steps: int = ranged("[0, inf)", default=0)
    """Also score the current weights every N steps (gathered on rank 0, as an export is); 0: at the end only."""
    at_end: bool = True
    """Score the final export (output_dir/hf) at the end of training."""
    limit: float | None = ranged("(0, inf)", default=None)
    """Examples per task (a fraction of them if < 1), as lm-eval's --limit; None: all."""
    num_fewshot: int | None = ranged("[0, inf)", default=None)
    """Few-shot examples per prompt; None: each task's own setting."""
    batch_size: int = ranged("[1, inf)", default=1)
    """Requests per forward in the harness."""
    timeout_s: int = ranged("[1, inf)", default=3600)
    """How long the other ranks wait for rank 0's scoring before failing."""


@dataclass
class EvalConfig:
    every_steps: int = ranged("[0, inf)", default=0)
    """Evaluate val_loss / val_ppl (recipes/dpo.py: val_loss, val_rewards/*, val_logps/*; recipes/kto.py: those
    and val_kl; recipes/reward.py: val_accuracy, ...) on all ranks every N steps (and at the end); 0 disables."""
    max_batches: int = ranged("[0, inf)", default=0)
    """Micro-batches per rank per evaluation; 0 evaluates the whole validation set."""
    harness: HarnessConfig = field(default_factory=HarnessConfig)


@dataclass
class ParallelConfig:
    strategy: Literal["auto", "ddp", "fsdp", "fsdp2", "none"] = "auto"
    """auto: DDP when the training state fits comfortably on one device, else FSDP2."""
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    """FSDP1 sharding strategy (strategy=fsdp)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (saves memory, costs a second all-gather)."""
    replicate: int = ranged("[1, inf)", default=1)
    """HSDP: number of replica groups (FSDP2 2-D mesh; FSDP1 HYBRID_SHARD)."""
    sp_size: int = ranged("[1, inf)", default=1)
    """Ulysses sequence parallelism: each row split over this many consecutive ranks (docs/long-context.md)."""
    mixed_precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype; parameters, optimizer state and gradient reduction stay fp32."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward."""
    cpu_offload: bool = False
    """FSDP: keep sharded parameters and gradients on CPU."""
    compile: bool = False
    """torch.compile each decoder layer."""


@dataclass
class DistributedConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when available, else cpu."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl on cuda, gloo on cpu."""
    timeout_s: int = ranged("[1, inf)", default=600)
    """Process-group timeout: a stuck collective fails after this long instead of hanging."""
    preflight: bool = True
    """Before training, check every rank joined, collectives work, output_dir is shared, versions match."""
    preflight_timeout_s: int = ranged("[1, inf)", default=180)
    """Preflight (including waiting for all ranks to join) fails after this long, naming what is missing."""


@dataclass
class TrainConfig:
    max_steps: int = ranged("[1, inf)", default=100)
    """Optimizer steps to run."""
    micro_batch_size: int = ranged("[1, inf)", default=4)
    """Rows per forward pass, per rank."""
    grad_accum_steps: int = ranged("[1, inf)", default=1)
    """Micro-batches per optimizer step."""
    lr: float = ranged("(0, inf)", default=3e-4)
    """Peak learning rate (before train.scale_lr)."""
    scale_lr: bool = False
    """Linear scaling rule: multiply lr by the data-parallel size."""
    warmup_steps: int = ranged("[0, inf)", default=0)
    """Linear warm-up steps. Longer than train.max_steps: the run ends before the lr peaks (said at start)."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up."""
    min_lr_ratio: float = ranged("[0, 1]", default=0.0)
    """Final lr as a fraction of the peak (cosine/linear)."""
    weight_decay: float = ranged("[0, inf)", default=0.0)
    """AdamW weight decay (not applied to norms and biases)."""
    betas: list[float] = ranged("[0, 1)", default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    max_grad_norm: float = ranged("[0, inf)", default=1.0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    seed: int = ranged("[0, 4294967295]", default=42)  # numpy (datasets' shuffles) takes seeds below 2**32
    """Model init, data order and LoRA's dropout masks (keyed by seed, step, sample and layer)."""
    on_nan: Literal["stop", "skip"] = "stop"
    """Non-finite loss or gradient: stop (naming the step, saving nothing) or skip the update."""
    loss_impl: Literal["chunked", "full", "liger"] = "chunked"
    """chunked: loss from the final hidden states through the output layer a chunk of trained tokens at a time
    (no [tokens x vocab] logits; same losses and gradients) | full: whole logits | liger: Liger Kernel (CUDA)."""
    loss_chunk_tokens: int = ranged("[0, inf)", default=0)
    """train.loss_impl=chunked: trained tokens per chunk; 0: as many as make 256 MiB of fp32 logits (at least 64)."""
    activation_offloading: bool = False
    """CUDA: the activations the forward saves for backward go to pinned host memory (a side stream) and come back
    for backward (TRL's name; with parallel.activation_checkpointing, the layers' inputs). On CPU a no-op, said
    once (docs/long-context.md)."""


@dataclass
class CheckpointConfig:
    every_steps: int = ranged("[0, inf)", default=0)
    """Save a sharded (DCP) checkpoint every N steps; 0 disables."""
    every_minutes: float = ranged("[0, inf)", default=0.0)
    """Also save when this many minutes passed since the last save; 0 disables."""
    keep_last: int = ranged("[0, inf)", default=2)
    """Keep the newest N complete checkpoints (older ones go after a newer one is complete); 0 keeps all."""
    async_: bool = False
    """(YAML key `async`) save in the background with DCP async_save while training continues."""
    resume: str = "auto"
    """auto: latest complete checkpoint in output_dir, else start fresh | never | a checkpoint path."""
    allow_changes: list[str] = field(default_factory=list)
    """Keys a resume may change although they make it another run (e.g. [train.grad_accum_steps, data.path]);
    a resume that changes any other such key is refused, naming it (llmtrain/run/resume.py)."""
    export_every_steps: int = ranged("[0, inf)", default=0)
    """Also write a Hugging Face export to output_dir/hf/step_<N> every N steps; 0 disables."""
    export_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """dtype of exported weights."""
    max_shard_size: str = "5GB"
    """Exported safetensors files are split above this size (with model.safetensors.index.json)."""
    export_wait_minutes: float = ranged("[0, 1440]", default=10.0)
    """An export that finds the disk full keeps the weights in memory and tries again every 10 s (a tenth of this
    wait if shorter) for this long while space is freed; 0 fails at once (llmtrain/export.py)."""


@dataclass
class WandbConfig:
    project: str | None = None
    """Weights & Biases project to log to (rank 0); unset: wandb is off."""
    entity: str | None = None
    """W&B user or team; default: your default entity."""
    name: str | None = None
    """Run name; default: the name of output_dir."""
    mode: Literal["online", "offline", "disabled", None] = None
    """online | offline (no network; sync later) | disabled; default: $WANDB_MODE, else online."""
    tags: list[str] = field(default_factory=list)
    """Tags attached to the run."""


@dataclass
class LogConfig:
    every_steps: int = ranged("[1, inf)", default=10)
    """Log metrics every N steps (and at the last step)."""
    progress: bool = True
    """tqdm progress bar on rank 0 when attached to a terminal (plain lines with an ETA otherwise)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to output_dir/tensorboard (rank 0)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging (log.wandb.project turns it on)."""
    peak_tflops: float | None = ranged("(0, inf)", default=None)
    """Peak dense TFLOP/s of one device in the compute dtype, for mfu; default: looked up by GPU name."""
    completions_every_steps: int = ranged("[0, inf)", default=0)
    """recipes/grpo.py: every N generation batches (the first included), a few sampled prompts with their
    completions and rewards to output_dir/completions.jsonl (rank 0); 0: never."""


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters (PEFT) on a frozen base instead of every weight; llmtrain/models/lora.py."""
    r: int = ranged("[1, inf)", default=16)
    """Rank of each adapter (lora_A: r x in, lora_B: out x r)."""
    alpha: float = ranged("(0, inf)", default=32.0)
    """Scaling numerator: an adapter adds (alpha / r) * B @ A to its layer's weight."""
    dropout: float = ranged("[0, 1)", default=0.05)
    """Dropout on an adapter's input; its masks depend on (train.seed, step, sample, layer) only, so any world
    size, split or resume gives the same (llmtrain/models/dropout.py)."""
    target_modules: str | list[str] = "all-linear"
    """all-linear (every linear layer but the output head) or a list of module names (q_proj, ... or full paths)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full and saved with the adapters (e.g. [embed_tokens, lm_head] after adding tokens)."""
    init_from: str | None = input_path(default=None)
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to continue training from."""
    base_dtype: Literal["fp32", "bf16"] = "fp32"
    """Storage dtype of the frozen base weights (bf16 halves their memory; needs parallel.mixed_precision=bf16)."""
    export: Literal["adapter", "merged", "both"] = "both"
    """What the export writes: output_dir/adapter (PEFT format), output_dir/hf (adapters merged in), or both."""
    quantize_base: Literal["none", "nf4"] = "none"
    """nf4 (QLoRA): the frozen linear weights of the decoder blocks stored 4-bit (torchao's NF4; llmtrain[qlora]);
    embeddings, norms and the output layer stay in base_dtype. llmtrain/models/nf4.py."""
    nf4_block_size: int = ranged("[2, inf)", default=64)
    """NF4: weights per absmax scale (QLoRA's and torchtune's 64)."""
    nf4_scaler_block_size: int = ranged("[1, inf)", default=256)
    """NF4: scales per 8-bit-quantized group of scales (double quantization; QLoRA's and torchtune's 256)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    output_dir: str = "outputs/run"
    """Where metrics, checkpoints and the HF export go."""


# Keys that moved to another section: refused with one line naming the new key.
MOVED = {f"grpo.{key}": f"rollout.{key}" for key in ("engine", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode",
                                                     "vllm_server_url", "vllm_server_timeout", "vllm_group_port")}


def suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where YAML is ambiguous."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not a valid choice; choose one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item):
            if not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"{key}: expected a list of mappings")
            return [_build(item, v, f"{key}[{i}].") for i, v in enumerate(value)]
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return value
    else:
        raise TypeError(f"unsupported config annotation {tp} for {key}")
    raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")


def _key(field_name: str) -> str:
    """YAML key of a field: Python keywords get a trailing underscore as field names (async_ -> async)."""
    return field_name.rstrip("_")


def _build(cls: type, raw: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = {_key(name): name for name in fields}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in names and dotted in MOVED:
            raise ConfigError(f"{dotted} moved to {MOVED[dotted]}")
        if key not in names:
            raise ConfigError(f"unknown config key '{dotted}'{suggest(dotted, [prefix + n for n in names])}")
        key = names[key]
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted}: expected a section (mapping), got {value!r}")
            kwargs[key] = _build(tp, value, f"{dotted}.")
        else:
            kwargs[key] = _coerce(value, tp, dotted)
            if valid := fields[key].metadata.get("range"):
                items = kwargs[key] if isinstance(kwargs[key], list) else [kwargs[key]]
                for i, item in enumerate(items):
                    if item is not None and item not in valid:
                        where = f"{dotted}[{i}]" if isinstance(kwargs[key], list) else dotted
                        finite = " and finite" if isinstance(item, float) and math.isinf(item) else ""  # > 0 holds
                        raise ConfigError(f"{where} must be {valid}{finite}, got {item!r}")
    return cls(**kwargs)


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    node = raw
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is a value, not a section")
        node = child
    node[leaf] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    pairs = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        try:
            pairs.append((key.strip(), yaml.safe_load(text) if text.strip() else text))
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: invalid YAML value ({str(e).splitlines()[0]}); quote it: "
                              f"{key}='\"{text}\"'") from None
    return pairs


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (at any depth), which plain YAML loaders resolve by
    keeping the last without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable):
                if key in lines:
                    raise ConfigError(f"key {key!r} is given twice in one mapping (lines {lines[key]} "
                                      f"and {key_node.start_mark.line + 1}); keep one")
                lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_config(path: str | Path | None, overrides: list[str] = (), cls: type[Config] = Config) -> Config:
    """Read YAML (optional), apply `key.sub=value` overrides, validate into a Config (or a recipe's subclass)."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: no such file: {path}")
        try:
            raw = yaml.load(path.read_text(), _UniqueKeyLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for key, value in parse_overrides(list(overrides)):
        _set_dotted(raw, key, value)
    cfg = _build(cls, raw, "")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field checks that need no I/O."""
    check_output_dir(cfg.output_dir)
    if (cfg.model.path is None) == (cfg.model.config is None):
        raise ConfigError("set exactly one of model.path (a HF model directory) or model.config (inline Llama config)")
    if cfg.model.config is not None and cfg.tokenizer.path is None:
        raise ConfigError("model.config builds a new model, so tokenizer.path must name a tokenizer directory")
    if bool(cfg.data.path) == bool(cfg.data.sources):
        raise ConfigError("set data.path (a file, glob or directory) or data.sources (a list), not both")
    if cfg.eval.every_steps and not (cfg.data.val_path or cfg.data.val_fraction):
        raise ConfigError("eval.every_steps needs validation data: set data.val_path or data.val_fraction")
    if len(cfg.train.betas) != 2:
        raise ConfigError("train.betas must have two values")
    if cfg.lora.enabled:
        if isinstance(cfg.lora.target_modules, str) and cfg.lora.target_modules != "all-linear":
            raise ConfigError(f"lora.target_modules: {cfg.lora.target_modules!r}: use all-linear or a list of "
                              "module names, e.g. [q_proj, v_proj]")
        if cfg.lora.base_dtype == "bf16" and cfg.parallel.mixed_precision != "bf16":
            # A bf16 base layer cannot take fp32 activations; with bf16 compute both sides match.
            raise ConfigError("lora.base_dtype=bf16 needs parallel.mixed_precision=bf16")
        if cfg.lora.base_dtype == "bf16" and cfg.parallel.strategy == "fsdp":
            raise ConfigError("lora.base_dtype=bf16: FSDP1 flattens each unit into one tensor of one dtype, "
                              "and the adapters are fp32; use parallel.strategy fsdp2 or ddp")


def check_output_dir(output_dir: str) -> None:
    """An output_dir that is empty (an unset shell variable: output_dir=$OUT) or names the current directory,
    the filesystem root or the home directory would spread a run's files (and its replaced hf/) over whatever
    is there: refused before anything is written."""
    if not output_dir.strip():
        raise ConfigError("output_dir is empty (an unset variable in output_dir=$VAR?): name the run's own "
                          "directory, e.g. output_dir=outputs/my-run")
    path = Path(output_dir).resolve()
    for name, place in (("the current directory", Path.cwd()), ("the filesystem root", Path(path.anchor)),
                        ("the home directory", Path.home())):
        if path == place.resolve():
            raise ConfigError(f"output_dir: {output_dir} is {name} ({path}): a run writes config.yaml, "
                              "metrics.jsonl, checkpoints/ and replaces hf/ there; name a directory of its own, "
                              "e.g. output_dir=outputs/my-run")


def input_paths(section: Any, prefix: str = "") -> dict[str, str]:
    """Every path the input fields (input_path) of a config or section name, by key (a list's items indexed)."""
    found = {}
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), prefix + _key(f.name)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            where = key if i is None else f"{key}[{i}]"
            if dataclasses.is_dataclass(item):
                found |= input_paths(item, f"{where}.")
            elif (path_of := f.metadata.get("input")) and item is not None and (path := path_of(item)):
                found[where] = path
    return found


def to_dict(cfg: Any) -> Any:
    if isinstance(cfg, list):
        return [to_dict(v) for v in cfg]
    if not dataclasses.is_dataclass(cfg):
        return cfg
    return {_key(f.name): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe(cls: type[Config] = Config) -> list[tuple[str, str, str, str]]:
    """(key, type and range, default, description) for every key, from the dataclasses and their docstrings."""
    import ast
    import inspect

    rows = []

    def docs(cls: type) -> dict[str, str]:
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body
        out = {}
        for stmt, nxt in zip(body, body[1:] + [None]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                out[stmt.target.id] = " ".join(str(nxt.value.value).split())
        return out

    def walk(cls: type, prefix: str) -> None:
        hints, text = typing.get_type_hints(cls), {}
        for base in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):  # a recipe's Config subclass
            text.update(docs(base))
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            tname = str(tp).replace("typing.", "") if typing.get_origin(tp) else tp.__name__
            if valid := f.metadata.get("range"):
                tname += f", {'each ' if typing.get_origin(tp) is list else ''}{valid}"
            rows.append((prefix + _key(f.name), tname, repr(default), text.get(f.name, "")))
            for arg in (tp, *typing.get_args(tp)):  # a list of sections (data.sources): its items' keys too
                if typing.get_origin(arg) is list and dataclasses.is_dataclass(typing.get_args(arg)[0]):
                    walk(typing.get_args(arg)[0], f"{prefix}{_key(f.name)}[].")

    walk(cls, "")
    return rows
