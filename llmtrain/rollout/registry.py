"""rollout.engine's choices (ENGINES: name -> the Engine's constructor, llmtrain.rollout.engine's signature) and
build(), which makes a run's engine from its rollout: section. A module of its own because it names every engine
module (each imports engine.py, local.py and sync.py, none this one)."""

from __future__ import annotations

from typing import NamedTuple

from llmtrain.models import hf
from llmtrain.rollout.engine import Engine, EngineSetup
from llmtrain.rollout.local import LocalEngine
from llmtrain.rollout.section import RolloutSection
from llmtrain.rollout.sync import WeightSync
from llmtrain.rollout.transformers import TransformersEngine
from llmtrain.rollout.vllm import VLLMEngine
from llmtrain.rollout.vllm_server import VLLMServerEngine
from llmtrain.train.build import Run, sampling_weights
from llmtrain.utils import DTYPES


def vllm(section: RolloutSection, setup: EngineSetup) -> Engine:
    """rollout.engine=vllm: on the server rollout.vllm_server_url names, else colocated in each training process."""
    engine = VLLMEngine if section.vllm_server_url is None else VLLMServerEngine
    return engine(section, setup)


ENGINES = {"local": LocalEngine, "transformers": TransformersEngine, "vllm": vllm}


class Rollout(NamedTuple):
    """A run's engine, its weight sync (push the policy into it before each generation batch) and the stop and
    padding ids it samples with."""
    engine: Engine
    weights: WeightSync
    eos_ids: list[int]
    pad_id: int


def build(section: RolloutSection, run: Run, max_len: int, max_rows: int) -> Rollout:
    """The engine rollout.engine names, on the run's policy: max_len, the tokens of a row at most (prompt +
    completion); max_rows, the rows of one generate call on a rank."""
    cfg, tokenizer = run.cfg, run.tokenizer
    eos = hf.stop_ids(run.model_config.eos_token_id, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    setup = EngineSetup(run.model, run.model_config, run.autocast, eos, pad, run.env.device, max_len, max_rows,
                        cfg.train.seed, DTYPES[cfg.parallel.mixed_precision], cfg.output_dir)
    engine = ENGINES[section.engine](section, setup)
    return Rollout(engine, WeightSync(engine, section.engine, cfg.train.seed, lambda: sampling_weights(run)), eos, pad)
