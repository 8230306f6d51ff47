"""scripts/cluster.py's emulated hosts, checked by what crosses their links: distinct addresses and
hostnames, TCP between hosts and on each loopback; a 40 Mbit/s link that takes its time; a cut
link that stalls a connection whose processes live on and deliver after heal; a host taken down
with every process killed; tear-down that leaves nothing behind after an uncaught exception,
SIGTERM or SIGKILL (then cleanup); and torchrun across hosts in three layouts (D = 3 one rank a
host; D = 2 x P = 2 with the pipeline cut across hosts; D = 2 x T = 2 with each tensor group inside
a host), each ending with the weights of the same layout run on one host. Needs root: each test but the refusal's skips with
cluster.unavailable_reason() otherwise."""
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

SOURCE = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "scripts"))
import cluster  # noqa: E402  the emulated hosts under test
DP = os.path.join(BINARY, "run_data_parallel")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
UNAVAILABLE = cluster.unavailable_reason()
PORT = 5555   # each host is a fresh namespace: any port is free there

# A TCP server for a host: each connection is read to its end (sink: the byte count is sent back)
# or echoed line by line (echo). Prints "listening" once it accepts.
SERVER = textwrap.dedent("""
    import socket, sys, threading
    mode, port = sys.argv[1], int(sys.argv[2])
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen()
    print("listening", flush=True)
    def serve(connection):
        with connection:
            if mode == "sink":
                received = 0
                while True:
                    chunk = connection.recv(1 << 16)
                    if not chunk:
                        break
                    received += len(chunk)
                connection.sendall(str(received).encode())
            else:
                for line in connection.makefile("rb"):
                    connection.sendall(line)
    while True:
        threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
""")

# Sends N bytes to ADDRESS:PORT and prints the seconds until the server has counted them all.
SEND = textwrap.dedent("""
    import socket, sys, time
    address, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    start = time.monotonic()
    with socket.create_connection((address, port), timeout=30) as s:
        s.sendall(b"x" * n)
        s.shutdown(socket.SHUT_WR)
        reply = s.recv(64).decode()
    print(f"{reply} {time.monotonic() - start:.4f}")
""")

# Connects to ADDRESS:PORT once, prints "connected" or "failed: <why>".
CONNECT = textwrap.dedent("""
    import socket, sys
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
        print("connected")
    except OSError as e:
        print(f"failed: {e!r}")
""")

# One long-lived connection: sends each stdin line, prints "got <line>" for each echoed one.
CHAT = textwrap.dedent("""
    import socket, sys, threading
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    s.settimeout(None)
    def read():
        for line in s.makefile("r"):
            print("got " + line.strip(), flush=True)
    threading.Thread(target=read, daemon=True).start()
    for line in sys.stdin:
        s.sendall(line.encode())
    threading.Event().wait()
""")


def python(code, *args):
    return [sys.executable, "-c", code] + [str(a) for a in args]


def wait_for(output, pattern, timeout):
    """The first line of a HostOutput matching pattern, waiting up to timeout seconds; None if none."""
    deadline = time.monotonic() + timeout
    while True:
        for line in list(output.lines):
            if re.search(pattern, line):
                return line
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def running(pid):
    """Whether pid is a process that still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def processes_with_argument(argument):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and running(entry):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if argument.encode() in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def leftovers(name):
    """The namespaces and links of cluster `name` still listed."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    listed += subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    return [word for word in listed.split() if word.startswith(f"{name}-")]


