#!/usr/bin/env python3
"""A throwaway two-node Slurm cluster on this one machine, for the test suite.

    python tests/slurm/cluster.py start|stop|status     # by hand: state in /tmp/llmtrain-slurm
    slurm_cluster                                        # pytest session fixture (defined below)

What it does (Debian 12's Slurm 22.05; root only):

* installs ``slurmctld slurmd slurm-client munge`` with apt (--no-install-recommends) if a binary is
  missing; not root or no apt-get: ClusterUnavailable, which the fixture turns into a skip;
* writes its own ``slurm.conf`` and munge key under a state dir and points every client at it through
  ``SLURM_CONF`` (``cluster.env``); nothing under /etc/slurm or /etc/munge is read or written;
* starts one ``munged`` (own key/socket/pid), one ``slurmctld`` and two ``slurmd -N n1|n2`` on free
  ports, all in the foreground under our own pid files (pid + start time, so a recycled pid is never
  killed);
* adds ``127.0.0.1 n1 n2`` to /etc/hosts (node names must resolve: the templates use the head node's
  name as the torchrun rendezvous host) and restores the file byte for byte on stop.

State dir: ``$LLMTRAIN_SLURM_STATE_DIR`` if set, else ``/tmp/llmtrain-slurm`` for the CLI. The fixture
reuses a CLI-started cluster if one is up (and leaves it running); otherwise it starts its own in a
``/tmp/llmtrain-slurm-session-*`` dir, so concurrent test sessions on one machine do not share (and
stop) one cluster, and first cleans up session dirs whose owning process died without teardown.

``stop`` cancels the cluster's jobs, stops the daemons it started, kills leftover processes of this
cluster (slurmstepd and job processes, recognised by their environment), restores /etc/hosts and
removes the state dir if this helper created it. ``start`` and ``stop`` are idempotent; ``start``
after a crash cleans up the leftovers first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_STATE_DIR = "/tmp/llmtrain-slurm"
NODES = ("n1", "n2")
MARKER_VAR = "LLMTRAIN_SLURM_CLUSTER"  # set in every daemon's and client's env: identifies our processes
HOSTS_FILE = Path("/etc/hosts")
OWNED_MARK = ".llmtrain-slurm-cluster"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "munged", "mungekey")
# A requeued job waits cred_expire seconds before it may start again (default 120 s): keep it short here.
CRED_EXPIRE_S = 5
TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT",
}


class ClusterUnavailable(RuntimeError):
    """Slurm cannot be set up here (not root, no apt, install failed): tests should skip."""


def _which(name: str) -> str | None:
    # /usr/sbin is not on every root PATH (e.g. some CI images)
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def ensure_installed(log=print) -> None:
    missing = [b for b in BINARIES if _which(b) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"Slurm binaries missing ({', '.join(missing)}) and not root: cannot apt-get install")
    if shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"Slurm binaries missing ({', '.join(missing)}) and apt-get is unavailable")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # DPkg::Lock::Timeout: wait for a concurrent apt/dpkg (another test session) instead of failing
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300", *PACKAGES]
    log(f"[slurm-cluster] installing {' '.join(PACKAGES)} with apt-get")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:  # empty package lists on a fresh image: update once and retry
        subprocess.run(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=300"], env=env,
                       capture_output=True, text=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    missing = [b for b in BINARIES if _which(b) is None]
    if r.returncode != 0 or missing:
        raise ClusterUnavailable(
            f"apt-get install {' '.join(PACKAGES)} failed (rc={r.returncode}, missing={missing}): {r.stderr[-2000:]}"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # field 22 (starttime); the comm field (2) may contain spaces, so split after the last ')'
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, start_time: str | None) -> bool:
    st = _proc_start_time(pid)
    if st is None or (start_time is not None and st != start_time):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_and_wait(pids: list[int], timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` s, for pids we have already verified as ours."""
    starts = {p: _proc_start_time(p) for p in pids}
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p, starts[p]) for p in pids):
        time.sleep(0.05)
    for p in pids:
        if _alive(p, starts[p]):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in pids:  # reap the ones that are our own children (started from this process)
        try:
            os.waitpid(p, os.WNOHANG)
        except ChildProcessError:
            pass


