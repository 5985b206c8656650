"""Distillation's config (recipes/distill.py --help-config): the distill: section beside the shared ones and the
rollout: section (on-policy steps' engine), and the set-up checks the recipe and python -m
llmtrain.tools.distill_precompute run before any process group: what on-policy steps need, the teacher model
(its directory, vocabulary, context) or the stored teacher (llmtrain.recipes.distill.teacher's store), and the
KD settings either needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from transformers import AutoConfig

from llmtrain import data, distributed
from llmtrain.config import Config, ConfigError, input_path, ranged
from llmtrain.models import hf
from llmtrain.recipes.distill import teacher as teacher_side
from llmtrain.rollout.section import RolloutSection, check_engine

USAGE = """\
Knowledge distillation of a student (model.path, or an inline model.config) on a teacher (distill.teacher_path)
with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/distill.py --config configs/demo-distill.yaml [key.sub=value ...]

The data are finetune's (text, instruction, chat) with its masks: the loss is taken on the tokens SFT trains.
Per trained token: distill.kd_weight x the divergence of the student's next-token distribution from the
teacher's (distill.loss: forward_kl, reverse_kl or jsd with distill.jsd_beta; at distill.temperature; over the
teacher's distill.top_k ids and a bucket for the rest, or the whole vocabulary) + (1 - distill.kd_weight) x the
student's cross-entropy on the labels. Neither model's [tokens x vocab] logits exist: both are taken a chunk of
tokens at a time (docs/distill.md). Teacher and student must share the tokenizer's vocabulary.

Offline teacher: python -m llmtrain.tools.distill_precompute --config ... --out DIR writes the teacher's top-k
log-probs of every trained token once; distill.teacher_logits=DIR then trains without loading the teacher.

On-policy (GKD): distill.on_policy_fraction of the steps, the student samples a completion (at most
distill.max_new_tokens, at distill.sampling_temperature) for each row's prompt (the row up to its first trained
token: data.format instruction or chat, unpacked) and the loss is taken on those completions' tokens.

Writes to output_dir what recipes/finetune.py writes; metrics.jsonl adds kd_loss and ce_loss (per trained
token); with distill.on_policy_fraction > 0, on_policy (1 or 0) at every step and, on on-policy steps, TRL's
completions/mean_length, /min_length, /max_length, /clipped_ratio, and generation_s, generated_tokens_per_s;
with eval.every_steps, val_loss (the student's cross-entropy), val_kd_loss and val_teacher_loss (offline:
val_loss and val_ppl only).
"""


@dataclass
class DistillSection:
    teacher_path: str | None = input_path(default=None)
    """The teacher: a Hugging Face model directory whose tokenizer has the student's vocabulary (a larger,
    padded embedding on either side is fine). Loaded frozen and sharded like the student (FSDP: FSDP2)."""
    teacher_dtype: Literal["match", "fp32", "bf16"] = "match"
    """The dtype the teacher computes in; match: parallel.mixed_precision's."""
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """forward_kl: KL(teacher || student) | reverse_kl: KL(student || teacher) | jsd: generalized
    Jensen-Shannon with distill.jsd_beta (GKD; TRL's generalized_jsd_loss)."""
    jsd_beta: float = ranged("(0, 1)", default=0.5)
    """jsd: the teacher's weight in the mixture (TRL's beta; its 0 and 1 are forward_kl and reverse_kl)."""
    temperature: float = ranged("(0, inf)", default=1.0)
    """Divides both models' logits before the KD term (not the CE term); the loss is not scaled by T²."""
    kd_weight: float = ranged("[0, 1]", default=1.0)
    """loss = kd_weight x KD + (1 - kd_weight) x the student's cross-entropy on the labels; 1: pure KD."""
    top_k: int = ranged("[0, inf)", default=0)
    """> 0: the teacher's k most likely ids per token, every other id lumped into one bucket (the divergence of
    the (k+1)-way distributions); 0: the whole vocabulary."""
    teacher_logits: str | None = input_path(default=None)
    """An offline teacher: a directory written by python -m llmtrain.tools.distill_precompute (the teacher's
    top-k log-probs of every trained token, at distill.temperature); the run trains from it and loads no
    teacher. Its data, row order, tokenizer, top_k and temperature must be this run's (checked)."""
    on_policy_fraction: float = ranged("[0, 1]", default=0.0)
    """On-policy distillation (GKD's lambda, TRL's lmbda): the share of steps on which the student samples a
    completion for each row's prompt (the row up to its first trained token) and learns the teacher's
    distributions on its own completion instead of the data's. Decided per step from (train.seed, step) alone:
    0 never, 1 every step. Needs the teacher model (not distill.teacher_logits) and rows with a prompt
    (data.format instruction or chat, data.train_on_prompt=false, data.packing=false)."""
    max_new_tokens: int = ranged("[1, inf)", default=128)
    """On-policy steps: tokens the student samples per completion at most (TRL's max_new_tokens)."""
    sampling_temperature: float = ranged("(0, inf)", default=1.0)
    """On-policy steps: the temperature the student samples at (TRL's GKDConfig.temperature, default 0.9 there);
    distill.temperature stays the KD term's."""


