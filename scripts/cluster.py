#!/usr/bin/env python3
"""Emulated hosts on this machine: each host is a network namespace with its own IPv4 address on a
Linux bridge, its own hostname and loopback, and a link that can be shaped, cut, healed or taken
down, so that multi-host runs (torchrun across hosts, elastic faults) can be tested on one machine.
Needs root, iproute2 (ip, tc with tbf) and util-linux (unshare); stdlib only.

As a module (tests and benchmarks):

    sys.path.insert(0, "scripts"); import cluster
    if cluster.unavailable_reason(): skip(cluster.unavailable_reason())
    with cluster.Cluster(3, rate_mbit=40) as c:           # host0..host2 at 10.77.0.1..3
        proc = c.hosts[1].popen(["sleep", "60"])           # a subprocess.Popen inside host1
        c.hosts[2].cut(); c.hosts[2].heal()                # link down and up, processes untouched
        c.hosts[1].down()                                  # every process of host1 killed, link down
        print(c.hosts[0].run(["hostname"]).stdout)         # "host0"
    with cluster.Cluster(2, slurm=True) as c:             # munged, slurmctld and slurmd's, nodes idle
        c.hosts[0].run(["sbatch", "--nodes", "2", "job.sh"], env=c.slurm_env())

Each event is logged as a cluster log line, "[12:03:04.512] host1 (10.77.0.2): link cut", and
Host.follow(proc) prefixes every line a process writes with its host and the time.

On the command line:

    .venv/bin/python scripts/cluster.py up 3 --rate 40               # until Ctrl-C, then torn down
    .venv/bin/python scripts/cluster.py up 2 --slurm                 # with Slurm; `run` then sets SLURM_CONF
    .venv/bin/python scripts/cluster.py run --cluster hc1a2b3 --host 1 -- hostname
    .venv/bin/python scripts/cluster.py cut --cluster hc1a2b3 --host 1   # also heal, down, shape
    .venv/bin/python scripts/cluster.py cleanup                      # leftovers of dead owners

Names: a cluster is "hc" and five hex digits (hc1a2b3); its bridge hc1a2b3-br, its hosts'
namespaces hc1a2b3-host0.., their bridge-side veths hc1a2b3-h0.. (eth0 inside each host). Clusters
never share a bridge, so two of them may use the same subnet. The bridge's alias names the owning
process, so cleanup removes only clusters whose owner is gone.

Shaping: a tbf qdisc on both ends of a host's veth (eth0 inside the host: what it sends; the bridge
side: what it receives), so each direction is limited to the rate. The bucket holds 4 ms of the
rate, at least 16 KiB (a rate of 40 Mbit/s: 20 kB, about 13 full-size packets; enough that the
kernel's timer granularity does not cut the rate), and a packet may wait 50 ms in the queue before
it is dropped (TCP then backs off as on a congested link).

Tear-down kills every process in the hosts, then removes the veths, the namespaces and the bridge;
it runs on leaving the with-block, on close(), at exit (atexit) and on SIGTERM, SIGINT and SIGHUP.
A process killed with SIGKILL leaves its cluster behind: the next Cluster or `cleanup` removes it.
Hostnames are not in any /etc/hosts (as on a cluster without DNS for them): a program that
resolves its own hostname gets no address or a loopback one, and must pick its interface itself.
A cluster with Slurm is the exception: Slurm's recipe passes hostnames around (MASTER_ADDR=host0),
so each host then gets an /etc/hosts naming every host (/etc/netns/<namespace>/hosts, which `ip
netns exec` mounts over /etc/hosts for what starts on that host afterwards).

Slurm (Debian's slurm-wlm and munge; Cluster(n, slurm=True) or cluster.start_slurm()): munged and
slurmctld on host0, a slurmd on every host, one slurm.conf naming each host with its address, all
files in <tmp>/<cluster>-slurm/, removed with the cluster. Slurm's commands run on a host with
SLURM_CONF set: host.run([...], env=cluster.slurm_env()). The Slurm class says which settings the
namespaces need, and why.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import io
import ipaddress
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, IO, List, Optional, Sequence, Tuple

NAME_PREFIX = "hc"
CLUSTER_NAME = re.compile(r"^hc[0-9a-f]{5}$")
OWNED_NAME = re.compile(r"^(hc[0-9a-f]{5})-")    # a namespace or link of some cluster
OWNER_ALIAS = re.compile(r"scripts/cluster\.py pid=(\d+) start=(\d+)")
HOST_INTERFACE = "eth0"                            # the host's end of its veth, inside its namespace
NETNS_DIR = "/run/netns"
BURST_SECONDS = 0.004
MIN_BURST_BYTES = 16384
QUEUE_LATENCY_MS = 50
KILL_PATIENCE_S = 5.0
NETNS_ETC_DIR = "/etc/netns"                       # `ip netns exec NS` mounts /etc/netns/NS/FILE over /etc/FILE
SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
SLURM_START_TIMEOUT_S = 30.0
SLURM_POLL_S = 0.2
# Job states after which a job runs no more (squeue(1) lists them); COMPLETING is not one yet.
SLURM_FINAL_JOB_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                          "PREEMPTED", "BOOT_FAIL", "DEADLINE")


def timestamp() -> str:
    return datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]


def ip_command(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Runs ip/tc/... with its output captured; check raises with the command and ip's message."""
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def process_start_time(pid: int) -> Optional[int]:
    """The start time of a process in clock ticks since boot (field 22 of /proc/pid/stat), or None
    where it is gone: with the pid it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def pids_in_namespace(namespace: str) -> List[int]:
    """Every process whose network namespace is `namespace` (what `ip netns pids` lists)."""
    try:
        target = os.stat(os.path.join(NETNS_DIR, namespace))
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            net = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue  # gone, or a zombie (it has no namespaces left)
        if (net.st_ino, net.st_dev) == (target.st_ino, target.st_dev):
            pids.append(int(entry))
    return pids


def kill_namespace_processes(namespace: str, already_killed: Sequence[int] = ()) -> int:
    """SIGKILLs every process of a namespace, again until none is left (one may fork meanwhile);
    returns how many were killed, not counting already_killed."""
    killed = set(already_killed)
    counted_before = len(killed)
    deadline = time.monotonic() + KILL_PATIENCE_S
    while True:
        pids = pids_in_namespace(namespace)
        if not pids:
            return len(killed) - counted_before
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"namespace {namespace}: processes {pids} survive SIGKILL")
        time.sleep(0.02)


def namespaces() -> List[str]:
    listed = ip_command(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def links() -> Dict[str, str]:
    """Every link of this namespace: name -> alias ("" where none)."""
    out = {}
    for line in ip_command(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        m = re.match(r"^\d+:\s+([^:@\s]+)", line)
        if m:
            alias = re.search(r"\\\s+alias (.*)$", line)
            out[m.group(1)] = alias.group(1).strip() if alias else ""
    return out


def unused_cluster_name() -> str:
    taken = {m.group(1) for name in namespaces() + list(links()) for m in [OWNED_NAME.match(name)] if m}
    while True:
        name = f"{NAME_PREFIX}{secrets.token_hex(3)[:5]}"
        if name not in taken:
            return name


def remove_cluster_network(name: str, host_namespaces: Sequence[str], bridge_ports: Sequence[str]) -> None:
    """Deletes a cluster's veths (both ends go together), namespaces and bridge, then waits until
    the kernel no longer lists them. Processes must be gone first: a namespace outlives its name
    while a process is in it."""
    for port in bridge_ports:
        ip_command(["ip", "link", "del", port], check=False)
    for namespace in host_namespaces:
        ip_command(["ip", "netns", "del", namespace], check=False)
    ip_command(["ip", "link", "del", f"{name}-br"], check=False)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left_links = [n for n in links() if n.startswith(f"{name}-")]
        left_namespaces = [n for n in namespaces() if n.startswith(f"{name}-")]
        left = left_links + left_namespaces
        if not left:
            return
        for link in left_links:
            ip_command(["ip", "link", "del", link], check=False)
        for namespace in left_namespaces:
            kill_namespace_processes(namespace)
            ip_command(["ip", "netns", "del", namespace], check=False)
        time.sleep(0.05)
    raise RuntimeError(f"cluster {name}: {left} still listed after tear-down")


def slurm_directory(name: str) -> str:
    """Where cluster `name` keeps Slurm's files: config, munge key and socket, state, spool, logs."""
    return os.path.join(tempfile.gettempdir(), f"{name}-slurm")


