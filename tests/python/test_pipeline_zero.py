"""run_data_parallel --zero_stage 1 and 3 inside pipeline stages and tensor-parallel shards: each stage's
AdamW state is sharded over the stage's data-parallel group (the tied wte in a bucket of its own on
the first and the last stage, so that their chunks of it are the same elements, summed over the
embedding group). After three AdamW steps with dropout 0 the weights equal the unsharded layout's
(only the order of sums differs: 1e-5 of the update) and plain data parallelism's (1e-3); --pytest's
gradients are the whole model's with the tied embeddings summed; the stage's state is half its
unsharded size on two data-parallel ranks; a sharded stage checkpoint resumes unsharded elsewhere
and an unsharded one resumes sharded. Under ZeRO-3 each stage's units (its blocks, wte alone, and
wpe or ln_f) are sharded the same way and gathered for each step: (2,1,1,2) and (2,1,2,2) train
like the unsharded stages, its gradients are the whole model's, and a checkpoint resumes into it bit for
bit. gpt2-tiny, a few batches, at most 8 processes."""
import os
import re
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from after_adamw import gradient_problems, weight_problems  # noqa: E402
from test_checkpoints import (DP, TINY as CHECKPOINTED, free_port, resume_without_learning, run,  # noqa: E402
                              weights)
from test_pipeline_processes import COMMON, LR, STEPS, train  # noqa: E402

STAGES = ["--pipeline_parallel_size", "2", "--n_chunk", "2"]
ZERO = ["--zero_stage", "1"]
ZERO3 = ["--zero_stage", "3"]
STATE = re.compile(r"--zero_stage 1 keeps (\d+) bytes of AdamW state on rank 0 \(replicated: (\d+)")


