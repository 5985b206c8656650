"""tests/models/test_qlora.py's memory worker, one process per mode (ru_maxrss is per process): build the 51M model
(tests/helpers/qlora.py's BIG) with LoRA on a base quantized as MODE (none or nf4); write the peak and current
RSS and the base's bytes as JSON.  Usage: python qlora_memory.py MODE OUT.json"""

import json
import resource
import sys
from dataclasses import replace
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch.distributed as dist  # noqa: E402

from helpers.qlora import BIG, QLORA, build  # noqa: E402


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _, report = build("none", replace(QLORA, quantize_base=mode), shape=BIG)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write_text(json.dumps({"peak": peak, "rss": rss, "base_bytes_fp32": 2 * report.bf16_bytes,
                               "base_bytes_nf4": report.nf4_bytes}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
