"""Slurm on scripts/cluster.py's emulated hosts: munged and slurmctld on host0 and a slurmd on each
host, from Debian's packages. The batch script of docs/data-parallel.md's Slurm section, read from
the page and run as written with sbatch on two hosts (one task each, the tiny model's flags), trains
as one plain two-rank launch on one host does; tear-down, after a finished job or in the middle of
a running one, leaves no daemon, task, namespace or file. Needs root, build/run_data_parallel and
the slurm-wlm and munge packages: skips with the reason otherwise."""
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import unittest

SOURCE = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "scripts"))
import cluster  # noqa: E402  the emulated hosts and their Slurm, under test
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cluster import running  # noqa: E402  whether a pid still runs (not a zombie)
DP = os.path.join(BINARY, "run_data_parallel")
DOC = os.path.join(SOURCE, "docs", "data-parallel.md")
UNAVAILABLE = cluster.slurm_unavailable_reason() or (
    None if os.access(DP, os.X_OK) else f"{DP} is not built (scripts/build.sh builds it)")
N_HOSTS = 2
TINY = ["--model", "gpt2-tiny", "--model_max_length", "32", "--train_size", "96", "--validation_size", "8",
        "--test_size", "2", "--no_progress", "--dropout", "0", "--batch_size", "24", "--n_epochs", "1",
        "--max_batches", "2", "--benchmark_only"]
