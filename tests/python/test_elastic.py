"""--elastic end to end: a data-parallel replica killed (-9) at step 5 of 12 under (2,1,1,1) and
(3,1,1,1). The run finishes without a restart; its weights equal the undisturbed run's by the AdamW
rule; the membership line and metrics.jsonl record are there; each step trained on the same
examples as the undisturbed run's (a per-step digest of the examples every process trained); no
step is missing or repeated. A replacement the launcher starts joins at step 7 and both replicas end
bit-identical; one that arrives after the last step leaves with nothing to do. Replicas of several
processes (a stage, tensor or context rank lost) are dropped whole and taken back whole by
replacements, each bit-identical to the process at its place in replica 0. Also: --min_replicas 2
ends the run naming the lost process, and the refusals before launch. gpt2-tiny, dropout 0 (a dropped replica's rows draw the survivors'
dropout masks otherwise)."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import unittest

SOURCE = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "scripts"))
from fault_injection import worker_of_rank  # noqa: E402  a launcher's worker by its RANK, from /proc
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from after_adamw import weight_problems  # noqa: E402  weights of two runs compared as AdamW guarantees
DP = os.path.join(BINARY, "run_data_parallel")

STEPS, LR = 12, 3e-3
# One epoch of 12 optimizer steps of 12 rows (6 or 4 a replica), dropout off.
TINY = ["--model", "gpt2-tiny", "--model_max_length", "32", "--train_size", "144", "--validation_size", "6",
        "--test_size", "2", "--no_progress", "--batch_size", "12", "--n_epochs", "1", "--dropout", "0",
        "--learning_rate", str(LR), "--dist_timeout_s", "5", "--threads_per_device", "1"]
TRAIN = re.compile(r"^Epoch 0 on Rank (\d+): Training Time")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def weights(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def records(work):
    with open(os.path.join(work, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_digests(folder):
    """step -> (examples, digest) summed over every process's file, digests modulo 2^64."""
    out = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                step, count, digest = (int(x) for x in line.split())
                c, d = out.get(step, (0, 0))
                out[step] = (c + count, (d + digest) % (1 << 64))
    return out


