"""Pre-flight checks of a multi-process, multi-node launch, before any model is built.

    python -m llmtrain.preflight [--output-dir DIR] [--timeout S]             # one process
    torchrun --nnodes 2 --nproc_per_node 8 ... -m llmtrain.preflight --output-dir DIR
    srun ... torchrun ... -m llmtrain.preflight                               # under Slurm

The recipe runs the same checks at the start of train() (distributed.preflight, default on):

* every rank joins: distributed.init waits (at most distributed.preflight_timeout_s) until all WORLD_SIZE
  ranks have announced themselves in the rendezvous store, and names the missing ranks otherwise;
* an all-reduce across all ranks returns the right sum (the backend really works between the nodes);
* output_dir is one filesystem on every node: rank 0 writes a token file, every rank must read it back
  (checkpoints are written collectively, and the resume of a requeued job reads them from any node);
* devices: on CUDA, LOCAL_WORLD_SIZE <= torch.cuda.device_count() on every node, and every rank uses the
  same device type;
* versions: python, torch, transformers, CUDA and the llmtrain git commit are identical on every rank.

A failure raises PreflightError (the CLI: exit 1) on every rank, naming the ranks and nodes concerned. A
rank that stops answering cannot hang the others: a watchdog ends the process after the timeout, saying
which check it was waiting in.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from llmtrain.config import DistributedConfig
from llmtrain.distributed import DistEnv, PreflightError, compact_ranks, init, node_name, shutdown

EXIT_CODE = 1
_COMMIT: list[str | None] = []


def llmtrain_commit() -> str | None:
    """Git commit of the llmtrain checkout in use (with -dirty when it has local changes), if any."""
    if not _COMMIT:
        root = Path(__file__).resolve().parents[1]
        commit = None
        if (root / ".git").exists():
            try:
                head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                                      capture_output=True, text=True, timeout=10)
                if head.returncode == 0:
                    commit = head.stdout.strip()
                    dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--"],
                                           capture_output=True, timeout=10)
                    commit += "-dirty" if dirty.returncode == 1 else ""
            except (OSError, subprocess.SubprocessError):
                pass
        _COMMIT.append(commit)
    return _COMMIT[0]


def versions() -> dict[str, str | None]:
    def dist_version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": dist_version("transformers"), "cuda": torch.version.cuda,
            "llmtrain": llmtrain_commit() or dist_version("llmtrain")}


@contextmanager
def _watchdog(env: DistEnv, timeout_s: float):
    """Yields stage(name): if the current stage is still running after timeout_s (another rank stopped
    answering), print which and exit at once: a hung collective must not become a hung job."""
    current = ["start"]
    done = threading.Event()

    def fire() -> None:
        if done.is_set():
            return
        print(f"error: preflight failed: rank {env.rank} on {node_name()} waited {timeout_s:.0f} s in "
              f"'{current[0]}' without an answer from all {env.world_size} ranks (one died, or the "
              f"{env.backend} network between the nodes does not work; see the other ranks' logs); "
              "exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_CODE)

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    timer.start()
    try:
        yield lambda name: current.__setitem__(0, name)
    finally:
        done.set()
        timer.cancel()


def _read_token(path: Path, token: str, wait_s: float) -> str | None:
    """None if `path` holds `token`, else what went wrong. Retries a little: NFS may cache a negative lookup."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = path.read_text()
            if text == token:
                return None
            problem = f"{path} holds something else than what rank 0 wrote"
        except OSError as e:
            problem = f"cannot read {path}, written by rank 0: {e.strerror or e}"
        if time.monotonic() >= deadline:
            return problem
        time.sleep(0.2)


def _where(ranks: list[int], infos: list[dict]) -> str:
    nodes = sorted({infos[r]["node"] for r in ranks})
    return f"rank{'s' if len(ranks) > 1 else ''} {compact_ranks(ranks)} ({', '.join(nodes[:8])}" \
           f"{', ...' if len(nodes) > 8 else ''})"


def find_problems(infos: list[dict], expected: float, output_dir) -> list[str]:
    """What is wrong, from every rank's report (infos[r] from rank r); [] when all is well."""
    problems = []
    world = len(infos)
    bad = [i["rank"] for i in infos if i["allreduce"] != expected]
    if bad:
        problems.append(f"all-reduce of rank+1 over {world} ranks should give {expected:g}; "
                        + "; ".join(f"rank {r} ({infos[r]['node']}) got {infos[r]['allreduce']:g}" for r in bad[:8]))
    bad = [i["rank"] for i in infos if i["fs"]]
    if bad:
        problems.append(f"output_dir {output_dir} is not one shared filesystem: {_where(bad, infos)} "
                        f"cannot see the file rank 0 ({infos[0]['node']}) wrote ({infos[bad[0]]['fs']}); "
                        "checkpoints and exports need a directory every node sees (NFS, Lustre, ...)")
    for i in infos:
        if i["devices"]:
            problems.append(f"rank {i['rank']} on {i['node']}: {i['devices']}; lower --nproc_per_node "
                            "(NPROC_PER_NODE) or request more GPUs per node")
    for key, label in (("device", "device type"), ("backend", "backend")):
        values = {i[key] for i in infos}
        if len(values) > 1:
            problems.append(f"ranks disagree on the {label}: " + "; ".join(
                f"{v} on {_where([i['rank'] for i in infos if i[key] == v], infos)}" for v in sorted(values)))
    for key in infos[0]["versions"]:
        groups: dict = {}
        for i in infos:
            groups.setdefault(i["versions"][key], []).append(i["rank"])
        if len(groups) > 1:
            problems.append(f"{key} version differs across ranks: " + "; ".join(
                f"{v} on {_where(ranks, infos)}" for v, ranks in groups.items()))
    return problems


