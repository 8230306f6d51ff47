"""scripts/cluster_layouts_bench.py's pure parts, on sample data (no cluster, no training): the bytes
each layout moves by formula, at gpt2-mini's shapes; step times read from metrics.jsonl (warm-up
dropped, a missing step refused by name); bytes per step as a run less a short run; the model
t(r) = t_unshaped + bytes / r, its crossover and the measured one interpolated in 1/r; the H100 +
InfiniBand rate; the summary's JSON, the table and the figure from a made-up benchmark; and the
refusal where no cluster can be made or the program is not built."""
import json
import math
import os
import sys
import tempfile
import unittest

SOURCE_DIR = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(SOURCE_DIR, "scripts"))

import cluster_layouts_bench as clb  # noqa: E402
from bench_common import BenchmarkError  # noqa: E402

# gpt2-mini with --fit_vocab: 4 layers, width 256, the tokenizer's 1,417 ids, 256 positions;
# batch 32 x 64 tokens.
MODEL = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab": 1417, "n_positions": 256}
N_PARAMS = 3587840   # what run_data_parallel prints for it
SHAPE = {"n_params": N_PARAMS, "n_layer": 4, "n_embd": 256, "vocab": 1417, "batch": 32, "tokens": 64,
         "global_tokens": 2048}
ACTIVATION = 32 * 64 * 256 * 4


def metrics(times, evals=()):
    lines = [json.dumps({"kind": "train", "step": i + 1, "epoch": 0, "loss": 7.0, "tokens": 1024,
                         "tokens_per_sec": 1024 / t, "step_time": t}) for i, t in enumerate(times)]
    lines += [json.dumps({"kind": "eval", "step": s, "epoch": 0, "validation_loss": 6.0}) for s in evals]
    return "\n".join(lines) + "\n"


class Formulas(unittest.TestCase):
    def test_the_parameter_count_is_the_programs(self):
        self.assertEqual(clb.n_parameters(**{k: MODEL[k] for k in ("n_layer", "n_embd", "vocab", "n_positions")}),
                         N_PARAMS)

    def test_data_parallel_sends_the_gradients_once_and_zero3_three_halves(self):
        self.assertEqual(clb.formula_bytes("data", SHAPE)["bytes"], 4 * N_PARAMS)
        self.assertEqual(clb.formula_bytes("data_naive", SHAPE)["bytes"], 4 * N_PARAMS)
        self.assertEqual(clb.formula_bytes("zero3", SHAPE)["bytes"], 1.5 * 4 * N_PARAMS)

    def test_the_pipeline_sends_one_activation_of_the_batch_and_the_tied_embeddings_gradient(self):
        self.assertEqual(clb.formula_bytes("pipeline_1f1b", SHAPE)["bytes"], ACTIVATION + 4 * 1417 * 256)
        self.assertEqual(clb.formula_bytes("pipeline_zb1p", SHAPE)["bytes"], ACTIVATION + 4 * 1417 * 256)

    def test_tensor_parallel_all_reduces_four_activations_a_block_and_two_more(self):
        got = clb.formula_bytes("tensor", SHAPE)
        self.assertEqual(got["bytes"], 18 * ACTIVATION + 3 * 32 * 64 * 4)
        self.assertIn("2(T-1)/T", got["formula"])

    def test_context_parallel_passes_kv_four_times_a_layer_and_all_reduces_the_gradients(self):
        kv = 2 * 32 * 32 * 256 * 4
        self.assertEqual(clb.formula_bytes("context", SHAPE)["bytes"], 4 * 4 * kv + 4 * N_PARAMS)

    def test_every_layout_has_a_formula(self):
        for key in clb.LAYOUTS:
            self.assertGreater(clb.formula_bytes(key, SHAPE)["bytes"], 0, key)

    def test_the_reporting_rank_is_the_last_stages_first(self):
        self.assertEqual(clb.LAYOUTS["pipeline_1f1b"].reporting_rank(), 1)
        for key in ("data", "tensor", "context", "zero3"):
            self.assertEqual(clb.LAYOUTS[key].reporting_rank(), 0, key)