class ElasticRun(unittest.TestCase):
    # The undisturbed runs, one of each world size, shared by the tests (made on first use).
    undisturbed = {}

    @classmethod
    def setUpClass(cls):
        cls.shared = tempfile.mkdtemp(prefix="elastic-undisturbed-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.shared, ignore_errors=True)

    def undisturbed_run(self, world_size):
        """The workdir and example digests of an --elastic run of `world_size` without a loss."""
        if world_size not in self.undisturbed:
            work, digests, p = self.elastic_run(self.shared, f"undisturbed{world_size}", world_size)
            self.assertEqual(p.returncode, 0, p.stderr[-3000:])
            self.undisturbed[world_size] = (work, digests, p)
        work, digests, _ = self.undisturbed[world_size]
        return work, digests

    @staticmethod
    def elastic_run(tmp, name, world_size, kill=None, extra=(), replacements=0, env_extra=None, timeout=5):
        """replacements: how many the launcher may start (None: its default, --world_size);
        timeout: --dist_timeout_s."""
        work = os.path.join(tmp, name)
        digests = os.path.join(tmp, name + "-digests")
        os.makedirs(digests)
        env = dict({"HARNESS_TEST_EXAMPLE_DIGESTS": digests}, **(env_extra or {}))
        if replacements is not None:
            env["HARNESS_ELASTIC_MAX_REPLACEMENTS"] = str(replacements)
        if kill:
            env["HARNESS_TEST_KILL_AT_STEP"] = kill
        tiny = TINY[:TINY.index("--dist_timeout_s") + 1] + [str(timeout)] + TINY[TINY.index("--dist_timeout_s") + 2:]
        proc = run([DP, "--world_size", str(world_size), "--master_port", str(free_port()), "--workdir", work,
                    "--elastic"] + list(extra) + tiny, env)
        return work, digests, proc

    def check_lost_replica(self, tmp, world_size, lost, extra=(), timeout=5, how=""):
        """Runs undisturbed and with process `lost` killed at step 5 (`how`: "vote", killed after the
        step's collectives, before its commit vote), checks the killed run against the undisturbed
        one, and returns both workdirs and the killed run's output."""
        plain, plain_digests = self.undisturbed_run(world_size)
        work, digests, k = self.elastic_run(tmp, "killed", world_size, kill=f"{lost}:5" + (f":{how}" if how else ""),
                                            extra=extra, timeout=timeout)
        self.assertEqual(k.returncode, 0, k.stderr[-4000:])
        self.assertNotIn("restart", k.stderr)
        left = world_size - 1
        self.assertEqual(sum(f"elastic: generation 1 at step 5: lost process {lost}; {left} of {world_size} "
                             "replicas go on" in line for line in k.stderr.splitlines()), 1, k.stderr[-3000:])
        # The membership record, once, between steps 4 and 5; every step once, in order.
        log = records(work)
        members = [r for r in log if r["kind"] == "membership"]
        self.assertEqual(members, [{"kind": "membership", "generation": 1, "step": 5, "replicas": left,
                                    "lost": [lost], "joined": []}])
        self.assertEqual([r["step"] for r in log if r["kind"] == "train"], list(range(1, STEPS + 1)))
        self.assertEqual(log.index(members[0]), 4, log)
        # The lost replica prints no epoch line; the others do.
        reporting = sorted(int(m[1]) for m in (TRAIN.match(l) for l in k.stdout.splitlines()) if m)
        self.assertEqual(reporting, [r for r in range(world_size) if r != lost], k.stdout)
        if not how:
            # Lost between steps: the step's start (an all-reduce) fails on every survivor, so
            # that none trains step 5 before it learns of the loss.
            for p in range(world_size):
                if p != lost:
                    self.assertIn(f"[process {p}] elastic: step 5's start failed in a collective", k.stderr)
            self.assertNotIn("elastic: step 5 failed in a collective", k.stderr)
        # The examples of every step, over all processes, are the undisturbed run's.
        expected, actual = step_digests(plain_digests), step_digests(digests)
        self.assertEqual(sorted(expected), list(range(1, STEPS + 1)))
        self.assertEqual(actual, expected)
        self.assertEqual({c for c, _ in expected.values()}, {12})
        # The weights: the undisturbed run's by the AdamW rule.
        problems = weight_problems(weights(work), weights(plain), LR, STEPS)
        self.assertEqual(problems, [], "\n".join(problems))
        return plain, work, k

    def test_a_killed_replica_of_two_leaves_one_that_trains_every_row(self):
        with tempfile.TemporaryDirectory() as tmp:
            self.check_lost_replica(tmp, 2, lost=1)

    def test_a_killed_replica_of_three_leaves_two_that_share_its_rows(self):
        # Process 0 is the one lost: the next generation's rank 0 writes the checkpoints (every 3
        # steps), the final model and metrics.jsonl from then on. The checkpoint of step 9, written
        # by 2 processes, resumes under 3 without --elastic and ends as the undisturbed run.
        with tempfile.TemporaryDirectory() as tmp:
            plain, work, _ = self.check_lost_replica(tmp, 3, lost=0, extra=["--checkpoint_every", "3"])
            checkpoint = os.path.join(work, "checkpoints", "step-00000009")
            self.assertTrue(os.path.exists(os.path.join(checkpoint, "manifest.json")))
            resumed = os.path.join(tmp, "resumed")
            r = run([DP, "--world_size", "3", "--master_port", str(free_port()), "--workdir", resumed, "--resume",
                     checkpoint] + TINY)
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            self.assertIn("resume: continuing from " + checkpoint, r.stderr)
            problems = weight_problems(weights(resumed), weights(plain), LR, STEPS)
            self.assertEqual(problems, [], "\n".join(problems))

    def test_survivors_away_from_the_lost_process_learn_of_it_at_once_not_at_the_timeout(self):
        # (4,1,1,1), process 1 killed at step 5, collectives allowed 60 s: process 2 or 3 can be
        # blocked in the all-reduce with a survivor rather than with process 1. The survivors that
        # failed let their connections go, so it fails too, and the generation forms at once.
        with tempfile.TemporaryDirectory() as tmp:
            _, _, k = self.check_lost_replica(tmp, 4, lost=1, timeout=60)
            agreed = re.search(r"lost process 1; 3 of 4 replicas go on \(([0-9.]+) s to agree and reconnect\)",
                               k.stderr)
            self.assertIsNotNone(agreed, k.stderr[-3000:])
            self.assertLess(float(agreed[1]), 20.0, k.stderr[-3000:])
            self.assertNotIn("Timed out", k.stderr)

    def test_a_replacement_joins_at_step_7_and_the_replicas_end_bit_identical(self):
        # Process 1 killed at step 5; the launcher starts process 2 in its place (RANK 1), which
        # joins at step 7, receives the weights, AdamW state and data position, and trains replica
        # 1's rows from there. The run ends with 2 replicas again.
        with tempfile.TemporaryDirectory() as tmp:
            plain, plain_digests = self.undisturbed_run(2)
            finals = os.path.join(tmp, "final-weights")
            os.makedirs(finals)
            work, digests, k = self.elastic_run(
                tmp, "grown", 2, kill="1:5", replacements=None,
                env_extra={"HARNESS_TEST_JOIN_AT_STEP": "7", "HARNESS_TEST_WEIGHT_DIGESTS": finals})
            self.assertEqual(k.returncode, 0, k.stderr[-4000:])
            self.assertIn("launcher: starting rank 2 as a replacement for rank 1 (--elastic)", k.stderr)
            for line in ("elastic: generation 1 at step 5: lost process 1; 1 of 2 replicas go on",
                         "elastic: generation 2 at step 7: process 2 joined; 2 of 2 replicas go on"):
                self.assertEqual(sum(line in l for l in k.stderr.splitlines()), 1, k.stderr[-4000:])
            log = records(work)
            self.assertEqual([r for r in log if r["kind"] == "membership"], [
                {"kind": "membership", "generation": 1, "step": 5, "replicas": 1, "lost": [1], "joined": []},
                {"kind": "membership", "generation": 2, "step": 7, "replicas": 2, "lost": [], "joined": [2]}])
            self.assertEqual([r["step"] for r in log if r["kind"] == "train"], list(range(1, STEPS + 1)))
            # The replacement reports as the replica it took over (Rank 1), the lost one did not.
            reporting = sorted(int(m[1]) for m in (TRAIN.match(l) for l in k.stdout.splitlines()) if m)
            self.assertEqual(reporting, [0, 1], k.stdout)
            # Every step's examples are the undisturbed run's; the replacement trained steps 7 to 12.
            self.assertEqual(step_digests(digests), step_digests(plain_digests))
            with open(os.path.join(digests, "process2.txt")) as f:
                self.assertEqual([int(line.split()[0]) for line in f], list(range(7, STEPS + 1)))
            # Both replicas bit-identical, and the undisturbed weights by the AdamW rule.
            ends = {}
            for name in os.listdir(finals):
                with open(os.path.join(finals, name)) as f:
                    ends[name] = f.read().strip()
            self.assertEqual(sorted(ends), ["process0.txt", "process2.txt"])
            self.assertEqual(ends["process0.txt"], ends["process2.txt"])
            problems = weight_problems(weights(work), weights(plain), LR, STEPS)
            self.assertEqual(problems, [], "\n".join(problems))

    def test_a_replacement_lost_while_being_admitted_is_dropped_and_another_joins(self):
        # Process 1 killed at step 5; its replacement, process 2, is killed at step 7 once admitted
        # and connected, before it has the state (HARNESS_TEST_LOSE_REPLACEMENT). The survivor
        # recovers as from any loss, and the next replacement, process 3, joins at step 9.
        with tempfile.TemporaryDirectory() as tmp:
            plain, plain_digests = self.undisturbed_run(2)
            finals = os.path.join(tmp, "final-weights")
            os.makedirs(finals)
            work, digests, k = self.elastic_run(
                tmp, "again", 2, kill="1:5", replacements=None,
                env_extra={"HARNESS_TEST_JOIN_AT_STEP": "7,9", "HARNESS_TEST_LOSE_REPLACEMENT": "2",
                           "HARNESS_TEST_WEIGHT_DIGESTS": finals})
            self.assertEqual(k.returncode, 0, k.stderr[-4000:])
            for line in ("launcher: starting rank 2 as a replacement for rank 1 (--elastic)",
                         "[process 2] test hook: killed while being admitted",
                         "[process 0] elastic: admitting process 2 at step 7 failed in a collective",
                         "launcher: starting rank 3 as a replacement for rank 2 (--elastic)",
                         "elastic: generation 1 at step 5: lost process 1; 1 of 2 replicas go on",
                         "elastic: generation 3 at step 7: lost process 2; 1 of 2 replicas go on",
                         "elastic: generation 4 at step 9: process 3 joined; 2 of 2 replicas go on"):
                self.assertEqual(sum(line in l for l in k.stderr.splitlines()), 1, line + "\n" + k.stderr[-4000:])
            log = records(work)
            self.assertEqual([r for r in log if r["kind"] == "membership"], [
                {"kind": "membership", "generation": 1, "step": 5, "replicas": 1, "lost": [1], "joined": []},
                {"kind": "membership", "generation": 3, "step": 7, "replicas": 1, "lost": [2], "joined": []},
                {"kind": "membership", "generation": 4, "step": 9, "replicas": 2, "lost": [], "joined": [3]}])
            self.assertEqual([r["step"] for r in log if r["kind"] == "train"], list(range(1, STEPS + 1)))
            self.assertEqual(step_digests(digests), step_digests(plain_digests))
            ends = {}
            for name in os.listdir(finals):
                with open(os.path.join(finals, name)) as f:
                    ends[name] = f.read().strip()
            self.assertEqual(sorted(ends), ["process0.txt", "process3.txt"])
            self.assertEqual(ends["process0.txt"], ends["process3.txt"])
            problems = weight_problems(weights(work), weights(plain), LR, STEPS)
            self.assertEqual(problems, [], "\n".join(problems))

    def test_with_every_process_that_started_lost_a_replacement_keeps_the_log_and_checkpoints(self):
        # Process 1 killed at step 5, its replacement (process 2) joins at step 7, and process 0 is
        # killed at step 9: the replacement trains on alone, as generation 3's rank 0. It takes
        # metrics.jsonl over and writes the checkpoints and the model; its step-10 checkpoint
        # resumes under 2 processes without --elastic and ends as the undisturbed run.
        with tempfile.TemporaryDirectory() as tmp:
            plain, plain_digests = self.undisturbed_run(2)
            work, digests, k = self.elastic_run(tmp, "taken-over", 2, kill="1:5,0:9", replacements=1,
                                                extra=["--checkpoint_every", "5"],
                                                env_extra={"HARNESS_TEST_JOIN_AT_STEP": "7"})
            self.assertEqual(k.returncode, 0, k.stderr[-4000:])
            self.assertIn("[rank 2] elastic: generation 3 at step 9: lost process 0; 1 of 2 replicas go on", k.stderr)
            log = records(work)
            self.assertEqual([r for r in log if r["kind"] == "membership"], [
                {"kind": "membership", "generation": 1, "step": 5, "replicas": 1, "lost": [1], "joined": []},
                {"kind": "membership", "generation": 2, "step": 7, "replicas": 2, "lost": [], "joined": [2]},
                {"kind": "membership", "generation": 3, "step": 9, "replicas": 1, "lost": [0], "joined": []}])
            self.assertEqual([r["step"] for r in log if r["kind"] == "train"], list(range(1, STEPS + 1)))
            reporting = sorted(int(m[1]) for m in (TRAIN.match(l) for l in k.stdout.splitlines()) if m)
            self.assertEqual(reporting, [1], k.stdout)
            self.assertEqual(step_digests(digests), step_digests(plain_digests))
            problems = weight_problems(weights(work), weights(plain), LR, STEPS)
            self.assertEqual(problems, [], "\n".join(problems))
            checkpoint = os.path.join(work, "checkpoints", "step-00000010")
            self.assertIn("[rank 2] checkpoint: saved " + checkpoint, k.stderr)
            resumed = os.path.join(tmp, "resumed")
            r = run([DP, "--world_size", "2", "--master_port", str(free_port()), "--workdir", resumed, "--resume",
                     checkpoint] + TINY)
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            self.assertIn("resume: continuing from " + checkpoint, r.stderr)
            problems = weight_problems(weights(resumed), weights(plain), LR, STEPS)
            self.assertEqual(problems, [], "\n".join(problems))

    def test_a_replica_lost_after_the_steps_all_reduce_has_the_others_take_the_step_again(self):
        # (3,1,1,1): process 1 dies once step 5's all-reduce succeeded everywhere, before its commit
        # vote. Processes 0 and 2 vote, find it lost, and neither updates its weights: both take
        # step 5 again with its rows, as after any loss.
        with tempfile.TemporaryDirectory() as tmp:
            _, _, k = self.check_lost_replica(tmp, 3, lost=1, how="vote")
            self.assertIn("[process 1] test hook: killed before its vote on step 5", k.stderr)
            for process in (0, 2):
                self.assertIn(f"[process {process}] elastic: step 5 of generation 0 is taken again", k.stderr)

    def test_a_lost_stage_drops_its_replica_and_the_other_pipeline_finishes_alone(self):
        with tempfile.TemporaryDirectory() as tmp:
            self.check_lost_stage(tmp, "1:5")

    def test_a_stage_lost_after_the_steps_collectives_has_every_survivor_take_the_step_again(self):
        # Process 1 dies once every collective of step 5 succeeded, before its commit vote: each
        # other stage could update its weights now (a barrier before the optimizer would let it),
        # but none does; all take step 5 again, and replica 0 goes on alone.
        with tempfile.TemporaryDirectory() as tmp:
            k = self.check_lost_stage(tmp, "1:5:vote")
            for process in (0, 2, 3):
                self.assertIn(f"[process {process}] elastic: step 5 of generation 0 is taken again", k.stderr)

    def check_lost_stage(self, tmp, kill):
        """(2,1,1,2): ranks 0 and 2 are replica 0's stages, 1 and 3 replica 1's (rank = p*D + d).
        Process 1 (replica 1's first stage) killed at step 5 (`kill`): process 3, its other stage,
        leaves with the reason, and replica 0's two stages train every row to step 12. Returns the
        run's output."""
        plain, plain_digests = self.undisturbed_run(2)
        stages = ["--pipeline_parallel_size", "2", "--n_chunk", "2"]
        work, digests, k = self.elastic_run(tmp, "staged", 4, kill=kill, extra=stages)
        self.assertEqual(k.returncode, 0, k.stderr[-4000:])
        self.assertEqual(sum("elastic: generation 1 at step 5: lost process 1; 1 of 2 replicas go on" in line
                             for line in k.stderr.splitlines()), 1, k.stderr[-4000:])
        self.assertIn("process 3's replica 1 lost process 1 and cannot train; it leaves generation 1", k.stderr)
        log = records(work)
        self.assertEqual([r for r in log if r["kind"] == "membership"],
                         [{"kind": "membership", "generation": 1, "step": 5, "replicas": 1, "lost": [1],
                           "joined": []}])
        self.assertEqual([r["step"] for r in log if r["kind"] == "train"], list(range(1, STEPS + 1)))
        # Each stage process of a replica trains its rows: every step's examples twice over.
        expected = {s: (2 * c, 2 * d % (1 << 64)) for s, (c, d) in step_digests(plain_digests).items()}
        self.assertEqual(step_digests(digests), expected)
        problems = weight_problems(weights(work), weights(plain), LR, STEPS)
        self.assertEqual(problems, [], "\n".join(problems))
        return k

    def check_replica_taken_back(self, tmp, name, extra, lost, leaver):
        """(2,...) of 4 processes, replica 1 = processes `lost` and `leaver`: `lost` killed at step 5,
        `leaver` leaves with the reason, and the launcher's two replacements take replica 1 back at
        step 7, each at its rank's place. Checks the run against the undisturbed one."""
        plain, plain_digests = self.undisturbed_run(2)
        finals = os.path.join(tmp, name + "-final-weights")
        os.makedirs(finals)
        work, digests, k = self.elastic_run(
            tmp, name, 4, kill=f"{lost}:5", extra=extra, replacements=None,
            env_extra={"HARNESS_TEST_JOIN_AT_STEP": "7", "HARNESS_TEST_WEIGHT_DIGESTS": finals})
        self.assertEqual(k.returncode, 0, k.stderr[-4000:])
        self.assertEqual(sum(f"elastic: generation 1 at step 5: lost process {lost}; 1 of 2 replicas go on" in line
                             for line in k.stderr.splitlines()), 1, k.stderr[-4000:])
        self.assertIn(f"process {leaver}'s replica 1 lost process {lost} and cannot train; it leaves generation 1",
                      k.stderr)
        # A replacement for each: the killed process and the one that left.
        started = dict((int(lost_rank), int(new)) for new, lost_rank in re.findall(
            r"launcher: starting rank (\d+) as a replacement for rank (\d+) \(--elastic\)", k.stderr))
        self.assertEqual(sorted(started), sorted([lost, leaver]), k.stderr[-4000:])
        self.assertEqual(sorted(started.values()), [4, 5])
        joined = [started[r] for r in sorted(started)]  # in the order of the ranks they take
        self.assertEqual(sum(f"elastic: generation 2 at step 7: processes {joined[0]}, {joined[1]} joined; "
                             "2 of 2 replicas go on" in line for line in k.stderr.splitlines()), 1, k.stderr[-4000:])
        log = records(work)
        self.assertEqual([r for r in log if r["kind"] == "membership"], [
            {"kind": "membership", "generation": 1, "step": 5, "replicas": 1, "lost": [lost], "joined": []},
            {"kind": "membership", "generation": 2, "step": 7, "replicas": 2, "lost": [], "joined": joined}])
        self.assertEqual([r["step"] for r in log if r["kind"] == "train"], list(range(1, STEPS + 1)))
        # Replica 1 reports again, from step 7, through its replacement.
        reporting = sorted(int(m[1]) for m in (TRAIN.match(l) for l in k.stdout.splitlines()) if m)
        self.assertEqual(reporting, [0, 1], k.stdout)
        # Each process of a replica trains its rows: every step's examples twice over, and each
        # replacement trained steps 7 to 12.
        expected = {s: (2 * c, 2 * d % (1 << 64)) for s, (c, d) in step_digests(plain_digests).items()}
        self.assertEqual(step_digests(digests), expected)
        for new in joined:
            with open(os.path.join(digests, f"process{new}.txt")) as f:
                self.assertEqual([int(line.split()[0]) for line in f], list(range(7, STEPS + 1)))
        # Each replacement ends bit-identical to the process at its place in replica 0 (rank r - 1
        # there: replica 1's ranks follow replica 0's at each place), and the weights are the
        # undisturbed run's by the AdamW rule.
        ends = {}
        for file in os.listdir(finals):
            with open(os.path.join(finals, file)) as f:
                ends[int(file[len("process"):-len(".txt")])] = f.read().strip()
        self.assertEqual(sorted(ends), sorted([r for r in range(4) if r not in (lost, leaver)] + joined))
        for rank, new in started.items():
            twin = rank - 1 if "--pipeline_parallel_size" in extra else rank - 2
            self.assertEqual(ends[new], ends[twin], f"process {new} (rank {rank}) against process {twin}")
        problems = weight_problems(weights(work), weights(plain), LR, STEPS)
        self.assertEqual(problems, [], "\n".join(problems))

    def test_a_lost_stage_drops_its_replica_and_two_replacements_take_it_back(self):
        # (2,1,1,2): process 1 (replica 1's first stage) killed at step 5, process 3 (its second)
        # leaves; at step 7 the replacements take ranks 1 and 3, each receiving its stage's weights
        # and AdamW state from the same stage of replica 0 (processes 0 and 2).
        with tempfile.TemporaryDirectory() as tmp:
            self.check_replica_taken_back(tmp, "staged-back", ["--pipeline_parallel_size", "2", "--n_chunk", "2"],
                                          lost=1, leaver=3)

    def test_a_lost_tensor_or_context_rank_drops_its_replica_and_replacements_take_it_back(self):
        # (2,1,2,1) and (2,2,1,1): ranks 2 and 3 are replica 1's tensor (or context) ranks
        # (rank = ((p*D + d)*C + c)*T + t). Process 3 killed at step 5: process 2 leaves, replica 0's
        # two ranks train every row, and at step 7 two replacements take ranks 2 and 3 back, each
        # receiving its slices (or the whole model) from the rank at its place in replica 0.
        with tempfile.TemporaryDirectory() as tmp:
            for name, flag in (("tensor", "--tensor_parallel_size"), ("context", "--context_parallel_size")):
                with self.subTest(name):
                    self.check_replica_taken_back(tmp, name, [flag, "2"], lost=3, leaver=2)

    def test_a_replacement_arriving_after_the_last_step_leaves_with_nothing_to_do(self):
        # Killed as step 12, the last, starts: the survivor takes it alone and finishes; the
        # launcher closes the admissions, and the waiting replacement exits 0 without training.
        with tempfile.TemporaryDirectory() as tmp:
            work, _, k = self.elastic_run(tmp, "late", 2, kill="1:12", replacements=None)
            self.assertEqual(k.returncode, 0, k.stderr[-4000:])
            self.assertIn("launcher: starting rank 2 as a replacement for rank 1 (--elastic)", k.stderr)
            self.assertIn("asked to join, and the run ended before the others reached a step boundary to admit it; "
                          "nothing to do", k.stderr)
            self.assertNotIn("joined;", k.stderr)
            self.assertEqual([r["step"] for r in records(work) if r["kind"] == "train"], list(range(1, STEPS + 1)))

    def test_a_replica_stopped_past_the_timeout_is_dropped_then_refused_when_continued(self):
        # SIGSTOP at step 5: the survivor's collective times out (--dist_timeout_s 5), the launcher
        # records the stopped process lost past its timeout, and the survivor goes on. Continued
        # then, the process finds that its generation went on without it and leaves, saying so.
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, "stopped")
            env = dict(os.environ, HARNESS_TEST_KILL_AT_STEP="1:5:stop", HARNESS_ELASTIC_MAX_REPLACEMENTS="0")
            proc = subprocess.Popen([DP, "--world_size", "2", "--master_port", str(free_port()), "--workdir", work,
                                     "--elastic"] + TINY, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True, env=env, start_new_session=True)
            err = []
            try:
                for line in proc.stderr:
                    err.append(line.rstrip("\n"))
                    if "elastic: generation 1 at step 5: lost process 1; 1 of 2 replicas go on" in line:
                        os.kill(worker_of_rank(proc.pid, 1), signal.SIGCONT)
                code = proc.wait(timeout=300)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.stderr.close()
            text = "\n".join(err)
            self.assertEqual(code, 0, text[-4000:])
            self.assertIn("launcher: rank 1 was stopped by SIGSTOP for more than 15 s; it is lost", text)
            self.assertIn("elastic: process 1 belongs to generation 0, and generation 1 went on without it", text)
            self.assertIn("(lost already)", text)
            self.assertEqual([r["step"] for r in records(work) if r["kind"] == "train"], list(range(1, STEPS + 1)))

    def test_below_min_replicas_the_run_stops_naming_the_lost_process(self):
        with tempfile.TemporaryDirectory() as tmp:
            _, _, proc = self.elastic_run(tmp, "min2", 2, kill="1:5", extra=["--min_replicas", "2"])
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn("lost process 1 at step 5; 1 replica(s) left, below --min_replicas 2", proc.stderr)

    def test_without_a_loss_the_elastic_run_is_the_plain_run_bit_for_bit(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            work, _ = self.undisturbed_run(2)
            e = self.undisturbed[2][2]
            self.assertIn("elastic=true min_replicas=1", e.stderr)
            plain = os.path.join(tmp, "plain")
            p = run([DP, "--world_size", "2", "--master_port", str(free_port()), "--workdir", plain] + TINY)
            self.assertEqual(p.returncode, 0, p.stderr[-3000:])
            a, b = weights(work), weights(plain)
            for key in b:
                self.assertTrue(torch.equal(a[key], b[key]), key)


class LossDuringACheckpoint(unittest.TestCase):
    def test_the_writer_killed_while_writing_leaves_the_previous_checkpoint_and_training_goes_on(self):
        with tempfile.TemporaryDirectory() as tmp:
            plain = os.path.join(tmp, "plain")
            p = run([DP, "--world_size", "3", "--master_port", str(free_port()), "--workdir", plain] + TINY)
            self.assertEqual(p.returncode, 0, p.stderr[-3000:])
            work = os.path.join(tmp, "w")
            # Every checkpoint write stalls 2 s half-written; process 0, the writer, is killed in the
            # second one (step 8).
            env = dict(os.environ, HARNESS_TEST_CHECKPOINT_STALL_MS="2000", HARNESS_ELASTIC_MAX_REPLACEMENTS="0")
            proc = subprocess.Popen([DP, "--world_size", "3", "--master_port", str(free_port()), "--workdir", work,
                                     "--elastic", "--checkpoint_every", "4"] + TINY, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
            err, out = [], []
            reader = threading.Thread(target=lambda: out.extend(proc.stdout.read().splitlines()), daemon=True)
            reader.start()
            try:
                writes = 0
                for line in proc.stderr:
                    err.append(line.rstrip("\n"))
                    if "checkpoint: writing" in line:
                        writes += 1
                        if writes == 2:
                            os.kill(worker_of_rank(proc.pid, 0), signal.SIGKILL)
                code = proc.wait(timeout=300)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            reader.join(timeout=10)
            proc.stdout.close()
            proc.stderr.close()
            text = "\n".join(err)
            self.assertEqual(code, 0, text[-4000:])
            self.assertIn("checkpoint: step 8 abandoned, a process was lost", text)
            self.assertIn("elastic: generation 1 at step 9: lost process 0; 2 of 3 replicas go on", text)
            checkpoints = os.path.join(work, "checkpoints")
            complete = sorted(d for d in os.listdir(checkpoints)
                              if os.path.exists(os.path.join(checkpoints, d, "manifest.json")))
            self.assertEqual(complete, ["step-00000004", "step-00000012"], os.listdir(checkpoints))
            problems = weight_problems(weights(work), weights(plain), LR, STEPS)
            self.assertEqual(problems, [], "\n".join(problems))


class ElasticBench(unittest.TestCase):
    def test_the_bench_times_both_recoveries_and_compares_the_loss_curves(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "figures")
            proc = subprocess.run([sys.executable, os.path.join(SOURCE, "scripts", "elastic_bench.py"), "--build-dir",
                                   BINARY, "--workdir", tmp, "--out-dir", out, "--model", "gpt2-tiny", "--steps", "8",
                                   "--kill-at", "4", "--checkpoint-every", "2", "--join-at", "6"],
                                  capture_output=True, text=True, timeout=600)
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            with open(os.path.join(out, "elastic.json")) as f:
                summary = json.load(f)
            self.assertTrue(os.path.getsize(os.path.join(out, "elastic.png")) > 0)
            for name in ("elastic", "elastic_alone", "restart"):
                self.assertGreater(summary["recovery_s"][name], 0)
                self.assertEqual(len(summary["runs"][name]["losses"]), 8)
            self.assertEqual(summary["largest_loss_difference_from_undisturbed"]["restart"], 0.0)
            self.assertLess(summary["largest_loss_difference_from_undisturbed"]["elastic"], 1e-4)
            self.assertLess(summary["largest_loss_difference_from_undisturbed"]["elastic_alone"], 1e-4)
            self.assertEqual(summary["runs"]["elastic"]["joined"]["step"], 6)
            self.assertIsNone(summary["runs"]["elastic_alone"]["joined"])  # no replacement was started
            self.assertGreater(summary["replacement_admit_and_send_s"], 0)
            self.assertAlmostEqual(summary["recovery_ratio_elastic_over_restart"],
                                   summary["recovery_s"]["elastic"] / summary["recovery_s"]["restart"])
            self.assertAlmostEqual(summary["recovery_ratio_elastic_alone_over_restart"],
                                   summary["recovery_s"]["elastic_alone"] / summary["recovery_s"]["restart"])
            # A kill step that is not a checkpoint's is refused.
            bad = subprocess.run([sys.executable, os.path.join(SOURCE, "scripts", "elastic_bench.py"), "--kill-at", "5",
                                  "--checkpoint-every", "2"], capture_output=True, text=True, timeout=60)
            self.assertNotEqual(bad.returncode, 0)
            self.assertIn("--kill-at must be a checkpoint's step", bad.stderr)


class Refusals(unittest.TestCase):
    def refused(self, extra, expected, env_extra=None):
        proc = run([DP, "--master_port", str(free_port()), "--workdir", tempfile.gettempdir()] + extra + TINY,
                   env_extra, timeout=120)
        self.assertNotEqual(proc.returncode, 0, proc.stderr)
        self.assertIn(expected, proc.stderr)
        self.assertNotIn("Epoch", proc.stdout)

    def test_flags_that_cannot_work_are_refused_before_launch(self):
        self.refused(["--world_size", "1", "--elastic"], "it needs at least 2 replicas")
        self.refused(["--world_size", "2", "--elastic", "--zero_stage", "1"],
                     "a lost rank's shard of the optimizer state exists nowhere else")
        self.refused(["--world_size", "2", "--elastic", "--tensor_parallel_size", "2"], "it needs at least 2 replicas")
        self.refused(["--world_size", "2", "--elastic", "--min_replicas", "3"], "--min_replicas 3: expected 1 to 2")
        self.refused(["--world_size", "2", "--min_replicas", "2"], "--min_replicas applies to --elastic runs only")

    def test_a_worker_of_another_launcher_refuses_elastic(self):
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost",
               "MASTER_PORT": str(free_port())}
        self.refused(["--world_size", "2", "--elastic"], "--elastic needs run_data_parallel's own launcher", env)


if __name__ == "__main__":
    unittest.main(verbosity=2)
