"""--memory_plan end to end through both programs: the plan's figures for gpt2-tiny (whole, as
pipeline stages, on one device and on two) printed with exit 0 before anything is started or
written, the one line of it every run prints at start, its activation estimate against the bytes a
step's tensors took (HARNESS_COUNT_CPU_TENSORS=1), and the refusal of a run whose model state
does not fit the memory a rank has, naming the bytes and the ZeRO stage that would fit (the memory
available set through the HARNESS_TEST_AVAILABLE_MEMORY_BYTES test hook)."""
import os
import re
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_checkpoints as ck  # noqa: E402  the programs' paths and run()

DP, PP = ck.DP, ck.PP
TINY = ["--model", "gpt2-tiny", "--model_max_length", "40", "--train_size", "16", "--validation_size", "8",
        "--test_size", "2", "--no_progress", "--benchmark_only", "--batch_size", "8", "--n_epochs", "1",
        "--max_batches", "1"]
# gpt2-tiny: 173824 parameters. As two pipeline stages by the default split, 1.5 and 0.5 blocks:
# 140480 (wte 65536, wpe 8192, block 0 49984, block 1's ln_1 and attention 16768) and 98880
# (block 1's ln_2 and MLP 33216, ln_f 128, the tied head's copy of wte 65536).
ROW = re.compile(r"^  (\S+) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+)  (.+)$", re.M)
PLAN_LINE = re.compile(r"weights (\d+) \+ gradients (\d+) \+ optimizer (\d+) = model state \d+ bytes, "
                       r"activations ~(\d+) bytes")
COUNTED = re.compile(r"rank (\d+)'s CPU tensors peaked at (\d+) bytes; a training step after the first allocated "
                     r"at most (\d+) bytes over what it held once its gradients were cleared")


def plan_rows(text):
    """{ranks or device: (parameters, weights, gradients, optimizer, activations, total)}"""
    return {m.group(1): tuple(int(m.group(i)) for i in range(2, 8)) for m in ROW.finditer(text)}


def env_with(**values):
    env = dict(os.environ)
    env.update({k: str(v) for k, v in values.items()})
    return env


class PrintedPlan(unittest.TestCase):
    def test_data_parallel_plans_each_rank_kind_and_exits_before_starting_anything(self):
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, "never")
            proc = ck.run([DP, "--world_size", "2", "--workdir", work, "--memory_plan"] + TINY)
            self.assertEqual(proc.returncode, 0)
            rows = plan_rows(proc.stdout)
            self.assertEqual(rows["0-1"][:4], (173824, 695296, 695296, 1390592), proc.stdout)
            params, weights, grads, adamw, activations, total = rows["0-1"]
            self.assertGreater(activations, 0)
            self.assertEqual(total, weights + grads + adamw + activations)
            self.assertIn("data 2 x tensor 1 x pipeline 1 = world 2", proc.stdout)
            self.assertRegex(proc.stdout, r"available per rank: \d+ bytes .*\(MemAvailable \d+ bytes / 2 ranks on this host\)")
            self.assertIn("model state per rank: at most 2781184 bytes", proc.stdout)
            self.assertNotIn("Epoch", proc.stdout)
            self.assertFalse(os.path.exists(work), "--memory_plan wrote the work directory")

            # ZeRO-1 halves AdamW's state over the 2 data-parallel ranks; pipeline stages hold their own.
            proc = ck.run([DP, "--world_size", "2", "--zero_stage", "1", "--memory_plan"] + TINY)
            self.assertEqual(plan_rows(proc.stdout)["0-1"][:4], (173824, 695296, 695296, 695296))
            proc = ck.run([DP, "--world_size", "2", "--pipeline_parallel_size", "2", "--n_chunk", "2",
                           "--memory_plan"] + TINY)
            rows = plan_rows(proc.stdout)
            self.assertEqual(rows["0"][:4], (140480, 561920, 561920, 1123840), proc.stdout)
            self.assertEqual(rows["1"][:4], (98880, 395520, 395520, 791040), proc.stdout)
            self.assertIn("stage 0: block halves 0-2, wte, wpe", proc.stdout)
            self.assertIn("stage 1: block halves 3, ln_f, wte (tied head)", proc.stdout)
            # The split is the default, by cost: half blocks cannot even out the head's 2.2 blocks.
            self.assertIn("forward and backward work (GPT-2's pieces costed from their shapes): 0 41.5%, 1 58.5%",
                          proc.stdout)

    def test_pipeline_plans_each_device(self):
        proc = ck.run([PP, "--memory_plan"] + TINY)
        self.assertEqual(plan_rows(proc.stdout)["cpu:0"][:4], (173824, 695296, 695296, 1390592), proc.stdout)
        self.assertIn("available per device:", proc.stdout)
        proc = ck.run([PP, "--model_parallel_mode", "pipeline_parallel", "--devices", "cpu:0,cpu:1", "--n_chunk", "2",
                       "--memory_plan"] + TINY)
        rows = plan_rows(proc.stdout)
        self.assertEqual(rows["cpu:0"][:4], (140480, 561920, 561920, 1123840), proc.stdout)
        self.assertEqual(rows["cpu:1"][:4], (98880, 395520, 395520, 791040), proc.stdout)
        self.assertRegex(proc.stdout, r"\(MemAvailable \d+ bytes / 2 devices on this host\)")
        self.assertNotIn("Epoch", proc.stdout)


