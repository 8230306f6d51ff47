"""run_data_parallel --zero_stage 3: each data-parallel rank stores 1/N of every unit (GPT-2's
blocks, and the embeddings with ln_f and the tied head) with its gradient and AdamW moments; a
unit is all-gathered right before its forward and again before its backward, and let go after.
After 4 AdamW steps with dropout 0 the weights equal the replicated run's (only the order of sums
differs: 1e-5 of the update), on 2 and 4 ranks, with and without accumulation, the tied wte
included; --pytest's gradients are the replicated run's; at most the prefetch window plus the
unit computing is gathered at once; checkpoints keep the unsharded format and resume across
stages; inside tensor parallelism each rank's slices are sharded over its data-parallel group, with
the same steps; under bf16 autocast with bf16 reductions stages 2 and 3 take the replicated bf16
run's steps; pipeline parallelism is refused with the reason. gpt2-tiny, a few batches, at most 4
processes."""
import os
import re
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from after_adamw import gradient_problems, weight_problems  # noqa: E402
from test_programs import DP, TINY, free_port, run  # noqa: E402
import test_zero2 as zero2  # noqa: E402
from test_zero2 import weights  # noqa: E402

HELD = re.compile(r"--zero_stage 3 held at most (\d+) bytes of gathered parameters at once while training on rank 0 "
                  r"\(largest unit (\d+) bytes, --zero_prefetch (\d+)\)")
STATE = re.compile(r"--zero_stage 3 keeps (\d+) bytes of AdamW state on rank 0 \(replicated: (\d+) on every rank\), "
                   r"and 1/(\d+) of the gradients and of the parameters")


