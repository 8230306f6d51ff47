"""run_data_parallel --pipeline_parallel_size P: pipeline stages as processes, alone and inside data
parallelism. After three AdamW steps with dropout 0 the weights equal one device's (or, with D > 1,
the same run's data parallelism alone) for GPipe, 1F1B and interleaved schedules, whose sends and
receives cross; the tied embedding stays one tensor; --pytest's gradients are the whole model's;
the printed lines are SPEC's, from the last stage only, also when torchrun starts the stages; bad
layouts are refused before launch; a killed stage ends the run promptly, naming it, and
--max_restarts resumes it bit for bit. gpt2-tiny
(2 blocks) and gpt2-mini (4 blocks), a few batches, at most 4 processes."""
import os
import re
import signal
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from after_adamw import gradient_problems, weight_problems  # noqa: E402
from test_checkpoints import (DP, TINY as CHECKPOINTED, TORCHRUN, Watched, environ_of, free_port,  # noqa: E402
                              resume_without_learning, run, saved_step_at_least, weights)
from fault_injection import descendants  # noqa: E402  (scripts/, on the path test_checkpoints sets)

NUMBER = r"(-?\d+(?:\.\d+)?)"
DP_TRAIN = re.compile(rf"^Epoch (\d+) on Rank (\d+): Training Time = {NUMBER}, Tokens_per_sec = {NUMBER}$")
DP_LOSS = re.compile(rf"^Epoch (\d+) on Rank (\d+): Validation Loss = {NUMBER}$")

LR, STEPS = 1e-3, 3
COMMON = ["--batch_size", "8", "--n_epochs", "1", "--max_batches", str(STEPS), "--threads_per_device", "1",
          "--dropout", "0", "--model_max_length", "40", "--learning_rate", str(LR), "--train_size", "48",
          "--validation_size", "8", "--test_size", "2", "--no_progress"]


def train(tmp, name, model, world, extra=(), benchmark_only=True):
    work = os.path.join(tmp, name)
    args = [DP, "--world_size", str(world), "--master_port", str(free_port()), "--workdir", work,
            "--model", model] + COMMON + list(extra) + (["--benchmark_only"] if benchmark_only else [])
    return work, run(args, timeout=600)


