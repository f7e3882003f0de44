"""Hosts on one machine: network namespaces joined by a bridge, each
host's link shaped with ``tc``.

    from clawcomm.launch.netns import Cluster

    with Cluster(hosts=2, rate="1gbit") as cluster:
        runs = cluster.torchrun(["job.py", "--size", "64M"], nproc_per_node=2)

How they are wired. A switch namespace holds a bridge. Host ``i`` is a namespace with one
interface, ``eth0``, at ``10.99.0.<i+1>/24``, wired by a veth pair to port
``p<i>`` of the bridge. A shaped link gets a token bucket (``tc tbf``) on
both ends of its pair, so the host's upload and its download are each
limited to the rate, as a host's network card is.

Namespaces share ``/dev/shm`` and the host name, so every rank of host ``i``
runs with ``CLAWCOMM_HOST_ID=netns-h<i>`` (shared memory only inside a host)
and ``CLAWCOMM_SOCKET_IFNAME=eth0`` (TCP over the host's link). Each host
runs its ranks under its own torchrun, with the c10d rendezvous on host 0's
address.

A dead link: this machine's kernel has no ``netem`` (delay and loss), so
``cut(i)`` takes the host's switch port down, which drops everything to
and from it, as ``netem loss 100%`` would.

Needs root and iproute2; ``unavailable()`` says why not, and the tests skip
with that reason. ``__exit__`` kills whatever still runs in the namespaces
and deletes them, on failure too; namespaces left behind by a killed run
(their names carry its pid) are removed by the next ``Cluster``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

from clawcomm.cost_model import link_bits_per_s

__all__ = ["Cluster", "HostRun", "unavailable"]

_PREFIX = "clawcomm"
_SUBNET = "10.99.0"
RDZV_PORT = 29400


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here (None if they can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"{_PREFIX}{os.getpid()}-probe"
    probe = _ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _netns_list() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_and_delete(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _remove_stale() -> None:
    """Deletes namespaces of earlier runs whose process is gone."""
    for ns in _netns_list():
        m = re.match(rf"{_PREFIX}(\d+)-", ns)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            _kill_and_delete(ns)


@dataclass
class HostRun:
    """One host's torchrun: its exit status and everything it printed."""

    host: int
    returncode: int | None  # None: killed at the timeout
    output: str


def failed(runs: list[HostRun]) -> bool:
    """Prints the end of what the first host that exited non-zero (or was
    killed) printed; True if one did. For scripts that run a job on every
    host and stop at the first failure."""
    for r in runs:
        if r.returncode != 0:
            print(f"--- host {r.host} exited with {r.returncode} ---\n{r.output[-4000:]}")
            return True
    return False