@dataclass
class SlurmCluster:
    state_dir: Path = field(default_factory=lambda: Path(os.environ.get("LLMTRAIN_SLURM_STATE_DIR", DEFAULT_STATE_DIR)))
    nodes: tuple[str, ...] = NODES
    log: object = print

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir).resolve()

    # ---- paths -------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.state_dir / "munge" / "munge.socket"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    @property
    def _pid_dir(self) -> Path:
        return self.state_dir / "pids"

    @property
    def _hosts_state(self) -> Path:
        return self.state_dir / "hosts.json"

    @property
    def env(self) -> dict[str, str]:
        """Environment for sbatch/srun/scontrol/squeue/scancel against this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env[MARKER_VAR] = str(self.state_dir)
        path = env.get("PATH", "")
        for d in ("/usr/sbin", "/usr/bin"):
            if d not in path.split(":"):
                path = f"{path}:{d}" if path else d
        env["PATH"] = path
        # Variables of an enclosing allocation would confuse sbatch/srun run from inside it.
        for k in list(env):
            if k.startswith("SLURM_") and k != "SLURM_CONF":
                del env[k]
        return env

    # ---- daemons -----------------------------------------------------------------------------
    def _pidfile(self, name: str) -> Path:
        return self._pid_dir / f"{name}.pid"

    def _read_pid(self, name: str) -> tuple[int, str | None] | None:
        try:
            pid, start = self._pidfile(name).read_text().split()
            return int(pid), start
        except (OSError, ValueError):
            return None

    def _daemon_names(self) -> list[str]:
        return ["munged", "slurmctld", *(f"slurmd-{n}" for n in self.nodes)]

    def _running_daemons(self) -> dict[str, int]:
        out = {}
        for name in self._daemon_names():
            rec = self._read_pid(name)
            if rec and _alive(*rec):
                out[name] = rec[0]
        return out

    def _spawn(self, name: str, argv: list[str]) -> int:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = self.env
        with open(self.log_dir / f"{name}.out", "ab") as out:
            p = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, cwd=self.state_dir, start_new_session=True,  # survive the CLI's exit
            )
        time.sleep(0.01)
        self._pid_dir.mkdir(parents=True, exist_ok=True)
        self._pidfile(name).write_text(f"{p.pid} {_proc_start_time(p.pid)}\n")
        return p.pid

    def _wait_for(self, what: str, check, timeout: float, names: list[str]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            dead = [n for n in names if not (self._read_pid(n) and _alive(*self._read_pid(n)))]
            if dead:
                break
            time.sleep(0.1)
        raise RuntimeError(f"slurm test cluster: {what} not ready after {timeout}s\n{self.log_tail()}")

    def is_running(self) -> bool:
        return len(self._running_daemons()) == len(self._daemon_names()) and self.conf.exists()

    def start(self) -> bool:
        """Start the cluster; returns True if this call started it, False if it was already up."""
        if self.is_running() and self._nodes_idle(timeout=5):
            return False
        ensure_installed(self.log)
        if os.geteuid() != 0:
            raise ClusterUnavailable("the local Slurm test cluster needs root (daemons, /etc/hosts)")
        if self._pid_dir.exists() or self._hosts_state.exists():
            self.stop(quiet=True)  # leftovers of a crashed run
        try:
            self._start()
        except BaseException:
            self.stop(quiet=True)  # the error message carries the daemons' logs
            raise
        return True

    def _start(self) -> None:
        t0 = time.monotonic()
        if not self.state_dir.exists() or not any(self.state_dir.iterdir()):
            # ours alone, so stop() may delete it; a pre-existing non-empty dir is left in place
            self.state_dir.mkdir(parents=True, exist_ok=True)
            (self.state_dir / OWNED_MARK).write_text("state dir of tests/slurm/cluster.py; removed on stop\n")
        for d in ("munge", "log", "pids", "ctld", "spool", "tmp"):
            (self.state_dir / d).mkdir(parents=True, exist_ok=True)
        # munged insists that every directory up to its socket is executable by all
        os.chmod(self.state_dir, 0o755)
        os.chmod(self.state_dir / "munge", 0o755)
        self._write_conf()
        self._add_hosts()

        key = self.state_dir / "munge" / "munge.key"
        subprocess.run([_which("mungekey"), "--create", "--force", f"--keyfile={key}"], check=True,
                       capture_output=True)
        os.chmod(key, 0o600)
        self._spawn("munged", [
            _which("munged"), "--foreground", f"--key-file={key}", f"--socket={self.munge_socket}",
            f"--pid-file={self.state_dir / 'munge' / 'munged.pid'}",
            f"--seed-file={self.state_dir / 'munge' / 'munged.seed'}",
            f"--log-file={self.log_dir / 'munged.log'}",
        ])
        self._wait_for("munged", self.munge_socket.exists, 10, ["munged"])

        # -D: foreground (our pid file is the daemon); -i: ignore state left from an older run
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait_for("slurmctld", lambda: self._ok(["scontrol", "ping"]), 20, ["munged", "slurmctld"])
        for n in self.nodes:
            self._spawn(f"slurmd-{n}", [_which("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
        self._wait_for("nodes", lambda: self._nodes_idle(timeout=0), 30, self._daemon_names())
        self.log(f"[slurm-cluster] up in {time.monotonic() - t0:.1f}s: nodes {','.join(self.nodes)}, "
                 f"SLURM_CONF={self.conf}")

    def stop(self, quiet: bool = False, keep_state: bool = False) -> None:
        running = self._running_daemons()
        if "slurmctld" in running and "munged" in running:
            ids = self._run(["squeue", "-h", "-o", "%A"], timeout=10).stdout.split()
            if ids:
                self._run(["scancel", *ids], timeout=10)
                deadline = time.monotonic() + 10
                while (time.monotonic() < deadline
                       and self._run(["squeue", "-h", "-o", "%A"], timeout=10).stdout.strip()):
                    time.sleep(0.2)
        # slurmd first, munged last (the others need it to say goodbye)
        for group in ([f"slurmd-{n}" for n in self.nodes], ["slurmctld"], ["munged"]):
            pids = [running[n] for n in group if n in running]
            if pids:
                _kill_and_wait(pids)
        self._kill_marked_leftovers()
        self._restore_hosts()
        if not keep_state and (self.state_dir / OWNED_MARK).exists():  # never rmtree a dir we did not make
            shutil.rmtree(self.state_dir, ignore_errors=True)
        if not quiet:
            self.log("[slurm-cluster] stopped")

    def _kill_marked_leftovers(self) -> None:
        """Processes of this cluster that outlive the daemons: slurmstepd (carries our marker variable,
        inherited from slurmd) and job processes (SLURM_JOB_ID plus SLURM_CONF=our conf, which jobs
        inherit from the sbatch/srun that submitted them). Never this process or its ancestors."""
        marker = f"{MARKER_VAR}={self.state_dir}".encode()
        conf = f"SLURM_CONF={self.conf}".encode()
        spare, pid = set(), os.getpid()
        while pid > 1 and pid not in spare:
            spare.add(pid)
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) in spare:
                continue
            try:
                env = set((d / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if marker in env or (conf in env and any(v.startswith(b"SLURM_JOB_ID=") for v in env)):
                pids.append(int(d.name))
        if pids:
            _kill_and_wait(pids, timeout=3)

    # ---- config ------------------------------------------------------------------------------
    def _write_conf(self) -> None:
        s = self.state_dir
        cpus = os.cpu_count() or 1
        ctld_port = _free_port()
        ports = {n: _free_port() for n in self.nodes}
        # slurmctld refuses to run unless SlurmctldHost names this machine (short hostname)
        host = socket.gethostname().split(".")[0]
        lines = [
            "# generated by tests/slurm/cluster.py: a local test cluster, do not use in production",
            "ClusterName=llmtrain-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
            f"StateSaveLocation={s / 'ctld'}",
            f"SlurmdSpoolDir={s / 'spool' / '%n'}",
            f"SlurmctldPidFile={s / 'ctld' / 'slurmctld.pid'}",
            f"SlurmdPidFile={s / 'spool' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log_dir / 'slurmd-%n.log'}",
            f"TmpFS={s / 'tmp'}",
            f"PlugStackConfig={s / 'plugstack.conf'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            # bf_interval/sched_interval: a requeued job becomes eligible after cred_expire; without these it then
            # waits up to 30 s for the next backfill pass
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,bf_interval=1,sched_interval=1",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "SlurmdParameters=config_overrides",
            "PropagateResourceLimits=NONE",
            "ReturnToService=2",
            "MinJobAge=300",
            "KillWait=5",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "MessageTimeout=10",
            "JobRequeue=1",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[n]} "
                         f"CPUs={cpus} RealMemory=512 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (s / "plugstack.conf").write_text("")

    # ---- /etc/hosts --------------------------------------------------------------------------
    def _hosts_line(self) -> str:
        return f"127.0.0.1 {' '.join(self.nodes)}  # llmtrain slurm test cluster {self.state_dir}\n"

    def _add_hosts(self) -> None:
        line = self._hosts_line()
        orig = HOSTS_FILE.read_bytes()
        if line.encode() in orig:
            return
        added = ("" if orig.endswith(b"\n") or not orig else "\n") + line
        self._hosts_state.write_text(json.dumps({"orig": orig.decode("latin-1"), "added": added}))
        # in place, not rename: /etc/hosts is often a bind mount in containers
        with open(HOSTS_FILE, "ab") as f:
            f.write(added.encode())

    def _restore_hosts(self) -> None:
        try:
            rec = json.loads(self._hosts_state.read_text())
        except (OSError, ValueError):
            rec = None
        cur = HOSTS_FILE.read_bytes()
        line = self._hosts_line().encode()
        if rec is not None and cur == (rec["orig"] + rec["added"]).encode("latin-1"):
            new = rec["orig"].encode("latin-1")
        elif line in cur:  # someone else edited the file meanwhile: remove just our line
            new = cur.replace(line, b"", 1)
        else:
            new = None
        if new is not None:
            with open(HOSTS_FILE, "r+b") as f:
                f.write(new)
                f.truncate()
        self._hosts_state.unlink(missing_ok=True)

    # ---- clients -----------------------------------------------------------------------------
    def _run(self, argv: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=kw.pop("env", self.env), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def _ok(self, argv: list[str]) -> bool:
        try:
            return self._run(argv, timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _nodes_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = self._run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
                states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            except (subprocess.TimeoutExpired, ValueError):
                states = {}
            if all(states.get(n) in ("idle", "mix", "alloc") for n in self.nodes):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
        r = self._run(["scontrol", "show", "job", "-o", str(job_id)], timeout=10)
        info = {}
        for tok in r.stdout.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                info.setdefault(k, v)
        return info

    def wait_job(self, job_id: str, timeout: float = 60, poll: float = 0.2) -> dict[str, str]:
        """Poll until the job reaches a terminal state (a requeued job passes through PENDING again)."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return info
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not finished after {timeout}s: {info}\n{self.log_tail()}")

    def sbatch(self, args: list[str], cwd: str | os.PathLike | None = None, env: dict | None = None,
               timeout: float = 30) -> str:
        """Submit with ``sbatch --parsable`` and return the job id."""
        r = self._run(["sbatch", "--parsable", *args], timeout=timeout, cwd=cwd, env=env or self.env)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch {args} failed (rc={r.returncode}): {r.stderr}\n{self.log_tail()}")
        return r.stdout.strip().split(";")[0]

    def log_tail(self, n: int = 30) -> str:
        out = []
        if self.log_dir.exists():
            for f in sorted(self.log_dir.iterdir()):
                try:
                    lines = f.read_text(errors="replace").splitlines()[-n:]
                except OSError:
                    continue
                if lines:
                    out.append(f"--- {f.name} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(out)

    def status(self) -> str:
        running = self._running_daemons()
        lines = [f"state dir: {self.state_dir} ({'exists' if self.state_dir.exists() else 'absent'})"]
        for name in self._daemon_names():
            lines.append(f"  {name:12s} {'running pid ' + str(running[name]) if name in running else 'not running'}")
        if "slurmctld" in running:
            r = self._run(["sinfo", "-N", "-l"], timeout=10)
            lines.append(r.stdout.rstrip())
            lines.append(f"use: export SLURM_CONF={self.conf}")
        return "\n".join(lines)


SESSION_PREFIX = "llmtrain-slurm-session-"


def session_cluster(log=print) -> SlurmCluster:
    """The cluster a test session should use.

    $LLMTRAIN_SLURM_STATE_DIR if set; else the one `cluster.py start` runs, if it is up (reused, and
    left running); else a fresh one in its own /tmp/llmtrain-slurm-session-* dir, so that two test
    sessions on one machine (each `pytest tests`) do not stop each other's cluster. Session dirs left
    by a session that died without teardown (owner pid gone) are cleaned up first.
    """
    if "LLMTRAIN_SLURM_STATE_DIR" in os.environ:
        return SlurmCluster(log=log)
    cli = SlurmCluster(state_dir=Path(DEFAULT_STATE_DIR), log=log)
    if cli.is_running():
        return cli
    import tempfile

    for d in Path("/tmp").glob(SESSION_PREFIX + "*"):
        try:
            pid, start = (d / "owner").read_text().split()
        except (OSError, ValueError):
            continue
        if (d / OWNED_MARK).exists() and not _alive(int(pid), start):
            SlurmCluster(state_dir=d, log=log).stop(quiet=True)
    # /tmp, not $TMPDIR: munge's and slurmd's unix socket paths must stay under 108 bytes
    d = Path(tempfile.mkdtemp(prefix=SESSION_PREFIX, dir="/tmp"))
    (d / "owner").write_text(f"{os.getpid()} {_proc_start_time(os.getpid())}\n")
    (d / OWNED_MARK).write_text("state dir of tests/slurm/cluster.py; removed on stop\n")
    return SlurmCluster(state_dir=d, log=log)


try:  # the fixture; the CLI works without pytest
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def slurm_cluster():
        """The local two-node cluster (n1, n2); use ``.env`` for sbatch/scontrol/srun/squeue/scancel.

        Skips when Slurm cannot be set up here (not root, no apt); LLMTRAIN_REQUIRE_SLURM=1 turns that
        into a failure. Stops the cluster at the end of the session if this session started it.
        """
        import atexit

        c = session_cluster(log=lambda msg: print(msg, file=sys.stderr))
        try:
            started = c.start()
        except ClusterUnavailable as e:
            c.stop(quiet=True)  # removes the empty session dir
            if os.environ.get("LLMTRAIN_REQUIRE_SLURM") == "1":
                pytest.fail(f"LLMTRAIN_REQUIRE_SLURM=1 but: {e}")
            pytest.skip(str(e))
        if started:
            atexit.register(c.stop, quiet=True)  # backstop should teardown never run
        try:
            yield c
        finally:
            if started:
                c.stop()
                atexit.unregister(c.stop)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["start", "stop", "status"])
    ap.add_argument("--state-dir", default=os.environ.get("LLMTRAIN_SLURM_STATE_DIR", DEFAULT_STATE_DIR))
    ap.add_argument("--keep-state", action="store_true", help="stop: keep the state dir (logs)")
    a = ap.parse_args(argv)
    c = SlurmCluster(state_dir=Path(a.state_dir))
    if a.action == "start":
        try:
            started = c.start()
        except ClusterUnavailable as e:
            print(f"cannot start: {e}", file=sys.stderr)
            return 2
        if not started:
            print("[slurm-cluster] already running")
        print(f"export SLURM_CONF={c.conf}")
    elif a.action == "stop":
        c.stop(keep_state=a.keep_state)
    else:
        print(c.status())
        return 0 if c.is_running() else 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