def remove_cluster_files(name: str, host_namespaces: Sequence[str]) -> None:
    """Deletes what a cluster wrote outside its namespaces: the hosts' /etc/netns/<namespace>/ and
    its Slurm directory. /etc/netns itself stays: other clusters may be writing into it."""
    for namespace in host_namespaces:
        shutil.rmtree(os.path.join(NETNS_ETC_DIR, namespace), ignore_errors=True)
    shutil.rmtree(slurm_directory(name), ignore_errors=True)


def orphaned_cluster_files() -> List[str]:
    """Cluster files whose cluster has no namespace or link left (its owner died mid-tear-down).
    Files are listed before the clusters: a cluster makes its network before its files."""
    found = []
    if os.path.isdir(NETNS_ETC_DIR):
        found += [(m.group(1), os.path.join(NETNS_ETC_DIR, entry)) for entry in os.listdir(NETNS_ETC_DIR)
                  for m in [OWNED_NAME.match(entry)] if m]
    found += [(m.group(1), os.path.join(tempfile.gettempdir(), entry)) for entry in os.listdir(tempfile.gettempdir())
              for m in [re.match(r"^(hc[0-9a-f]{5})-slurm$", entry)] if m]
    present = clusters_present()
    return [path for name, path in found if name not in present]


def owner_alias() -> str:
    """What a cluster's bridge carries as its alias: this process, by pid and start time."""
    return f"scripts/cluster.py pid={os.getpid()} start={process_start_time(os.getpid())}"


def owner_alive(alias: str) -> bool:
    m = OWNER_ALIAS.search(alias)
    return bool(m) and process_start_time(int(m.group(1))) == int(m.group(2))


