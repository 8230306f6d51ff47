"""The programs as a new user first runs them: the project's own presets with the default flags
(gpt2-tiny's n_positions equals the default --model_max_length), and what the per-rank lines add
up to with tensor parallelism."""
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
        batch, length, epochs = 8, 32, 2
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, "w")
            proc = run([DP, "--world_size", "4", "--tensor_parallel_size", "2", "--batch_size", str(batch),
                        "--n_epochs", str(epochs), "--max_batches", "1", "--benchmark_only", "--workdir", work,
                        "--master_port", str(free_port())] + TINY)
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
                self.assertGreater(summed / trained, 0.85, (epoch, summed, trained, proc.stdout))
                self.assertLess(summed / trained, 1.15, (epoch, summed, trained, proc.stdout))
                for f in figures:
                    self.assertAlmostEqual(f.tok * f.time / replica_tokens, 1.0, delta=0.15)


if __name__ == "__main__":
    unittest.main(verbosity=2)