def run(env: DistEnv, output_dir: str | os.PathLike | None, timeout_s: float) -> str:
    """Run the checks on every rank (a collective); returns a one-line summary, raises PreflightError."""
    t0 = time.perf_counter()
    world = env.world_size
    with _watchdog(env, timeout_s) as stage:
        stage("all-reduce")
        t = torch.tensor([float(env.rank + 1)], device=env.device)
        dist.all_reduce(t)
        info = {"rank": env.rank, "node": node_name(), "local_rank": env.local_rank,
                "device": env.device.type, "backend": env.backend, "allreduce": t.item(), "fs": None,
                "devices": None, "versions": versions()}
        if env.device.type == "cuda":
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            if local_world > torch.cuda.device_count():
                info["devices"] = (f"LOCAL_WORLD_SIZE={local_world} processes on this node but "
                                   f"torch.cuda.device_count()={torch.cuda.device_count()} "
                                   f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")

        token_path = None
        if output_dir is not None:
            stage("shared output_dir")
            name = [None]
            if env.rank == 0:
                Path(output_dir).mkdir(parents=True, exist_ok=True)
                token = f"{uuid.uuid4().hex} written by rank 0 on {node_name()}\n"
                token_path = Path(output_dir) / f".preflight-{uuid.uuid4().hex[:12]}"
                token_path.write_text(token)
                name = [(token_path.name, token)]
            dist.broadcast_object_list(name, src=0, device=env.device)
            fname, token = name[0]
            if env.rank != 0:
                info["fs"] = _read_token(Path(output_dir) / fname, token, min(10.0, timeout_s / 3))

        stage("gathering versions")
        infos: list[dict] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(infos, info)
    if token_path is not None:
        token_path.unlink(missing_ok=True)

    problems = find_problems(infos, world * (world + 1) / 2, output_dir)
    if problems:
        raise PreflightError("preflight failed (seen from rank "
                             f"{env.rank} on {node_name()}):\n  - " + "\n  - ".join(problems))

    nodes: dict[str, list[int]] = {}
    for i in infos:
        nodes.setdefault(i["node"], []).append(i["rank"])
    v = infos[0]["versions"]
    return (f"preflight ok in {time.perf_counter() - t0:.1f} s: {world} rank{'s' if world > 1 else ''} on "
            f"{len(nodes)} node{'s' if len(nodes) > 1 else ''} ("
            + "; ".join(f"{n}: {compact_ranks(r)}" for n, r in list(nodes.items())[:8])
            + ("; ..." if len(nodes) > 8 else "") + "), all-reduce ok, "
            + ("output_dir shared, " if output_dir is not None else "")
            + "same versions on every rank ("
            + ", ".join(f"{k} {val}" for k, val in v.items() if val is not None) + ")")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.preflight",
                                description="Check a (multi-node) launch before training: every rank joins, "
                                            "an all-reduce works, output_dir is shared, versions match.")
    p.add_argument("--output-dir", help="directory that must be the same filesystem on every node (skipped if unset)")
    p.add_argument("--timeout", type=float, default=DistributedConfig.preflight_timeout_s,
                   help="seconds to wait for all ranks and for each check (default %(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    a = p.parse_args(argv)
    section = DistributedConfig(device=a.device, backend=a.backend, timeout_s=max(1, int(a.timeout)),
                                preflight=True, preflight_timeout_s=max(1, int(a.timeout)))
    rank = os.environ.get("RANK", "0")
    try:
        env = init(section)
    except PreflightError as e:
        print(f"error: preflight failed: {e}", file=sys.stderr, flush=True)
        return EXIT_CODE
    except Exception as e:  # noqa: BLE001 - any start-up failure, named
        print(f"error: preflight failed: rank {rank} on {node_name()}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_CODE
    try:
        summary = run(env, a.output_dir, a.timeout)
        if env.is_main:
            print(summary, flush=True)
        return 0
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_CODE
    finally:
        shutdown()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # see distributed.hard_exit: no interpreter teardown after gloo