class Cluster:
    """``hosts`` namespace hosts on one bridge; ``rate`` (tc's syntax:
    "1gbit", "10gbit", "200mbit") shapes every host's link, None leaves
    them unshaped (veth pairs run at memory speed)."""

    def __init__(self, hosts: int, rate: str | None = None):
        if hosts < 1 or hosts > 200:
            raise ValueError(f"Cluster: hosts={hosts} is not in [1, 200]")
        self.hosts = hosts
        self.rate = rate
        self._tag = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.switch = f"{self._tag}-sw"
        self.names = [f"{self._tag}-h{i}" for i in range(hosts)]
        self._made: list[str] = []

    # -- setup and teardown -------------------------------------------------

    def __enter__(self) -> Cluster:
        why = unavailable()
        if why:
            raise RuntimeError(f"clawcomm.launch.netns: cannot make namespace hosts: {why}")
        _remove_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kills every process in the namespaces and deletes them."""
        for ns in reversed(self._made):
            _kill_and_delete(ns)
        self._made.clear()

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}",
                "netns", self.switch)  # fmt: skip
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # `ip netns exec` mounts these over /etc/resolv.conf and
            # /etc/hosts: no name server (lookups fail at once instead of
            # timing out on one the namespace cannot reach), and the shared
            # host name resolves to this host's own address.
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/resolv.conf", "w") as f:
                f.write("# no name server inside a namespace host\n")
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.addr(i)} {socket.gethostname()}\n")
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            if self.rate:
                self.shape(i, self.rate)

    # -- links ----------------------------------------------------------------

    def addr(self, host: int) -> str:
        return f"{_SUBNET}.{host + 1}"

    def shape(self, host: int, rate: str) -> None:
        """Limits host's upload and download to `rate` (a token bucket on
        both ends of its link; the bucket holds 1 ms of traffic, at least
        64 KB, so that TSO bursts pass)."""
        bits = link_bits_per_s(rate)
        burst = max(64 << 10, int(bits / 8 / 1000))
        for ns, dev in ((self.names[host], "eth0"), (self.switch, f"p{host}")):
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", rate, "burst", str(burst), "latency", "50ms"],
                check=True, capture_output=True, text=True,
            )  # fmt: skip

    def cut(self, host: int) -> None:
        """Kills host's link: nothing goes to or from it any more."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def restore(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{host}", "up")

    def kill(self, host: int) -> None:
        """SIGKILLs every process of the host (its torchrun and ranks) at
        once, as a host that dies: all are stopped first, so that none sees
        another die and reports it (one by one, a rank killed last had time
        to notice its neighbour's death and write its error: 1 run in 20)."""
        stopped: set[int] = set()
        while True:  # until no new process appears (torchrun may start one)
            pids = {
                int(p) for p in _ip("netns", "pids", self.names[host], check=False).stdout.split()
            }
            if pids <= stopped:
                break
            for pid in pids - stopped:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
            stopped |= pids
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- running --------------------------------------------------------------

    def env(self, host: int) -> dict[str, str]:
        """The environment every rank of `host` runs with."""
        env = dict(os.environ)
        env.update(
            CLAWCOMM_HOST_ID=f"netns-h{host}",
            CLAWCOMM_SOCKET_IFNAME="eth0",
            GLOO_SOCKET_IFNAME="eth0",  # gloo (the bench's control group) too
            # torch's own TCPStore clients connect to host 0's address.
            NO_PROXY="*",
        )
        return env

    def popen(self, host: int, argv: list[str], env: dict[str, str] | None = None, **kwargs):
        """Starts argv inside the host's namespace."""
        full = self.env(host)
        full.update(env or {})
        return subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], *argv], env=full, **kwargs
        )

    def torchrun(
        self,
        script_and_args: list[str],
        nproc_per_node: int,
        env: dict[str, str] | None = None,
        timeout: float = 300,
        during=None,
        fork: bool = False,
    ) -> list[HostRun]:
        """Runs `script_and_args` on every host under torchrun (c10d
        rendezvous on host 0), nproc_per_node ranks per host, and waits for
        every host. `during(cluster)`, if given, is called once all hosts
        have started (to cut a link or kill a host mid-run); if it returns
        True, every host is killed when it returns. Ranks are
        numbered by host: host h runs ranks h*nproc .. (h+1)*nproc-1 when
        the rendezvous admits the hosts in order, which torchrun does not
        promise; a job reads GROUP_RANK or CLAWCOMM_HOST_ID to know.
        ``fork``: each host's agent imports the job once and forks its
        workers (``clawcomm.launch.forkrun``; ``script_and_args`` then
        starts with ``-m MODULE``), which starts them seconds sooner."""
        if fork and script_and_args[:1] != ["-m"]:
            raise ValueError("Cluster.torchrun(fork=True) runs a module: -m MODULE [ARGS]")
        launcher = "clawcomm.launch.forkrun" if fork else "torch.distributed.run"
        run_id = uuid.uuid4().hex[:8]
        procs = []
        for h in range(self.hosts):
            argv = [
                sys.executable, "-m", launcher,
                f"--nnodes={self.hosts}", f"--nproc-per-node={nproc_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.addr(0)}:{RDZV_PORT}",
                f"--rdzv-id={run_id}", f"--local-addr={self.addr(h)}", "--max-restarts=0",
                # Host 0 serves the rendezvous store (torchrun's own guess
                # compares host names, which every namespace shares).
                f"--rdzv-conf=is_host={int(h == 0)}",
                "--monitor-interval=0.2", *script_and_args,
            ]  # fmt: skip
            procs.append(
                self.popen(
                    h,
                    argv,
                    env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )  # fmt: skip
            )
        if during is not None and during(self):
            for h in range(self.hosts):
                self.kill(h)
        deadline = time.monotonic() + timeout
        runs = []
        for h, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                runs.append(HostRun(h, p.returncode, out))
            except subprocess.TimeoutExpired:
                self.kill(h)
                out, _ = p.communicate()
                runs.append(HostRun(h, None, out))
        return runs
