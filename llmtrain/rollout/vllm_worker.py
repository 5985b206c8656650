"""llmtrain's vLLM worker extension: a vLLM server started with
`--worker-extension-cls llmtrain.rollout.vllm_worker.WeightCheck` (and VLLM_SERVER_DEV_MODE=1, which opens
/collective_rpc) lets rollout.vllm_server_url's weight-sync check read the weights each worker samples with. vLLM
mixes the class into its Worker: self.model_runner.model is the worker's model, self.model_config.hf_config its
Hugging Face config. /collective_rpc passes strings only, so names travel as JSON."""

from __future__ import annotations

import json

from llmtrain.rollout.vllm import hf_layout, vllm_fingerprint


class WeightCheck:
    def llmtrain_dtype(self) -> str:
        """The dtype of the worker's weights ("bfloat16"): a push sends it, the fingerprint is taken in it."""
        return str(next(self.model_runner.model.parameters()).dtype).removeprefix("torch.")

    def llmtrain_fingerprint(self, names: str) -> dict[str, float]:
        """llmtrain.rollout.sync's fingerprint of the JSON list `names` (Hugging Face names) of the worker's weights."""
        if not hasattr(self, "llmtrain_shapes"):  # the model's names and shapes, built on meta once
            self.llmtrain_shapes = hf_layout(self.model_config.hf_config).shapes
        return vllm_fingerprint(self.model_runner.model, self.llmtrain_shapes, json.loads(names))