def unavailable_reason() -> Optional[str]:
    """None where clusters can be made here, else why not (for unittest's skip and the CLI)."""
    if os.geteuid() != 0:
        return f"scripts/cluster.py needs root (uid {os.geteuid()})"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"scripts/cluster.py needs {tool}, which is not installed (iproute2, util-linux)"
    probe = unused_cluster_name()
    try:   # the bridge first, with its owner, as a cluster's: a concurrent cleanup leaves it alone
        bridge = ip_command(["ip", "link", "add", f"{probe}-br", "type", "bridge"], check=False)
        if bridge.returncode != 0:
            return f"Linux bridges are unavailable: {bridge.stderr.strip()}"
        ip_command(["ip", "link", "set", "dev", f"{probe}-br", "alias", owner_alias()], check=False)
        made = ip_command(["ip", "netns", "add", f"{probe}-probe"], check=False)
        if made.returncode != 0:
            return f"network namespaces are unavailable: {made.stderr.strip()}"
        veth = ip_command(["ip", "link", "add", f"{probe}-h0", "type", "veth", "peer", "name", HOST_INTERFACE,
                           "netns", f"{probe}-probe"], check=False)
        if veth.returncode != 0:
            return f"veth pairs are unavailable: {veth.stderr.strip()}"
        tbf = ip_command(["tc", "qdisc", "add", "dev", f"{probe}-h0", "root", "tbf", "rate", "40mbit", "burst",
                          str(MIN_BURST_BYTES), "latency", f"{QUEUE_LATENCY_MS}ms"], check=False)
        if tbf.returncode != 0:
            return f"tc's tbf qdisc (link shaping) is unavailable: {tbf.stderr.strip()}"
        unshared = ip_command(["ip", "netns", "exec", f"{probe}-probe", "unshare", "--uts", "true"], check=False)
        if unshared.returncode != 0:
            return f"UTS namespaces are unavailable: {unshared.stderr.strip()}"
        return None
    finally:
        ip_command(["ip", "link", "del", f"{probe}-h0"], check=False)
        ip_command(["ip", "netns", "del", f"{probe}-probe"], check=False)
        ip_command(["ip", "link", "del", f"{probe}-br"], check=False)


def slurm_program(program: str) -> Optional[str]:
    """The path of a Slurm or munge program; the daemons live in /usr/sbin, often not on PATH."""
    return shutil.which(program, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def slurm_unavailable_reason() -> Optional[str]:
    """None where clusters with Slurm can be made here, else why not."""
    reason = unavailable_reason()
    if reason:
        return reason
    missing = [program for program in SLURM_PROGRAMS if slurm_program(program) is None]
    if missing:
        return (f"Slurm on emulated hosts needs {', '.join(missing)}, which is not installed (Debian's "
                f"slurm-wlm and munge; scripts/setup.sh installs them)")
    return None


class ClusterLog:
    """Timestamped lines to a stream (None: kept only), safe from several threads."""

    def __init__(self, stream: Optional[IO[str]]):
        self.stream = stream
        self.lines: List[str] = []
        self.lock = threading.Lock()

    def write(self, who: str, message: str, separator: str = ": ") -> None:
        line = f"[{timestamp()}] {who}{separator}{message}"
        with self.lock:
            self.lines.append(line)
            if self.stream is not None:
                self.stream.write(line + "\n")
                self.stream.flush()


class HostOutput:
    """The lines a host's process writes, pumped by threads from its pipes into the cluster log
    ("[12:03:04.512] host1 | line") and kept in `lines` for assertions."""

    def __init__(self, label: str, log: ClusterLog, proc: subprocess.Popen, echo: bool = True):
        self.label = label
        self.lines: List[str] = []
        self.threads = [threading.Thread(target=self.pump, args=(stream, log, echo), daemon=True)
                        for stream in (proc.stdout, proc.stderr) if stream is not None]
        for thread in self.threads:
            thread.start()

    def pump(self, stream: IO, log: ClusterLog, echo: bool) -> None:
        with stream:
            for raw in iter(stream.readline, "" if isinstance(stream, io.TextIOBase) else b""):
                line = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw).rstrip("\n")
                self.lines.append(line)
                if echo:
                    log.write(self.label, line, separator=" | ")

    def wait(self, timeout: Optional[float] = None) -> None:
        """Until every pipe reached its end (the process and its children closed it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self.threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def text(self) -> str:
        return "\n".join(self.lines)


class Host:
    """One emulated host: namespace, address, hostname, and the bridge-side end of its link."""

    def __init__(self, cluster: "Cluster", index: int, address: str):
        self.cluster = cluster
        self.index = index
        self.name = f"host{index}"
        self.address = address
        self.namespace = f"{cluster.name}-host{index}"
        self.bridge_port = f"{cluster.name}-h{index}"
        self.processes: List[subprocess.Popen] = []
        self.outputs: List[HostOutput] = []

    def __repr__(self) -> str:
        return f"{self.name} ({self.address})"

    def log(self, message: str) -> None:
        self.cluster.log.write(repr(self), message)

    def command_line(self, args: Sequence[str]) -> List[str]:
        """args run inside this host: its network namespace and a UTS namespace named after it."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name] + list(args)

    def popen(self, args: Sequence[str], env: Optional[Dict[str, str]] = None, **popen_kwargs) -> subprocess.Popen:
        """Starts args on this host (env: the whole environment, as for subprocess.Popen; the
        default is this process's) and returns its Popen, whose pid is the command's own."""
        self.cluster.log.write(self.name, f"$ {shlex.join(args)}")
        proc = subprocess.Popen(self.command_line(args), env=env, **popen_kwargs)
        self.processes.append(proc)
        return proc

    def follow(self, proc: subprocess.Popen, echo: bool = True) -> HostOutput:
        """Pumps proc's piped stdout and stderr into the cluster log, each line prefixed with this
        host and the time; the returned HostOutput keeps the lines."""
        output = HostOutput(self.name, self.cluster.log, proc, echo)
        self.outputs.append(output)
        return output

    def start(self, args: Sequence[str], env: Optional[Dict[str, str]] = None, echo: bool = True):
        """popen with stdout and stderr merged into one followed pipe: (Popen, HostOutput)."""
        proc = self.popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return proc, self.follow(proc, echo)

    def run(self, args: Sequence[str], timeout: float = 60, env: Optional[Dict[str, str]] = None,
            check: bool = False, input: Optional[str] = None) -> subprocess.CompletedProcess:
        """Runs args on this host to completion, output captured as text."""
        self.cluster.log.write(self.name, f"$ {shlex.join(args)}")
        proc = subprocess.run(self.command_line(args), env=env, capture_output=True, text=True,
                              timeout=timeout, input=input)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{self.name}: {shlex.join(args)} exited {proc.returncode}\n{proc.stdout}{proc.stderr}")
        return proc

    def pids(self) -> List[int]:
        return pids_in_namespace(self.namespace)

    def shape(self, rate_mbit: float) -> None:
        """Limits what this host sends and what it receives to rate_mbit (megabits/s) each."""
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit {rate_mbit} must be > 0 (unshape() removes the limit)")
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(MIN_BURST_BYTES, int(rate_bytes * BURST_SECONDS))
        tbf = ["root", "tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", f"{QUEUE_LATENCY_MS}ms"]
        ip_command(["tc", "qdisc", "replace", "dev", self.bridge_port] + tbf)
        ip_command(["tc", "-n", self.namespace, "qdisc", "replace", "dev", HOST_INTERFACE] + tbf)
        self.log(f"link shaped to {rate_mbit:g} Mbit/s each way (tbf burst {burst} B, latency {QUEUE_LATENCY_MS} ms)")

    def unshape(self) -> None:
        ip_command(["tc", "qdisc", "del", "dev", self.bridge_port, "root"], check=False)
        ip_command(["tc", "-n", self.namespace, "qdisc", "del", "dev", HOST_INTERFACE, "root"], check=False)
        self.log("link unshaped")

    def cut(self) -> None:
        """The link goes down at the bridge (a pulled cable); processes keep running."""
        ip_command(["ip", "link", "set", "dev", self.bridge_port, "down"])
        self.log("link cut")

    def heal(self) -> None:
        """Brings both ends of the link up again (after cut() or down())."""
        ip_command(["ip", "-n", self.namespace, "link", "set", "dev", HOST_INTERFACE, "up"])
        ip_command(["ip", "link", "set", "dev", self.bridge_port, "up"])
        self.log("link healed")

    def kill_all(self) -> int:
        """SIGKILLs every process of this host; returns how many. The processes started here are
        killed by pid too: one just started may not have entered the namespace yet."""
        killed = 0
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
                killed += 1
        return killed + kill_namespace_processes(self.namespace, already_killed=[p.pid for p in self.processes])

    def down(self) -> int:
        """Kills every process of this host (SIGKILL) and takes its link down; returns how many."""
        killed = self.kill_all()
        ip_command(["ip", "link", "set", "dev", self.bridge_port, "down"])
        ip_command(["ip", "-n", self.namespace, "link", "set", "dev", HOST_INTERFACE, "down"])
        self.log(f"down (killed {killed} process{'' if killed == 1 else 'es'}, link down)")
        return killed


