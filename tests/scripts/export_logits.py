"""Train as recipes/finetune.py does (the library's build, data steps and loop with the SFT step), then
save the trained (still wrapped) model's logits on a probe batch, so a test can compare them with what
transformers computes from the exported directory. With LoRA also the frozen base after training and, per
rank, which parameters had gradients at the last optimizer step (grads_rank<N>.json).
Usage: torchrun ... tests/scripts/export_logits.py --config X [overrides]"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from llmtrain import distributed  # noqa: E402
from llmtrain.models.names import base_name, clean_name, is_adapter  # noqa: E402
from llmtrain.train.build import build, data_steps  # noqa: E402
from llmtrain.train.cli import parse_args, setup  # noqa: E402
from llmtrain.train.loop import loop  # noqa: E402
from llmtrain.train.step import TokenObjective, accumulate  # noqa: E402

cfg = setup(parse_args(sys.argv[1:], __doc__))
env = distributed.init(cfg.distributed)
run = build(cfg, env, "finetune")
_, steps = data_steps(run, "rows")
grads = {}
if cfg.lora.enabled:  # at each optimizer step: parameters with gradients; does it hold the trained ones only

    def record(opt, args, kwargs):
        params = list(run.model.named_parameters())
        grads.update(with_grad=sorted(clean_name(n) for n, p in params if p.grad is not None),
                     trained=sorted(clean_name(n) for n, p in params if p.requires_grad),
                     optimizer_holds_trained={id(p) for g in opt.param_groups for p in g["params"]}
                     == {id(p) for _, p in params if p.requires_grad})

    run.opt.register_step_pre_hook(record)
objective = TokenObjective(run.token_loss)
model = loop(run, steps, lambda batches: accumulate(run.stepper, batches, objective))
probe = (torch.arange(2 * 24).reshape(2, 24) * 7919) % 500 + 6  # ordinary (non-special) token ids
model.eval()
with torch.no_grad():
    logits = model(input_ids=probe.to(env.device)).logits.float().cpu()
if env.is_main:
    save_file({"input_ids": probe, "logits": logits.contiguous()}, str(Path(cfg.output_dir) / "probe.safetensors"))
if cfg.lora.enabled:  # the frozen base after training, by its model.path names, to compare bit for bit
    (Path(cfg.output_dir) / f"grads_rank{env.rank}.json").write_text(json.dumps(grads))
    state = run.plan.strategy.full_state_dict(model, env.device)
    if env.is_main:
        save_file({base_name(k): v.clone() for k, v in state.items() if not is_adapter(k) and ".modules_to_save." not in k},
                  str(Path(cfg.output_dir) / "frozen.safetensors"))
distributed.shutdown()
distributed.hard_exit(0)
