"""The benchmark runner's parsing, statistics, grader checks and figures, on sample logs and a tiny
synthetic trace (no program is run: the long benchmarks are not part of the test suite)."""
import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

SOURCE_DIR = os.environ.get("HARNESS_SOURCE_DIR",
                            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(SOURCE_DIR, "scripts"))

import bench_common as bc  # noqa: E402
import plot_trace  # noqa: E402
import run_benchmarks  # noqa: E402

DP_LOG = """\
Epoch 0 on Rank 0: Training Time = 12.5, Tokens_per_sec = 1000.0
Epoch 0 on Rank 1: Training Time = 13.5, Tokens_per_sec = 900.0
Epoch 1 on Rank 1: Training Time = 9.0, Tokens_per_sec = 1100.0
Epoch 1 on Rank 0: Training Time = 10.0, Tokens_per_sec = 1200.0
Epoch 2 on Rank 0: Training Time = 12.0, Tokens_per_sec = 1000.0
Epoch 2 on Rank 1: Training Time = 11.0, Tokens_per_sec = 1300.0
Rank 0 training time: avg:11.5, std:1.0801234497346435, tokens_per_second: avg: 1066.6666666666667, std:94.28090415820634
Rank 1 training time: avg:11.166666666666666, std:1.8408935028645435, tokens_per_second: avg: 1100.0, std:163.29931618554522
"""

PP_LOG = """\
Epoch 0: Training Time = 3.0, Tokens_per_sec = 100.5
Epoch 0: Validation Loss = 5.25
Epoch 0: BLEU = 0.0
Epoch 1: Training Time = 2.0, Tokens_per_sec = 150.0
Epoch 1: Validation Loss = 4.75
Epoch 1: BLEU = 1.5
Epoch 2: Training Time = 4.0, Tokens_per_sec = 75.0
Training time: avg:3.0, std:0.816496580927726, tokens_per_second: avg: 108.5, std:31.0
"""


def pp_log(times_rates):
    lines = [f"Epoch {e}: Training Time = {t}, Tokens_per_sec = {r}" for e, (t, r) in enumerate(times_rates)]
    tm, ts = bc.mean_std([t for t, _ in times_rates])
    rm, rs = bc.mean_std([r for _, r in times_rates])
    lines.append(f"Training time: avg:{tm}, std:{ts}, tokens_per_second: avg: {rm}, std:{rs}")
    return "\n".join(lines) + "\n"


def dp_log(per_rank):
    lines = []
    for e in range(len(per_rank[0])):
        for r, figures in enumerate(per_rank):
            lines.append(f"Epoch {e} on Rank {r}: Training Time = {figures[e][0]}, Tokens_per_sec = {figures[e][1]}")
    for r, figures in enumerate(per_rank):
        tm, ts = bc.mean_std([t for t, _ in figures])
        rm, rs = bc.mean_std([x for _, x in figures])
        lines.append(f"Rank {r} training time: avg:{tm}, std:{ts}, tokens_per_second: avg: {rm}, std:{rs}")
    return "\n".join(lines) + "\n"