class ReadingARun(unittest.TestCase):
    def test_the_steps_after_the_warmup_are_read(self):
        text = metrics([1.5, 0.5, 0.25, 0.75], evals=[2])
        self.assertEqual(clb.step_times(text, 4, 1, "m.jsonl"), [0.5, 0.25, 0.75])
        self.assertEqual(clb.step_times(text, 4, 0, "m.jsonl"), [1.5, 0.5, 0.25, 0.75])

    def test_a_missing_step_is_refused_naming_the_file(self):
        with self.assertRaisesRegex(BenchmarkError, r"w/metrics.jsonl: train steps \[1, 2\], expected 1..3"):
            clb.step_times(metrics([1.0, 1.0]), 3, 1, "w/metrics.jsonl")

    def test_a_bad_step_time_is_refused_with_its_line(self):
        with self.assertRaisesRegex(BenchmarkError, "m.jsonl:2: step_time"):
            clb.step_times(metrics([1.0]) + '{"kind": "train", "step": 2, "step_time": "x"}\n', 2, 1, "m.jsonl")

    def test_the_shape_comes_from_config_json_and_the_count_from_the_printed_line(self):
        config = json.dumps({"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 1417, "n_positions": 256})
        self.assertEqual(clb.model_of(config, "config.json"), MODEL)
        line = "run_data_parallel: world_size=1 model=gpt2-mini (3587840 parameters) vocab=1417 batch_size=16"
        self.assertEqual(clb.printed_parameters(line, "log"), N_PARAMS)
        with self.assertRaisesRegex(BenchmarkError, "x.log: no 'model=NAME"):
            clb.printed_parameters("nothing", "x.log")

    def test_bytes_per_step_subtract_the_short_run(self):
        # start-up 13 MB, then 14.5 MB a step: 4 steps against 2.
        self.assertEqual(clb.bytes_per_step(13e6 + 4 * 14.5e6, 13e6 + 2 * 14.5e6, 4, 2), 14.5e6)
        with self.assertRaises(ValueError):
            clb.bytes_per_step(1, 1, 2, 2)


class RateModel(unittest.TestCase):
    def test_a_step_costs_its_bytes_at_the_rate_and_nothing_unshaped(self):
        self.assertEqual(clb.predicted_step_seconds(0.25, 5e6, "40"), 0.25 + 1.0)
        self.assertEqual(clb.predicted_step_seconds(0.25, 5e6, clb.UNSHAPED), 0.25)

    def test_the_predicted_crossover_is_where_the_two_lines_meet(self):
        # D: 0.25 s + 14.35 MB; P: 0.30 s + 3.55 MB: (14.35 - 3.55) MB / 0.05 s = 216 MB/s = 1728 Mbit/s.
        got = clb.crossover_predicted(0.25, 14.35e6, 0.30, 3.55e6)
        self.assertAlmostEqual(got["mbit"], 1728.0, places=6)
        rate = got["mbit"]
        self.assertAlmostEqual(clb.predicted_step_seconds(0.25, 14.35e6, rate),
                               clb.predicted_step_seconds(0.30, 3.55e6, rate))
        self.assertIn("bytes_D - bytes_P", got["formula"])

    def test_no_crossover_where_the_pipeline_is_ahead_already_or_moves_more(self):
        self.assertIsNone(clb.crossover_predicted(0.30, 14e6, 0.25, 3e6)["mbit"])
        self.assertIn("never overtakes", clb.crossover_predicted(0.25, 3e6, 0.30, 14e6)["why"])

    def test_the_schedules_bubble_is_1f1bs_and_a_third_of_it_for_zb_h1(self):
        self.assertEqual(clb.schedule_bubble("pipeline_1f1b", 4), 0.25)
        self.assertAlmostEqual(clb.schedule_bubble("pipeline_zb1p", 4), 1 / 12)

    def test_the_closed_form_crossover_is_where_the_bubble_costs_what_the_extra_bytes_do(self):
        # t_1 = 0.2 s, bubble 1/4: 0.05 s against (14 - 4) MB: 200 MB/s = 1600 Mbit/s.
        got = clb.crossover_closed_form(0.2, 14e6, 4e6, 0.25)
        self.assertAlmostEqual(got["mbit"], 1600.0)
        rate = got["mbit"]
        self.assertAlmostEqual(clb.predicted_step_seconds(0.2, 14e6, rate),
                               clb.predicted_step_seconds(0.2 * 1.25, 4e6, rate))
        self.assertIsNone(clb.crossover_closed_form(0.2, 4e6, 14e6, 0.25)["mbit"])

    def test_the_measured_crossover_is_interpolated_in_one_over_the_rate(self):
        # Both exactly on the model: 1/r = 0 (unshaped), 1/1000 and 1/200 (in Mbit/s).
        data = {r: clb.predicted_step_seconds(0.25, 14.35e6, r) for r in ("unshaped", "1000", "200", "40")}
        pipe = {r: clb.predicted_step_seconds(0.30, 3.55e6, r) for r in ("unshaped", "1000", "200", "40")}
        got = clb.crossover_measured(data, pipe)
        self.assertAlmostEqual(got["mbit"], 1728.0, places=6)
        self.assertEqual(got["bracket"], ["unshaped", "1000"])

    def test_a_measured_crossover_outside_the_rates_says_so(self):
        ahead = clb.crossover_measured({"unshaped": 1.0, "40": 2.0}, {"unshaped": 0.9, "40": 1.0})
        self.assertIsNone(ahead["mbit"])
        self.assertIn("ahead already", ahead["why"])
        never = clb.crossover_measured({"unshaped": 1.0, "40": 2.0}, {"unshaped": 1.1, "40": 2.5})
        self.assertIsNone(never["mbit"])
        self.assertIn("down to the slowest link", never["why"])

    def test_the_fit_recovers_compute_and_exposed_bytes(self):
        seconds = {r: clb.predicted_step_seconds(0.25, 14e6, r) for r in ("unshaped", "1000", "200", "40")}
        fit = clb.fit_rate_model(seconds)
        self.assertAlmostEqual(fit["compute_seconds"], 0.25)
        self.assertAlmostEqual(fit["exposed_bytes"] / 14e6, 1.0)
        self.assertIsNone(clb.fit_rate_model({"unshaped": 1.0}))

    def test_the_h100_rate_gives_this_core_the_h100s_flops_per_byte(self):
        # 98.9 GFLOP/s is 1e-4 of 989 TFLOP/s: 1e-4 of 400 Gb/s is 40 Mbit/s.
        self.assertAlmostEqual(clb.h100_equivalent_mbit(98.9e9), 40.0)


def sample_runs():
    """Two rounds of data and the 1F1B pipeline at three rates and the H100 point, on the model
    (bytes as counted, a start-up of 13 MB and 36 MB), the second round 10% slower."""
    runs = []
    for round_index, slow in enumerate((1.0, 1.1)):
        for rate in ("unshaped", "200", "40", clb.H100_RATE):
            for key, compute, step_bytes, startup in (("data", 0.25, 14.5e6, 13e6), ("pipeline_1f1b", 0.30, 3.6e6, 36e6)):
                mbit = 38.0 if rate == clb.H100_RATE else rate
                seconds = clb.predicted_step_seconds(compute, step_bytes, mbit) * slow
                runs.append({"layout": key, "rate": rate, "round": round_index, "step_seconds": seconds,
                             "tokens_per_sec": 2048 / seconds,
                             "sent_bytes": [startup + 4 * step_bytes, startup + 4 * step_bytes * 0.95]})
    runs.append({"layout": "data", "rate": "40", "round": 2, "step_seconds": None, "tokens_per_sec": None,
                 "error": "failed"})
    short = {"data": {"steps": 2, "sent_bytes": [13e6 + 2 * 14.5e6, 13e6 + 2 * 14.5e6 * 0.95]},
             "pipeline_1f1b": {"steps": 2, "sent_bytes": [36e6 + 2 * 3.6e6, 36e6 + 2 * 3.6e6 * 0.95]}}
    return runs, short


def sample_result():
    runs, short = sample_runs()
    single = {"model": MODEL, "n_params_printed": N_PARAMS, "tokens_per_sec": 4500.0, "step_seconds": 0.2276,
              "batch_size": 16, "log": "single.log"}
    fpt = 21.84e6
    measured = {"single": single, "singles": [dict(single, tokens_per_sec=4400.0)], "fpt": fpt,
                "core_flops": 4500.0 * fpt, "h100": 38.0, "short_runs": short, "runs": runs, "failures": ["failed"]}
    config = {"model": "gpt2-mini", "batch_size": 32, "model_max_length": 64, "global_tokens": 2048, "n_chunk": 4,
              "bucket_cap_mb": 4.0, "steps": 4, "warmup_steps": 1, "rounds": 2,
              "rates_mbit": ["unshaped", "200", "40"], "layouts": ["data", "pipeline_1f1b"],
              "h100_layouts": ["data", "pipeline_1f1b"]}
    machine = {"cpu": "Test CPU", "cores": 2, "device": "one core", "load_average_start": 1.0,
               "load_average_end": 1.0}
    return clb.build_result(config, measured, machine)


class Summary(unittest.TestCase):
    def test_medians_bytes_and_crossovers_come_out_of_the_runs(self):
        result = sample_result()
        data = result["layouts"]["data"]
        self.assertAlmostEqual(data["tokens_per_sec"]["unshaped"]["median"], (2048 / 0.25 + 2048 / 0.275) / 2)
        self.assertAlmostEqual(data["step_seconds"]["unshaped"], 0.25 * 1.05)
        self.assertEqual(len(data["tokens_per_sec"]["40"]["per_round"]), 3)   # the failed round kept as None
        self.assertIsNone(data["tokens_per_sec"]["40"]["per_round"][2])
        counted = data["bytes_per_step"]["counted"]
        self.assertAlmostEqual(counted["per_host"][0], 14.5e6)
        self.assertAlmostEqual(counted["per_host"][1], 14.5e6 * 0.95)
        self.assertAlmostEqual(counted["over_formula"], 14.5e6 / (4 * N_PARAMS))
        self.assertAlmostEqual(data["exposed_over_bytes_at_rate"]["200"], 1.05)   # the median round is 5% slow
        crossover = result["crossover"]["pipeline_1f1b"]
        # Closed form: 1F1B's bubble 1/4 of the one process's 0.2276 s.
        self.assertAlmostEqual(crossover["predicted"]["mbit"], (14.5e6 - 3.6e6) / (0.25 * 0.2276) * 8 / 1e6, places=6)
        self.assertEqual(crossover["predicted"]["bytes"], "counted")
        expected = (14.5e6 - 3.6e6) / ((0.30 - 0.25) * 1.05) * 8 / 1e6
        self.assertAlmostEqual(crossover["predicted_from_unshaped_runs"]["mbit"], expected, places=6)
        self.assertIn("fit_over_all_rates", crossover)
        self.assertGreater(crossover["measured"]["mbit"], 200)
        self.assertEqual(crossover["measured"]["bracket"], ["unshaped", "200"])
        self.assertAlmostEqual(result["h100_infiniband"]["rate_mbit"], 38.0)
        self.assertEqual(set(result["h100_infiniband"]["measured_tokens_per_sec"]), {"data", "pipeline_1f1b"})
        self.assertEqual(result["model"]["n_params"], N_PARAMS)
        self.assertEqual(len(result["single_process"]["achieved_gflops"]), 2)
        json.dumps(result)   # all of it serialisable

    def test_a_parameter_count_unlike_the_programs_is_refused(self):
        runs, short = sample_runs()
        single = {"model": MODEL, "n_params_printed": N_PARAMS + 1, "tokens_per_sec": 1.0, "step_seconds": 1.0,
                  "batch_size": 16, "log": "single.log"}
        measured = {"single": single, "singles": [], "fpt": 1.0, "core_flops": 1.0, "h100": 1.0, "short_runs": short,
                    "runs": runs, "failures": []}
        with self.assertRaisesRegex(BenchmarkError, "single.log: the program counts 3587841 parameters"):
            clb.build_result({"batch_size": 32, "model_max_length": 64, "global_tokens": 2048, "steps": 4,
                              "layouts": ["data"], "h100_layouts": []}, measured, {})

    def test_the_table_has_every_layout_rate_and_the_crossover(self):
        table = clb.format_table(sample_result())
        for text in ("D=2 bucketed", "P=2 1F1B", "unshaped", "200 Mbit/s", "40 Mbit/s", "H100+IB (38)",
                     "14.50/13.78", "14.35", "P=2 1F1B overtakes D=2 bucketed below: measured 1,744 Mbit/s "
                     "(between unshaped and 200 Mbit/s); predicted 1,533 Mbit/s", "r_x = (bytes_D - bytes_P) / (b t_1)",
                     "= 38 Mbit/s"):
            self.assertIn(text, table)

    def test_the_figure_is_written(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "cluster_layouts.png")
            clb.draw(sample_result(), path)
            with open(path, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class FakeCluster:
    def __init__(self, reason):
        self.reason = reason

    def unavailable_reason(self):
        return self.reason


class Refusal(unittest.TestCase):
    def test_no_cluster_here_is_refused_with_the_reason(self):
        with self.assertRaisesRegex(SystemExit, "refused: no emulated hosts here: scripts/cluster.py needs root"):
            clb.main(["--workdir", "/nonexistent"], cluster_module=FakeCluster("scripts/cluster.py needs root (uid 1000)"))

    def test_a_program_not_built_is_refused_naming_it(self):
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertRaisesRegex(SystemExit, f"refused: {tmp}/run_data_parallel is not built"):
                clb.main(["--build-dir", tmp], cluster_module=FakeCluster(None))

    def test_bad_flags_are_refused_by_name(self):
        for argv, message in ((["--rates", "200,40"], "must include 'unshaped'"),
                              (["--rates", "unshaped,fast"], "'fast' is neither"),
                              (["--layouts", "data,ring"], r"unknown layout\(s\) \['ring'\]"),
                              (["--steps", "1"], "--steps 1 must be at least 2")):
            with self.assertRaisesRegex(SystemExit, message):
                clb.parse_args(argv)

    def test_rates_are_ordered_fastest_first_and_fast_mode_is_short(self):
        args = clb.parse_args(["--rates", "40,unshaped,1000,200", "--fast"])
        self.assertEqual(args.rate_list, ["unshaped", "1000", "200", "40"])
        self.assertEqual((args.rounds, args.steps), (1, 3))
        self.assertTrue(math.isinf(clb.rate_bytes_per_s("unshaped")))


if __name__ == "__main__":
    unittest.main(verbosity=2)