class Slurm:
    """Slurm on a cluster's hosts, from Debian's packages: munged and slurmctld on host0, a slurmd on
    every host, all files in slurm_directory(cluster). Made by Cluster.start_slurm(); its daemons are
    processes of the hosts and die with them, its files are removed with the cluster."""

    def __init__(self, cluster: "Cluster", cpus_per_host: Optional[int] = None):
        self.cluster = cluster
        self.directory = slurm_directory(cluster.name)
        self.conf = os.path.join(self.directory, "slurm.conf")
        self.munge_socket = os.path.join(self.directory, "munge.socket")
        self.cpus_per_host = cpus_per_host or os.cpu_count() or 1
        self.daemons: List[Tuple[str, subprocess.Popen, HostOutput]] = []   # (what, process, its output)
        self.last_sinfo = ""

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """base (default: this process's environment) with SLURM_CONF naming this cluster's config."""
        return dict(os.environ if base is None else base, SLURM_CONF=self.conf)

    def config(self) -> str:
        """slurm.conf. Why the settings that differ from a real cluster's:
        - SlurmctldHost and NodeAddr give addresses, so no daemon resolves a name to reach another.
        - SlurmdSpoolDir, SlurmdPidFile and SlurmdLogFile carry %n (the node's name): every slurmd
          sees the one file system.
        - No cgroups: proctrack/pgid finds a step's processes by process group, task/none binds
          nothing, jobacct_gather/none measures nothing (cgroup.conf says why slurmd still needs
          CgroupPlugin named). Tear-down kills every process of the hosts anyway.
        - SlurmdParameters=config_overrides: every host sees all of the machine's cores; a node has
          the CPUs configured here, and memory is not a consumable (CR_CPU).
        - MpiDefault=none: the program makes its own process group from MASTER_ADDR.
        - MailProg=/bin/true: Debian's default (/usr/bin/mail) is not installed, and slurmctld logs
          "Configured MailProg is invalid" otherwise."""
        d = self.directory
        hosts = self.cluster.hosts
        nodes = "".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={self.cpus_per_host} State=UNKNOWN\n"
                        for h in hosts)
        return (f"# cluster {self.cluster.name}, written by scripts/cluster.py; removed with the cluster\n"
                f"ClusterName={self.cluster.name}\n"
                f"SlurmctldHost={hosts[0].name}({hosts[0].address})\n"
                f"SlurmUser=root\nSlurmdUser=root\n"
                f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket}\nCredType=cred/munge\n"
                f"StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool/%n\n"
                f"SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd-%n.pid\n"
                f"SlurmctldLogFile={d}/slurmctld.log\nSlurmdLogFile={d}/slurmd-%n.log\n"
                f"ProctrackType=proctrack/pgid\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
                f"AccountingStorageType=accounting_storage/none\nJobCompType=jobcomp/none\n"
                f"SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSlurmdParameters=config_overrides\n"
                f"SchedulerType=sched/builtin\nMpiDefault=none\nReturnToService=2\nMailProg=/bin/true\n"
                + nodes +
                f"PartitionName=hosts Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")

    def write_files(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)   # a dead cluster's of the same name
        os.makedirs(os.path.join(self.directory, "state"), mode=0o755)
        for host in self.cluster.hosts:
            os.makedirs(os.path.join(self.directory, "spool", host.name))
        with open(self.conf, "w") as f:
            f.write(self.config())
        # slurmd (22.05) loads a cgroup plugin even with no cgroup proctrack, task or accounting
        # plugin, and its default, autodetect, fails inside a host: `ip netns exec` mounts a fresh
        # sysfs there, with nothing at /sys/fs/cgroup ("error: No filesystem mounted on
        # /sys/fs/cgroup", "error: Unable to initialize cgroup plugin", "error: slurmd
        # initialization failed"). Naming cgroup/v1 skips the detection; the plugin touches the
        # cgroup file system only for the cgroup plugins, and none is configured.
        with open(os.path.join(self.directory, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\n")
        key = os.path.join(self.directory, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as f:
            f.write(secrets.token_bytes(128))    # munged reads only a key no one else may read

    def start(self, timeout: float = SLURM_START_TIMEOUT_S) -> None:
        """Starts munged, slurmctld and the slurmd's, and returns once sinfo shows every host idle."""
        started = time.monotonic()
        deadline = started + timeout
        host0 = self.cluster.hosts[0]
        self.cluster.write_hosts_files()
        self.write_files()
        # One munged, on host0, serves every host: Slurm reaches it through a Unix socket at a path
        # (AuthInfo=socket=), and such a socket belongs to the file system the hosts share, not to a
        # network namespace; so slurmd on host1 signs and checks credentials through host0's munged,
        # with the one key. A credential then names host0 as its origin (--origin); slurmctld takes
        # a job's AllocNode from it and nothing else (replies go to the connection's peer address).
        self.start_daemon(host0, "munged", [
            slurm_program("munged"), "--foreground", f"--socket={self.munge_socket}",
            f"--key-file={self.directory}/munge.key", f"--pid-file={self.directory}/munged.pid",
            f"--log-file={self.directory}/munged.log", f"--seed-file={self.directory}/munged.seed",
            f"--origin={host0.address}"])
        self.wait_until(lambda: os.path.exists(self.munge_socket), "munged to make its socket", deadline)
        self.start_daemon(host0, "slurmctld", [slurm_program("slurmctld"), "-D", "-f", self.conf])
        for host in self.cluster.hosts:
            self.start_daemon(host, "slurmd", [slurm_program("slurmd"), "-D", "-N", host.name, "-f", self.conf])
        self.wait_until(self.nodes_idle, f"sinfo to show {', '.join(h.name for h in self.cluster.hosts)} idle",
                        deadline)
        self.cluster.log.write(f"cluster {self.cluster.name}", f"Slurm up in {time.monotonic() - started:.1f} s: "
                               f"munged and slurmctld on host0, slurmd on every host; SLURM_CONF={self.conf}")

    def start_daemon(self, host: Host, what: str, args: Sequence[str]) -> None:
        proc, output = host.start(args, env=self.env(), echo=False)   # their log files hold the rest
        self.daemons.append((f"{what} on {host.name}", proc, output))

    def query(self, args: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm command on host0, not written to the cluster log (waits poll with it)."""
        return subprocess.run(self.cluster.hosts[0].command_line(args), env=self.env(), capture_output=True,
                              text=True, timeout=timeout)

    def nodes_idle(self) -> bool:
        shown = self.query(["sinfo", "--noheader", "--Node", "--format", "%N %T"])
        self.last_sinfo = (shown.stdout + shown.stderr).strip()
        states = dict(line.split()[:2] for line in shown.stdout.splitlines() if len(line.split()) >= 2)
        return all(states.get(host.name) == "idle" for host in self.cluster.hosts)

    def wait_until(self, ready, what: str, deadline: float) -> None:
        while not ready():
            exited = [f"{who} exited with {proc.returncode}" for who, proc, _ in self.daemons if proc.poll() is not None]
            if exited:
                raise self.failure(f"{'; '.join(exited)} while waiting for {what}")
            if time.monotonic() > deadline:
                raise self.failure(f"timed out waiting for {what}")
            time.sleep(SLURM_POLL_S)

    def failure(self, message: str) -> RuntimeError:
        """message with sinfo's last answer and the last lines of every daemon's output."""
        parts = [f"cluster {self.cluster.name}: Slurm: {message}"]
        if self.last_sinfo:
            parts.append(f"sinfo said:\n{self.last_sinfo}")
        for who, _, output in self.daemons:
            parts.append(f"{who}, last lines:\n" + "\n".join(output.lines[-15:]))
        return RuntimeError("\n".join(parts))

    def job(self, job_id: str) -> Dict[str, str]:
        """scontrol's fields of a job (JobState, ExitCode, NodeList, ...); {} where Slurm knows none."""
        shown = self.query(["scontrol", "--oneliner", "show", "job", str(job_id)])
        return dict(re.findall(r"(\w+)=(\S*)", shown.stdout)) if shown.returncode == 0 else {}

    def wait_for_job(self, job_id: str, timeout: float) -> Dict[str, str]:
        """The job's fields once it has ended (SLURM_FINAL_JOB_STATES); raises after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in SLURM_FINAL_JOB_STATES:
                return fields
            if time.monotonic() > deadline:
                raise self.failure(f"job {job_id} still {fields.get('JobState', 'unknown')} after {timeout:g} s")
            time.sleep(SLURM_POLL_S)


class LiveClusters:
    """The clusters of this process still up, torn down at exit and on SIGTERM/SIGINT/SIGHUP even
    where the caller never reaches close(). The only module-level state."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self):
        self.clusters: List["Cluster"] = []
        self.lock = threading.RLock()    # reentrant: a signal may arrive inside close()
        self.previous_handlers: Dict[int, object] = {}
        self.hooks_installed = False

    def add(self, cluster: "Cluster") -> None:
        with self.lock:
            self.clusters.append(cluster)
            if not self.hooks_installed:
                self.hooks_installed = True
                atexit.register(self.close_all, "exit")
            if threading.current_thread() is threading.main_thread():
                for signum in self.SIGNALS:
                    if signum not in self.previous_handlers:
                        self.previous_handlers[signum] = signal.signal(signum, self.on_signal)

    def remove(self, cluster: "Cluster") -> None:
        with self.lock:
            if cluster in self.clusters:
                self.clusters.remove(cluster)

    def close_all(self, why: str) -> None:
        with self.lock:
            for cluster in list(self.clusters):
                if cluster.owner_pid == os.getpid():   # not in a forked child: the parent owns them
                    cluster.close(why)

    def on_signal(self, signum: int, frame) -> None:
        self.close_all(f"signal {signal.Signals(signum).name}")
        previous = self.previous_handlers.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)      # SIGINT's default raises KeyboardInterrupt
            return
        if previous == signal.SIG_IGN:
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)     # die of the signal, as without the handler


LIVE_CLUSTERS = LiveClusters()


class Cluster:
    """n_hosts emulated hosts on a fresh bridge, made on construction; a context manager that
    tears them down. rate_mbit shapes every host's link (None: unshaped). subnet: the hosts'
    addresses, host k at the (k+1)-th address. log: where the cluster log goes (None: only kept,
    in cluster.log.lines). slurm: start Slurm on the hosts too (start_slurm())."""

    def __init__(self, n_hosts: int, rate_mbit: Optional[float] = None, subnet: str = "10.77.0.0/24",
                 log: Optional[IO[str]] = sys.stderr, slurm: bool = False):
        network = ipaddress.ip_network(subnet)
        if n_hosts < 1 or n_hosts > network.num_addresses - 2:
            raise ValueError(f"n_hosts {n_hosts} must be in 1..{network.num_addresses - 2} for subnet {subnet}")
        self.log = ClusterLog(log)
        self.owned = True
        self.owner_pid = os.getpid()
        self.prefix_length = network.prefixlen
        self.closed = False
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        removed = cleanup_stale(log=None)
        if removed:
            self.log.write("cluster", f"removed leftovers of dead clusters: {', '.join(removed)}")
        self.name = unused_cluster_name()
        self.bridge = f"{self.name}-br"
        hosts = list(network.hosts())
        self.hosts = [Host(self, k, str(hosts[k])) for k in range(n_hosts)]
        self.slurm: Optional[Slurm] = None
        LIVE_CLUSTERS.add(self)
        try:
            self.create()
            if rate_mbit is not None:
                for host in self.hosts:
                    host.shape(rate_mbit)
            if slurm:
                self.start_slurm()
        except BaseException:
            self.close("failed to start")
            raise
        rate = "unshaped" if rate_mbit is None else f"{rate_mbit:g} Mbit/s links"
        self.log.write(f"cluster {self.name}", f"up: {n_hosts} hosts on bridge {self.bridge}, {subnet}, {rate}: "
                       + ", ".join(repr(h) for h in self.hosts))

    @classmethod
    def attach(cls, name: str, log: Optional[IO[str]] = sys.stderr) -> "Cluster":
        """A cluster made by another process (`up`), to run commands and faults on; close() leaves it."""
        if not CLUSTER_NAME.match(name):
            raise ValueError(f"{name!r} is no cluster name (hc and five hex digits, as `list` prints)")
        cluster = cls.__new__(cls)   # no hosts made: they exist already
        cluster.log, cluster.owned, cluster.owner_pid, cluster.closed = ClusterLog(log), False, os.getpid(), False
        cluster.name, cluster.bridge, cluster.hosts, cluster.slurm = name, f"{name}-br", [], None
        indices = sorted(int(m.group(1)) for ns in namespaces()
                         for m in [re.match(rf"^{name}-host(\d+)$", ns)] if m)
        if not indices:
            raise ValueError(f"cluster {name} has no hosts here (`scripts/cluster.py list` shows the clusters)")
        for k in indices:
            shown = ip_command(["ip", "-n", f"{name}-host{k}", "-4", "-o", "addr", "show", "dev", HOST_INTERFACE])
            address = re.search(r"inet (\S+)/", shown.stdout)
            cluster.hosts.append(Host(cluster, k, address.group(1) if address else "no address"))
        if os.path.exists(slurm_directory(name)):
            cluster.slurm = Slurm(cluster)   # its daemons run already: for slurm_env()
        return cluster

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.close("error in the with-block" if kind else "end of the with-block")

    def host(self, index: int) -> Host:
        """host{index}, by its index (attached clusters may miss some)."""
        for host in self.hosts:
            if host.index == index:
                return host
        raise ValueError(f"cluster {self.name} has no host{index} (hosts: {', '.join(h.name for h in self.hosts)})")

    def create(self) -> None:
        ip_command(["ip", "link", "add", self.bridge, "type", "bridge"])
        ip_command(["ip", "link", "set", "dev", self.bridge, "alias", owner_alias()])
        ip_command(["ip", "link", "set", "dev", self.bridge, "up"])
        for host in self.hosts:
            ip_command(["ip", "netns", "add", host.namespace])
            ip_command(["ip", "link", "add", host.bridge_port, "type", "veth", "peer", "name", HOST_INTERFACE,
                        "netns", host.namespace])
            ip_command(["ip", "link", "set", "dev", host.bridge_port, "master", self.bridge, "up"])
            inside = ["ip", "-n", host.namespace]
            ip_command(inside + ["addr", "add", f"{host.address}/{self.prefix_length}", "dev", HOST_INTERFACE])
            ip_command(inside + ["link", "set", "dev", HOST_INTERFACE, "up"])
            ip_command(inside + ["link", "set", "dev", "lo", "up"])

    def write_hosts_files(self) -> None:
        """Names every host in each host's /etc/hosts, for what starts on a host from now on (`ip
        netns exec` mounts /etc/netns/<namespace>/hosts over /etc/hosts): a host's own name is
        its address, never a loopback one."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{host.address}\t{host.name}" for host in self.hosts]
        for host in self.hosts:
            directory = os.path.join(NETNS_ETC_DIR, host.namespace)
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")

    def start_slurm(self, timeout: float = SLURM_START_TIMEOUT_S, cpus_per_host: Optional[int] = None) -> Slurm:
        """Starts munged and slurmctld on host0 and a slurmd on every host (Slurm.start), and
        returns once every host is an idle node; raises with the daemons' last lines otherwise."""
        if not self.owned:
            raise ValueError(f"cluster {self.name} belongs to another process: start Slurm with `up --slurm`")
        if self.slurm is not None:
            raise ValueError(f"cluster {self.name} runs Slurm already (SLURM_CONF={self.slurm.conf})")
        reason = slurm_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        slurm = Slurm(self, cpus_per_host)
        slurm.start(timeout)   # on failure the daemons and files stay until close(), as a host's processes do
        self.slurm = slurm
        return slurm

    def slurm_env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """base (default: this process's environment) with SLURM_CONF set: for Slurm's commands,
        run on a host (host.run(["sinfo"], env=cluster.slurm_env()))."""
        if self.slurm is None:
            raise ValueError(f"cluster {self.name} runs no Slurm: Cluster(n, slurm=True) or start_slurm() first")
        return self.slurm.env(base)

    def close(self, why: str = "close()") -> None:
        """Kills every process of every host, removes veths, namespaces and the bridge. Safe to
        call again; an attached cluster is left as it is."""
        if self.closed or not self.owned:
            return
        killed = 0   # closed only at the end: a signal arriving meanwhile tears down in full again
        for host in self.hosts:
            try:
                killed += host.kill_all()
            except RuntimeError as e:
                self.log.write(repr(host), str(e))
        for host in self.hosts:
            for proc in host.processes:
                try:
                    proc.wait(timeout=2)   # reap them: no zombie is left either
                except subprocess.TimeoutExpired:
                    self.log.write(repr(host), f"pid {proc.pid} survives SIGKILL")
            for output in host.outputs:
                output.wait(timeout=2)
        remove_cluster_network(self.name, [h.namespace for h in self.hosts], [h.bridge_port for h in self.hosts])
        remove_cluster_files(self.name, [h.namespace for h in self.hosts])
        self.closed = True
        LIVE_CLUSTERS.remove(self)
        self.log.write(f"cluster {self.name}", f"torn down ({why}; killed {killed} "
                       f"process{'' if killed == 1 else 'es'})")


def clusters_present() -> Dict[str, Dict[str, object]]:
    """Every cluster with a namespace or link here: name -> {"namespaces", "links", "owner"}."""
    found: Dict[str, Dict[str, object]] = {}
    all_links = links()
    for item in namespaces() + list(all_links):
        m = OWNED_NAME.match(item)
        if m:
            entry = found.setdefault(m.group(1), {"namespaces": [], "links": [], "owner": ""})
            entry["links" if item in all_links else "namespaces"].append(item)
    for name, entry in found.items():
        entry["owner"] = all_links.get(f"{name}-br", "")
    return found


def wait_all(runs, timeout: float, grace: float = 15) -> List[Optional[int]]:
    """Exit codes of [(Popen, HostOutput)] started on the hosts (Host.start), None where still
    running: waits until all have ended, or `timeout` seconds, or `grace` seconds after the first
    one failed (the others, which wait on it, end by then or are reported still running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc, _ in runs]
        if all(code is not None for code in codes):
            return codes
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.1)
    return [proc.poll() for proc, _ in runs]


def cleanup_stale(log: Optional[IO[str]] = sys.stderr, include_live: bool = False) -> List[str]:
    """Removes every cluster of this script whose owning process is gone (include_live: every
    cluster), processes in its hosts included; returns their names."""
    removed = []
    for name, entry in clusters_present().items():
        if not include_live and owner_alive(str(entry["owner"])):
            continue
        if not include_live and not entry["owner"]:
            time.sleep(0.5)   # a bridge just made has no alias yet: look again before judging
            if owner_alive(links().get(f"{name}-br", "")):
                continue
        killed = sum(kill_namespace_processes(ns) for ns in entry["namespaces"])
        remove_cluster_network(name, entry["namespaces"], [l for l in entry["links"] if not l.endswith("-br")])
        remove_cluster_files(name, entry["namespaces"])
        removed.append(name)
        if log is not None:
            log.write(f"[{timestamp()}] cluster {name}: removed ({len(entry['namespaces'])} namespaces, "
                      f"{len(entry['links'])} links, killed {killed} processes; {entry['owner'] or 'no owner'})\n")
    for path in orphaned_cluster_files():
        shutil.rmtree(path, ignore_errors=True)
        if log is not None:
            log.write(f"[{timestamp()}] removed {path} (its cluster is gone)\n")
    return removed


def command_up(args) -> int:
    with Cluster(args.n_hosts, rate_mbit=args.rate, subnet=args.subnet, slurm=args.slurm) as cluster:
        print(f"cluster {cluster.name}: Ctrl-C tears it down", flush=True)
        for host in cluster.hosts:
            print(f"  {host.name}  {host.address}  namespace {host.namespace}", flush=True)
        if cluster.slurm is not None:
            print(f"Slurm: SLURM_CONF={cluster.slurm.conf} (`run` sets it)", flush=True)
        me = os.path.relpath(os.path.abspath(__file__))
        print(f"run on a host:  {me} run --cluster {cluster.name} --host 1 -- hostname", flush=True)
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


def command_run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("run needs a command after --")
    attached = Cluster.attach(args.cluster)
    env = attached.slurm_env() if attached.slurm is not None else None
    return subprocess.call(attached.host(args.host).command_line(command), env=env)


def command_fault(args) -> int:
    host = Cluster.attach(args.cluster).host(args.host)
    if args.subcommand == "shape" and args.rate:
        host.shape(args.rate)
    elif args.subcommand == "shape":
        host.unshape()
    else:
        getattr(host, args.subcommand)()   # cut, heal or down
    return 0


def command_list(args) -> int:
    for name, entry in sorted(clusters_present().items()):
        state = "live" if owner_alive(str(entry["owner"])) else "stale"
        print(f"{name}  {state}  {len(entry['namespaces'])} hosts  {entry['owner'] or 'no owner'}")
    return 0


def command_cleanup(args) -> int:
    removed = cleanup_stale(include_live=args.all)
    print(f"removed {len(removed)} cluster(s)" + (f": {', '.join(removed)}" if removed else ""))
    return 0


def parse_args(argv: Optional[Sequence[str]]):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="subcommand", required=True)
    up = sub.add_parser("up", help="make N hosts and keep them until Ctrl-C")
    up.add_argument("n_hosts", type=int, metavar="N")
    up.add_argument("--rate", type=float, default=None, help="each host's link in Mbit/s each way (default: unshaped)")
    up.add_argument("--subnet", default="10.77.0.0/24", help="the hosts' addresses (default: 10.77.0.0/24)")
    up.add_argument("--slurm", action="store_true", help="start munged and slurmctld on host0, a slurmd on each host")
    for name, what in (("run", "run a command on a host of a cluster made by `up`"),
                       ("cut", "take a host's link down; its processes keep running"),
                       ("heal", "bring a host's link up again"),
                       ("down", "kill every process of a host and take its link down"),
                       ("shape", "shape a host's link (no --rate: unshape)")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--cluster", required=True, help="the cluster's name, as `up` and `list` print it")
        p.add_argument("--host", type=int, required=True, help="the host's index (0 for host0)")
        if name == "shape":
            p.add_argument("--rate", type=float, default=None, help="Mbit/s each way (default: unshape)")
        if name == "run":
            p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    sub.add_parser("list", help="the clusters present, live or stale")
    cleanup = sub.add_parser("cleanup", help="remove clusters whose owning process is gone")
    cleanup.add_argument("--all", action="store_true", help="live clusters too")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    reason = slurm_unavailable_reason() if getattr(args, "slurm", False) else unavailable_reason()
    if reason:
        print(f"scripts/cluster.py: {reason}", file=sys.stderr)
        return 2
    commands = {"up": command_up, "run": command_run, "list": command_list, "cleanup": command_cleanup}
    try:
        return commands.get(args.subcommand, command_fault)(args)
    except (ValueError, RuntimeError) as e:
        print(f"scripts/cluster.py: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