class ParseTest(unittest.TestCase):
    def test_pipeline_log_with_evaluation_lines(self):
        log = bc.parse_log_text(PP_LOG, "pp.log", "pp", expected_epochs=3)
        self.assertEqual([f.time for f in log.epochs[0]], [3.0, 2.0, 4.0])
        self.assertEqual([f.tok for f in log.epochs[0]], [100.5, 150.0, 75.0])
        stats = bc.combined_stats(log, warmup=1)
        self.assertEqual(stats.n, 2)
        self.assertAlmostEqual(stats.time_mean, 3.0)
        self.assertAlmostEqual(stats.time_std, 1.0)
        self.assertAlmostEqual(stats.tok_mean, 112.5)
        self.assertAlmostEqual(stats.tok_std, 37.5)

    def test_two_rank_log_time_is_mean_and_throughput_is_sum_over_ranks(self):
        log = bc.parse_log_text(DP_LOG, "dp.log", "dp", world_size=2, expected_epochs=3)
        stats = bc.combined_stats(log, warmup=1)
        # epoch 1: time (10 + 9) / 2 = 9.5, tok 1200 + 1100 = 2300; epoch 2: 11.5, 2300
        self.assertAlmostEqual(stats.time_mean, 10.5)
        self.assertAlmostEqual(stats.time_std, 1.0)
        self.assertAlmostEqual(stats.tok_mean, 2300.0)
        self.assertAlmostEqual(stats.tok_std, 0.0)

    def assertParseError(self, text, kind, *fragments, world_size=1, epochs=3):
        with self.assertRaises(bc.LogParseError) as ctx:
            bc.parse_log_text(text, "/logs/bad.log", kind, world_size, epochs)
        message = str(ctx.exception)
        self.assertIn("/logs/bad.log", message)
        for fragment in fragments:
            self.assertIn(fragment, message)

    def test_malformed_number_names_file_and_line(self):
        bad = PP_LOG.replace("Training Time = 2.0", "Training Time = two")
        self.assertParseError(bad, "pp", "bad.log:4", "malformed")

    def test_nan_is_an_error_not_a_value(self):
        bad = PP_LOG.replace("Tokens_per_sec = 150.0", "Tokens_per_sec = nan")
        self.assertParseError(bad, "pp", "bad.log:4", "Tokens_per_sec is nan")

    def test_missing_epoch_is_an_error(self):
        bad = "\n".join(l for l in PP_LOG.splitlines() if not l.startswith("Epoch 1: Training"))
        self.assertParseError(bad, "pp", "missing epoch(s) [1]")

    def test_missing_rank_and_missing_summary(self):
        no_rank1 = "\n".join(l for l in DP_LOG.splitlines() if "Rank 1" not in l)
        self.assertParseError(no_rank1, "dp", "rank 1", world_size=2)
        no_summary = "\n".join(l for l in PP_LOG.splitlines() if not l.startswith("Training time"))
        self.assertParseError(no_summary, "pp", "summary line is missing")

    def test_pipeline_line_in_data_parallel_log_is_malformed(self):
        self.assertParseError(PP_LOG, "dp", "malformed", world_size=1)

    def test_summary_that_disagrees_with_epoch_lines(self):
        bad = PP_LOG.replace("avg:3.0,", "avg:7.0,")
        self.assertParseError(bad, "pp", "disagrees")

    def test_empty_or_absent_log(self):
        self.assertParseError("", "pp", "no Training Time line")
        with self.assertRaises(bc.LogParseError) as ctx:
            bc.parse_log("/nonexistent/x.log", "pp")
        self.assertIn("/nonexistent/x.log", str(ctx.exception))

    def test_warmup_must_leave_an_epoch(self):
        log = bc.parse_log_text(PP_LOG, "pp.log", "pp", expected_epochs=3)
        with self.assertRaises(bc.LogParseError):
            bc.combined_stats(log, warmup=3)


class SummaryTest(unittest.TestCase):
    def test_keys_are_exactly_specs(self):
        s = bc.Stats(10.0, 1.0, 100.0, 5.0, 2)
        f = bc.Stats(5.0, 0.5, 190.0, 4.0, 2)
        out = bc.performance_summary(3, 1, 96, 2, s, f, s, f)
        self.assertEqual(set(out), {"config", "data_parallel", "pipeline_parallel"})
        self.assertEqual(set(out["config"]), {"epochs", "warmup_epochs_dropped", "pipeline_batch_size",
                                              "pipeline_n_chunk"})
        self.assertEqual(set(out["data_parallel"]), {"single_gpu", "two_gpu", "speedup_time_reduction_x",
                                                     "speedup_throughput_x"})
        self.assertEqual(set(out["pipeline_parallel"]), {"model_parallel", "pipeline_parallel",
                                                         "speedup_time_reduction_x", "speedup_throughput_x"})
        self.assertEqual(set(out["data_parallel"]["two_gpu"]), {"time_mean", "time_std", "tok_mean", "tok_std"})
        self.assertAlmostEqual(out["data_parallel"]["speedup_time_reduction_x"], 2.0)
        self.assertAlmostEqual(out["data_parallel"]["speedup_throughput_x"], 1.9)

    def test_grader_names_the_failed_check(self):
        s = bc.Stats(10.0, 1.0, 100.0, 5.0, 2)
        f = bc.Stats(5.0, 0.5, 190.0, 4.0, 2)
        out = bc.performance_summary(3, 1, 96, 2, s, f, s, f)
        failures = bc.threshold_failures(out, 1.5, 1.95, 1.0, 1.0)
        self.assertEqual(len(failures), 1)
        self.assertIn("--dp-throughput-threshold", failures[0])
        self.assertEqual(bc.threshold_failures(out, 1.5, 1.5, 1.5, 1.5), [])

    def test_gpipe_figures(self):
        self.assertAlmostEqual(bc.gpipe_bound(2, 2), 4 / 3)
        self.assertAlmostEqual(bc.gpipe_bound(2, 4), 1.6)
        self.assertAlmostEqual(bc.gpipe_bubble(2, 2), 1 / 3)


