"""eval.harness: lm-evaluation-harness scores of what is being trained, logged as harness/<task>/<metric> with the
training metrics. Every eval.harness.every_steps the current weights are gathered on rank 0 (as an export gathers
them: no rank holds more) and scored there; at the end the final export is scored. Neither touches the data order,
the RNG streams (llmtrain.eval.score gives them back) or what a checkpoint holds, so training and resume are as
without it. The other ranks wait for rank 0 on a group of their own with eval.harness.timeout_s."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from llmtrain import eval as harness_lib
from llmtrain import export
from llmtrain.config import ConfigError, HarnessConfig, LoraConfig


def check(section: HarnessConfig) -> None:
    """Before any process group: the extra is installed and every task loads (offline, local data)."""
    if section.tasks:
        try:
            harness_lib.load_tasks(section.tasks)
        except harness_lib.EvalError as e:
            raise ConfigError(f"eval.harness.tasks: {e}") from None


class Harness:
    def __init__(self, section: HarnessConfig, lora_section: LoraConfig):
        self.section, self.lora = section, lora_section if lora_section.enabled else None
        # Rank 0 scores while the others wait: longer than a training collective may take.
        self.wait = dist.new_group(backend="gloo", timeout=timedelta(seconds=section.timeout_s)) \
            if section.tasks else None

    def due(self, step: int, last: bool) -> bool:
        """Score the current weights after this step (the last step's are scored by at_end when it is on)."""
        every = self.section.every_steps
        return bool(self.section.tasks) and every > 0 and step % every == 0 and not (last and self.section.at_end)

    def at_end(self) -> bool:
        return bool(self.section.tasks) and self.section.at_end

    def score_current(self, run) -> dict:
        """Collective: the weights as they are now, merged as an export merges them; scores on rank 0."""
        state = export.hf_state(run.model, run.plan.strategy, run.env.device, self.lora)
        scores = {}
        if state:
            model = harness_lib.model_from_weights(run.model_config, state, torch.float32,
                                                   f"eval.harness at step {run.state.step}")
            scores = self._score(model, run.tokenizer)
            del model, state
        dist.barrier(group=self.wait)
        return scores

    def score_export(self, run, out: Path) -> dict:
        """Collective: the final export (output_dir/hf) as a user loads it; scores on rank 0."""
        scores = self._score(str(out), run.tokenizer) if run.env.is_main else {}
        dist.barrier(group=self.wait)
        return scores

    def _score(self, model, tokenizer) -> dict:
        s = self.section
        return harness_lib.score(model, tokenizer, s.tasks, s.limit, s.num_fewshot, s.batch_size)
