"""run_data_parallel --context_parallel_size C: each sequence of a replica's batch split over C
ranks (zigzag chunks, ring attention). After three AdamW steps with dropout 0 the weights equal
one device's (data parallelism alone's when D > 1) by the rule of after_adamw.py, for (D,C,T,P) =
(1,2,1,1), (2,2,1,1), (1,2,2,1) and (1,3,1,1), under ZeRO-2 and ZeRO-3, (2,2,2,1) under ZeRO-2, with
--sequence_parallel (1,1,2,1), (1,2,2,1), (1,1,2,2) in pipeline stages (1F1B, and zbv with every
forward recomputed) and (2,1,2,2) under zb1p with ZeRO-1, (1,2,1,2) in pipeline stages under 1F1B,
and with two batches a step (--gradient_accumulation_steps 2); the validation loss is one device's;
only c = 0 prints; --model_max_length 38 is padded to a multiple of 2C (40, 42), of 2C·T with sequence
parallelism (40). The refusals name the flags.
Checkpoints reshard to and from context ranks; a killed context rank is named. gpt2-tiny, a few
batches, at most 8 processes."""
import json
import os
import signal
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from after_adamw import weight_problems  # noqa: E402
from test_programs import DP, DP_LOSS, DP_TRAIN, TINY, free_port, matching, run  # noqa: E402
from test_checkpoints import (TINY as CHECKPOINTED, Watched, environ_of, resume_without_learning,  # noqa: E402
                              saved_step_at_least)
from fault_injection import descendants  # noqa: E402  (scripts/, on the path test_checkpoints sets)

# 38 tokens: not a multiple of 2C = 4, so every context run pads its sequences.
SMALL = [a if a != "40" else "38" for a in TINY]
STEPS = 3


def weights(work):
    from safetensors.torch import load_file
    return load_file(os.path.join(work, "model.safetensors"))