def synthetic_trace(path):
    """GPipe, K=2, M=2, unit tasks (1 ms = 1000 us) in one 6 ms step: each device is busy 4 ms."""
    def x(name, tid, start, dur, mb=None, part=None):
        e = {"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": start * 1000, "dur": dur * 1000}
        if mb is not None:
            e["args"] = {"micro_batch": mb, "partition": part}
        return e
    events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": n}}
              for t, n in ((1, "cpu:0"), (2, "cpu:1"), (3, "main"))]
    for step, t0 in ((0, 0), (1, 10)):
        events += [x("forward", 1, t0 + 0, 1, 0, 0), x("forward", 1, t0 + 1, 1, 1, 0),
                   x("forward", 2, t0 + 1, 1, 0, 1), x("forward", 2, t0 + 2, 1, 1, 1),
                   x("backward", 2, t0 + 3, 1, 1, 1), x("backward", 2, t0 + 4, 1, 0, 1),
                   x("backward", 1, t0 + 4, 1, 1, 0), x("backward", 1, t0 + 5, 1, 0, 0),
                   x("step", 3, t0, 6)]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


class TimelineTest(unittest.TestCase):
    def test_bubble_fraction_of_an_ideal_gpipe_step_and_figure(self):
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "t.json")
            synthetic_trace(trace)
            out = os.path.join(tmp, "t.png")
            report = plot_trace.plot_trace(trace, out, step="last")
            self.assertEqual(report.device_tracks, ["cpu:0", "cpu:1"])
            self.assertEqual((report.k, report.m), (2, 2))
            self.assertAlmostEqual(report.window[0], 10.0)
            self.assertAlmostEqual(report.bubble_fraction, 1 / 3)
            self.assertAlmostEqual(report.gpipe_bubble, 1 / 3)
            # forward phase 0-3 ms and backward phase 3-6 ms: each device idles 1 ms of each
            self.assertAlmostEqual(report.phase_bubble_fraction, 1 / 3)
            self.assertGreater(os.path.getsize(out), 5000)

    def test_bad_trace_files(self):
        with tempfile.TemporaryDirectory() as tmp:
            bad = os.path.join(tmp, "bad.json")
            with open(bad, "w") as f:
                f.write("{not json")
            with self.assertRaises(plot_trace.TraceError) as ctx:
                plot_trace.load_trace(bad)
            self.assertIn("bad.json", str(ctx.exception))
            with self.assertRaises(plot_trace.TraceError):
                plot_trace.load_trace(os.path.join(tmp, "absent.json"))