@dataclass
class DistillConfig(Config):
    """recipes/distill.py's Config: the shared sections plus distill: and rollout: (on-policy steps' engine)."""
    distill: DistillSection = field(default_factory=DistillSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)


def check(cfg: DistillConfig) -> None:
    """Before any process group: what on-policy steps need; the teacher directory, its vocabulary against the
    student's tokenizer, distill.top_k against it, and the loss path; or, with distill.teacher_logits, the stored
    teacher."""
    check_on_policy(cfg)
    if cfg.distill.teacher_logits is not None:
        check_stored(cfg)
    else:
        check_teacher(cfg)


def check_on_policy(cfg: DistillConfig) -> None:
    """distill.on_policy_fraction > 0: a teacher model (an offline store has no log-probs for tokens the student
    samples) and rows that are one example each with a prompt before its first trained token (text rows and
    data.train_on_prompt train from the second token on: there is no prompt to complete)."""
    d, section = cfg.distill, cfg.data
    if d.on_policy_fraction == 0:
        if cfg.rollout != RolloutSection():
            raise ConfigError("rollout: its engine samples on-policy steps only; set distill.on_policy_fraction > 0, "
                              "or leave rollout.* unset")
        return
    check_engine(cfg.rollout, distributed.device_kind(cfg.distributed) == "cuda")
    why = f"distill.on_policy_fraction={d.on_policy_fraction:g} samples completions for the rows' prompts"
    if cfg.parallel.sp_size > 1:
        raise ConfigError(f"parallel.sp_size={cfg.parallel.sp_size}: on-policy steps are not split over a sequence "
                          f"group yet ({why}); set parallel.sp_size=1 or distill.on_policy_fraction=0")
    if d.teacher_logits is not None:
        raise ConfigError(f"distill.teacher_logits: an offline teacher has no log-probs for the tokens the student "
                          f"samples ({why}); unset it to load the teacher (distill.teacher_path), or set "
                          "distill.on_policy_fraction=0")
    if "text" in data.formats_used(section):
        raise ConfigError(f"data.format: text rows have no prompt, every token but the first is trained ({why}); "
                          "use data.format=instruction or chat, or set distill.on_policy_fraction=0")
    if section.train_on_prompt:
        raise ConfigError(f"data.train_on_prompt: rows that train their prompt have none to complete ({why}); set "
                          "data.train_on_prompt=false")
    if section.packing:
        raise ConfigError(f"data.packing: a packed row holds several examples, one prompt each ({why}); set "
                          "data.packing=false")


def check_completion_room(section: DistillSection, seq_len: int, configs: dict[str, object]) -> None:
    """On-policy rows (a prompt of up to data.seq_len tokens, then up to distill.max_new_tokens sampled ones)
    within each model's max_position_embeddings (configs: {whose: its config})."""
    longest = seq_len + section.max_new_tokens
    for whose, config in configs.items():
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and longest > limit:
            raise ConfigError(f"distill.max_new_tokens: data.seq_len {seq_len} + {section.max_new_tokens} sampled "
                              f"tokens is longer than the {whose} max_position_embeddings={limit} (an on-policy row "
                              "is a prompt of up to data.seq_len tokens and its completion); lower "
                              "distill.max_new_tokens or data.seq_len")