class ShardedStages(unittest.TestCase):
    def same(self, actual, expected, label, fraction):
        problems = weight_problems(weights(actual), weights(expected), LR, STEPS, update_fraction=fraction)
        self.assertEqual(problems, [], label)

    def test_sharded_stages_train_like_unsharded_stages_and_like_data_parallelism(self):
        with tempfile.TemporaryDirectory() as tmp:
            plain, _ = train(tmp, "dp2", "gpt2-tiny", 2)
            for name, world, layout in (("d2p2", 4, STAGES), ("d2t2p2", 8, STAGES + ["--tensor_parallel_size", "2"])):
                unsharded, _ = train(tmp, name, "gpt2-tiny", world, layout)
                sharded, proc = train(tmp, name + "_zero", "gpt2-tiny", world, layout + ZERO)
                self.assertIn("zero_stage=1", proc.stderr)
                self.same(sharded, unsharded, name + ": ZeRO-1 against unsharded stages", 1e-5)
                self.same(sharded, plain, name + ": ZeRO-1 stages against data parallelism", 1e-3)
            # (2,1,1,2) and (2,1,2,2) under ZeRO-3: each stage's units (each tensor-parallel rank's
            # slices of them) sharded over its two replicas, gathered for each step; the wte unit's
            # chunks summed over the embedding group.
            for name, world, layout in (("d2p2", 4, STAGES), ("d2t2p2", 8, STAGES + ["--tensor_parallel_size", "2"])):
                units, proc = train(tmp, name + "_zero3", "gpt2-tiny", world, layout + ZERO3)
                self.assertIn("zero_stage=3", proc.stderr)
                self.same(units, os.path.join(tmp, name), name + ": ZeRO-3 against unsharded stages", 1e-5)
                self.same(units, plain, name + ": ZeRO-3 stages against data parallelism", 1e-3)
                if name == "d2p2":  # rank 0 (stage 0) gathered its stage's units, no more: wpe, wte, its blocks
                    held = int(re.search(r"\((\d+) parameters, (\d+) held on rank 0\)", proc.stderr).group(2))
                    gathered = int(re.search(r"--zero_stage 3 held at most (\d+) bytes", proc.stderr).group(1))
                    self.assertGreaterEqual(gathered, 4 * held)
                    self.assertLess(gathered, 4 * held + 4 * 64 * 2)  # each unit padded to a multiple of 2
            # Interleaved: stage 0's process also holds the third of four virtual stages.
            interleaved, _ = train(tmp, "interleaved_zero", "gpt2-tiny", 4,
                                   ["--pipeline_parallel_size", "2", "--n_chunk", "2", "--pipeline_schedule",
                                    "interleaved", "--virtual_stages", "2", "--balance", "0.5,0.5,0.5,0.5"] + ZERO)
            self.same(interleaved, plain, "(2,1,2) interleaved, ZeRO-1", 1e-3)

    def test_a_stage_keeps_half_its_state_and_its_gradients_are_the_whole_models(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            _, proc = train(tmp, "state", "gpt2-tiny", 4, STAGES + ZERO)
            kept, replicated = map(int, STATE.search(proc.stderr).groups())
            # Rank 0 is stage 0: its chunks of the stage's buckets, padded to a multiple of 2.
            total, held = map(int, re.search(r"\((\d+) parameters, (\d+) held on rank 0\)", proc.stderr).groups())
            self.assertGreaterEqual(kept, 8 * held // 2)
            self.assertLess(kept, 8 * held // 2 + 8 * 64)
            self.assertLessEqual(kept, replicated // 2 + 8 * 64)  # the stage's AdamW state unsharded

            def gradients(name, world, extra):
                grads = os.path.join(tmp, name + "_grads")
                run([DP, "--pytest", "--grad_dir", grads, "--world_size", str(world), "--master_port", str(free_port()),
                     "--workdir", os.path.join(tmp, name), "--model", "gpt2-tiny"] + COMMON + extra, timeout=600)
                return [torch.load(os.path.join(grads, f"model{r}_gradients.pth")) for r in range(world)]
            expected = gradients("dp2", 2, [])
            for name, zero in (("d2p2", ZERO), ("d2p2_zero3", ZERO3)):
                got = gradients(name, 4, STAGES + zero)
                for rank, grads in enumerate(got):
                    want = expected[rank % 2]  # rank = p * D + d: its data-parallel rank is rank % 2
                    self.assertEqual(sorted(grads), sorted(want), f"{name}, rank {rank}")
                    self.assertEqual(gradient_problems(grads, want), [], f"{name}, rank {rank}")


class ShardedStageCheckpoints(unittest.TestCase):
    """A sharded stage checkpoint is the same unsplit state as any other: at learning rate 0 the
    resumed run ends with exactly the checkpoint's weights, and training on continues."""

    def test_sharded_stages_reshard_to_one_rank_and_back(self):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "src")
            sharded = ["--world_size", "4", "--pipeline_parallel_size", "2"] + ZERO
            run([DP, "--master_port", str(free_port()), "--workdir", src] + sharded + CHECKPOINTED + ["--n_epochs", "1"],
                timeout=600)
            checkpoint = os.path.join(src, "checkpoints", "step-00000004")
            checkpoint = resume_without_learning(self, ["--world_size", "1"], checkpoint, tmp, "one", epochs=2)
            checkpoint = resume_without_learning(self, sharded, checkpoint, tmp, "back", epochs=3)
            # And as ZeRO-3's units of the stages: each stage's chunks from the unsplit state.
            units = ["--world_size", "4", "--pipeline_parallel_size", "2"] + ZERO3
            resume_without_learning(self, units, checkpoint, tmp, "units", epochs=4)

    def test_a_sharded_stage_run_resumed_continues_like_the_run_left_alone(self):
        with tempfile.TemporaryDirectory() as tmp:
            sharded = ["--world_size", "4", "--pipeline_parallel_size", "2", "--dropout", "0"] + ZERO
            plain = os.path.join(tmp, "plain")
            run([DP, "--master_port", str(free_port()), "--workdir", plain] + sharded + CHECKPOINTED, timeout=600)
            work = os.path.join(tmp, "w")
            run([DP, "--master_port", str(free_port()), "--workdir", work] + sharded + CHECKPOINTED +
                ["--n_epochs", "1"], timeout=600)
            proc = run([DP, "--master_port", str(free_port()), "--workdir", work, "--resume", "auto"] + sharded +
                       CHECKPOINTED, timeout=600)
            self.assertIn("continuing from", proc.stderr)
            self.assertEqual(weight_problems(weights(work), weights(plain), lr=3e-3, steps=8), [])


if __name__ == "__main__":
    unittest.main()
