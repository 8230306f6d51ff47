"""The controls of a real training run, end to end through the programs: each step's learning rate
in metrics.jsonl against transformers' schedules, --max_steps and --eval_every with their printed
lines and records, a run killed and resumed continuing the schedule exactly, and --max_grad_norm's
global norm in every layout (data, tensor and ZeRO-1 parallel, pipeline stages as processes, the
in-process pipeline and model parallel) against one device and against torch.nn.utils.clip_grad_norm_. Uses gpt2-tiny and a few
batches so that each run takes seconds."""
import json
import math
import os
import re
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_checkpoints as ck  # noqa: E402  Watched (a program killed with -9 at a printed line), run
from after_adamw import weight_problems  # noqa: E402  weights of two runs compared as AdamW guarantees

DP, PP = ck.DP, ck.PP
NUMBER = r"(-?\d+(?:\.\d+)?)"
STEP_LOSS = re.compile(rf"^Step (\d+)(?: on Rank (\d+))?: Validation Loss = {NUMBER}$")
EPOCH_TRAIN = re.compile(rf"^Epoch (\d+)(?: on Rank (\d+))?: Training Time = {NUMBER}, Tokens_per_sec = {NUMBER}$")
TRAIN_FIELDS = ["kind", "step", "epoch", "loss", "learning_rate", "grad_norm", "tokens", "tokens_per_sec",
                "step_time", "peak_memory_bytes"]

TINY = ["--model", "gpt2-tiny", "--model_max_length", "40", "--train_size", "64", "--validation_size", "16",
        "--test_size", "4", "--no_progress", "--dropout", "0", "--benchmark_only"]


