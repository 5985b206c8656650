"""Every family x ddp/fsdp/fsdp2 in one process group, through the library functions the recipe calls
(models.build.build_model -> the micro-batch accumulation -> export_hf), measured against
transformers' from_pretrained of the same directory. Rank 0 writes the numbers as JSON for
tests/models/test_families.py to assert on.  Usage: torchrun --nproc_per_node=2 family_matrix.py ROOT OUT.json
(ROOT/<family> are directories made by tests/helpers/families.py)."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from helpers.families import FAMILIES  # noqa: E402
from llmtrain import distributed, export, optim, parallelize  # noqa: E402
from llmtrain.config import DistributedConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from llmtrain.data.formats import IGNORE  # noqa: E402
from llmtrain.losses.token import TokenLoss  # noqa: E402
from llmtrain.models import hf as model_lib  # noqa: E402
from llmtrain.models.build import build_model  # noqa: E402
from llmtrain.models.names import clean_name  # noqa: E402
from llmtrain.recipes.sft import TokenObjective  # noqa: E402
from llmtrain.train.step import Stepper, accumulate  # noqa: E402

STRATEGIES = ["ddp", "fsdp", "fsdp2"]
STEPS, ROWS, SEQ, SPLIT = 3, 4, 32, 20  # global batch ROWS rows of two packed documents (SPLIT + SEQ - SPLIT)


def global_batch(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(6, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(SPLIT), torch.arange(SEQ - SPLIT)]).expand(ROWS, SEQ)
    labels = ids.clone()
    labels[:, SPLIT] = IGNORE  # the second document's first token is not predicted from the first
    return {"input_ids": ids, "position_ids": positions.contiguous(), "labels": labels}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def run(family_dir: Path, strategy: str, env, out: Path) -> dict:
    section = ModelConfig(path=str(family_dir))
    tokenizer = model_lib.load_tokenizer(section.path, False)
    config = model_lib.load_model_config(section, tokenizer)
    reference = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32)
    built = build_model(section, config, ParallelConfig(strategy=strategy), env, seed=0)
    model, plan = built.model, built.plan
    result = {"describe": plan.strategy.describe(model)}
    # Before any forward, as in the recipe: FSDP2 leaves the last layer's gathered parameters registered
    # after a forward, and an optimizer built then would update those copies.
    train = TrainConfig(lr=1e-3, weight_decay=0.1, max_steps=STEPS)
    opt = optim.build_optimizer(model, train, train.lr, built.no_decay)

    # The loaded model equals from_pretrained's: every parameter (gathered) and buffer (on every rank).
    ref_buffers = {name: b for name, b in reference.named_buffers()}
    buffer_diff = torch.tensor(max(max_diff(b, ref_buffers[clean_name(n)]) for n, b in model.named_buffers()))
    result["buffer_diff"] = distributed.all_reduce(buffer_diff, dist.ReduceOp.MAX).item()
    full = plan.strategy.full_weights(model, env.device)
    if env.is_main:
        ref_state = reference.state_dict()
        assert full.keys() <= ref_state.keys(), sorted(full.keys() - ref_state.keys())
        result["param_diff"] = max(max_diff(t, ref_state[n]) for n, t in full.items())
        result["param_names"] = len(full)

    batch = global_batch(config.vocab_size)
    local = {k: v[env.rank * ROWS // env.world_size:(env.rank + 1) * ROWS // env.world_size] for k, v in batch.items()}
    with torch.no_grad():
        first = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        ref_first = reference(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    result["first_logits_diff"] = distributed.all_reduce(torch.tensor(max_diff(first, ref_first)),
                                                         dist.ReduceOp.MAX).item()

    model.train()
    objective = TokenObjective(TokenLoss("chunked", model, env.device))  # the default train.loss_impl
    stepper = Stepper(model, plan, opt, None, 1.0, env.device, env.world_size)
    result["losses"] = [accumulate(stepper, [local], objective, (0, step)).loss for step in range(STEPS)]

    # The export reproduces the trained model's logits in transformers.
    export_dir = out / f"{family_dir.name}_{strategy}"
    export.export_hf(model, plan.strategy, env.device, export_dir, config, tokenizer)
    model.eval()
    probe = batch["input_ids"][:2]
    with torch.no_grad():
        trained = model(input_ids=probe, use_cache=False).logits
    if env.is_main:
        exported = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
        with torch.no_grad():
            result["export_logits_diff"] = max_diff(exported(input_ids=probe).logits, trained)
        # Plain transformers generate stops at the chat turn's end (generation_config.json lists it): with that
        # token's logit forced up, one token is generated, not max_new_tokens.
        eos = exported.generation_config.eos_token_id
        result["stop_ids"], result["end_of_turn"] = eos if isinstance(eos, list) else [eos], \
            model_lib.end_of_turn_ids(tokenizer)
        turn_end = torch.tensor(result["end_of_turn"][:1])
        hook = exported.get_output_embeddings().register_forward_hook(
            lambda module, args, logits: logits.index_fill(-1, turn_end, 1e4))
        result["new_tokens_until_turn_end"] = exported.generate(probe[:1], max_new_tokens=4, do_sample=False).shape[1] \
            - probe.shape[1]
        hook.remove()
    return result


def meta_buffers_refused(family_dir: Path, env) -> str:
    """Built the old way (buffers on meta too), Gemma3's embed_scale and RoPE inv_freq are never loaded:
    check_initialized must refuse, on every rank. Returns its message."""
    section = ModelConfig(path=str(family_dir))
    config = model_lib.load_model_config(section, model_lib.load_tokenizer(section.path, False))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    pcfg = ParallelConfig(strategy="fsdp2")
    plan = parallelize.resolve(pcfg, 0, env.world_size, env.device)
    model = parallelize.parallelize(model, pcfg, plan, distributed.build_mesh(env, 1), env.device)
    plan.strategy.load(model, family_dir, config, seed=0)
    try:
        model_lib.check_initialized(model)
    except FloatingPointError as e:
        return str(e)
    return "not refused"


def main() -> None:
    root, out_json = Path(sys.argv[1]), Path(sys.argv[2])
    env = distributed.init(DistributedConfig())
    results = {f: {s: run(root / f, s, env, root) for s in STRATEGIES} for f in FAMILIES}
    results["meta_buffers_refused"] = meta_buffers_refused(root / "gemma3", env)
    if env.is_main:
        out_json.write_text(json.dumps(results, indent=1))
    distributed.shutdown()


if __name__ == "__main__":
    main()
    distributed.hard_exit(0)