class RunnerTest(unittest.TestCase):
    """The runner end to end on reused logs: summary JSON, figures, table, grader exit status."""

    def write_logs(self, perf, sfx):
        os.makedirs(perf, exist_ok=True)
        logs = {
            f"dp_ws1_b64{sfx}": dp_log([[(20, 500), (10, 1000), (10, 1000)]]),
            f"dp_ws2_b128{sfx}": dp_log([[(12, 480), (6, 950), (6, 1000)], [(12, 480), (6, 950), (6, 900)]]),
            f"pp_model_b96{sfx}": pp_log([(10, 600), (8, 700), (8, 700)]),
            f"pp_pipeline_b96_n2{sfx}": pp_log([(9, 700), (7, 800), (7, 800)]),
        }
        for name, text in logs.items():
            with open(os.path.join(perf, name + ".log"), "w") as f:
                f.write(text)

    def test_reused_logs_give_summary_figures_and_grader_status(self):
        with tempfile.TemporaryDirectory() as tmp:
            workdir, figs = os.path.join(tmp, "w"), os.path.join(tmp, "figs")
            self.write_logs(os.path.join(workdir, "perf"), "_fast2")
            common = ["--reuse-logs", "--max-batches", "2", "--workdir", workdir, "--out-dir", figs,
                      "--no-scaling", "--no-timeline", "--no-schedules", "--build-dir", os.path.join(tmp, "nobuild"),
                      "--devices", "cpu:0,cpu:1"]
            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
                rc = run_benchmarks.main(common + ["--mode", "grader", "--dp-time-threshold", "1.5",
                                                   "--dp-throughput-threshold", "1.5",
                                                   "--pp-time-threshold", "1.1",
                                                   "--pp-throughput-threshold", "1.1"])
            self.assertEqual(rc, 0, out.getvalue())
            with open(os.path.join(figs, "performance_summary.json")) as f:
                summary = json.load(f)
            self.assertAlmostEqual(summary["data_parallel"]["single_gpu"]["time_mean"], 10.0)
            self.assertAlmostEqual(summary["data_parallel"]["two_gpu"]["tok_mean"], 1900.0)
            self.assertAlmostEqual(summary["data_parallel"]["speedup_time_reduction_x"], 10 / 6)
            self.assertAlmostEqual(summary["pipeline_parallel"]["speedup_throughput_x"], 800 / 700)
            for png in ("ddp_training_time.png", "ddp_tokens_per_second.png", "pp_training_time.png",
                        "pp_tokens_per_second.png"):
                self.assertGreater(os.path.getsize(os.path.join(figs, png)), 5000, png)
            self.assertIn("pp_pipeline_b96_n2_fast2", out.getvalue())

            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
                rc = run_benchmarks.main(common + ["--mode", "grader", "--pp-time-threshold", "100"])
            self.assertEqual(rc, 1)
            self.assertIn("FAILED: pipeline time speedup", out.getvalue())
            self.assertIn("--pp-time-threshold", out.getvalue())

            # The defaults are the course's (1.5 / 1.5 / 1.0 / 1.0): these logs' 1.67x and 1.14x pass
            # them; --strict holds them to the project's 1.8x and 1.25x and names every miss.
            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
                rc = run_benchmarks.main(common + ["--mode", "grader"])
            self.assertEqual(rc, 0, out.getvalue())
            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
                rc = run_benchmarks.main(common + ["--mode", "grader", "--strict"])
            self.assertEqual(rc, 1)
            for flag in ("--dp-time-threshold 1.800x", "--pp-throughput-threshold 1.250x"):
                self.assertIn(flag, out.getvalue())
            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
                rc = run_benchmarks.main(common + ["--mode", "grader", "--strict", "--dp-time-threshold", "1.5",
                                                   "--dp-throughput-threshold", "1.5", "--pp-time-threshold", "1",
                                                   "--pp-throughput-threshold", "1"])
            self.assertEqual(rc, 0, out.getvalue())

    def test_grader_defaults_are_the_originals(self):
        args = run_benchmarks.parse_args(["--mode", "grader"])
        self.assertEqual((args.dp_time_threshold, args.dp_throughput_threshold, args.pp_time_threshold,
                          args.pp_throughput_threshold), (1.5, 1.5, 1.0, 1.0))
        args = run_benchmarks.parse_args(["--mode", "grader", "--strict", "--pp-time-threshold", "1.1"])
        self.assertEqual((args.dp_time_threshold, args.dp_throughput_threshold, args.pp_time_threshold,
                          args.pp_throughput_threshold), (1.8, 1.8, 1.1, 1.25))

    def test_schedules_table_goals_and_figures_from_a_pipeline_bench_result(self):
        def config(name, schedule, m, v, ckpt, tok, bubble, unit, held, allocated):
            return {"name": name, "schedule": schedule, "micro_batches": m, "virtual_stages": v,
                    "activation_checkpointing": ckpt, "balance": "2,2", "step_seconds": [1.0],
                    "step_seconds_median": 6144 / tok, "tokens_per_second": tok, "bubble_measured": bubble,
                    "bubble_unit_time": unit, "peak_in_flight": [m, m], "peak_held_activation_bytes": held,
                    "peak_allocated_in_forwards_bytes": allocated, "traced_step": 4}
        configurations = [
            config("model_parallel", "gpipe", 1, 1, "never", 1000, 0.5, 0.5, [100, 100], [110, 110]),
            config("gpipe_m4", "gpipe", 4, 1, "never", 1500, 0.21, 0.2, [400, 400], [410, 410]),
            config("1f1b_m4", "1f1b", 4, 1, "never", 1600, 0.22, 0.2, [200, 100], [210, 110]),
            config("interleaved_m4_v2", "interleaved", 4, 2, "never", 1700, 0.15, 0.11, [250, 150], [260, 160]),
            config("gpipe_m8", "gpipe", 8, 1, "never", 1700, 0.12, 0.11, [800, 800], [810, 810]),
            config("1f1b_m8", "1f1b", 8, 1, "never", 1750, 0.12, 0.11, [200, 100], [210, 110]),
            config("interleaved_m8_v2", "interleaved", 8, 2, "never", 1800, 0.07, 0.06, [250, 150], [260, 160]),
            config("gpipe_m4_ckpt-always", "gpipe", 4, 1, "always", 1200, 0.21, 0.2, [40, 1], [200, 110]),
            config("1f1b_m4_ckpt-except_last", "1f1b", 4, 1, "except_last", 1300, 0.22, 0.2, [80, 30], [210, 110]),
            config("1f1b_m4_ckpt-always", "1f1b", 4, 1, "always", 1100, 0.22, 0.2, [20, 1], [150, 110]),
        ]
        bench = {"model": "gpt2-mini", "n_layer": 4, "n_embd": 256, "vocab_size": 4096, "batch_size": 96,
                 "tokens": 64, "devices": "cpu:0,cpu:1", "threads_per_device": 1, "balance_flag": "auto",
                 "configurations": configurations}
        with tempfile.TemporaryDirectory() as tmp:
            workdir, figs = os.path.join(tmp, "w"), os.path.join(tmp, "figs")
            perf = os.path.join(workdir, "perf")
            self.write_logs(perf, "_fast2")
            os.makedirs(os.path.join(perf, "schedules"))
            with open(os.path.join(perf, "pipeline_bench.json"), "w") as f:
                json.dump(bench, f)
            events = [{"name": "step", "ph": "X", "ts": 0, "dur": 1000, "pid": 1, "tid": 1, "args": {}}]
            for k, (name, start, dur, track) in enumerate([("forward", 0, 200, 2), ("forward", 200, 200, 3),
                                                            ("backward", 400, 400, 3), ("backward", 800, 200, 2)]):
                events.append({"name": name, "ph": "X", "ts": start, "dur": dur, "pid": 1, "tid": track,
                               "args": {"micro_batch": 0, "stage": track - 2}})
            events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": n}}
                       for t, n in ((1, "main"), (2, "cpu:0"), (3, "cpu:1"))]
            with open(os.path.join(perf, "schedules", "1f1b_m4.trace.json"), "w") as f:
                json.dump({"traceEvents": events}, f)
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                rc = run_benchmarks.main(["--reuse-logs", "--max-batches", "2", "--workdir", workdir,
                                          "--out-dir", figs, "--no-scaling", "--no-timeline",
                                          "--devices", "cpu:0,cpu:1", "--build-dir", os.path.join(tmp, "nobuild")])
            self.assertEqual(rc, 0)
            with open(os.path.join(figs, "benchmark_details.json")) as f:
                details = json.load(f)["schedules"]
            goals = details["goals"]
            self.assertAlmostEqual(goals["pipeline_over_model_parallel_m4"]["speedup_x"], 1.7)
            self.assertEqual(goals["pipeline_over_model_parallel_m4"]["best_schedule"], "interleaved V=2")
            self.assertAlmostEqual(goals["pipeline_over_model_parallel_m8"]["speedup_x"], 1.8)
            self.assertAlmostEqual(goals["one_f_one_b_over_gpipe_held_activations_m8"]["ratio_of_peaks"], 200 / 800)
            self.assertEqual(goals["one_f_one_b_over_gpipe_held_activations_m8"]["per_device"], [0.25, 0.125])
            ckpt = goals["activation_checkpointing"]["configurations"]
            self.assertEqual(ckpt["1f1b_m4_ckpt-always"]["against"], "1f1b_m4")
            self.assertAlmostEqual(ckpt["1f1b_m4_ckpt-always"]["held_activation_bytes_fewer_x"], 200 / 20)
            self.assertAlmostEqual(ckpt["1f1b_m4_ckpt-always"]["allocated_in_forwards_fewer_x"], 210 / 150)
            self.assertAlmostEqual(ckpt["1f1b_m4_ckpt-always"]["step_time_more_fraction"], 1600 / 1100 - 1)
            self.assertFalse(ckpt["1f1b_m4_ckpt-always"]["meets_goal"])
            self.assertAlmostEqual(ckpt["gpipe_m4_ckpt-always"]["held_activation_bytes_fewer_x"], 400 / 40)
            self.assertTrue(ckpt["gpipe_m4_ckpt-always"]["meets_goal"])  # 1500 / 1200: 25% more time
            self.assertFalse(goals["bubble_within_0_03"]["interleaved_m4_v2"])
            self.assertTrue(goals["bubble_within_0_03"]["1f1b_m4"])
            self.assertAlmostEqual(details["configurations"]["gpipe_m4"]["speedup_over_model_parallel_x"], 1.5)
            self.assertEqual(set(details["timelines"]), {"1f1b"})
            self.assertEqual(details["resolved_balance"], "2,2")  # what the pipeline runs are given
            for png in ("pp_schedules.png", "pp_timeline_1f1b.png"):
                self.assertGreater(os.path.getsize(os.path.join(figs, png)), 5000, png)

    def test_broken_log_stops_the_runner_with_its_name(self):
        with tempfile.TemporaryDirectory() as tmp:
            workdir = os.path.join(tmp, "w")
            perf = os.path.join(workdir, "perf")
            self.write_logs(perf, "")
            with open(os.path.join(perf, "dp_ws2_b128.log"), "a") as f:
                f.write("Epoch 3 on Rank 0: Training Time = , Tokens_per_sec = 1\n")
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
                rc = run_benchmarks.main(["--reuse-logs", "--workdir", workdir, "--out-dir",
                                          os.path.join(tmp, "f"), "--skip-pp", "--devices", "cpu:0,cpu:1"])
            self.assertEqual(rc, 2)
            self.assertIn("dp_ws2_b128.log:", err.getvalue())
            self.assertIn("malformed", err.getvalue())

    def test_bad_options_are_refused(self):
        with contextlib.redirect_stderr(io.StringIO()) as err, self.assertRaises(SystemExit):
            run_benchmarks.parse_args(["--epochs", "2", "--warmup-epochs", "2"])
        self.assertIn("--warmup-epochs", err.getvalue())


