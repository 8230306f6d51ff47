"""run_data_parallel --zero_stage 2: each data-parallel rank keeps only its chunks of AdamW's state
and of the gradients (the full gradients let go as their buckets are reduce-scattered; with
--gradient_accumulation_steps each batch is reduce-scattered and accumulated into the chunks).
After 4 AdamW steps with dropout 0 the weights equal the replicated run's (only the order of sums
differs: 1e-5 of the update), with and without accumulation, on 2 and 4 ranks, inside tensor
parallelism and pipeline stages, the tied weights included; --pytest's gradients are the replicated
run's; checkpoints keep the unsharded format and resume across stages 0, 1 and 2; the refusals name
the flags. gpt2-tiny, a few batches, at most 4 processes."""
import os
import re
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from after_adamw import gradient_problems, weight_problems  # noqa: E402
from test_programs import DP, TINY, free_port, run  # noqa: E402

STATE = re.compile(r"--zero_stage (\d) keeps (\d+) bytes of AdamW state on rank 0 \(replicated: (\d+) on every rank\)"
                   r"(, and 1/(\d+) of the gradients)?")


def weights(work):
    from safetensors.torch import load_file
    return load_file(os.path.join(work, "model.safetensors"))


class ZeroStageTwo(unittest.TestCase):
    def train(self, tmp, name, world, zero, epochs=2, resume=False, extra=()):
        work = os.path.join(tmp, name)
        proc = run([DP, "--world_size", str(world), "--zero_stage", str(zero), "--batch_size", "16",
                    "--max_batches", "2", "--n_epochs", str(epochs), "--benchmark_only", "--dropout", "0",
                    "--learning_rate", "1e-3", "--workdir", work, "--master_port", str(free_port())]
                   + (["--resume", "auto"] if resume else []) + TINY + list(extra), timeout=600)
        return work, proc

    def same(self, actual, expected, label, fraction=1e-5):
        problems = weight_problems(weights(actual), weights(expected), lr=1e-3, steps=4,
                                   update_fraction=fraction)
        self.assertEqual(problems, [], label)

    def test_sharded_gradients_take_the_replicated_steps_with_and_without_accumulation(self):
        with tempfile.TemporaryDirectory() as tmp:
            for world in (2, 4):
                for accumulation in ([], ["--gradient_accumulation_steps", "2"]):
                    label = f"world {world}{' accumulating' if accumulation else ''}"
                    replicated, _ = self.train(tmp, f"r{world}{len(accumulation)}", world, 0, extra=accumulation)
                    sharded, proc = self.train(tmp, f"z{world}{len(accumulation)}", world, 2, extra=accumulation)
                    self.same(sharded, replicated, label)
                    stage, mine, full, _, shards = STATE.search(proc.stderr).groups()
                    self.assertEqual((stage, shards), ("2", str(world)), proc.stderr)
                    self.assertLessEqual(int(mine), int(full) / world + 2 * 4 * 64)  # 1/N, plus padding

    def test_sharded_gradients_inside_tensor_parallelism_and_pipeline_stages(self):
        with tempfile.TemporaryDirectory() as tmp:
            for name, layout in (("t2", ["--tensor_parallel_size", "2"]),
                                 ("p2", ["--pipeline_parallel_size", "2", "--n_chunk", "2"])):
                accumulation = ["--gradient_accumulation_steps", "2"]
                replicated, _ = self.train(tmp, name + "_0", 4, 0, extra=layout + accumulation)
                sharded, _ = self.train(tmp, name + "_2", 4, 2, extra=layout + accumulation)
                self.same(sharded, replicated, name + ": ZeRO-2 accumulating against unsharded")

    def test_gradients_and_checkpoints_across_stages(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            def gradients(name, extra):
                grads = os.path.join(tmp, name)
                run([DP, "--pytest", "--grad_dir", grads, "--batch_size", "16", "--dropout", "0", "--world_size", "2",
                     "--workdir", os.path.join(tmp, name + "_work"), "--master_port", str(free_port())] + TINY + extra)
                return torch.load(os.path.join(grads, "model0_gradients.pth"))
            plain = gradients("plain", [])
            for extra in (["--zero_stage", "2"], ["--zero_stage", "2", "--gradient_accumulation_steps", "2"]):
                expected = plain if len(extra) == 2 else gradients("plain_acc", extra[2:])
                got = gradients("zero2" + str(len(extra)), extra)
                self.assertEqual(sorted(got), sorted(expected))
                self.assertEqual(gradient_problems(got, expected), [], str(extra))
            # The unsharded format: an epoch under one stage, the next under another, ends where
            # the replicated run does.
            replicated, _ = self.train(tmp, "replicated", 2, 0)
            for first, second in ((2, 0), (0, 2), (2, 1), (1, 2)):
                work, _ = self.train(tmp, f"mixed{first}{second}", 2, first, epochs=1)
                self.train(tmp, f"mixed{first}{second}", 2, second, epochs=2, resume=True)
                self.same(work, replicated, f"stage {first} then {second}")

    def test_refusals_name_the_flags(self):
        for extra, needle in ((["--grad_sync", "naive"], "--zero_stage 2 reduce-scatters gradient buckets: it needs "
                                                         "--grad_sync bucketed"),
                              (["--allreduce", "ring"], "--zero_stage 2 reduce-scatters with the process group's"),
                              (["--zero_stage", "4"], "--zero_stage 4: expected 0, 1, 2 or 3")):
            proc = run([DP, "--world_size", "2", "--zero_stage", "2"] + extra + TINY, check=False)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn(needle, proc.stderr)


if __name__ == "__main__":
    unittest.main()
