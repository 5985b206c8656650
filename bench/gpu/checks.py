"""bench/gpu.sh's environment checks, one line each (PASS / FAIL / SKIP), exit 1 if any failed.

    python bench/gpu/checks.py              # on the GPU machine: CUDA, NCCL, bf16, torch.compile
    python bench/gpu/checks.py --allow-cpu  # the same code on CPU (gloo, fp32 reference), as a dry run

  nccl      a 1-rank NCCL process group (one GPU cannot host two NCCL ranks): all_reduce of ones,
            a broadcast and a barrier
  bf16      a bf16 matmul on the device agrees with fp32 to bf16 precision; autocast produces bf16
  compile   torch.compile of a small MLP (inductor) gives the eager result, forward and backward
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_collectives(device: torch.device) -> str:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        x = torch.ones(1 << 20, device=device)
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(x, torch.ones_like(x)), "all_reduce of ones over 1 rank changed the values"
        version = torch.cuda.nccl.version() if backend == "nccl" else "-"
        version = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        return f"{backend} (version {version}): all_reduce/broadcast/barrier over 1 rank"
    finally:
        dist.destroy_process_group()


def check_bf16(device: torch.device) -> str:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise AssertionError("torch.cuda.is_bf16_supported() is False")
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(512, 512, generator=g).to(device) for _ in range(2))
    ref = a @ b
    out = (a.bfloat16() @ b.bfloat16()).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"bf16 matmul relative error {rel:.3g}"
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16, "autocast did not produce bf16"
    return f"bf16 matmul relative error {rel:.2e}; autocast -> bf16"


def check_compile(device: torch.device) -> str:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(device)
    x = torch.randn(64, 256, device=device)
    eager = mlp(x)
    eager.sum().backward()
    grad = mlp[0].weight.grad.clone()
    mlp.zero_grad()
    compiled = torch.compile(mlp)
    t0 = time.perf_counter()
    out = compiled(x)
    out.sum().backward()
    seconds = time.perf_counter() - t0
    torch.testing.assert_close(out, eager, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(mlp[0].weight.grad, grad, rtol=1e-3, atol=1e-3)
    return f"inductor forward+backward matches eager (first call {seconds:.1f} s)"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--allow-cpu", action="store_true", help="run on CPU when no GPU is visible (dry run)")
    args = p.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)} | torch {torch.__version__} | CUDA {torch.version.cuda}")
    elif args.allow_cpu:
        device = torch.device("cpu")
        print(f"device: cpu (dry run) | torch {torch.__version__}")
    else:
        print("FAIL cuda: no CUDA device visible (use --allow-cpu for a dry run)")
        return 1
    failed = 0
    for name, fn in (("collectives", check_collectives), ("bf16", check_bf16), ("compile", check_compile)):
        try:
            print(f"PASS {name}: {fn(device)}", flush=True)
        except Exception as e:  # report every check, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e).strip()[:500]}", flush=True)
            traceback.print_exc(limit=3, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