class PrecisionMemoryBench(unittest.TestCase):
    """scripts/precision_memory_bench.py end to end with the built program on the tiny model."""

    def test_per_round_ratios_pair_each_run_with_its_rounds_fp32_run_and_peak(self):
        import precision_memory_bench
        rounds = {"fp32": [{"tokens_per_sec": 100.0}, {"tokens_per_sec": 50.0}, {"tokens_per_sec": 80.0}],
                  "zero1": [{"tokens_per_sec": 110.0}, {"tokens_per_sec": 45.0}, {"tokens_per_sec": 84.0}],
                  "accumulation4": [{"tokens_per_sec": 90.0}, {"tokens_per_sec": 50.0}, {"tokens_per_sec": 40.0}]}
        # 1e9 FLOP per token: 100 tokens/s against a 125 GFLOP/s peak is 0.8.
        r = precision_memory_bench.per_round_ratios(rounds, [125.0, 100.0, 80.0], 1e9)
        self.assertEqual(r["fp32_two_process_peak_gflops"], [125.0, 100.0, 80.0])
        self.assertEqual(r["fp32_mfu"]["per_round"], [0.8, 0.5, 1.0])
        self.assertEqual(r["fp32_mfu"]["median"], 0.8)
        self.assertEqual([round(x, 6) for x in r["zero1_over_fp32_x"]["per_round"]], [1.1, 0.9, 1.05])
        self.assertAlmostEqual(r["zero1_over_fp32_x"]["median"], 1.05)
        self.assertAlmostEqual(r["accumulation4_over_fp32_x"]["median"], 0.9)
        self.assertNotIn("bf16_over_fp32_x", r)  # not run (no bf16 units)

    def test_writes_every_measure_goal_and_the_figure(self):
        import precision_memory_bench
        source = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        build = os.environ.get("HARNESS_BINARY_DIR", os.path.join(source, "build"))
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out")
            with contextlib.redirect_stdout(io.StringIO()):
                precision_memory_bench.main(["--build-dir", build, "--workdir", tmp, "--out-dir", out,
                                             "--model", "gpt2-tiny", "--model-max-length", "40", "--epochs", "2",
                                             "--max-batches", "1", "--batch-size", "16", "--matmul-size", "128",
                                             "--force-bf16", "--rounds", "2"])
            with open(os.path.join(out, "benchmark_details.json")) as f:
                r = json.load(f)["precision_memory"]
            self.assertTrue(os.path.isfile(os.path.join(out, "precision_memory.png")))
            for key in ("fp32_two_processes", "bf16_two_processes", "fp32_one_process", "bf16_one_process"):
                self.assertGreater(r["peaks_gflops"][key], 0.0, key)
            for run in ("fp32", "bf16", "zero1", "accumulation4"):
                self.assertGreater(r["runs"][run]["tokens_per_sec"], 0.0, run)
                self.assertEqual(len(r["runs"][run]["commands"]), 2, run)  # the two rounds
                self.assertEqual([len(e) for e in r["runs"][run]["tokens_per_sec_per_epoch"]], [1, 1], run)
            self.assertEqual(r["accumulation"]["n4_over_n1_bytes_per_batch_x"], 0.25)
            self.assertLessEqual(r["zero"]["n2_fraction"], 0.5 + 1e-3)
            self.assertLessEqual(r["zero"]["n4_fraction"], 0.25 + 1e-3)
            self.assertGreater(r["fp32_mfu"], 0.0)
            self.assertEqual(len(r["per_round"]["fp32_two_process_peak_gflops"]), 2)  # one per round
            self.assertEqual(len(r["per_round"]["zero1_over_fp32_x"]["per_round"]), 2)
            self.assertEqual(len(r["goals"]), 7)
            self.assertIsNone(r["bf16_quality"])  # only with --quality (run.sh's job, minutes per seed)
            self.assertEqual([k for k, v in r["goals"].items() if v is None],
                             ["bf16 quality (run.sh settings): validation loss within 3% of fp32's",
                              "bf16 quality (run.sh settings): BLEU within 2 points of fp32's"])

    def test_quality_runs_take_scripts_run_sh_settings(self):
        import precision_memory_bench
        with open(os.path.join(os.path.dirname(precision_memory_bench.__file__), "run.sh")) as f:
            run_sh = " ".join(f.read().replace("\\\n", " ").split())
        flags = precision_memory_bench.RUN_SH_FLAGS
        for flag, value in zip(flags[::2], flags[1::2]):
            self.assertIn(f"{flag} {value}", run_sh.replace('"$@"', ""), flag)
        self.assertIn("--fit_vocab", run_sh)

    def test_quality_compares_the_means_over_seeds_and_reports_fp32s_spread(self):
        import argparse
        import precision_memory_bench
        finals = {("fp32", 1): (0.10, 90.0), ("bf16", 1): (0.11, 89.0),
                  ("fp32", 2): (0.30, 80.0), ("bf16", 2): (0.28, 82.0)}
        calls = []

        def fake_run(args, name, extra):
            calls.append((name, extra))
            precision = "bf16" if "bf16" in extra else "fp32"
            loss, bleu = finals[(precision, int(extra[extra.index("--seed") + 1]))]
            return {"final_validation_loss": loss, "final_bleu": bleu}

        original = precision_memory_bench.quality_run
        precision_memory_bench.quality_run = fake_run
        try:
            q = precision_memory_bench.bf16_quality(argparse.Namespace(quality_seeds=[1, 2]))
        finally:
            precision_memory_bench.quality_run = original
        self.assertEqual(len(calls), 4)
        self.assertEqual(calls[1], ("quality_bf16_seed1", ["--seed", "1", "--precision", "bf16"]))
        self.assertAlmostEqual(q["fp32_mean_validation_loss"], 0.20)
        self.assertAlmostEqual(q["bf16_mean_validation_loss"], 0.195)
        self.assertAlmostEqual(q["validation_loss_relative_difference"], 0.025)
        self.assertAlmostEqual(q["bleu_difference"], 0.5)
        self.assertAlmostEqual(q["fp32_validation_loss_spread_over_seeds"], 1.0)


if __name__ == "__main__":
    unittest.main()
