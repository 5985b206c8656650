"""tests/models/test_qlora.py's 2-rank worker: fsdp2 and ddp (and fsdp2 with bf16 compute, and fsdp2 on rows that do not
split), each built as the recipes build it (tests/helpers/qlora.py), stepped, and its dequantized base gathered;
rank 0 saves them (torch.save).  Usage: torchrun --nproc_per_node=2 qlora_ranks.py OUT.pt"""

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from helpers.qlora import MODEL, ODD, QLORA, build, dequantized_base, step  # noqa: E402


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    results = {}
    for name, strategy, dtype, shape, steps in (("fsdp2", "fsdp2", torch.float32, MODEL, 2),
                                                ("ddp", "ddp", torch.float32, MODEL, 2),
                                                ("fsdp2_bf16", "fsdp2", torch.bfloat16, MODEL, 4),
                                                ("fsdp2_odd", "fsdp2", torch.float32, ODD, 1)):
        model, report = build(strategy, QLORA, dtype, shape)
        base = dequantized_base(model)
        results[name] = {**step(model, steps), "base": base, "report": json.loads(json.dumps(report.__dict__))}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
