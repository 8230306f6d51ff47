"""--pipeline_schedule zb1p and zbv: the zero-bubble schedules, whose backward runs as B (input
gradients) and W (the linear layers' weight gradients, deferred). After three AdamW steps with
dropout 0 the weights equal one device's by the AdamW rule: stages as processes (2 and 4), with
D = 2 (ZeRO-1 included) and T = 2, and run_pipeline's worker threads. ZB-V puts the loss on the
first stage, so the first stage's process reports; the trace shows the W passes; the memory plan
counts activations until their W. gpt2-tiny (2 blocks) and gpt2-mini (4 blocks), at most 8
processes."""
import json
import os
import re
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from after_adamw import weight_problems  # noqa: E402
from test_checkpoints import DP, PP, free_port, run, weights  # noqa: E402

NUMBER = r"(-?\d+(?:\.\d+)?)"
DP_TRAIN = re.compile(rf"^Epoch (\d+) on Rank (\d+): Training Time = {NUMBER}, Tokens_per_sec = {NUMBER}$")

LR, STEPS = 1e-3, 3
COMMON = ["--batch_size", "8", "--n_epochs", "1", "--max_batches", str(STEPS), "--threads_per_device", "1",
          "--dropout", "0", "--model_max_length", "40", "--learning_rate", str(LR), "--train_size", "48",
          "--validation_size", "8", "--test_size", "2", "--no_progress"]


def train(tmp, name, model, world, extra=()):
    work = os.path.join(tmp, name)
    args = [DP, "--world_size", str(world), "--master_port", str(free_port()), "--workdir", work,
            "--model", model, "--benchmark_only"] + COMMON + list(extra)
    return work, run(args, timeout=600)


def reporters(proc):
    return sorted(m[2] for m in (DP_TRAIN.match(l) for l in proc.stdout.splitlines()) if m)


class ZeroBubbleEqualsOneDevice(unittest.TestCase):
    def check_same(self, expected_dir, actual_dir, label):
        self.assertEqual(weight_problems(weights(actual_dir), weights(expected_dir), LR, STEPS), [], label)

    def test_two_and_four_stages_as_processes(self):
        with tempfile.TemporaryDirectory() as tmp:
            for model, P in (("gpt2-tiny", 2), ("gpt2-mini", 4)):
                one, _ = train(tmp, f"one-{model}", model, 1)
                for schedule in ("zb1p", "zbv"):
                    label = f"{schedule} over {P} stages"
                    staged, proc = train(tmp, f"{schedule}-{P}", model, P,
                                         ["--pipeline_parallel_size", str(P), "--pipeline_schedule", schedule,
                                          "--n_chunk", "4"])
                    self.check_same(one, staged, label)
                    # ZB-V: two chunks a device, 2P stages in a V; its last stage is on pipeline rank 0.
                    chunks = 2 if schedule == "zbv" else 1
                    self.assertIn(f"pipeline_schedule={schedule} n_chunk=4 virtual_stages={chunks} "
                                  f"stages={chunks * P}", proc.stderr, label)
                    self.assertEqual(reporters(proc), ["0"], label)

    def test_inside_data_and_tensor_parallelism(self):
        with tempfile.TemporaryDirectory() as tmp:
            plain, _ = train(tmp, "dp2", "gpt2-tiny", 2)
            for name, extra in (("d2p2-zb1p", ["--pipeline_schedule", "zb1p"]),
                                ("d2p2-zbv-zero1", ["--pipeline_schedule", "zbv", "--zero_stage", "1"])):
                staged, proc = train(tmp, name, "gpt2-tiny", 4, ["--pipeline_parallel_size", "2", "--n_chunk", "2"] + extra)
                self.check_same(plain, staged, name)
                self.assertEqual(reporters(proc), ["0", "1"], name)
            one, _ = train(tmp, "one", "gpt2-tiny", 1)
            t2p2, _ = train(tmp, "t2p2-zbv", "gpt2-tiny", 4,
                            ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2", "--n_chunk", "4",
                             "--pipeline_schedule", "zbv"])
            self.check_same(one, t2p2, "(1,2,2) zbv")