# What a launch made elsewhere would pass down; the test's own environment must not leak into the job.
LAUNCH_VARIABLES = re.compile(r"^(SLURM_|RANK$|WORLD_SIZE$|LOCAL_RANK$|LOCAL_WORLD_SIZE$|MASTER_|TORCHELASTIC_|GLOO_SOCKET_IFNAME$)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_environment():
    env = {k: v for k, v in os.environ.items() if not LAUNCH_VARIABLES.match(k)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def documented_recipe():
    """The shell block of docs/data-parallel.md's Slurm section that exports MASTER_ADDR, as lines."""
    with open(DOC) as f:
        page = f.read()
    section = re.search(r"(?ms)^### Slurm\n(.*?)(?=^#{1,3} |\Z)", page)
    blocks = re.findall(r"(?ms)^```sh\n(.*?)^```", section.group(1)) if section else []
    recipe = [block for block in blocks if "MASTER_ADDR" in block and "srun" in block]
    if not recipe:
        raise AssertionError(f"{DOC}: no ```sh block with MASTER_ADDR and srun under '### Slurm'")
    return recipe[0].strip().splitlines()


def batch_script(workdir):
    """The documented recipe as a batch script: its lines unchanged but the srun line's task count
    (one task on each host) and the program's flags (the tiny model, rank 0 writing to workdir)."""
    lines = documented_recipe()
    srun = [i for i, line in enumerate(lines) if re.match(r"^srun --ntasks-per-node \d+ build/run_data_parallel\b", line)]
    if len(srun) != 1:
        raise AssertionError(f"{DOC}: the Slurm recipe has no 'srun --ntasks-per-node N build/run_data_parallel' line:\n"
                             + "\n".join(lines))
    program = os.path.relpath(DP, SOURCE) if DP.startswith(SOURCE + os.sep) else DP
    lines[srun[0]] = " ".join(["srun", "--ntasks-per-node", "1", program] + TINY + ["--workdir", workdir])
    return "#!/bin/sh\n" + "\n".join(lines) + "\n"


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        return f"({path}: {e.strerror})"


def command_line(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def processes_mentioning(text):
    """Running processes whose command line or environment holds text: the daemons name their
    cluster's files in their arguments, the job's tasks carry its SLURM_CONF."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not running(entry):
            continue
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{entry}/{part}", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(entry))
                        break
            except OSError:
                pass
    return found


def tasks_named(c, command):
    """The hosts running a process called command, a host once per process."""
    found = []
    for host in c.hosts:
        for pid in host.pids():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == command and running(pid):
                        found.append(host.name)
            except OSError:
                pass
    return found


@unittest.skipIf(UNAVAILABLE, UNAVAILABLE)
class SlurmOnEmulatedHosts(unittest.TestCase):
    def assert_nothing_left(self, c, directory):
        deadline = time.monotonic() + 5   # a killed process may linger a moment before it is reaped
        while processes_mentioning(directory) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [f"pid {pid}: {command_line(pid)}" for pid in processes_mentioning(directory)]
        self.assertEqual(left, [], f"processes of cluster {c.name}'s Slurm after tear-down")
        self.assertFalse(os.path.exists(directory), f"{directory} survives tear-down")
        hosts_files = [path for path in (os.path.join(cluster.NETNS_ETC_DIR, h.namespace) for h in c.hosts)
                       if os.path.exists(path)]
        self.assertEqual(hosts_files, [], "the hosts' /etc/netns entries survive tear-down")
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        self.assertNotIn(f"{c.name}-", listed)

    def test_the_documented_recipe_trains_on_two_hosts_as_one_host_does(self):
        import torch
        from safetensors.torch import load_file
        env = job_environment()
        with tempfile.TemporaryDirectory() as tmp:
            plain = os.path.join(tmp, "plain")
            single = subprocess.run([DP, "--world_size", str(N_HOSTS), "--master_port", str(free_port()),
                                     "--workdir", plain] + TINY, capture_output=True, text=True, timeout=300, env=env)
            self.assertEqual(single.returncode, 0, single.stdout + single.stderr)
            script = os.path.join(tmp, "recipe.sh")
            with open(script, "w") as f:
                f.write(batch_script(os.path.join(tmp, "slurm")))
            with cluster.Cluster(N_HOSTS, log=None, slurm=True) as c:
                directory = c.slurm.directory
                submitted = c.hosts[0].run(["sbatch", "--parsable", "--nodes", str(N_HOSTS), "--ntasks-per-node", "1",
                                            "--chdir", SOURCE, "--output", os.path.join(tmp, "job-%j.out"), script],
                                           env=c.slurm_env(env), check=True)
                job_id = submitted.stdout.strip().split(";")[0]
                job = c.slurm.wait_for_job(job_id, timeout=180)
            output = read(os.path.join(tmp, f"job-{job_id}.out"))
            context = f"the batch script:\n{read(script)}\nits output:\n{output}\nthe cluster log:\n" + \
                      "\n".join(c.log.lines[-40:])
            self.assertEqual((job.get("JobState"), job.get("ExitCode")), ("COMPLETED", "0:0"), context)
            self.assertEqual(job.get("NodeList"), f"host[0-{N_HOSTS - 1}]", context)
            for host in c.hosts:   # each host's rank binds Gloo to its own address, toward host0's
                self.assertRegex(output, rf"(?m)^.*Gloo.*{re.escape(host.address)}(?![\d.])",
                                 f"no rank on {host.name} printed its Gloo address\n{context}")
            expected = load_file(os.path.join(plain, "model.safetensors"))
            actual = load_file(os.path.join(tmp, "slurm", "model.safetensors"))
            problems = [f"{name}: missing" for name in expected if name not in actual]
            problems += [f"{name}: largest difference {float((actual[name] - w).abs().max()):.3g}"
                         for name, w in expected.items()
                         if name in actual and not torch.allclose(actual[name], w, atol=1e-6, rtol=1e-5)]
            self.assertEqual(problems, [], f"sbatch on {N_HOSTS} hosts against one launch of {N_HOSTS} ranks")
        self.assert_nothing_left(c, directory)

    def test_an_error_with_a_job_running_leaves_no_daemon_task_or_file(self):
        with self.assertRaisesRegex(RuntimeError, "the test's own error"):
            with cluster.Cluster(N_HOSTS, log=None, slurm=True) as c:
                directory = c.slurm.directory
                submitted = c.hosts[0].run(["sbatch", "--parsable", "--nodes", str(N_HOSTS), "--ntasks-per-node", "1",
                                            "--output", "/dev/null", "--wrap", "srun sleep 300"],
                                           env=c.slurm_env(job_environment()), check=True)
                job_id = submitted.stdout.strip().split(";")[0]
                deadline = time.monotonic() + 30
                while len(tasks_named(c, "sleep")) < N_HOSTS and time.monotonic() < deadline:
                    time.sleep(0.1)
                self.assertEqual(sorted(tasks_named(c, "sleep")), [h.name for h in c.hosts], "srun's tasks")
                self.assertEqual(c.slurm.job(job_id).get("JobState"), "RUNNING")
                self.assertTrue(processes_mentioning(directory), "no process names the Slurm directory")
                raise RuntimeError("the test's own error")
        self.assert_nothing_left(c, directory)


if __name__ == "__main__":
    unittest.main(verbosity=2)