def check_stored(cfg: DistillConfig) -> None:
    """distill.teacher_logits: a complete, intact precompute of this run's rows, tokenizer, top_k and
    temperature, covering its train.max_steps (the global batch at WORLD_SIZE / parallel.sp_size data-parallel
    ranks)."""
    d = cfg.distill
    check_kd_settings(cfg, "trained from stored log-probs")
    tokenizer = hf.load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    dp_size = distributed.world_size_from_env() // cfg.parallel.sp_size  # one that does not divide: ulysses.check
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * dp_size
    teacher_side.check(d.teacher_logits, teacher_side.expected(cfg.data, cfg.train.seed, tokenizer, d.top_k,
                                                               d.temperature), cfg.train.max_steps * global_batch)


def check_teacher(cfg: DistillConfig, precompute: bool = False) -> None:
    """distill.teacher_path: a Hugging Face causal LM with the student's vocabulary; precompute: its top-k log-probs
    are to be stored (the precompute), where top_k 0 is no option."""
    d = cfg.distill
    if d.teacher_path is None:
        raise ConfigError("distill.teacher_path: not set; name the teacher's Hugging Face model directory")
    if not Path(d.teacher_path).is_dir():
        raise ConfigError(f"distill.teacher_path: no such directory: {d.teacher_path} (configs/demo-distill.yaml's "
                          "teacher is the SFT demo's export: run torchrun --standalone --nproc_per_node=2 "
                          "recipes/finetune.py --config configs/demo.yaml first)")
    hf.check_model_dir(d.teacher_path, "distill.teacher_path")
    check_kd_settings(cfg)
    student_tok = hf.load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    teacher_tok = hf.load_tokenizer(d.teacher_path, cfg.model.trust_remote_code, "distill.teacher_path",
                                    "the teacher's directory holds its tokenizer (the student's vocabulary)")
    hf.check_vocab(student_tok, teacher_tok, "distill.teacher_path", d.teacher_path)
    if d.top_k >= len(student_tok):
        whole = "" if precompute else ", or 0 for the whole vocabulary"
        raise ConfigError(f"distill.top_k: {d.top_k} is not below the vocabulary's {len(student_tok)} ids; use a "
                          f"smaller k{whole}")
    teacher_config = AutoConfig.from_pretrained(d.teacher_path, trust_remote_code=cfg.model.trust_remote_code)
    if teacher_config.vocab_size < len(teacher_tok):
        raise ConfigError(f"distill.teacher_path: the teacher's vocab_size is {teacher_config.vocab_size} "
                          f"({d.teacher_path}/config.json), fewer than the {len(teacher_tok)} tokens of the vocabulary "
                          "it shares with the student: not a model of this tokenizer")
    hf.check_seq_len(teacher_config, cfg.data.seq_len, "the teacher's (distill.teacher_path)")
    if d.on_policy_fraction > 0:
        check_completion_room(d, cfg.data.seq_len, {"student's": hf.load_model_config(cfg.model, student_tok),
                                                    "teacher's": teacher_config})


def check_kd_settings(cfg: DistillConfig, stored: str | None = None) -> None:
    """The loss is taken chunked; a `stored` teacher (what is done with its log-probs) keeps the top-k bucket
    (top_k > 0) of map-style data's global sample order (a stream has none)."""
    if cfg.train.loss_impl != "chunked":
        raise ConfigError(f"train.loss_impl: recipes/distill.py computes its loss chunked (llmtrain.losses.distill)"
                          f"; set train.loss_impl=chunked, not {cfg.train.loss_impl}")
    if stored and cfg.distill.top_k == 0:
        raise ConfigError(f"distill.top_k: 0 (the whole vocabulary) cannot be {stored}; an offline teacher stores "
                          "the top-k log-probs: set distill.top_k, e.g. 64")
    if stored and cfg.data.streaming:
        raise ConfigError(f"data.streaming: a stream has no global sample order, so an offline teacher cannot be "
                          f"{stored}; set data.streaming=false")


def teacher_dtype(cfg: DistillConfig) -> str:
    """The dtype the teacher computes in (distill.teacher_dtype; match: parallel.mixed_precision's)."""
    d = cfg.distill
    return cfg.parallel.mixed_precision if d.teacher_dtype == "match" else d.teacher_dtype