class ContextParallel(unittest.TestCase):
    def train(self, tmp, name, world, extra=(), batches=STEPS):
        work = os.path.join(tmp, name)
        proc = run([DP, "--world_size", str(world), "--batch_size", "16", "--max_batches", str(batches),
                    "--n_epochs", "1", "--dropout", "0", "--learning_rate", "1e-3", "--workdir", work,
                    "--master_port", str(free_port())] + SMALL + list(extra), timeout=600)
        return work, proc

    def same_weights(self, actual, expected, label, steps=STEPS):
        problems = weight_problems(weights(actual), weights(expected), lr=1e-3, steps=steps)
        self.assertEqual(problems, [], label)

    def validation_losses(self, proc):
        return {int(m[2]): float(m[3]) for m in matching(DP_LOSS, proc.stdout)}

    def test_one_replica_over_two_context_ranks_trains_like_one_device(self):
        with tempfile.TemporaryDirectory() as tmp:
            alone, alone_proc = self.train(tmp, "alone", 1)
            split, proc = self.train(tmp, "c2", 2, ["--context_parallel_size", "2"])
            self.same_weights(split, alone, "(1,2,1,1) against one device")
            # One replica: one rank (c = 0) prints its lines, with the replica's tokens.
            self.assertEqual([(int(m[1]), int(m[2])) for m in matching(DP_TRAIN, proc.stdout)], [(0, 0)])
            self.assertFalse(os.path.exists(os.path.join(split, "rank1_results_epoch0.json")))
            losses, expected = self.validation_losses(proc), self.validation_losses(alone_proc)
            self.assertEqual(list(losses), [0])
            self.assertAlmostEqual(losses[0], expected[0], delta=1e-4 * abs(expected[0]))
            self.assertIn("context_parallel_size=2", proc.stderr)
            with open(os.path.join(split, "rank0_gen_epoch0.json")) as f:
                self.assertEqual(len(json.load(f)), 4)

    def test_two_replicas_of_two_context_ranks_train_like_data_parallelism(self):
        with tempfile.TemporaryDirectory() as tmp:
            data, data_proc = self.train(tmp, "d2", 2)
            both, proc = self.train(tmp, "d2c2", 4, ["--context_parallel_size", "2"])
            self.same_weights(both, data, "(2,2,1,1) against D = 2")
            self.assertEqual(sorted(int(m[2]) for m in matching(DP_TRAIN, proc.stdout)), [0, 1])
            losses, expected = self.validation_losses(proc), self.validation_losses(data_proc)
            self.assertEqual(sorted(losses), [0, 1])
            for d in (0, 1):
                self.assertAlmostEqual(losses[d], expected[d], delta=1e-4 * abs(expected[d]))
            # All four dimensions but the pipeline's, ZeRO-2 sharding over the D·C = 4 ranks of each slice.
            four, _ = self.train(tmp, "d2c2t2z2", 8, ["--context_parallel_size", "2", "--tensor_parallel_size", "2",
                                                      "--zero_stage", "2", "--benchmark_only"])
            self.same_weights(four, data, "(2,2,2,1) with ZeRO-2 against D = 2")

    def test_context_inside_tensor_parallelism_and_zero_train_like_one_device(self):
        with tempfile.TemporaryDirectory() as tmp:
            alone, _ = self.train(tmp, "alone", 1, ["--benchmark_only"])
            for name, world, extra in (("t2c2", 4, ["--context_parallel_size", "2", "--tensor_parallel_size", "2"]),
                                       ("c2z2", 2, ["--context_parallel_size", "2", "--zero_stage", "2"]),
                                       ("c2z3", 2, ["--context_parallel_size", "2", "--zero_stage", "3"]),
                                       ("c3", 3, ["--context_parallel_size", "3"]),  # 38 padded to 42
                                       # Sequence parallelism: T = 2 alone, and inside C = 2 (38 padded to 40).
                                       ("t2", 2, ["--tensor_parallel_size", "2"]),
                                       ("t2sp", 2, ["--tensor_parallel_size", "2", "--sequence_parallel"]),
                                       ("t2c2sp", 4, ["--context_parallel_size", "2", "--tensor_parallel_size", "2",
                                                      "--sequence_parallel"])):
                work, _ = self.train(tmp, name, world, ["--benchmark_only"] + extra)
                self.same_weights(work, alone, name + " against one device")

    def test_context_ranks_inside_pipeline_stages_train_like_one_device(self):
        # (1,2,1,2): each stage's two context ranks run their ring; the stages pass shards down.
        with tempfile.TemporaryDirectory() as tmp:
            alone, alone_proc = self.train(tmp, "alone", 1)
            staged, proc = self.train(tmp, "c2p2", 4, ["--context_parallel_size", "2", "--pipeline_parallel_size", "2",
                                                       "--n_chunk", "4"])
            self.same_weights(staged, alone, "(1,2,1,2) against one device")
            self.assertIn("context_parallel_size=2", proc.stderr)
            self.assertIn("pipeline_parallel_size=2", proc.stderr)
            # The last stage's c = 0 prints; evaluation and generation run through the stages.
            self.assertEqual([(int(m[1]), int(m[2])) for m in matching(DP_TRAIN, proc.stdout)], [(0, 0)])
            losses, expected = self.validation_losses(proc), self.validation_losses(alone_proc)
            self.assertEqual(list(losses), [0])
            self.assertAlmostEqual(losses[0], expected[0], delta=1e-4 * abs(expected[0]))
            # Greedy generation runs the whole prompt through the stages: one device's translations.
            with open(os.path.join(staged, "rank0_gen_epoch0.json")) as f, \
                    open(os.path.join(alone, "rank0_gen_epoch0.json")) as g:
                self.assertEqual(json.load(f), json.load(g))

    def test_sequence_parallelism_inside_pipeline_stages_trains_like_one_device(self):
        # (1,1,2,2): the stages pass each tensor rank's part of a micro-batch. Under 1F1B with
        # 4 micro-batches of 4 rows the parts are whole rows; under zbv with 16 of one row (and every
        # forward recomputed) they are halves of each sequence, 38 positions padded to 40.
        with tempfile.TemporaryDirectory() as tmp:
            alone, alone_proc = self.train(tmp, "alone", 1)
            expected = self.validation_losses(alone_proc)
            with open(os.path.join(alone, "rank0_gen_epoch0.json")) as g:
                translations = json.load(g)
            for name, extra in (("rows", ["--n_chunk", "4"]),
                                ("positions", ["--n_chunk", "16", "--pipeline_schedule", "zbv",
                                               "--activation_checkpointing", "always"])):
                with self.subTest(name):
                    staged, proc = self.train(tmp, "t2p2sp-" + name, 4,
                                              ["--tensor_parallel_size", "2", "--pipeline_parallel_size", "2",
                                               "--sequence_parallel"] + extra)
                    self.same_weights(staged, alone, "(1,1,2,2) with --sequence_parallel against one device")
                    self.assertIn("sequence_parallel=true", proc.stderr)
                    self.assertIn("pipeline_parallel_size=2", proc.stderr)
                    losses = self.validation_losses(proc)
                    self.assertEqual(list(losses), [0])
                    self.assertAlmostEqual(losses[0], expected[0], delta=1e-4 * abs(expected[0]))
                    # Generation passes whole sequences down the stages (the cached path is not split).
                    with open(os.path.join(staged, "rank0_gen_epoch0.json")) as f:
                        self.assertEqual(json.load(f), translations)
            # (2,1,2,2) under zb1p (a split backward) with ZeRO-1: data parallelism alone's weights.
            data, _ = self.train(tmp, "d2", 2, ["--benchmark_only"])
            eight, _ = self.train(tmp, "d2t2p2sp", 8, ["--tensor_parallel_size", "2", "--pipeline_parallel_size", "2",
                                                      "--sequence_parallel", "--n_chunk", "4", "--pipeline_schedule",
                                                      "zb1p", "--zero_stage", "1", "--benchmark_only"])
            self.same_weights(eight, data, "(2,1,2,2) with --sequence_parallel, zb1p and ZeRO-1 against D = 2")

    def test_accumulated_batches_weigh_as_on_one_device(self):
        # Two batches a step: each rank's loss is divided by both whole batches' label weight.
        with tempfile.TemporaryDirectory() as tmp:
            accumulation = ["--gradient_accumulation_steps", "2", "--benchmark_only"]
            alone, _ = self.train(tmp, "alone", 1, accumulation, batches=4)
            split, _ = self.train(tmp, "c2", 2, ["--context_parallel_size", "2"] + accumulation, batches=4)
            self.same_weights(split, alone, "(1,2,1,1) accumulating against one device", steps=2)

    def test_memory_plan_counts_a_ranks_rows_and_positions(self):
        proc = run([DP, "--memory_plan", "--world_size", "4", "--context_parallel_size", "2", "--batch_size", "16"]
                   + SMALL)
        self.assertIn("layout: data 2 x context 2 x tensor 1 x pipeline 1 = world 4", proc.stdout)
        self.assertIn("8 rows x 20 tokens", proc.stdout)  # 16 rows over D = 2; 38 padded to 40, over C = 2

    def test_refusals_name_the_flags(self):
        unsized = [a for a in TINY if a not in ("--model_max_length", "40")]
        for extra, needle in (
                (["--context_parallel_size", "2", "--world_size", "3", "--model_max_length", "40"],
                 "--context_parallel_size 2"),
                (["--context_parallel_size", "3", "--world_size", "3", "--model_max_length", "127"],
                 "--context_parallel_size 3 pads --model_max_length 127 to 132 positions"),
                (["--sequence_parallel", "--world_size", "2", "--model_max_length", "40"],
                 "--sequence_parallel splits the sequence over the tensor-parallel group: it needs "
                 "--tensor_parallel_size 2 or more, not 1")):
            proc = run([DP] + unsized + extra, check=False)
            self.assertNotEqual(proc.returncode, 0, proc.stderr)
            self.assertIn(needle, proc.stderr)