class ZeroBubbleTables(unittest.TestCase):
    def test_pipeline_schedule_prints_the_gantt_charts_beside_one_f_one_bs(self):
        tool = os.path.join(os.path.dirname(DP), "pipeline_schedule")
        out = run([tool, "--schedule", "zb1p", "--stages", "2", "--micro_batches", "4"]).stdout
        self.assertIn("device 0  F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3\n"
                      "device 1  .  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3\n", out)
        self.assertIn("device 0  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3\n", out)  # 1F1B, same clock
        self.assertIn("Bubble ratio: 7.7% against 1F1B's 20.0% (0.38x)", out)
        out = run([tool, "--schedule", "zbv", "--stages", "2", "--micro_batches", "4"]).stdout
        self.assertIn("device 0  F0.0 F1.0 F2.0 F0.1 B0.1 W0.1", out)
        self.assertIn("Bubble ratio: 4.0% against 1F1B's 20.0% (0.20x)", out)
        self.assertIn("the schedule's bound is 4 half stages, 1F1B's 2 whole ones", out)
        refused = run([tool, "--schedule", "zbv", "--virtual_stages", "3"], check=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("zbv runs its own two chunks per device", refused.stderr)
        # With --model, the order a run of gpt2-mini takes: made on its stages' estimated costs, it
        # is shorter on them than the paper's order.
        out = run([tool, "--schedule", "zbv", "--stages", "2", "--micro_batches", "4", "--model", "gpt2-mini"]).stdout
        self.assertIn("Stages (blocks each, the default split): 1,1,1.5,0.5\n", out)
        self.assertIn("Estimated ticks per stage, F/B/W (the largest action 1000): "
                      "456/597/361 449/537/361 616/750/481 951/1000/767\n", out)
        self.assertIn("device 0: F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B0.0 B1.1 W0.0 F2.1 B1.0", out)
        steps = re.search(r"this order's step (\d+) ticks, bubble [\d.]+%; the paper's order \(above without "
                          r"--model\) (\d+) ticks", out)
        self.assertIsNotNone(steps, out)
        self.assertLess(int(steps[1]), int(steps[2]))
        # Another split, given as --balance takes it (and refused, naming it, where it does not fit).
        out = run([tool, "--schedule", "zbv", "--stages", "2", "--micro_batches", "4", "--model", "gpt2-mini",
                   "--balance", "0.5,1,1.5,1"]).stdout
        self.assertIn("Stages (blocks each, --balance): 0.5,1,1.5,1\n", out)
        refused = run([tool, "--schedule", "zbv", "--stages", "2", "--model", "gpt2-mini", "--balance", "1,3"],
                      check=False)
        self.assertIn("--balance 1,3 gives 2 stages but the pipeline has 4 (2 devices x 2 chunks)", refused.stderr)
        refused = run([tool, "--schedule", "zb1p", "--model", "gpt2-mini"], check=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("--model orders --schedule zbv only", refused.stderr)


class ZeroBubbleThreads(unittest.TestCase):
    def run_pipeline(self, work, extra):
        return run([PP, "--workdir", work, "--model", "gpt2-tiny", "--devices", "cpu:0,cpu:1"] + COMMON + list(extra),
                   timeout=600)

    def test_worker_threads_train_like_one_device_and_trace_w_passes(self):
        with tempfile.TemporaryDirectory() as tmp:
            one = os.path.join(tmp, "one")
            self.run_pipeline(one, [])
            for schedule in ("zb1p", "zbv"):
                work = os.path.join(tmp, schedule)
                trace = os.path.join(tmp, schedule + ".json")
                proc = self.run_pipeline(work, ["--model_parallel_mode", "pipeline_parallel", "--n_chunk", "4",
                                                "--pipeline_schedule", schedule, "--trace", trace])
                self.assertEqual(weight_problems(weights(work), weights(one), LR, STEPS), [], schedule)
                self.assertIn(f"schedule={schedule} micro_batches=4", proc.stderr)
                with open(trace) as f:
                    events = json.load(f)["traceEvents"]
                # Every (micro-batch, stage) gets one W a step, on the device that ran its B.
                stages = 4 if schedule == "zbv" else 2
                ws = [e for e in events if e.get("name") == "weight" and e.get("ph") == "X"]
                self.assertEqual(len(ws), STEPS * 4 * stages, schedule)
                b_track = {(e["args"]["micro_batch"], e["args"]["stage"]): e["tid"]
                           for e in events if e.get("name") == "backward"}
                for e in ws:
                    self.assertEqual(e["tid"], b_track[(e["args"]["micro_batch"], e["args"]["stage"])])


class ZeroBubbleCheckpoints(unittest.TestCase):
    def test_a_zero_bubble_run_resumes_under_its_joint_backward_order_and_back_exactly(self):
        # Two epochs of four steps, dropout on, a checkpoint after each epoch: the checkpoint of
        # step 4 of one schedule, resumed under its partner, ends where the undisturbed run ends,
        # bit for bit (zb1p trains as 1F1B does, zbv as interleaved V = 2 over the same stages).
        from test_checkpoints import SAVED, TINY
        torch = __import__("torch")
        # A checkpoint each epoch (4 steps): the two newest are kept, step 4's among them.
        tiny = TINY[:TINY.index("--checkpoint_every")] + ["--checkpoint_every", "4"]
        pipeline = [PP, "--model_parallel_mode", "pipeline_parallel", "--devices", "cpu:0,cpu:1", "--n_chunk", "2"]
        pairs = ((["--pipeline_schedule", "zb1p"], ["--pipeline_schedule", "1f1b"]),
                 (["--pipeline_schedule", "zbv"], ["--pipeline_schedule", "interleaved", "--virtual_stages", "2"]))
        with tempfile.TemporaryDirectory() as tmp:
            for k, (split, joint) in enumerate(pairs):
                runs = {}
                for name, schedule in (("split", split), ("joint", joint)):
                    work = os.path.join(tmp, f"{k}-{name}")
                    proc = run(pipeline + ["--workdir", work] + tiny + schedule, timeout=600)
                    step4 = [m[1] for m in map(SAVED.search, proc.stderr.splitlines()) if m and int(m[2]) == 4]
                    self.assertEqual(len(step4), 1, proc.stderr[-2000:])
                    runs[name] = (work, step4[0], schedule)
                for source, target in (("split", "joint"), ("joint", "split")):
                    work = os.path.join(tmp, f"{k}-{source}-then-{target}")
                    proc = run(pipeline + ["--workdir", work, "--resume", runs[source][1]] + tiny + runs[target][2],
                               timeout=600)
                    self.assertIn("continuing from " + runs[source][1], proc.stderr)
                    expected, actual = weights(runs[source][0]), weights(work)
                    self.assertEqual(sorted(expected), sorted(actual))
                    for key in expected:
                        self.assertTrue(torch.equal(expected[key], actual[key]),
                                        f"{' '.join(runs[source][2])} resumed under {' '.join(runs[target][2])}: {key}")


class ZeroBubbleBenchSummary(unittest.TestCase):
    def test_peak_memory_pairs_each_rounds_larger_ranks(self):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
        import zero_bubble_bench as zbb

        def run_of(tokens, peaks):
            return {"tokens_per_sec": tokens, "bubble": 0.1, "peak_rss_bytes_per_rank": peaks}
        # Round 2's 1F1B run peaks far above the others: paired round by round, it decides nothing.
        rounds = [{"1f1b": run_of(100, [500, 480]), "zb1p": run_of(110, [490, 520]), "zbv": run_of(111, [505, 470])},
                  {"1f1b": run_of(100, [500, 470]), "zb1p": run_of(112, [495, 525]), "zbv": run_of(113, [500, 480])},
                  {"1f1b": run_of(100, [700, 600]), "zb1p": run_of(108, [500, 530]), "zbv": run_of(109, [510, 490])}]
        s = zbb.summarise(rounds)
        self.assertEqual(s["zb1p_peak_over_1f1b"]["per_round"], [520 / 500, 525 / 500, 530 / 700])
        self.assertAlmostEqual(s["zb1p_peak_over_1f1b"]["median"], 1.04)
        self.assertEqual(s["zbv_peak_over_1f1b"]["per_round"], [505 / 500, 1.0, 510 / 700])
        self.assertEqual(s["peak_rss_bytes_per_rank"]["1f1b"], [700, 600])  # each rank's largest, as before
        self.assertAlmostEqual(s["zb1p_over_1f1b"]["median"], 1.10)


if __name__ == "__main__":
    unittest.main()