class EqualToOneDevice(unittest.TestCase):
    def check_same(self, expected_dir, actual_dir, label):
        problems = weight_problems(weights(actual_dir), weights(expected_dir), LR, STEPS)
        self.assertEqual(problems, [], label)

    def test_two_stages_through_every_schedule_train_like_one_device(self):
        with tempfile.TemporaryDirectory() as tmp:
            one, _ = train(tmp, "one", "gpt2-tiny", 1)
            for schedule in ("gpipe", "1f1b"):
                staged, proc = train(tmp, schedule, "gpt2-tiny", 2,
                                     ["--pipeline_parallel_size", "2", "--pipeline_schedule", schedule, "--n_chunk", "4"])
                self.assertIn("pipeline_parallel_size=2", proc.stderr)
                self.check_same(one, staged, schedule)
                # Stage 1 reports, as data-parallel rank 0; stage 0 prints no epoch line.
                self.assertEqual([m[2] for m in (DP_TRAIN.match(l) for l in proc.stdout.splitlines()) if m], ["0"])

    def test_interleaved_and_four_stages_train_like_one_device(self):
        with tempfile.TemporaryDirectory() as tmp:
            one, _ = train(tmp, "one", "gpt2-mini", 1)
            interleaved, _ = train(tmp, "interleaved", "gpt2-mini", 2,
                                   ["--pipeline_parallel_size", "2", "--pipeline_schedule", "interleaved",
                                    "--virtual_stages", "2", "--n_chunk", "4"])
            self.check_same(one, interleaved, "interleaved V=2")
            four, proc = train(tmp, "four", "gpt2-mini", 4, ["--pipeline_parallel_size", "4", "--n_chunk", "4"])
            self.assertIn("stages=4 balance=1,1,1.5,0.5 (default, by cost)", proc.stderr)
            # Stage 0 keeps only its own weights (wte, wpe and one block of four) while it trains.
            total, held = map(int, re.search(r"\((\d+) parameters, (\d+) held on rank 0\)", proc.stderr).groups())
            self.assertLess(held, total * 0.75)
            self.check_same(one, four, "(1,1,4) 1f1b")

    def test_data_parallel_over_two_stage_pipelines_trains_like_data_parallel_alone(self):
        with tempfile.TemporaryDirectory() as tmp:
            plain, _ = train(tmp, "dp2", "gpt2-tiny", 2)
            staged, proc = train(tmp, "dp2pp2", "gpt2-tiny", 4, ["--pipeline_parallel_size", "2", "--n_chunk", "2"])
            self.check_same(plain, staged, "(2,1,2)")
            self.assertEqual(sorted(m[2] for m in (DP_TRAIN.match(l) for l in proc.stdout.splitlines()) if m), ["0", "1"])

    def test_tensor_parallel_stages_alone_and_inside_data_parallelism_train_like_one_device_and_dp(self):
        with tempfile.TemporaryDirectory() as tmp:
            one, _ = train(tmp, "one", "gpt2-tiny", 1)
            t2p2, _ = train(tmp, "t2p2", "gpt2-tiny", 4,
                            ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2", "--n_chunk", "4"])
            self.check_same(one, t2p2, "(1,2,2)")
            plain, _ = train(tmp, "dp2", "gpt2-tiny", 2)
            d2t2p2, proc = train(tmp, "d2t2p2", "gpt2-tiny", 8,
                                 ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2", "--n_chunk", "2"])
            self.check_same(plain, d2t2p2, "(2,2,2)")
            # The last stage's tensor rank 0 of each replica reports, as its data-parallel rank.
            self.assertEqual(sorted(m[2] for m in (DP_TRAIN.match(l) for l in proc.stdout.splitlines()) if m), ["0", "1"])

    def test_clipping_by_the_global_norm_sums_the_stages_and_counts_the_tied_wte_once(self):
        import json
        def norms(work):
            with open(os.path.join(work, "metrics.jsonl")) as f:
                return [r["grad_norm"] for r in map(json.loads, f) if r["kind"] == "train"]
        clip = ["--max_grad_norm", "0.5"]  # below every step's norm: each step is clipped
        with tempfile.TemporaryDirectory() as tmp:
            one, _ = train(tmp, "one", "gpt2-tiny", 1, clip)
            expected = norms(one)
            self.assertEqual(len(expected), STEPS)
            self.assertTrue(all(n > 0.5 for n in expected), expected)
            for name, world, layout in (("p2", 2, ["--pipeline_parallel_size", "2"]),
                                        ("t2p2", 4, ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2"])):
                staged, _ = train(tmp, name, "gpt2-tiny", world, layout + clip)
                for k, (a, b) in enumerate(zip(norms(staged), expected)):
                    self.assertLess(abs(a - b), 1e-6 * b, f"{name}: the norm of step {k + 1}")
                self.check_same(one, staged, name + " clipped")

    def test_evaluation_and_the_saved_model_equal_one_device_and_keep_one_wte(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            one, proc_one = train(tmp, "one", "gpt2-tiny", 1, benchmark_only=False)
            staged, proc = train(tmp, "staged", "gpt2-tiny", 2, ["--pipeline_parallel_size", "2"], benchmark_only=False)
            saved = weights(staged)
            self.assertIn("transformer.wte.weight", saved)
            self.assertFalse([k for k in saved if "lm_head" in k], "the tied head is saved once, as wte")
            self.check_same(one, staged, "saved model")
            loss_one = [float(m[3]) for m in (DP_LOSS.match(l) for l in proc_one.stdout.splitlines()) if m]
            loss = [float(m[3]) for m in (DP_LOSS.match(l) for l in proc.stdout.splitlines()) if m]
            self.assertEqual(len(loss), 1, proc.stdout)
            self.assertAlmostEqual(loss[0], loss_one[0], delta=1e-4 * abs(loss_one[0]))

    def test_evaluation_through_the_stages_gives_one_devices_loss_generations_and_bleu(self):
        import json
        # A checkpoint trained a little on one device, resumed at learning rate 0 in every layout:
        # the same weights everywhere, so the loss must agree to rounding and greedy generation
        # (each stage keeping its own layers' KV cache, a block cut between its halves included)
        # token for token.
        with tempfile.TemporaryDirectory() as tmp:
            src, _ = train(tmp, "src", "gpt2-tiny", 1, ["--learning_rate", "3e-2"])
            checkpoint = os.path.join(src, "checkpoints", "step-%08d" % STEPS)
            still = ["--resume", checkpoint, "--learning_rate", "0", "--n_epochs", "2"]
            def evaluated(name, world, layout):
                work, proc = train(tmp, name, "gpt2-tiny", world, layout + still, benchmark_only=False)
                with open(os.path.join(work, "rank0_gen_epoch1.json")) as f:
                    generations = [item["gen"] for item in json.load(f)]
                losses = [float(m[3]) for m in (DP_LOSS.match(l) for l in proc.stdout.splitlines()) if m]
                self.assertEqual(len(losses), 1, proc.stdout)
                return losses[0], generations
            loss_one, generations_one = evaluated("one", 1, [])
            self.assertTrue(any(generations_one), generations_one)
            for name, world, layout in (("p2", 2, ["--pipeline_parallel_size", "2"]),
                                        ("p2cut", 2, ["--pipeline_parallel_size", "2", "--balance", "1.5,0.5"]),
                                        ("t2p2", 4, ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2"])):
                loss, generations = evaluated(name, world, layout)
                self.assertAlmostEqual(loss, loss_one, delta=1e-5 * abs(loss_one), msg=name)
                self.assertEqual(generations, generations_one, name)

    def test_pytest_gradients_are_the_whole_models_with_the_tied_embeddings_summed(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            def gradients(name, world, extra):
                grads = os.path.join(tmp, name + "_grads")
                run([DP, "--pytest", "--grad_dir", grads, "--world_size", str(world), "--master_port", str(free_port()),
                     "--workdir", os.path.join(tmp, name), "--model", "gpt2-tiny"] + COMMON + extra, timeout=600)
                return [torch.load(os.path.join(grads, f"model{r}_gradients.pth")) for r in range(world)]
            (one,) = gradients("one", 1, [])
            staged = gradients("staged", 2, ["--pipeline_parallel_size", "2"])
            for rank, got in enumerate(staged):
                self.assertEqual(sorted(got), sorted(one), f"rank {rank}")
                self.assertEqual(gradient_problems(got, one), [], f"rank {rank}")


class Refused(unittest.TestCase):
    def refused(self, extra, *needles):
        with tempfile.TemporaryDirectory() as tmp:
            proc = run([DP, "--workdir", os.path.join(tmp, "w"), "--model", "gpt2-tiny"] + COMMON + extra, check=False)
            self.assertNotEqual(proc.returncode, 0)
            for needle in needles:
                self.assertIn(needle, proc.stderr)
            self.assertNotIn("Epoch", proc.stdout)

    def test_bad_layouts_and_flags_are_refused_before_launch_naming_the_flags(self):
        self.refused(["--world_size", "3", "--pipeline_parallel_size", "2"], "--world_size 3", "--pipeline_parallel_size 2")
        self.refused(["--world_size", "2", "--pipeline_parallel_size", "4"], "--pipeline_parallel_size 4")
        # gpt2-tiny's 2 blocks are 4 halves: 4 stages take one each (the default split), 8 cannot.
        self.refused(["--world_size", "8", "--pipeline_parallel_size", "8"], "8 stages", "4 block halves")
        self.refused(["--world_size", "2", "--pipeline_parallel_size", "2", "--pipeline_schedule", "zigzag"],
                     "--pipeline_schedule", "zigzag")
        self.refused(["--world_size", "2", "--pipeline_parallel_size", "2", "--n_chunk", "9"], "--n_chunk 9")
        self.refused(["--world_size", "2", "--pipeline_parallel_size", "2", "--balance", "2,1"], "balance")
        self.refused(["--world_size", "8", "--pipeline_parallel_size", "2", "--tensor_parallel_size", "3"],
                     "--tensor_parallel_size 3")


class Resharding(unittest.TestCase):
    """Checkpoints are unsplit state whatever the layout: each resumes under any other. With
    --learning_rate 0 the resumed run must end with exactly the checkpoint's weights."""

    def test_a_checkpoint_reshards_along_2_1_2_then_1_2_1_then_4_1_1_then_2_2_2(self):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "src")
            run([DP, "--world_size", "4", "--pipeline_parallel_size", "2", "--master_port", str(free_port()),
                 "--workdir", src] + CHECKPOINTED + ["--n_epochs", "1"], timeout=600)
            checkpoint = os.path.join(src, "checkpoints", "step-00000004")
            checkpoint = resume_without_learning(self, ["--world_size", "2", "--tensor_parallel_size", "2"],
                                                 checkpoint, tmp, "t2", epochs=2)
            checkpoint = resume_without_learning(self, ["--world_size", "4"], checkpoint, tmp, "d4", epochs=3)
            resume_without_learning(self, ["--world_size", "8", "--tensor_parallel_size", "2",
                                    "--pipeline_parallel_size", "2"], checkpoint, tmp, "d2t2p2", epochs=4)

    def test_a_stage_checkpoint_resumed_on_one_rank_continues_like_the_stages(self):
        with tempfile.TemporaryDirectory() as tmp:
            stages = ["--world_size", "2", "--pipeline_parallel_size", "2"]
            nodrop = ["--dropout", "0"]
            plain = os.path.join(tmp, "plain")
            run([DP, "--master_port", str(free_port()), "--workdir", plain] + stages + CHECKPOINTED + nodrop, timeout=600)
            work = os.path.join(tmp, "w")
            run([DP, "--master_port", str(free_port()), "--workdir", work] + stages + CHECKPOINTED + nodrop +
                ["--n_epochs", "1"], timeout=600)
            # One data-parallel rank either way, so the same batches: weights and AdamW state carry
            # over and the second epoch ends where the stages' did, up to rounding.
            proc = run([DP, "--world_size", "1", "--master_port", str(free_port()), "--workdir", work,
                        "--resume", "auto"] + CHECKPOINTED + nodrop, timeout=600)
            self.assertIn("continuing from", proc.stderr)
            self.assertEqual(weight_problems(weights(work), weights(plain), lr=3e-3, steps=8), [])


class KilledStage(unittest.TestCase):
    STAGES = ["--world_size", "2", "--pipeline_parallel_size", "2"]

    def signal_stage(self, args, rank, signum, after_step):
        """Runs `args`, sends `signum` to the worker of `rank` once step `after_step` is saved, and
        returns (exit code, stderr lines, seconds from the signal to the end)."""
        watched = Watched(args)
        try:
            watched.wait_for(saved_step_at_least(after_step))
            workers = [p for p in descendants(watched.proc.pid) if environ_of(p).get(b"RANK") == str(rank).encode()]
            self.assertTrue(workers, f"no rank {rank} worker found")
            start = time.time()
            os.kill(workers[0], signum)
            code = watched.finish(timeout=120)
        finally:
            if watched.proc.poll() is None:
                watched.kill_all()
        return code, watched.err, time.time() - start

    def test_a_killed_stage_ends_the_run_promptly_naming_it(self):
        with tempfile.TemporaryDirectory() as tmp:
            code, err, seconds = self.signal_stage(
                [DP, "--master_port", str(free_port()), "--workdir", os.path.join(tmp, "w")] + self.STAGES +
                CHECKPOINTED + ["--n_epochs", "50"], 0, signal.SIGKILL, 2)
            self.assertNotEqual(code, 0)
            self.assertLess(seconds, 30)
            self.assertTrue(any("rank 0" in l and "SIGKILL" in l for l in err), "\n".join(err[-20:]))

    def test_a_stage_that_stops_answering_is_named(self):
        with tempfile.TemporaryDirectory() as tmp:
            code, err, _ = self.signal_stage(
                [DP, "--master_port", str(free_port()), "--workdir", os.path.join(tmp, "w"), "--dist_timeout_s", "4"] +
                self.STAGES + CHECKPOINTED + ["--n_epochs", "50"], 1, signal.SIGSTOP, 2)
            self.assertNotEqual(code, 0)
            self.assertTrue(any("rank 1 was stopped by SIGSTOP" in l for l in err), "\n".join(err[-20:]))
            self.assertTrue(any("got no answer from pipeline rank 1" in l for l in err), "\n".join(err[-20:]))

    def test_max_restarts_after_a_killed_stage_ends_bit_identical(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            plain = os.path.join(tmp, "plain")
            run([DP, "--master_port", str(free_port()), "--workdir", plain] + self.STAGES + CHECKPOINTED, timeout=600)
            work = os.path.join(tmp, "w")
            code, err, _ = self.signal_stage(
                [DP, "--master_port", str(free_port()), "--workdir", work, "--max_restarts", "1"] + self.STAGES +
                CHECKPOINTED, 1, signal.SIGKILL, 3)
            self.assertEqual(code, 0, "\n".join(err[-30:]))
            a, b = weights(plain), weights(work)
            for key in a:
                self.assertTrue(torch.equal(a[key], b[key]), key)


class UnderTorchrun(unittest.TestCase):
    """torchrun starts the ranks (RANK, WORLD_SIZE and the store from its agent) instead of the
    program's own launcher: the stages find their pipeline, data-parallel and embedding groups the
    same way, so the run is the program's own, line for line and weight for weight."""

    def test_torchrun_trains_two_replicas_of_two_stages_like_the_programs_own_launch(self):
        torch = __import__("torch")
        layout = ["--pipeline_parallel_size", "2", "--n_chunk", "2"]
        with tempfile.TemporaryDirectory() as tmp:
            own, own_proc = train(tmp, "own", "gpt2-tiny", 4, layout, benchmark_only=False)
            work = os.path.join(tmp, "torchrun")
            # torchrun's agent keeps a torchelastic_* folder in TMPDIR: the test's own, removed with it.
            proc = run([TORCHRUN, "--nnodes", "1", "--nproc_per_node", "4", "--master_port", str(free_port()),
                        "--no-python", DP, "--workdir", work, "--model", "gpt2-tiny"] + COMMON + layout, timeout=600,
                       env=dict(os.environ, TMPDIR=tmp))
            self.assertIn("world_size=4", proc.stderr)
            self.assertIn("pipeline_parallel_size=2 data_parallel_size=2", proc.stderr)

            def spec_lines(stdout):
                lines = stdout.splitlines()
                trained = sorted(m[2] for m in (DP_TRAIN.match(l) for l in lines) if m)
                losses = sorted((m[2], m[3]) for m in (DP_LOSS.match(l) for l in lines) if m)
                return trained, losses
            trained, losses = spec_lines(proc.stdout)
            # Each replica's last stage reports, as its data-parallel rank: one epoch line and one loss.
            self.assertEqual(trained, ["0", "1"], proc.stdout)
            self.assertEqual([rank for rank, _ in losses], ["0", "1"], proc.stdout)
            self.assertEqual(losses, spec_lines(own_proc.stdout)[1])
            a, b = weights(own), weights(work)
            self.assertEqual(sorted(a), sorted(b))
            for key in a:
                self.assertTrue(torch.equal(a[key], b[key]), key)


if __name__ == "__main__":
    unittest.main(verbosity=2)
