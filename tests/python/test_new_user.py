"""The programs as a new user first runs them: the project's own presets with the default flags
(gpt2-tiny's n_positions equals the default --model_max_length), what the per-rank lines add up
to with tensor parallelism, and a refusal by one rank reported by every rank in the same words."""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import unittest

SOURCE = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
DP = os.path.join(BINARY, "run_data_parallel")
PP = os.path.join(BINARY, "run_pipeline")
sys.path.insert(0, os.path.join(SOURCE, "scripts"))
import bench_common  # noqa: E402  (the benchmark runner's own parser of the printed lines)

NUMBER = r"(-?\d+(?:\.\d+)?)"
DP_TRAIN = re.compile(rf"^Epoch (\d+) on Rank (\d+): Training Time = {NUMBER}, Tokens_per_sec = {NUMBER}$", re.M)
DP_LOSS = re.compile(rf"^Epoch (\d+) on Rank (\d+): Validation Loss = {NUMBER}$", re.M)
DP_BLEU = re.compile(rf"^Epoch (\d+) on Rank (\d+): BLEU = {NUMBER}$", re.M)
PP_LOSS = re.compile(rf"^Epoch (\d+): Validation Loss = {NUMBER}$", re.M)
PP_BLEU = re.compile(rf"^Epoch (\d+): BLEU = {NUMBER}$", re.M)
TRANSPORT_ERRORS = ("Connection closed by peer", "Connection reset by peer", "pair.cc")

# Only the sizes of the run: the model's flags (--model_max_length, --batch_size, dropout) stay
# the programs' defaults.
ONE_BATCH = ["--n_epochs", "1", "--max_batches", "1", "--train_size", "128", "--validation_size", "8",
             "--test_size", "2", "--no_progress"]
TINY = ["--model", "gpt2-tiny", "--model_max_length", "32", "--train_size", "64", "--validation_size", "8",
        "--test_size", "2", "--no_progress", "--dropout", "0"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, timeout=600, check=True, env=None):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


