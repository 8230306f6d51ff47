"""scripts/parallel_layouts_bench.py's pure parts: a run's tokens/s read from SPEC §7's lines (the
reporting ranks summed per epoch, warm-up epochs dropped, the pipeline's own form too), a log
without the lines refused by name, and the ratios taken per round."""
import os
import sys
import unittest

SOURCE_DIR = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(SOURCE_DIR, "scripts"))

import parallel_layouts_bench as plb  # noqa: E402
from bench_common import BenchmarkError  # noqa: E402


class TokensPerSec(unittest.TestCase):
    def test_the_replicas_lines_are_summed_per_epoch_after_the_warmup(self):
        text = "\n".join([
            "Epoch 0 on Rank 0: Training Time = 1.0, Tokens_per_sec = 100.0",
            "Epoch 0 on Rank 1: Training Time = 1.0, Tokens_per_sec = 900.0",
            "Epoch 1 on Rank 1: Training Time = 1.0, Tokens_per_sec = 60.5",
            "rank 0 epoch 1 4/4 loss=6.9",
            "Epoch 1 on Rank 0: Training Time = 1.0, Tokens_per_sec = 40.0",
            "Epoch 2 on Rank 0: Training Time = 1.0, Tokens_per_sec = 50.0",
            "Epoch 2 on Rank 1: Training Time = 1.0, Tokens_per_sec = 50.0"])
        self.assertEqual(plb.tokens_per_sec(text, 1, "log"), [100.5, 100.0])
        self.assertEqual(plb.tokens_per_sec(text, 0, "log"), [1000.0, 100.5, 100.0])

    def test_run_pipelines_lines_count_as_one_replica(self):
        text = "Epoch 0: Training Time = 2.0, Tokens_per_sec = 10.0\nEpoch 1: Training Time = 2.0, Tokens_per_sec = 12.5"
        self.assertEqual(plb.tokens_per_sec(text, 1, "log"), [12.5])

    def test_a_log_without_a_measured_epoch_is_refused_naming_it(self):
        with self.assertRaisesRegex(BenchmarkError, "w/run.log: no epoch line at or after epoch 1"):
            plb.tokens_per_sec("Epoch 0: Training Time = 2.0, Tokens_per_sec = 10.0", 1, "w/run.log")


class Summary(unittest.TestCase):
    def test_ratios_are_the_median_of_each_rounds_ratio(self):
        names = list(plb.LAYOUTS)
        rounds = []
        for processes, threads in ((100.0, 100.0), (90.0, 100.0), (120.0, 100.0)):
            r = {name: 50.0 for name in names}
            r["pipeline processes (1,1,2)"], r["pipeline threads"] = processes, threads
            rounds.append(r)
        summary = plb.summarise("gpt2-tiny", rounds)
        self.assertEqual(summary["pipeline_processes_over_threads_x"]["per_round"], [1.0, 0.9, 1.2])
        self.assertEqual(summary["pipeline_processes_over_threads_x"]["median"], 1.0)
        self.assertEqual(summary["tokens_per_sec"]["pipeline processes (1,1,2)"], 100.0)
        self.assertEqual(summary["fastest"], "pipeline processes (1,1,2)")


if __name__ == "__main__":
    unittest.main(verbosity=2)