class StartLine(unittest.TestCase):
    def test_every_run_prints_one_line_of_the_plan(self):
        with tempfile.TemporaryDirectory() as tmp:
            for program, extra, line in (
                    (DP, ["--world_size", "2", "--master_port", str(ck.free_port())],
                     "run_data_parallel: memory plan per rank (the most: ranks 0-1): weights 695296 + gradients 695296 "
                     "+ optimizer 1390592 = model state 2781184 bytes, activations ~"),
                    (PP, [], "run_pipeline: memory plan per device (the most: cpu:0): weights 695296 + gradients "
                             "695296 + optimizer 1390592 = model state 2781184 bytes, activations ~")):
                proc = ck.run([program, "--workdir", os.path.join(tmp, os.path.basename(program))] + TINY + extra)
                self.assertEqual(proc.stderr.count("memory plan per"), 1, proc.stderr)
                self.assertIn(line, proc.stderr)
                self.assertRegex(proc.stdout, r"Epoch 0(?: on Rank 0)?: Training Time = ")


class PlanAgainstCountedTensors(unittest.TestCase):
    """Two steps with every CPU tensor allocation counted: each rank's step (from its cleared
    gradients to its peak) took what the plan estimates for activations, within 15%, at D = 2 and
    with context, tensor and sequence parallelism at once (the vocabulary-parallel loss, the ring's
    buffers); and the run's peak held the weights and AdamW's state besides."""

    def test_a_step_takes_the_planned_activations(self):
        two_steps = TINY[:-1] + ["2"]
        with tempfile.TemporaryDirectory() as tmp:
            for name, layout in (("data", ["--world_size", "2"]),
                                 ("context_tensor_sequence", ["--world_size", "4", "--context_parallel_size", "2",
                                                              "--tensor_parallel_size", "2", "--sequence_parallel"])):
                with self.subTest(layout=name):
                    proc = ck.run([DP, "--workdir", os.path.join(tmp, name), "--master_port", str(ck.free_port())]
                                  + two_steps + layout, env=env_with(HARNESS_COUNT_CPU_TENSORS=1))
                    weights, _, optimizer, planned = (int(v) for v in PLAN_LINE.search(proc.stderr).groups())
                    counted = {int(m[1]): (int(m[2]), int(m[3])) for m in COUNTED.finditer(proc.stderr)}
                    ranks = int(layout[1])
                    self.assertEqual(sorted(counted), list(range(ranks)), proc.stderr)
                    for rank, (peak, step) in counted.items():
                        self.assertGreater(step, 0)
                        self.assertGreaterEqual(peak, weights + optimizer + step, f"rank {rank}")
                        self.assertLess(abs(planned / step - 1.0), 0.15,
                                        f"rank {rank}: planned {planned} bytes of activations, a step took {step}")


class Refusal(unittest.TestCase):
    def refused(self, args, available):
        proc = ck.run(args + TINY, check=False, env=env_with(HARNESS_TEST_AVAILABLE_MEMORY_BYTES=available))
        self.assertNotEqual(proc.returncode, 0, proc.stderr)
        self.assertNotIn("Epoch", proc.stdout)
        self.assertIn("are available per", proc.stderr)
        self.assertIn("HARNESS_TEST_AVAILABLE_MEMORY_BYTES, the test hook", proc.stderr)
        return proc.stderr

    def test_a_model_state_that_does_not_fit_is_refused_naming_the_figures_and_the_stage(self):
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, "w")
            # 16 x 173824 bytes per rank; ZeRO-1 over 2 ranks: 4 + 4 + 8 / 2 per parameter = 2085888.
            err = self.refused([DP, "--world_size", "2", "--workdir", work], 2100000)
            self.assertIn("the model state needs 2781184 bytes (2.65 MiB) per rank on ranks 0-1", err)
            self.assertIn("but 2100000 bytes (2.00 MiB) are available per rank", err)
            self.assertIn("--zero_stage 1 would need 2085888 bytes per rank and fit", err)
            self.assertNotIn("cannot run it", err)
            # Over 4 ranks with a 0.01 MB bucket only ZeRO-2 fits: 4 + 4 / 4 + 8 / 4 per parameter + the bucket.
            err = self.refused([DP, "--world_size", "4", "--bucket_cap_mb", "0.01", "--workdir", work], 1500000)
            self.assertIn("--zero_stage 2 would need 1227253 bytes per rank and fit", err)
            if "cannot run it" in err:  # a build without ZeRO-2 says so
                self.assertIn("but this build cannot run it here: --zero_stage 2", err)
            # Nothing shards a single replica.
            err = self.refused([PP, "--workdir", work], 1000000)
            self.assertIn("the model state needs 2781184 bytes (2.65 MiB) per device on cpu:0", err)
            self.assertIn("no ZeRO stage fits: --zero_stage 3 would still need 2781184 bytes per device over 1 "
                          "data-parallel rank", err)
            # Enough memory: the same runs go ahead.
            proc = ck.run([DP, "--world_size", "2", "--workdir", work, "--master_port", str(ck.free_port())] + TINY,
                          env=env_with(HARNESS_TEST_AVAILABLE_MEMORY_BYTES=2781184))
            self.assertIn("HARNESS_TEST_AVAILABLE_MEMORY_BYTES, the test hook", proc.stderr)


if __name__ == "__main__":
    unittest.main()