class ContextParallelCheckpoints(unittest.TestCase):
    """Checkpoints hold the unsplit state whatever C is: a (1,2,2,1) checkpoint resumes on one rank,
    and that rank's resumes as (2,2,1,1), each resumed at learning rate 0 for one more epoch, so
    that the weights it ends with are the checkpoint's bit for bit. A killed context rank ends the
    run promptly, named."""

    def test_a_context_checkpoint_reshards_to_one_rank_and_back_to_context_ranks(self):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "c2t2")
            run([DP, "--world_size", "4", "--context_parallel_size", "2", "--tensor_parallel_size", "2",
                 "--master_port", str(free_port()), "--workdir", src] + CHECKPOINTED + ["--n_epochs", "1"],
                timeout=600)
            checkpoint = os.path.join(src, "checkpoints", "step-00000004")
            checkpoint = resume_without_learning(self, ["--world_size", "1"], checkpoint, tmp, "one", epochs=2)
            resume_without_learning(self, ["--world_size", "4", "--context_parallel_size", "2"], checkpoint, tmp,
                                    "d2c2", epochs=3)

    def test_a_killed_context_rank_ends_the_run_promptly_naming_it(self):
        with tempfile.TemporaryDirectory() as tmp:
            watched = Watched([DP, "--world_size", "2", "--context_parallel_size", "2", "--master_port",
                               str(free_port()), "--workdir", os.path.join(tmp, "w")] + CHECKPOINTED +
                              ["--n_epochs", "50"])
            try:
                watched.wait_for(saved_step_at_least(2))
                workers = [p for p in descendants(watched.proc.pid) if environ_of(p).get(b"RANK") == b"1"]
                self.assertTrue(workers, "no rank 1 worker found")
                start = time.time()
                os.kill(workers[0], signal.SIGKILL)
                code = watched.finish(timeout=120)
            finally:
                if watched.proc.poll() is None:
                    watched.kill_all()
            self.assertNotEqual(code, 0)
            self.assertLess(time.time() - start, 30)
            self.assertTrue(any("rank 1" in line and "SIGKILL" in line for line in watched.err),
                            "\n".join(watched.err[-20:]))


if __name__ == "__main__":
    unittest.main()
