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

from llmtrain import distributed, train as trainer  # noqa: E402
from llmtrain.step import train_step  # noqa: E402

cfg = trainer.setup(trainer.parse_args(sys.argv[1:], __doc__))
env = distributed.init(cfg.distributed)
run = trainer.build(cfg, env)
_, steps = trainer.data_steps(run)
grads = {}
if cfg.lora.enabled:  # at each optimizer step: parameters with gradients; does it hold the trained ones only
    from llmtrain.models.hf import clean_name

    def record(opt, args, kwargs):
        params = list(run.model.named_parameters())
        grads.update(with_grad=sorted(clean_name(n) for n, p in params if p.grad is not None),
                     trained=sorted(clean_name(n) for n, p in params if p.requires_grad),
                     optimizer_holds_trained={id(p) for g in opt.param_groups for p in g["params"]}
                     == {id(p) for _, p in params if p.requires_grad})

    run.opt.register_step_pre_hook(record)
model = trainer.loop(run, steps, lambda batches: train_step(run.model, run.plan, batches, run.opt, run.scaler,
                                                            cfg.train.max_grad_norm, env.device, env.world_size,
                                                            run.token_loss))
probe = (torch.arange(2 * 24).reshape(2, 24) * 7919) % 500 + 6  # ordinary (non-special) token ids
model.eval()
with torch.no_grad():
    logits = model(input_ids=probe.to(env.device)).logits.float().cpu()
if env.is_main:
    save_file({"input_ids": probe, "logits": logits.contiguous()}, str(Path(cfg.output_dir) / "probe.safetensors"))
if cfg.lora.enabled:  # the frozen base after training, by its model.path names, to compare bit for bit
    (Path(cfg.output_dir) / f"grads_rank{env.rank}.json").write_text(json.dumps(grads))
    from llmtrain.checkpoint import full_state_dict
    from llmtrain.models.lora import base_name, is_adapter

    state = full_state_dict(model, run.plan.strategy, env.device)
    if env.is_main:
        save_file({base_name(k): v.clone() for k, v in state.items() if not is_adapter(k) and ".modules_to_save." not in k},
                  str(Path(cfg.output_dir) / "frozen.safetensors"))
distributed.shutdown()
distributed.hard_exit(0)