class ClusterTestCase(unittest.TestCase):
    def setUp(self):
        if UNAVAILABLE:
            self.skipTest(UNAVAILABLE)

    def start_server(self, host, mode):
        proc, output = host.start(python(SERVER, mode, PORT))
        self.assertIsNotNone(wait_for(output, "^listening$", 30), f"{host.name}'s server:\n{output.text()}")
        return proc, output

    def connect(self, source, target, timeout=2.0):
        return source.run(python(CONNECT, target.address, PORT, timeout), timeout=30).stdout.strip()

    def send_seconds(self, source, target, n_bytes):
        """Seconds for n_bytes to reach target's sink server from source."""
        proc = source.run(python(SEND, target.address, PORT, n_bytes), timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        received, seconds = proc.stdout.split()
        self.assertEqual(int(received), n_bytes)
        return float(seconds)


class Refusal(unittest.TestCase):
    """Runs everywhere: where clusters cannot be made, the module and the command line say why."""

    def test_without_root_the_reason_names_the_uid_and_the_command_line_exits_2_with_it(self):
        import contextlib
        import io
        from unittest import mock
        with mock.patch("os.geteuid", return_value=1000):
            self.assertEqual(cluster.unavailable_reason(), "scripts/cluster.py needs root (uid 1000)")
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                self.assertEqual(cluster.main(["up", "2"]), 2)
            self.assertIn("needs root (uid 1000)", err.getvalue())


class Hosts(ClusterTestCase):
    def test_hosts_have_their_own_address_hostname_and_loopback_and_reach_each_other(self):
        with cluster.Cluster(3, log=None) as c:
            self.assertEqual([h.name for h in c.hosts], ["host0", "host1", "host2"])
            self.assertEqual(len({h.address for h in c.hosts}), 3)
            for host in c.hosts:
                seen = host.run(["sh", "-c", "hostname; ip -4 -o addr show dev eth0"], check=True).stdout
                self.assertEqual(seen.splitlines()[0], host.name)
                self.assertIn(f"inet {host.address}/", seen)
                self.assertEqual(host.run(python("import socket; print(socket.gethostname())")).stdout.strip(),
                                 host.name)
            self.start_server(c.hosts[2], "echo")
            said = c.hosts[0].run(python(textwrap.dedent("""
                import socket, sys
                with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
                    s.sendall(b"hello from host0\\n")
                    print(s.makefile().readline().strip())
            """), c.hosts[2].address, PORT), timeout=30)
            self.assertEqual(said.stdout.strip(), "hello from host0", said.stderr)
            # host2 listens on all its addresses; host0's loopback is host0's own.
            self.assertTrue(self.connect(c.hosts[2], c.hosts[2]).startswith("connected"))
            loopback = c.hosts[2].run(python(CONNECT, "127.0.0.1", PORT, 2)).stdout.strip()
            self.assertEqual(loopback, "connected")
            elsewhere = c.hosts[0].run(python(CONNECT, "127.0.0.1", PORT, 2)).stdout.strip()
            self.assertIn("ConnectionRefused", elsewhere)
            self.assertIn("host0: $ ", "\n".join(c.log.lines))


class Shaping(ClusterTestCase):
    def test_a_40_mbit_link_takes_its_time_in_each_direction_and_unshaped_does_not(self):
        n_bytes = 2_000_000   # 0.4 s at 40 Mbit/s
        with cluster.Cluster(2, rate_mbit=40, log=None) as c:
            self.start_server(c.hosts[1], "sink")
            shaped = self.send_seconds(c.hosts[0], c.hosts[1], n_bytes)
            for host in c.hosts:
                host.unshape()
            unshaped = self.send_seconds(c.hosts[0], c.hosts[1], n_bytes)
            c.hosts[1].shape(40)   # the receiver's side alone: what host1 receives is limited too
            received_shaped = self.send_seconds(c.hosts[0], c.hosts[1], n_bytes)
            c.hosts[1].unshape()
            c.hosts[0].shape(40)   # the sender's side alone
            sent_shaped = self.send_seconds(c.hosts[0], c.hosts[1], n_bytes)
        figures = f"shaped {shaped:.3f} s, unshaped {unshaped:.3f} s, receiver shaped {received_shaped:.3f} s, " \
                  f"sender shaped {sent_shaped:.3f} s for {n_bytes} bytes"
        for seconds in (shaped, received_shaped, sent_shaped):
            self.assertGreaterEqual(seconds, 0.3, figures)
            self.assertLess(seconds, 10, figures)
        self.assertLess(unshaped, shaped / 2, figures)


class Faults(ClusterTestCase):
    def chat(self, c):
        """A client on host0 holding one connection to host1's echo server: (Popen, HostOutput)."""
        proc = c.hosts[0].popen(python(CHAT, c.hosts[1].address, PORT), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return proc, c.hosts[0].follow(proc)

    def test_a_cut_link_stalls_a_connection_whose_processes_live_on_and_deliver_after_heal(self):
        with cluster.Cluster(2, log=None) as c:
            server, _ = self.start_server(c.hosts[1], "echo")
            client, output = self.chat(c)
            client.stdin.write("before\n")
            client.stdin.flush()
            self.assertIsNotNone(wait_for(output, "^got before$", 10), output.text())
            c.hosts[1].cut()
            client.stdin.write("during\n")
            client.stdin.flush()
            time.sleep(1.5)
            self.assertIsNone(wait_for(output, "^got during$", 0), "delivered over a cut link")
            self.assertIsNone(client.poll(), output.text())
            self.assertIsNone(server.poll())
            self.assertIn(server.pid, c.hosts[1].pids())
            self.assertIn(client.pid, c.hosts[0].pids())
            self.assertIsNone(wait_for(output, "^got during$", 0), "delivered over a cut link")
            c.hosts[1].heal()
            client.stdin.write("after\n")
            client.stdin.flush()
            # TCP's retransmission, backed off during the cut, delivers both within seconds.
            self.assertIsNotNone(wait_for(output, "^got after$", 20), output.text())
            self.assertEqual([line for line in output.lines if line.startswith("got ")],
                             ["got before", "got during", "got after"])
            self.assertIsNone(client.poll())
            log = "\n".join(c.log.lines)
            self.assertIn(f"host1 ({c.hosts[1].address}): link cut", log)
            self.assertIn(f"host1 ({c.hosts[1].address}): link healed", log)
            self.assertRegex(log, r"\[\d\d:\d\d:\d\d\.\d{3}\] host0 \| got before")
            client.stdin.close()

    def test_down_kills_every_process_of_the_host_and_makes_it_unreachable(self):
        with cluster.Cluster(2, log=None) as c:
            target = c.hosts[1]
            self.start_server(target, "echo")
            target.popen(["sh", "-c", "sleep 1000 & sleep 1000 & wait"])
            sleeper = target.popen(["sleep", "1000"])
            self.assertEqual(self.connect(c.hosts[0], target), "connected")
            deadline = time.monotonic() + 10
            while len(target.pids()) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            before = target.pids()
            self.assertGreaterEqual(len(before), 5, before)   # server, sh, two sleeps of sh, sleep
            killed = target.down()
            self.assertEqual(killed, len(before))
            self.assertEqual(target.pids(), [])
            self.assertEqual(sleeper.wait(timeout=5), -signal.SIGKILL)
            self.assertEqual([pid for pid in before if running(pid)], [])
            self.assertTrue(self.connect(c.hosts[0], target).startswith("failed"))
            self.assertIn(f"host1 ({target.address}): down (killed {killed} processes, link down)",
                          "\n".join(c.log.lines))


# Makes a cluster outside any with-block, starts `sleep MARKER` on host1, prints the cluster's name
# and the sleep's pid, then on a line from stdin fails (raise), or waits to be signalled (wait).
OWNER = textwrap.dedent("""
    import json, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    import cluster
    c = cluster.Cluster(2)
    sleeper = c.hosts[1].popen(["sleep", sys.argv[2]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not c.hosts[1].pids():
        time.sleep(0.01)
    print(json.dumps({"name": c.name, "pid": sleeper.pid}), flush=True)
    if sys.argv[3] == "raise":
        sys.stdin.readline()
        raise RuntimeError("the test body fails")
    time.sleep(120)
""")


class TearDown(ClusterTestCase):
    def owner(self, ending):
        """A process owning a cluster, ending as told: (Popen, its cluster's name, the sleep's pid, marker)."""
        marker = f"1000.{random.randrange(10 ** 6):06d}"
        proc = subprocess.Popen([sys.executable, "-c", OWNER, os.path.join(SOURCE, "scripts"), marker, ending],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(self.finish_owner, proc)
        line = proc.stdout.readline()
        self.assertTrue(line, proc.stderr.read() if proc.poll() is not None else "no line from the owner")
        started = json.loads(line)
        self.assertTrue(leftovers(started["name"]))
        self.assertTrue(running(started["pid"]))
        return proc, started["name"], started["pid"], marker

    def finish_owner(self, proc):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if not pipe.closed:
                pipe.close()

    def assert_nothing_left(self, name, pid, marker, why):
        self.assertEqual(leftovers(name), [], why)
        self.assertFalse(running(pid), why)
        self.assertEqual(processes_with_argument(marker), [], why)

    def test_leaving_a_with_block_by_an_exception_tears_down(self):
        marker = f"1000.{random.randrange(10 ** 6):06d}"
        with self.assertRaises(RuntimeError):
            with cluster.Cluster(2, log=None) as c:
                sleeper = c.hosts[0].popen(["sleep", marker])
                raise RuntimeError("the test body fails")
        self.assertEqual(sleeper.poll(), -signal.SIGKILL)
        self.assert_nothing_left(c.name, sleeper.pid, marker, "\n".join(c.log.lines))
        self.assertIn("torn down (error in the with-block; killed 1 process)", c.log.lines[-1])

    def test_an_uncaught_exception_tears_down_at_exit(self):
        proc, name, pid, marker = self.owner("raise")
        _, err = proc.communicate("go\n", timeout=30)
        self.assertEqual(proc.returncode, 1, err)
        self.assertIn("RuntimeError: the test body fails", err)
        self.assertIn("torn down (exit; killed 1 process)", err)
        self.assert_nothing_left(name, pid, marker, err)

    def test_sigterm_tears_down_and_the_owner_dies_of_it(self):
        proc, name, pid, marker = self.owner("wait")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        self.assertEqual(proc.returncode, -signal.SIGTERM, err)
        self.assertIn("torn down (signal SIGTERM; killed 1 process)", err)
        self.assert_nothing_left(name, pid, marker, err)

    def test_after_sigkill_cleanup_removes_what_the_owner_left(self):
        proc, name, pid, marker = self.owner("wait")
        proc.kill()
        proc.wait(timeout=30)
        self.assertTrue(leftovers(name), "SIGKILL cannot be caught: the cluster stays until cleanup")
        self.assertIn(name, cluster.cleanup_stale(log=None))
        self.assert_nothing_left(name, pid, marker, "after cleanup_stale")

    def test_the_command_line_lists_clusters_and_names_a_missing_one(self):
        script = os.path.join(SOURCE, "scripts", "cluster.py")
        listed = subprocess.run([sys.executable, script, "list"], capture_output=True, text=True, timeout=30)
        self.assertEqual(listed.returncode, 0, listed.stderr)
        bad = subprocess.run([sys.executable, script, "cut", "--cluster", "hc00000", "--host", "0"],
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(bad.returncode, 1)
        self.assertIn("cluster hc00000 has no hosts here", bad.stderr)


# The runs of the layouts, small: gpt2-tiny, 2 steps of batch 24.
TINY = ["--model", "gpt2-tiny", "--model_max_length", "32", "--train_size", "96", "--validation_size", "8",
        "--test_size", "2", "--no_progress", "--dropout", "0", "--batch_size", "24", "--n_epochs", "1",
        "--max_batches", "2", "--benchmark_only"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchrunAcrossHosts(ClusterTestCase):
    """torchrun on every host, the c10d rendezvous on host0, no GLOO_SOCKET_IFNAME: each layout ends
    with the weights of the same layout run by one launcher on one host."""

    def setUp(self):
        super().setUp()
        for needed in (DP, TORCHRUN):
            if not os.access(needed, os.X_OK):
                self.skipTest(f"{needed} is not built or installed (scripts/build.sh, scripts/setup.sh)")
        try:
            import torch  # noqa: F401
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            self.skipTest(f"{sys.executable} has no torch or safetensors ({e}): run with .venv/bin/python")

    def across_hosts(self, n_hosts, per_host, layout, replicas_saved=()):
        """Runs `layout` as n_hosts x per_host torchrun workers and as one plain launch; compares rank
        0's model and the replicas of the ranks in replicas_saved (--save_every_rank's rank{r}/)."""
        import torch
        from safetensors.torch import load_file
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("GLOO_SOCKET_IFNAME", None)   # each rank must find its interface by itself
        with tempfile.TemporaryDirectory() as tmp:
            plain = os.path.join(tmp, "plain")
            single = subprocess.run([DP, "--world_size", str(n_hosts * per_host), "--master_port", str(free_port()),
                                     "--workdir", plain] + TINY + layout,
                                    capture_output=True, text=True, timeout=300, env=env)
            self.assertEqual(single.returncode, 0, single.stdout + single.stderr)
            with cluster.Cluster(n_hosts, log=None) as c:
                master = c.hosts[0].address
                runs = [host.start([TORCHRUN, "--nnodes", str(n_hosts), "--nproc_per_node", str(per_host),
                                    "--node_rank", str(host.index), "--master_addr", master,
                                    "--master_port", str(PORT), "--no-python", DP,
                                    "--workdir", os.path.join(tmp, host.name)] + TINY + layout, env=env)
                        for host in c.hosts]
                codes = cluster.wait_all(runs, timeout=180)
            log = "\n".join(c.log.lines[-120:])
            self.assertEqual(codes, [0] * n_hosts, f"exit codes of host0..{n_hosts - 1}; the cluster log:\n{log}")
            for host, (_, output) in zip(c.hosts, runs):
                self.assertRegex(output.text(), rf"(?m)^.*Gloo.*{re.escape(host.address)}(?![\d.])",
                                 f"{host.name} printed no Gloo line with its own address:\n{output.text()}")
            problems = []
            for rank in (0,) + tuple(replicas_saved):
                where = "" if rank == 0 else f"rank{rank}"
                host = c.hosts[rank // per_host]
                expected = load_file(os.path.join(plain, where, "model.safetensors"))
                actual = load_file(os.path.join(tmp, host.name, where, "model.safetensors"))
                problems += [f"rank {rank}: {name}: missing" for name in expected if name not in actual]
                problems += [f"rank {rank}: {name}: largest difference {float((actual[name] - w).abs().max()):.3g}"
                             for name, w in expected.items()
                             if name in actual and not torch.allclose(actual[name], w, atol=1e-6, rtol=1e-5)]
            self.assertEqual(problems, [], f"torchrun on {n_hosts} hosts against one launch of the same layout")

    def test_torchrun_on_three_hosts_trains_as_one_host_does_without_gloo_socket_ifname(self):
        self.across_hosts(3, 1, ["--save_every_rank"], replicas_saved=(1, 2))

    def test_a_pipeline_split_across_two_hosts_trains_as_on_one(self):
        # D = 2 x P = 2, rank = p*D + d: host0 holds stage 0 of both replicas, host1 stage 1, so
        # every activation and its gradient crosses the link.
        self.across_hosts(2, 2, ["--pipeline_parallel_size", "2", "--n_chunk", "2"])

    def test_tensor_groups_stay_within_a_host_and_train_as_on_one(self):
        # (D, C, T, P) = (2, 1, 2, 1), rank = d*T + t: each host holds one replica's tensor group,
        # and only the data-parallel all-reduce crosses the link.
        self.across_hosts(2, 2, ["--tensor_parallel_size", "2"])


class CutLinkWithoutElastic(ClusterTestCase):
    """A link cut under a run without --elastic: no hang, every side ends within --dist_timeout_s
    plus 30 s, and each says what it saw: the hosts that can still reach the store name the ranks
    and host behind the cut; the host behind it says that it is cut off."""

    def setUp(self):
        super().setUp()
        for needed in (DP, TORCHRUN):
            if not os.access(needed, os.X_OK):
                self.skipTest(f"{needed} is not built or installed (scripts/build.sh, scripts/setup.sh)")

    def test_a_cut_link_ends_the_run_within_the_bound_naming_the_host_behind_it(self):
        timeout_s = 10
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("GLOO_SOCKET_IFNAME", None)
        # Long enough to be cut in the middle: 800 steps of batch 24 (the cut comes after a few).
        flags = TINY[:TINY.index("--max_batches")]
        flags[flags.index("--train_size") + 1] = "19200"
        with tempfile.TemporaryDirectory() as tmp, cluster.Cluster(3, log=None) as c:
            runs = [host.start([TORCHRUN, "--nnodes", "3", "--nproc_per_node", "1", "--node_rank", str(host.index),
                                "--master_addr", c.hosts[0].address, "--master_port", str(PORT), "--no-python", DP,
                                "--workdir", os.path.join(tmp, host.name), "--dist_timeout_s", str(timeout_s)] + flags,
                               env=env)
                    for host in c.hosts]
            started = wait_for(runs[0][1], r"^layout: ", 120)
            time.sleep(3)   # a few steps in
            self.assertEqual([proc.poll() for proc, _ in runs], [None] * 3,
                             "the run ended before the cut:\n" + "\n".join(c.log.lines[-40:]))
            self.assertIsNotNone(started)
            cut_at = time.monotonic()
            c.hosts[2].cut()
            codes = cluster.wait_all(runs, timeout=timeout_s + 30, grace=timeout_s + 30)
            elapsed = time.monotonic() - cut_at
            log = "\n".join(c.log.lines[-60:])
        self.assertTrue(all(code not in (None, 0) for code in codes), f"exit codes {codes}; the cluster log:\n{log}")
        self.assertLess(elapsed, timeout_s + 30, log)
        behind = f"rank 2 ({c.hosts[2].name} {c.hosts[2].address}) did not answer through the rendezvous store"
        for host, (_, output) in zip(c.hosts[:2], runs[:2]):
            self.assertIn(behind, output.text(), f"{host.name} did not name the host behind the cut:\n{log}")
            self.assertIn("ranks 0, 1", output.text())
        self.assertRegex(runs[2][1].text(), rf"this rank \(rank 2 on {c.hosts[2].name} {re.escape(c.hosts[2].address)}\)"
                                            r" could not reach the rendezvous store .* cut off", log)


class ElasticHosts(ClusterTestCase):
    """--elastic under torchrun on 3 hosts, one process a host: gpt2-tiny, 12 steps of 12 rows."""
    STEPS, LR = 12, 3e-3
    FLAGS = ["--model", "gpt2-tiny", "--model_max_length", "32", "--train_size", "144", "--validation_size", "6",
             "--test_size", "2", "--no_progress", "--batch_size", "12", "--n_epochs", "1", "--dropout", "0",
             "--learning_rate", str(LR), "--dist_timeout_s", "10", "--threads_per_device", "1", "--elastic"]

    def setUp(self):
        super().setUp()
        for needed in (DP, TORCHRUN):
            if not os.access(needed, os.X_OK):
                self.skipTest(f"{needed} is not built or installed (scripts/build.sh, scripts/setup.sh)")

    @staticmethod
    def environment():
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("GLOO_SOCKET_IFNAME", None)   # each rank finds its interface by itself
        return env

    def start_with_host2_stopped_at_step_5(self, c, tmp, env):
        """The run on every host, returned once rank 2 has stopped itself (SIGSTOP) as step 5 starts."""
        runs = self.start(c, tmp, dict(env, HARNESS_TEST_KILL_AT_STEP="2:5:stop"))
        self.assertIsNotNone(wait_for(runs[2][1], r"test hook: stopped at step 5", 120), "\n".join(c.log.lines[-40:]))
        return runs

    def assert_the_undisturbed_run_after_a_loss_at_step_5(self, tmp, plain, log):
        """host0's metrics record the loss of rank 2 at step 5 and every step; its weights are the
        undisturbed run's by the AdamW rule."""
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from after_adamw import weight_problems
        from safetensors.torch import load_file
        with open(os.path.join(tmp, "host0", "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        self.assertEqual([r for r in records if r["kind"] == "membership"],
                         [{"kind": "membership", "generation": 1, "step": 5, "replicas": 2, "lost": [2],
                           "joined": []}], log)
        self.assertEqual([r["step"] for r in records if r["kind"] == "train"], list(range(1, self.STEPS + 1)))
        problems = weight_problems(load_file(os.path.join(tmp, "host0", "model.safetensors")),
                                   load_file(os.path.join(plain, "model.safetensors")), self.LR, self.STEPS)
        self.assertEqual(problems, [], "\n".join(problems))

    def undisturbed_run(self, tmp, env):
        """The workdir of the same run on one host, without a loss."""
        plain = os.path.join(tmp, "plain")
        proc = subprocess.run([DP, "--world_size", "3", "--master_port", str(free_port()), "--workdir", plain]
                              + self.FLAGS, capture_output=True, text=True, timeout=300, env=env)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        return plain

    def start(self, c, tmp, env):
        return [host.start([TORCHRUN, "--nnodes", "3", "--nproc_per_node", "1", "--node_rank", str(host.index),
                            "--master_addr", c.hosts[0].address, "--master_port", str(PORT), "--no-python", DP,
                            "--workdir", os.path.join(tmp, host.name)] + self.FLAGS, env=env)
                for host in c.hosts]



class StoreHostLostUnderElastic(ElasticHosts):
    """The host whose torchrun agent serves the store is lost: the store is the one single point of
    failure (as torchft's lighthouse is), and every survivor ends saying so."""

    def test_losing_the_host_that_holds_the_store_ends_the_run_saying_so(self):
        env = dict(self.environment(), HARNESS_TEST_KILL_AT_STEP="0:5:stop")
        with tempfile.TemporaryDirectory() as tmp, cluster.Cluster(3, log=None) as c:
            runs = self.start(c, tmp, env)
            self.assertIsNotNone(wait_for(runs[0][1], r"test hook: stopped at step 5", 120),
                                 "\n".join(c.log.lines[-40:]))
            c.hosts[0].down()   # torchrun's agent on host0 serves the store
            codes = cluster.wait_all(runs[1:], timeout=60, grace=60)
            log = "\n".join(c.log.lines[-60:])
        self.assertTrue(all(code not in (None, 0) for code in codes), f"{codes}\n{log}")
        for host, (_, output) in zip(c.hosts[1:], runs[1:]):
            self.assertIn(f"the rendezvous store at {c.hosts[0].address}:{PORT} cannot be reached from this rank "
                          f"({host.name} {host.address}): under --elastic the store is the run's one single point "
                          "of failure", output.text(), log)


class ElasticAcrossHosts(ElasticHosts):
    """host2 is taken down (every process killed, its link down) in step 5 of 12. The survivors go
    on without a restart, agree on the next generation within 5 s (host2's heartbeat stands still:
    nobody else is left to record its loss), and end with the undisturbed run's weights by the
    AdamW rule; the membership record names host2's rank."""

    def test_a_host_lost_in_step_5_leaves_two_that_finish_with_the_undisturbed_weights(self):
        env = self.environment()
        with tempfile.TemporaryDirectory() as tmp:
            plain = self.undisturbed_run(tmp, env)
            with cluster.Cluster(3, log=None) as c:
                runs = self.start_with_host2_stopped_at_step_5(c, tmp, env)
                c.hosts[2].down()
                lost_at = time.monotonic()
                agreed = wait_for(runs[0][1], r"elastic: generation 1 at step 5: lost process 2; 2 of 3", 60)
                agreed_after = time.monotonic() - lost_at
                # The survivors' workers end; their torchrun agents would then wait out their exit
                # barrier (300 s) for host2's agent, which is gone: the test does not.
                for _, output in runs[:2]:
                    self.assertIsNotNone(wait_for(output, r"Rank \d training time: avg", 120),
                                         "\n".join(c.log.lines[-60:]))
                log = "\n".join(c.log.lines[-80:])
            self.assertIsNotNone(agreed, log)
            self.assertLess(agreed_after, 5.0, log)
            self.assert_the_undisturbed_run_after_a_loss_at_step_5(tmp, plain, log)


class CutLinkUnderElastic(ElasticHosts):
    """A link cut under --elastic: exactly one side goes on. host2 stops itself as step 5 starts,
    its link is cut, and it is let go on (SIGCONT), alive behind the cut. host0 and host1, which
    hold the store, go on without it once its collective times out and its heartbeat stands still;
    once they have, the link heals, and host2 is refused as a dead generation and exits having
    written no checkpoint and no metrics."""

    def test_a_cut_link_lets_the_side_with_the_store_go_on_and_refuses_the_other_after_healing(self):
        env = self.environment()
        with tempfile.TemporaryDirectory() as tmp:
            plain = self.undisturbed_run(tmp, env)
            with cluster.Cluster(3, log=None) as c:
                runs = self.start_with_host2_stopped_at_step_5(c, tmp, env)
                c.hosts[2].cut()
                for pid in c.hosts[2].pids():   # the worker (stopped) and its agent, alive behind the cut
                    os.kill(pid, signal.SIGCONT)
                agreed = wait_for(runs[0][1], r"elastic: generation 1 at step 5: lost process 2; 2 of 3", 60)
                c.hosts[2].heal()
                refused = wait_for(runs[2][1], r"went on without it", 60)
                for _, output in runs[:2]:
                    self.assertIsNotNone(wait_for(output, r"Rank \d training time: avg", 120),
                                         "\n".join(c.log.lines[-60:]))
                log = "\n".join(c.log.lines[-80:])
            self.assertIsNotNone(agreed, log)
            self.assertIsNotNone(refused, log)
            self.assertIn("generation 1 went on without it (members {0,1}); it must not train", refused)
            self.assertFalse(os.path.exists(os.path.join(tmp, "host2", "metrics.jsonl")), log)
            self.assertFalse(os.path.exists(os.path.join(tmp, "host2", "checkpoints")), log)
            self.assert_the_undisturbed_run_after_a_loss_at_step_5(tmp, plain, log)


if __name__ == "__main__":
    unittest.main(verbosity=2)