class ZeroStageThree(unittest.TestCase):
    train = zero2.ZeroStageTwo.train  # the same runs and the same comparison as stage 2's tests
    same = zero2.ZeroStageTwo.same

    def test_sharded_parameters_take_the_replicated_steps_with_and_without_accumulation(self):
        with tempfile.TemporaryDirectory() as tmp:
            for world in (2, 4):
                for accumulation in ([], ["--gradient_accumulation_steps", "2"]):
                    label = f"world {world}{' accumulating' if accumulation else ''}"
                    replicated, _ = self.train(tmp, f"r{world}{len(accumulation)}", world, 0, extra=accumulation)
                    sharded, proc = self.train(tmp, f"z{world}{len(accumulation)}", world, 3, extra=accumulation)
                    self.same(sharded, replicated, label)
                    self.assertIn("transformer.wte.weight", weights(sharded))
                    self.assertFalse([k for k in weights(sharded) if "lm_head" in k], "the tied head is saved once")
                    mine, full, shards = map(int, STATE.search(proc.stderr).groups())
                    self.assertEqual(shards, world)
                    self.assertLessEqual(mine, full / world + 2 * 4 * world * 3)  # 1/N, plus each unit's padding

    def test_sharded_parameters_inside_tensor_parallelism(self):
        # Each tensor-parallel rank's slices of every unit are sharded over its data-parallel group:
        # the steps are the replicated run's, and a checkpoint (unsplit) resumes without either.
        layout, accumulation = ["--tensor_parallel_size", "2"], ["--gradient_accumulation_steps", "2"]
        with tempfile.TemporaryDirectory() as tmp:
            replicated, _ = self.train(tmp, "t2_0", 4, 0, extra=layout + accumulation)
            sharded, proc = self.train(tmp, "t2_3", 4, 3, extra=layout + accumulation)
            self.same(sharded, replicated, "data 2 x tensor 2, ZeRO-3")
            mine, full, shards = map(int, STATE.search(proc.stderr).groups())
            self.assertEqual(shards, 2)
            self.assertLessEqual(mine, full / 2 + 2 * 4 * 2 * 3)
            self.assertFalse([k for k in weights(sharded) if "lm_head" in k], "the tied head is saved once")
            work, _ = self.train(tmp, "t2_then_plain", 4, 3, epochs=1, extra=layout + accumulation)
            self.train(tmp, "t2_then_plain", 2, 0, epochs=2, resume=True, extra=accumulation)
            self.same(work, replicated, "ZeRO-3 under tensor parallelism, then replicated")

    def test_bf16_autocast_and_bf16_reductions_take_the_replicated_bf16_steps(self):
        # bf16 products and bf16 gradients on the wire, as the replicated run with the same flags:
        # both sharded stages agree with it to 1e-3 of the update (the reductions round in other
        # orders), where the fp32 run is some 6e-2 from it; held to 1e-2.
        bf16 = ["--precision", "bf16", "--grad_reduce_dtype", "bf16"]
        with tempfile.TemporaryDirectory() as tmp:
            replicated, _ = self.train(tmp, "bf16_0", 2, 0, extra=bf16)
            fp32, _ = self.train(tmp, "fp32_0", 2, 0)
            self.assertNotEqual(weight_problems(weights(fp32), weights(replicated), lr=1e-3, steps=4,
                                                update_fraction=1e-2), [],
                                "the bf16 run trains apart from the fp32 one by more than the tolerance")
            for stage in (2, 3):
                sharded, _ = self.train(tmp, f"bf16_{stage}", 2, stage, extra=bf16)
                self.same(sharded, replicated, f"--zero_stage {stage}, bf16", fraction=1e-2)

    def test_at_most_the_prefetch_window_and_the_unit_computing_are_gathered(self):
        with tempfile.TemporaryDirectory() as tmp:
            for prefetch in (0, 1, 2):
                _, proc = self.train(tmp, f"p{prefetch}", 2, 3, epochs=1, extra=["--zero_prefetch", str(prefetch)])
                held, largest, said = map(int, HELD.search(proc.stderr).groups())
                self.assertEqual(said, prefetch)
                self.assertGreater(held, 0)
                self.assertLessEqual(held, (prefetch + 1) * largest, f"--zero_prefetch {prefetch}")
            # gpt2-tiny's model state is ~0.7 MB a copy: a run gathering everything at once would hold
            # the whole model (3 units), above one unit plus nothing ahead.
            self.assertLess(held, 3 * largest + 1)

    def test_gradients_and_checkpoints_across_stages(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            def gradients(name, extra):
                grads = os.path.join(tmp, name)
                run([DP, "--pytest", "--grad_dir", grads, "--batch_size", "16", "--dropout", "0", "--world_size", "2",
                     "--workdir", os.path.join(tmp, name + "_work"), "--master_port", str(free_port())] + TINY + extra)
                return [torch.load(os.path.join(grads, f"model{r}_gradients.pth")) for r in range(2)]
            plain = gradients("plain", [])
            for rank, got in enumerate(gradients("zero3", ["--zero_stage", "3"])):
                self.assertEqual(sorted(got), sorted(plain[rank]))
                self.assertEqual(gradient_problems(got, plain[rank]), [], f"rank {rank}")
            replicated, _ = self.train(tmp, "replicated", 2, 0)
            for first, second in ((3, 0), (0, 3), (3, 2), (1, 3)):
                work, _ = self.train(tmp, f"mixed{first}{second}", 2, first, epochs=1)
                self.train(tmp, f"mixed{first}{second}", 2, second, epochs=2, resume=True)
                self.same(work, replicated, f"stage {first} then {second}")

    def test_evaluation_gathers_the_model_and_prints_the_replicated_loss(self):
        loss = re.compile(r"^Epoch 0 on Rank 0: Validation Loss = (-?\d+(?:\.\d+)?)$", re.M)
        with tempfile.TemporaryDirectory() as tmp:
            plain = run([DP, "--world_size", "2", "--batch_size", "16", "--max_batches", "2", "--n_epochs", "1",
                         "--dropout", "0", "--workdir", os.path.join(tmp, "plain"), "--master_port", str(free_port())]
                        + TINY, timeout=600)
            sharded = run([DP, "--world_size", "2", "--zero_stage", "3", "--batch_size", "16", "--max_batches", "2",
                           "--n_epochs", "1", "--dropout", "0", "--workdir", os.path.join(tmp, "sharded"),
                           "--master_port", str(free_port())] + TINY, timeout=600)
            want, got = float(loss.search(plain.stdout)[1]), float(loss.search(sharded.stdout)[1])
            self.assertAlmostEqual(got, want, delta=1e-4 * abs(want))

    def test_refusals_name_the_reason(self):
        # (Inside pipeline stages it runs: test_pipeline_zero.py.)
        for extra, needle in ((["--zero_prefetch", "-1"], "--zero_prefetch -1"),
                              (["--grad_sync", "naive"], "it needs --grad_sync bucketed, not naive")):
            proc = run([DP, "--world_size", "2", "--zero_stage", "3"] + extra + TINY, check=False)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn(needle, proc.stderr)
            self.assertNotIn("Epoch", proc.stdout)


if __name__ == "__main__":
    unittest.main()