class PresetsWithDefaultFlags(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def pipeline(self, preset):
        work = os.path.join(self.tmp.name, "pp-" + preset)
        proc = run([PP, "--model", preset, "--workdir", work] + ONE_BATCH)
        self.assertEqual(len(PP_LOSS.findall(proc.stdout)), 1, proc.stdout)
        self.assertEqual(len(PP_BLEU.findall(proc.stdout)), 1, proc.stdout)
        with open(os.path.join(work, "gen_epoch0.json")) as f:
            self.assertEqual(len(json.load(f)), 2)
        return work

    def data_parallel(self, preset):
        work = os.path.join(self.tmp.name, "dp-" + preset)
        proc = run([DP, "--world_size", "2", "--model", preset, "--workdir", work,
                    "--master_port", str(free_port())] + ONE_BATCH)
        self.assertEqual(sorted(r for _, r, _ in DP_LOSS.findall(proc.stdout)), ["0", "1"], proc.stdout)
        self.assertEqual(sorted(r for _, r, _ in DP_BLEU.findall(proc.stdout)), ["0", "1"], proc.stdout)
        for rank in (0, 1):
            with open(os.path.join(work, f"rank{rank}_gen_epoch0.json")) as f:
                self.assertEqual(len(json.load(f)), 2)
        return work

    # gpt2-tiny has n_positions 128, the default --model_max_length: training feeds 128 tokens and
    # generation never more (the token appended last is not fed back).
    def test_tiny_at_its_full_length_trains_and_generates_in_run_pipeline(self):
        work = self.pipeline("gpt2-tiny")
        with open(os.path.join(work, "config.json")) as f:
            self.assertEqual(json.load(f)["n_positions"], 128)

    def test_tiny_at_its_full_length_trains_and_generates_in_run_data_parallel(self):
        self.data_parallel("gpt2-tiny")

    def test_tiny_at_its_full_length_writes_pytest_gradients(self):
        grads = os.path.join(self.tmp.name, "grads")
        run([DP, "--world_size", "2", "--model", "gpt2-tiny", "--pytest", "--grad_dir", grads,
             "--workdir", os.path.join(self.tmp.name, "pytest"), "--master_port", str(free_port())] + ONE_BATCH)
        self.assertEqual(sorted(os.listdir(grads)), ["model0_gradients.pth", "model1_gradients.pth"])

    def test_mini_trains_and_evaluates_in_run_pipeline(self):
        self.pipeline("gpt2-mini")

    def test_mini_trains_and_evaluates_in_run_data_parallel(self):
        self.data_parallel("gpt2-mini")

    def test_a_length_beyond_the_positions_names_the_largest_that_fits(self):
        proc = run([PP, "--model", "gpt2-tiny", "--model_max_length", "129", "--workdir",
                    os.path.join(self.tmp.name, "long")] + ONE_BATCH, check=False)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("--model_max_length 129 needs n_positions >= 129 but the model has n_positions 128: "
                      "pass --model_max_length 128 or less", proc.stderr)
        self.assertNotIn("Training Time", proc.stdout)


class TensorParallelReports(unittest.TestCase):
    def test_the_sum_over_the_printed_ranks_is_the_runs_throughput(self):
        # World 4 = 2 data-parallel replicas of 2 tensor-parallel ranks: one line per replica and
        # epoch, as data-parallel ranks 0 and 1, each counting its replica's tokens once.
        # Batches large enough that a batch's compute outweighs the loader's few milliseconds in the
        # epoch's time on a busy machine.
        batch, length, epochs = 16, 128, 2
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, "w")
            proc = run([DP, "--world_size", "4", "--tensor_parallel_size", "2", "--batch_size", str(batch),
                        "--n_epochs", str(epochs), "--max_batches", "1", "--benchmark_only", "--workdir", work,
                        "--master_port", str(free_port())] + TINY + ["--model_max_length", str(length)])
            lines = DP_TRAIN.findall(proc.stdout)
            self.assertEqual(sorted((int(e), int(r)) for e, r, _, _ in lines),
                             [(e, r) for e in range(epochs) for r in (0, 1)], proc.stdout)
            self.assertEqual(sorted(re.findall(r"^Rank (\d+) training time: avg:", proc.stdout, re.M)), ["0", "1"])
            # The benchmark runner's arithmetic: time = mean over the printed ranks, throughput = sum.
            log = bench_common.parse_log_text(proc.stdout, "tp.log", "dp", world_size=2, expected_epochs=epochs)
            replica_tokens = batch // 2 * length  # a replica's half of the batch, padded to --model_max_length
            for epoch in range(epochs):
                figures = [log.epochs[r][epoch] for r in (0, 1)]
                # Each epoch is one batch: what a replica trained per second is its tokens over its
                # printed time, and the runner's sum over the printed ranks must be the sum of those
                # (each token counted once, not once per tensor-parallel rank).
                trained = sum(replica_tokens / f.time for f in figures)
                summed = sum(f.tok for f in figures)
                # A sum counting each token T = 2 times would be twice it; the margin is for the
                # epoch's time outside the batch's step (the loader, a busy machine's scheduling).
                self.assertGreater(summed / trained, 0.7, (epoch, summed, trained, proc.stdout))
                self.assertLess(summed / trained, 1.5, (epoch, summed, trained, proc.stdout))


class RefusalsStopEveryRank(unittest.TestCase):
    def assert_ranks_say(self, proc, reason):
        # Every rank that prints before the launcher stops the others says the same; none repeats
        # the transport's words about a peer that is gone.
        self.assertNotEqual(proc.returncode, 0)
        for words in TRANSPORT_ERRORS:
            self.assertNotIn(words, proc.stderr)
        self.assertIn(reason, proc.stderr)
        for line in proc.stderr.splitlines():
            if "error:" in line:
                self.assertIn(reason, line)
        self.assertNotIn("Training Time", proc.stdout)

    def test_another_runs_checkpoints_in_the_work_directory(self):
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, "w")
            first = ["--world_size", "2", "--batch_size", "8", "--n_epochs", "1", "--max_batches", "2",
                     "--benchmark_only", "--workdir", work]
            run([DP] + first + ["--master_port", str(free_port())] + TINY)
            proc = run([DP] + first + ["--learning_rate", "1e-3", "--master_port", str(free_port())] + TINY, check=False)
            self.assert_ranks_say(proc, "holds checkpoints of another run beyond step 0")
            self.assertIn("rank 0 refused to start, so no rank starts", proc.stderr)

    def test_ranks_that_read_other_training_pairs_are_named(self):
        with tempfile.TemporaryDirectory() as tmp:
            proc = run([DP, "--world_size", "3", "--batch_size", "6", "--n_epochs", "1", "--max_batches", "1",
                        "--benchmark_only", "--workdir", os.path.join(tmp, "w"), "--master_port", str(free_port())]
                       + TINY, check=False, env={"HARNESS_TEST_DROP_TRAINING_PAIR_ON_RANK": "2"})
            self.assert_ranks_say(proc, "rank 2 read other training pairs than rank 0")
            self.assertIn("--dataset", proc.stderr)
            self.assertNotIn("rank 1 read", proc.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