def records(work, kind):
    with open(os.path.join(work, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def transformers_rates(schedule, peak, warmup, total):
    import torch
    import transformers
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([p], lr=peak)
    function = {"cosine": transformers.get_cosine_schedule_with_warmup,
                "linear": transformers.get_linear_schedule_with_warmup}[schedule]
    scheduler = function(optimizer, warmup, total)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


class Schedules(unittest.TestCase):
    def test_each_steps_rate_is_transformers_and_max_steps_and_eval_every_end_and_evaluate_the_run(self):
        with tempfile.TemporaryDirectory() as tmp:
            # 64 pairs in batches of 8: 8 steps an epoch; 2 epochs = 16 steps, unless --max_steps.
            for schedule, extra, total in (("cosine", [], 16), ("linear", ["--max_steps", "11"], 11)):
                work = os.path.join(tmp, schedule)
                proc = ck.run([PP, "--workdir", work, "--batch_size", "8", "--n_epochs", "2", "--learning_rate", "1e-3",
                               "--lr_schedule", schedule, "--warmup_steps", "3", "--eval_every", "4"] + TINY + extra)
                train = records(work, "train")
                self.assertEqual([r["step"] for r in train], list(range(1, total + 1)))
                self.assertEqual(list(train[0]), TRAIN_FIELDS)
                self.assertEqual([r["learning_rate"] for r in train], transformers_rates(schedule, 1e-3, 3, total))
                self.assertEqual([r["epoch"] for r in train], [s // 8 for s in range(total)])
                for r in train:
                    self.assertGreater(r["grad_norm"], 0.0)
                    self.assertEqual(r["tokens"], 8 * 40)
                    self.assertGreater(r["tokens_per_sec"], 0.0)
                    self.assertGreater(r["step_time"], 0.0)
                    self.assertGreater(r["peak_memory_bytes"], 0)
                # Evaluations every 4 steps, printed and logged alike.
                printed = {int(m[1]): m[3] for m in map(STEP_LOSS.match, proc.stdout.splitlines()) if m}
                self.assertEqual(sorted(printed), list(range(4, total + 1, 4)))
                logged = {r["step"]: r["validation_loss"] for r in records(work, "eval")}
                self.assertEqual(set(logged), set(printed))
                for step, loss in printed.items():
                    self.assertAlmostEqual(float(loss), logged[step], places=12)
                # --max_steps 11 ends inside the second epoch, whose line is still printed.
                self.assertEqual(len([m for m in map(EPOCH_TRAIN.match, proc.stdout.splitlines()) if m]), 2)

    def test_a_floor_lifts_the_decay_and_the_data_parallel_lines_name_the_rank(self):
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, "dp")
            proc = ck.run([DP, "--world_size", "2", "--workdir", work, "--batch_size", "16", "--n_epochs", "1",
                           "--learning_rate", "1e-3", "--lr_schedule", "linear", "--min_learning_rate", "1e-4",
                           "--eval_every", "2", "--master_port", str(ck.free_port())] + TINY)
            train = records(work, "train")
            self.assertEqual(len(train), 4)  # 32 pairs a rank in per-rank batches of 8
            self.assertEqual([r["learning_rate"] for r in train],
                             [1e-4 + (1e-3 - 1e-4) * ((4 - k) / 4) for k in range(4)])
            printed = sorted((int(m[1]), int(m[2])) for m in map(STEP_LOSS.match, proc.stdout.splitlines()) if m)
            self.assertEqual(printed, [(2, 0), (2, 1), (4, 0), (4, 1)])
            self.assertEqual([r["step"] for r in records(work, "eval")], [2, 4])  # rank 0's

    def test_bad_values_are_refused_before_training_naming_the_flag(self):
        for extra, message in ((["--lr_schedule", "step"], "--lr_schedule step"),
                               (["--warmup_steps", "-1"], "--warmup_steps"),
                               (["--min_learning_rate", "1"], "--min_learning_rate 1"),
                               (["--max_grad_norm", "-0.5"], "--max_grad_norm must be >= 0, got -0.5"),
                               (["--weight_decay", "-1"], "--weight_decay"),
                               (["--max_steps", "-2"], "--max_steps"),
                               (["--eval_every", "-1"], "--eval_every")):
            for program in (PP, DP):
                proc = ck.run([program] + TINY + extra, check=False)
                self.assertNotEqual(proc.returncode, 0, extra)
                self.assertIn(message, proc.stderr, extra)


class TensorBoardAndPlot(unittest.TestCase):
    def test_event_files_hold_the_logs_scalars_for_tensorboards_reader_and_the_plot_is_drawn(self):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        with tempfile.TemporaryDirectory() as tmp:
            work, board = os.path.join(tmp, "work"), os.path.join(tmp, "board")
            ck.run([PP, "--workdir", work, "--tensorboard_dir", board, "--batch_size", "8", "--n_epochs", "1",
                    "--lr_schedule", "cosine", "--warmup_steps", "2", "--eval_every", "3"] + TINY)
            events = EventAccumulator(board)
            events.Reload()
            tags = set(events.Tags()["scalars"])
            self.assertEqual(tags, {"train/" + f for f in TRAIN_FIELDS[2:]} | {"eval/validation_loss"})
            train = records(work, "train")
            for field in ("loss", "learning_rate", "grad_norm", "tokens_per_sec", "peak_memory_bytes"):
                points = events.Scalars("train/" + field)
                self.assertEqual([p.step for p in points], [r["step"] for r in train], field)
                for p, r in zip(points, train):
                    self.assertAlmostEqual(p.value, r[field], delta=1e-6 * max(1.0, abs(r[field])), msg=field)
            evals = events.Scalars("eval/validation_loss")
            self.assertEqual([(p.step, round(p.value, 5)) for p in evals],
                             [(r["step"], round(r["validation_loss"], 5)) for r in records(work, "eval")])
            png = os.path.join(tmp, "curve.png")
            ck.run([sys.executable, os.path.join(ck.SOURCE, "scripts", "plot_metrics.py"),
                    os.path.join(work, "metrics.jsonl"), png])
            with open(png, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class ResumedSchedule(unittest.TestCase):
    def test_a_killed_run_resumed_takes_the_undisturbed_runs_rates_and_weights(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            # ck.TINY: 2 epochs of 4 steps, a checkpoint after each; killed after step 5.
            extra = ["--lr_schedule", "cosine", "--warmup_steps", "2", "--max_grad_norm", "0.5"]
            plain = os.path.join(tmp, "plain")
            ck.run([PP, "--workdir", plain] + ck.TINY + extra)
            work = os.path.join(tmp, "killed")
            watched = ck.Watched([PP, "--workdir", work] + ck.TINY + extra)
            try:
                watched.wait_for(ck.saved_step_at_least(5))
            finally:
                watched.kill_all()
            resumed = ck.run([PP, "--workdir", work, "--resume", "auto"] + ck.TINY + extra)
            self.assertRegex(resumed.stderr, r"resume: continuing from \S+ \(step [5-7],")
            a, b = records(plain, "train"), records(work, "train")
            self.assertEqual([r["step"] for r in b], list(range(1, 9)))  # each step once, killed or not
            for x, y in zip(a, b):
                self.assertEqual(x["learning_rate"], y["learning_rate"], x["step"])
                self.assertEqual(x["grad_norm"], y["grad_norm"], x["step"])
                self.assertEqual(x["loss"], y["loss"], x["step"])
            wa, wb = ck.weights(plain), ck.weights(work)
            for name in wa:
                self.assertTrue(torch.equal(wa[name], wb[name]), f"{name} differs after the resume")
            # A resume under another schedule says so.
            other = ck.run([PP, "--workdir", work, "--resume", "auto"] + ck.TINY + ["--lr_schedule", "linear"])
            self.assertIn("the learning-rate schedule differs (checkpoint: --lr_schedule cosine --learning_rate 0.003 "
                          "--warmup_steps 2", other.stderr)


    def test_a_run_ended_by_max_steps_inside_an_epoch_resumes_there_with_a_larger_budget(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            # ck.TINY without checkpoints every step: 2 epochs of 4 steps, constant rate.
            at = ck.TINY.index("--checkpoint_every")
            args = ck.TINY[:at] + ck.TINY[at + 2:]
            plain = os.path.join(tmp, "plain")
            undisturbed = ck.run([PP, "--workdir", plain] + args)
            work = os.path.join(tmp, "budget")
            first = ck.run([PP, "--workdir", work, "--max_steps", "6"] + args)
            self.assertRegex(first.stderr, r"checkpoint: saved \S+ \(step 6, epoch 1, batch 2,")
            self.assertEqual(len([m for m in map(EPOCH_TRAIN.match, first.stdout.splitlines()) if m]), 2)
            second = ck.run([PP, "--workdir", work, "--resume", "auto"] + args)
            self.assertRegex(second.stderr, r"resume: continuing from \S+ \(step 6, epoch 1, batch 2\)")
            self.assertEqual([r["step"] for r in records(work, "train")], list(range(1, 9)))
            # The finished epoch 1 is reported whole, as the undisturbed run reports it.
            lines = lambda out: [m[1] for m in map(EPOCH_TRAIN.match, out.splitlines()) if m]
            self.assertEqual(lines(second.stdout), ["1"])
            self.assertEqual(lines(undisturbed.stdout), ["0", "1"])
            wa, wb = ck.weights(plain), ck.weights(work)
            for name in wa:
                self.assertTrue(torch.equal(wa[name], wb[name]), f"{name} differs after the resume")


class AsyncCheckpoint(unittest.TestCase):
    def test_training_goes_on_during_a_write_and_a_kill_in_one_leaves_the_previous_checkpoint(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            # ck.TINY: 2 epochs of 4 steps, a checkpoint after each.
            plain = os.path.join(tmp, "plain")
            ck.run([PP, "--workdir", plain] + ck.TINY)
            work = os.path.join(tmp, "killed")
            env = dict(os.environ, HARNESS_TEST_CHECKPOINT_STALL_MS="3000")
            watched = ck.Watched([PP, "--workdir", work, "--async_checkpoint"] + ck.TINY, env=env)
            try:
                writing = lambda line: line.startswith("checkpoint: writing")
                watched.wait_for(writing)
                # While step 1's checkpoint is being written, step 2 trains (and is logged).
                deadline = time.time() + 2.5
                while time.time() < deadline and len(records(work, "train")) < 2:
                    time.sleep(0.05)
                self.assertGreaterEqual(len(records(work, "train")), 2)
                self.assertFalse(any(ck.SAVED.search(line) for line in watched.err), "\n".join(watched.err))
                # Step 2's copy waits for step 1's write; kill inside step 2's write.
                watched.wait_for(lambda line: sum(map(writing, watched.err)) >= 2 and writing(line))
            finally:
                watched.kill_all()
            saved = [m for m in map(ck.SAVED.search, watched.err) if m]
            self.assertEqual([int(m[2]) for m in saved], [1])
            resumed = ck.run([PP, "--workdir", work, "--resume", "auto", "--async_checkpoint"] + ck.TINY)
            self.assertRegex(resumed.stderr, r"resume: continuing from \S+ \(step 1,")
            a, b = ck.weights(plain), ck.weights(work)
            for name in a:
                self.assertTrue(torch.equal(a[name], b[name]), f"{name} differs after the resume")

    def test_every_multi_process_layout_writes_the_synchronous_runs_checkpoints(self):
        torch = __import__("torch")
        from safetensors.torch import load_file
        with tempfile.TemporaryDirectory() as tmp:
            for layout in (["--world_size", "2"], ["--world_size", "2", "--zero_stage", "1"],
                           ["--world_size", "2", "--tensor_parallel_size", "2"],
                           ["--world_size", "2", "--pipeline_parallel_size", "2"]):
                runs = {}
                for name, extra in (("sync", []), ("async", ["--async_checkpoint"])):
                    work = os.path.join(tmp, name + "_".join(layout))
                    proc = ck.run([DP, "--workdir", work, "--master_port", str(ck.free_port())] + layout + extra
                                  + ck.TINY)
                    runs[name] = work
                    self.assertEqual(len([m for m in map(ck.SAVED.search, proc.stderr.splitlines()) if m]), 8)
                last = lambda work: sorted(os.listdir(os.path.join(work, "checkpoints")))[-1]
                self.assertEqual(last(runs["sync"]), last(runs["async"]))
                for file in ("model.safetensors", "optimizer.safetensors"):
                    x = load_file(os.path.join(runs["sync"], "checkpoints", last(runs["sync"]), file))
                    y = load_file(os.path.join(runs["async"], "checkpoints", last(runs["async"]), file))
                    self.assertEqual(set(x), set(y), file)
                    for key in x:
                        self.assertTrue(torch.equal(x[key], y[key]), f"{layout} {file}: {key}")


class SlowSave(unittest.TestCase):
    def test_ranks_waiting_for_a_save_longer_than_the_collective_timeout_do_not_time_out(self):
        with tempfile.TemporaryDirectory() as tmp:
            # Each save stalls 3.5 s, the collectives may wait 2 s.
            env = dict(os.environ, HARNESS_TEST_CHECKPOINT_STALL_MS="3500")
            for extra in ([], ["--async_checkpoint"]):
                work = os.path.join(tmp, "slow" + "".join(extra))
                proc = ck.run([DP, "--world_size", "2", "--workdir", work, "--dist_timeout_s", "2",
                               "--batch_size", "16", "--max_batches", "2", "--n_epochs", "1", "--checkpoint_every", "1",
                               "--master_port", str(ck.free_port())] + TINY + extra, env=env)
                self.assertEqual([int(m[2]) for m in map(ck.SAVED.search, proc.stderr.splitlines()) if m], [1, 2])


class GlobalGradientNorm(unittest.TestCase):
    """Two steps of batch 16, clipped at 0.5 (the norms are near 3, so every step clips). In each
    layout the first step's norm is torch.nn.utils.clip_grad_norm_'s on that layout's averaged,
    unsplit gradients (its --pytest file); layouts that train the same examples (the same
    data-parallel size) measure the same norms at every step and end with the same weights.

    The same norms: to 1e-6 at the first step, whose gradients are of the same weights and differ
    by rounding alone; to 1e-5 after it, where the weights themselves differ by what AdamW makes
    of that rounding (tests/python/after_adamw.py: an element whose gradient is near zero moves by
    a sizeable fraction of lr either way), so the second step's gradients are of other weights.
    Measured: the tensor-parallel run's second norm is 1.05e-6 from one rank's on an Intel Xeon."""

    ARGS = ["--batch_size", "16", "--max_batches", "2", "--n_epochs", "1", "--learning_rate", "1e-3",
            "--max_grad_norm", "0.5"] + TINY

    def train(self, tmp, name, program, extra):
        work = os.path.join(tmp, name)
        ports = ["--master_port", str(ck.free_port())] if program == DP else []
        ck.run([program, "--workdir", work] + ports + self.ARGS + extra)
        return work

    def clip_grad_norm_of_first_step(self, tmp, name, extra):
        torch = __import__("torch")
        grads = os.path.join(tmp, name + "_grads")
        ck.run([DP, "--pytest", "--grad_dir", grads, "--workdir", os.path.join(tmp, name + "_pytest"),
                "--master_port", str(ck.free_port())] + self.ARGS + extra)
        leaves = []
        for g in torch.load(os.path.join(grads, "model0_gradients.pth")).values():
            leaf = torch.nn.Parameter(torch.zeros_like(g))
            leaf.grad = g.clone()
            leaves.append(leaf)
        return float(torch.nn.utils.clip_grad_norm_(leaves, 0.5))

    def assert_same_norms_and_weights(self, work, reference, label):
        norms = [r["grad_norm"] for r in records(work, "train")]
        expected = [r["grad_norm"] for r in records(reference, "train")]
        self.assertEqual(len(norms), len(expected), label)
        for k, (n, e) in enumerate(zip(norms, expected)):
            self.assertLess(abs(n - e), (1e-6 if k == 0 else 1e-5) * e, f"{label}: step {k + 1}: {n} against {e}")
        self.assertEqual(weight_problems(ck.weights(work), ck.weights(reference), lr=1e-3, steps=2), [],
                         label)

    def test_every_layout_measures_and_clips_by_one_devices_norm(self):
        with tempfile.TemporaryDirectory() as tmp:
            layouts = {"one rank": ["--world_size", "1"],
                       "data parallel": ["--world_size", "2"],
                       "tensor parallel": ["--world_size", "2", "--tensor_parallel_size", "2"],
                       "data x tensor parallel": ["--world_size", "4", "--tensor_parallel_size", "2"],
                       "ZeRO-1": ["--world_size", "2", "--zero_stage", "1"],
                       "pipeline stages": ["--world_size", "2", "--pipeline_parallel_size", "2"]}
            work = {}
            for name, extra in layouts.items():
                work[name] = self.train(tmp, name.replace(" ", "_"), DP, extra)
                train = records(work[name], "train")
                self.assertTrue(all(r["grad_norm"] > 0.5 for r in train), name)
                reference = self.clip_grad_norm_of_first_step(tmp, name.replace(" ", "_"), extra)
                self.assertLess(abs(train[0]["grad_norm"] - reference), 1e-6 * reference,
                                f"{name}: {train[0]['grad_norm']} against clip_grad_norm_'s {reference}")
            self.assert_same_norms_and_weights(work["tensor parallel"], work["one rank"], "tensor parallel")
            self.assert_same_norms_and_weights(work["data x tensor parallel"], work["data parallel"], "data x tensor")
            self.assert_same_norms_and_weights(work["ZeRO-1"], work["data parallel"], "ZeRO-1")
            self.assert_same_norms_and_weights(work["pipeline stages"], work["one rank"], "pipeline stages")
            # run_pipeline trains in order: its own single device is the reference.
            alone = self.train(tmp, "alone", PP, [])
            for name, extra in (("pipeline", ["--model_parallel_mode", "pipeline_parallel", "--devices", "cpu:0,cpu:1",
                                              "--n_chunk", "2", "--threads_per_device", "1"]),
                                ("model parallel", ["--model_parallel_mode", "model_parallel", "--devices", "cpu:0,cpu:1",
                                                    "--threads_per_device", "1"])):
                self.assert_same_norms_and_weights(self.train(tmp, name.replace(" ", "_"), PP, extra), alone, name)


if __name__ == "__main__":
    unittest.main()
