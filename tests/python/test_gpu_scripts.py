"""The GPU machine's check, tested as far as a CPU allows (issue 15): scripts/gpu_bundle.sh builds
the bundle (Debian packages, nccl.h, the stripped programs) under 64 MiB; scripts/gpu_check.py
runs end to end with CUDA absent, in a clean prefix unpacked from the bundle alone, builds the
programs from it (every header and library of the bundle's packages taken from the prefix, none
from /usr), reports every CUDA case as skipped with its reason and writes a well-formed report; a
second run takes the bundle's own programs. gpu_throughput refuses without a GPU, naming it.

The work folder is build-gpu-check-test/ in the source tree, the same on every run, so that with
CCACHE_BASEDIR set to the tree ccache finds the previous run's objects: a warm run costs the
configure, the links and the check's own runs (--smoke: gpt2-tiny, one batch).

GpuCheckPieces tests the check's parts that need no programs (the source hash, the parsers of
gtest's output, the printed figures, the report's assembly, the .deb extraction, the gradient
comparison) in a second or two."""
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import unittest

SOURCE = os.environ.get("HARNESS_SOURCE_DIR",
                        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
WORK = os.path.join(SOURCE, "build-gpu-check-test")
BUNDLE = os.path.join(WORK, "bundle")  # kept between runs: its .deb files are not downloaded again
LIMIT = 64 * 1024 * 1024
# The check as the GPU machine runs it: the plain python3 there, which has torch and nothing else.
CHECK = [shutil.which("python3") or sys.executable, os.path.join(SOURCE, "scripts", "gpu_check.py")]
sys.path.insert(0, os.path.join(SOURCE, "scripts"))
import gpu_check  # noqa: E402
# The bundle's packages, whose files must come from the prefix in the build (not from /usr).
BUNDLE_HEADERS = re.compile(r"^\s*/usr/include/(nlohmann/|gloo/|gtest/|gmock/|sentencepiece|cxxopts\.hpp)", re.M)


def run(cmd, timeout, env=None):
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=SOURCE)
    return proc, time.monotonic() - start


def check_env():
    env = dict(os.environ)
    env["HARNESS_PYTHON"] = os.path.join(SOURCE, ".venv", "bin", "python")
    # Paths under the tree become relative for ccache, so this run hits the objects of the last.
    env["CCACHE_BASEDIR"] = SOURCE
    env["CCACHE_NOHASHDIR"] = "1"
    env.pop("OUT", None)
    return env


class GpuCheckOnACpu(unittest.TestCase):
    timings = {}

    @classmethod
    def setUpClass(cls):
        if shutil.which("dpkg") is None or shutil.which("apt-get") is None:
            raise unittest.SkipTest("needs dpkg and apt-get (a Debian or Ubuntu machine)")
        os.makedirs(WORK, exist_ok=True)
        for folder in ("work", "out", "work-carried", "out-carried"):
            shutil.rmtree(os.path.join(WORK, folder), ignore_errors=True)
        env = check_env()
        # The programs as the CI build made them (no build here); carried when they are up to date.
        proc, cls.timings["bundle"] = run(["bash", os.path.join(SOURCE, "scripts", "gpu_bundle.sh"), "--out", BUNDLE,
                                           "--build-dir", BINARY, "--no-build"], 600, env)
        cls.bundle_proc = proc
        if proc.returncode != 0:
            raise AssertionError(f"gpu_bundle.sh exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        # The check, building from the bundle alone in a clean prefix, with CUDA absent.
        cls.out = os.path.join(WORK, "out")
        proc, cls.timings["check_with_build"] = run(
            CHECK + [cls.out, "--bundle", BUNDLE,
             "--work", os.path.join(WORK, "work"), "--binaries", "build", "--smoke", "--budget", "1500"], 1700, env)
        cls.check_proc = proc
        with open(os.path.join(cls.out, "gpu_check_report.json")) as f:
            cls.report = json.load(f)

    @classmethod
    def tearDownClass(cls):
        # The builds (hundreds of MB); the bundle stays (its .deb files), and the reports and logs.
        for folder in ("work", "work-carried"):
            shutil.rmtree(os.path.join(WORK, folder, "build"), ignore_errors=True)
        print(f"\n[test_gpu_scripts] seconds: {json.dumps({k: round(v, 1) for k, v in cls.timings.items()})}",
              file=sys.stderr)

    def step(self, report, name):
        found = [s for s in report["steps"] if s["name"] == name]
        self.assertEqual(len(found), 1, f"step {name!r} in {[s['name'] for s in report['steps']]}")
        return found[0]

    def test_bundle_holds_the_packages_and_is_under_64_mib(self):
        size = int(self.bundle_proc.stdout.strip().splitlines()[-1])
        self.assertLess(size, LIMIT)
        self.assertIn("travels with the tree", self.bundle_proc.stdout)
        debs = os.listdir(os.path.join(BUNDLE, "debs"))
        for package in ("libsentencepiece-dev", "libsentencepiece0", "nlohmann-json3-dev", "libcxxopts-dev",
                        "libgloo-dev", "libgtest-dev", "libgmock-dev", "pkgconf-bin", "libpkgconf3"):
            self.assertIn(package + ".deb", debs)
        with open(os.path.join(BUNDLE, "manifest.json")) as f:
            manifest = json.load(f)
        self.assertIn("libsentencepiece-dev", manifest["packages"])
        self.assertTrue(os.path.isfile(os.path.join(BUNDLE, "include", "nccl.h")))
        total = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(BUNDLE) for n in names)
        self.assertLess(total, LIMIT)

    def test_check_runs_end_to_end_and_every_cuda_case_is_skipped(self):
        r = self.report
        self.assertEqual(self.check_proc.returncode, 0, self.check_proc.stdout[-4000:] + self.check_proc.stderr[-2000:])
        self.assertTrue(r["summary"]["ok"], json.dumps(r["summary"], indent=1))
        self.assertEqual(r["gpus"], 0)
        self.assertTrue(r["smoke"])
        self.assertEqual(sorted(os.listdir(self.out)), ["gpu_check.log", "gpu_check_report.json"])
        tier = r["cuda_tests"]
        self.assertGreaterEqual(tier["total"], 15)
        self.assertEqual(tier["skipped"], tier["total"])
        self.assertTrue(r["summary"]["every_cuda_case_skipped"])
        for case in tier["cases"]:
            self.assertEqual(case["status"], "skipped", case["name"])
            self.assertEqual(case.get("message"), "no GPU", case["name"])  # the first check of every case
        # Every GPU step is skipped for want of a GPU, its CPU stand-in (--smoke) passed.
        for name in ("run_pipeline single device (with evaluation)", "run_pipeline model_parallel",
                     "run_pipeline pipeline_parallel gpipe", "run_pipeline pipeline_parallel 1f1b except_last",
                     "run_pipeline pipeline_parallel interleaved", "run_pipeline pipeline_parallel zb1p",
                     "run_pipeline pipeline_parallel zbv", "run_data_parallel --world_size 1 --backend nccl",
                     "run_data_parallel --world_size 2 --backend nccl", "run_data_parallel --zero_stage 2 --backend nccl",
                     "run_data_parallel --zero_stage 3 --backend nccl", "pytest gradients on cuda",
                     "pytest gradients: cuda equals cpu", "gpu_single throughput"):
            s = self.step(r, name)
            self.assertEqual(s["status"], "skipped", name)
            self.assertEqual(s["reason"], "no GPU", name)
            self.assertEqual(s["smoke"]["status"], "passed", f"{name}: {json.dumps(s['smoke'])[-3000:]}")
            self.assertIn(name, r["summary"]["gpu_steps_skipped"])
        evaluated = self.step(r, "run_pipeline single device (with evaluation)")["smoke"]["figures"]
        self.assertTrue(evaluated["training"] and evaluated["validation_loss"] and evaluated["bleu"])
        bench = self.step(r, "gpu_single throughput")["smoke"]["result"]
        self.assertTrue(bench["cpu_smoke"])
        self.assertEqual({(x["tokens"], x["precision"]) for x in bench["runs"]},
                         {(16, "fp32"), (16, "bf16"), (32, "fp32"), (32, "bf16")})
        for x in bench["runs"]:
            self.assertGreater(x["tokens_per_second"], 0.0, x)
            self.assertGreaterEqual(x["largest_batch_that_fits"], 1, x)
        self.assertLess(r["seconds"], r["budget_seconds"])

    def test_the_build_took_the_bundle_packages_from_the_prefix_alone(self):
        r = self.report
        self.assertEqual(r["programs"]["from"], "built here")
        self.assertEqual(self.step(r, "build")["status"], "passed")
        build = os.path.join(WORK, "work", "build")
        prefix = os.path.join(WORK, "work", "prefix")
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            cache = f.read()
        for key in ("nlohmann_json_DIR", "GTest_DIR", "CXXOPTS_INCLUDE_DIR", "GLOO_INCLUDE_DIR",
                    "SENTENCEPIECE_INCLUDE_DIRS", "pkgcfg_lib_SENTENCEPIECE_sentencepiece"):
            m = re.search(rf"^{key}(?::\w+)?=(.*)$", cache, re.M)
            self.assertTrue(m, f"{key} not in CMakeCache.txt")
            self.assertTrue(m[1].startswith(prefix), f"{key}={m[1]} is not under {prefix}")
        # Every header each object was compiled from (ninja's dependency log): none of the bundle's
        # packages from /usr/include.
        deps = subprocess.run(["ninja", "-C", build, "-t", "deps"], capture_output=True, text=True).stdout
        # (paths under the tree show relative to the build folder: ccache's CCACHE_BASEDIR)
        for header in ("nlohmann/json.hpp", "sentencepiece_processor.h", "gtest/gtest.h", "cxxopts.hpp",
                       "gloo/algorithm.h"):
            self.assertRegex(deps, rf"(?m)^\s*(\.\./|{re.escape(os.path.dirname(prefix))}/)prefix/usr/include/"
                                   rf"{re.escape(header)}$")
        self.assertIsNone(BUNDLE_HEADERS.search(deps), BUNDLE_HEADERS.search(deps))
        # The programs load SentencePiece from the prefix.
        ldd = subprocess.run(["ldd", os.path.join(build, "run_pipeline")], capture_output=True, text=True).stdout
        self.assertRegex(ldd, rf"libsentencepiece\.so\.0 => {re.escape(prefix)}/usr/lib/")

    def test_a_second_run_takes_the_bundles_programs(self):
        with open(os.path.join(BUNDLE, "manifest.json")) as f:
            manifest = json.load(f)
        if not manifest.get("binaries_source_hash"):
            self.skipTest(f"the programs in {BINARY} are not up to date with the tree: the bundle carries none")
        out = os.path.join(WORK, "out-carried")
        proc, self.timings["check_carried"] = run(
            CHECK + [out, "--bundle", BUNDLE,
             "--work", os.path.join(WORK, "work-carried"), "--binaries", "carried", "--budget", "300"], 400, check_env())
        with open(os.path.join(out, "gpu_check_report.json")) as f:
            report = json.load(f)
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-2000:])
        self.assertEqual(report["programs"]["from"], "bundle")
        self.assertEqual(report["carried_programs_load"]["status"], "passed")
        self.assertEqual(self.step(report, "build")["reason"], "--binaries carried")
        self.assertTrue(report["summary"]["every_cuda_case_skipped"])
        self.assertEqual(self.step(report, "gpu_single throughput")["reason"], "no GPU")  # no --smoke: not run

    def test_gpu_throughput_refuses_without_a_gpu(self):
        proc, _ = run([os.path.join(BINARY, "gpu_throughput")], 120)
        self.assertEqual(proc.returncode, 3, proc.stderr)
        self.assertIn("no GPU", proc.stderr)
        proc, _ = run([sys.executable, os.path.join(SOURCE, "scripts", "run_benchmarks.py"), "--gpu-single",
                       "--build-dir", BINARY, "--out-dir", os.path.join(WORK, "bench-refused")], 120)
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertIn("no GPU", proc.stderr)


class GpuCheckPieces(unittest.TestCase):
    """gpu_check.py's parts, without programs, a build or a GPU."""

    def test_source_hash_is_sha256sum_of_the_sorted_listing_of_sources_alone(self):
        with tempfile.TemporaryDirectory() as root:
            files = {"CMakeLists.txt": b"project(x)\n", "src/b.cpp": b"int b;\n", "src/a.h": b"#pragma once\n",
                     "src/Z.hpp": b"//\n", "tests/CMakeLists.txt": b"add()\n", "apps/p.cpp": b"int main(){}\n"}
            for rel, data in files.items():
                os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
                with open(os.path.join(root, rel), "wb") as f:
                    f.write(data)
            with open(os.path.join(root, "src", "notes.md"), "w") as f:  # not a source
                f.write("x")
            os.symlink("b.cpp", os.path.join(root, "src", "link.cpp"))  # find -type f leaves links out
            listed = gpu_check.source_files(root)
            self.assertEqual(listed, sorted(files, key=str.encode))  # byte order: "src/Z.hpp" before "src/a.h"
            listing = "".join(f"{hashlib.sha256(files[r]).hexdigest()}  {r}\n" for r in listed)
            expected = hashlib.sha256(listing.encode()).hexdigest()[:16]
            self.assertEqual(gpu_check.source_hash(root), expected)
            if shutil.which("sha256sum"):  # what the hash has always been: find | sort | sha256sum
                shell = subprocess.run(
                    "find CMakeLists.txt cmake include src apps tests fuzz -type f \\( -name '*.cpp' -o -name '*.h' "
                    "-o -name '*.hpp' -o -name 'CMakeLists.txt' \\) 2>/dev/null | LC_ALL=C sort | xargs sha256sum "
                    "| sha256sum | cut -c1-16", shell=True, cwd=root, capture_output=True, text=True).stdout.strip()
                self.assertEqual(shell, expected)
            with open(os.path.join(root, "src", "notes.md"), "w") as f:
                f.write("changed")
            self.assertEqual(gpu_check.source_hash(root), expected)
            with open(os.path.join(root, "src", "b.cpp"), "w") as f:
                f.write("int b = 1;\n")
            self.assertNotEqual(gpu_check.source_hash(root), expected)

    def test_source_hash_command_prints_the_trees_hash(self):
        proc = subprocess.run(CHECK + ["--source-hash"], capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), gpu_check.source_hash(SOURCE))

    def test_printed_figures_reads_both_programs_lines(self):
        output = "\n".join([
            "loading gpt2-tiny",
            "Epoch 0: Training Time = 1.5, Tokens_per_sec = 100.25",
            "Epoch 0: Validation Loss = 3.5",
            "Epoch 0: BLEU = 0.125",
            "Epoch 1 on Rank 1: Training Time = 2.000, Tokens_per_sec = 4e3",
            "[rank 0] Epoch 1 on Rank 0: Training Time = 2.5, Tokens_per_sec = nan",
            "Epoch 2: Training Time = 1.5 seconds, Tokens_per_sec = 1",  # not the form: not a figure
        ])
        f = gpu_check.printed_figures(output)
        self.assertEqual(f["training"][:2], [{"epoch": 0, "rank": 0, "seconds": 1.5, "tokens_per_sec": 100.25},
                                             {"epoch": 1, "rank": 1, "seconds": 2.0, "tokens_per_sec": 4000.0}])
        self.assertEqual(len(f["training"]), 3)
        self.assertTrue(math.isnan(f["training"][2]["tokens_per_sec"]))
        self.assertEqual(f["validation_loss"], [{"epoch": 0, "rank": 0, "value": 3.5}])
        self.assertEqual(f["bleu"], [{"epoch": 0, "rank": 0, "value": 0.125}])
        self.assertEqual(gpu_check.printed_figures("nothing here\n"), {})

    def test_parse_gtest_reads_a_killed_run_and_the_skip_messages(self):
        output = "\n".join([
            "[==========] Running 4 tests from 1 test suite.",
            "[ RUN      ] Cuda.Skips",
            "/src/tests/cuda/gpt2_cuda_test.cpp:12: Skipped",
            "no GPU",
            "[  SKIPPED ] Cuda.Skips (0 ms)",
            "[ RUN      ] Cuda.Passes",
            "[       OK ] Cuda.Passes (1500 ms)",
            "[ RUN      ] Cuda.Fails",
            "tests/cuda/x.cpp:3: Failure",
            "Expected equality",
            "[  FAILED  ] Cuda.Fails (7 ms)",
            "[ RUN      ] Cuda.Hangs",
            "still going",
        ])
        cases = gpu_check.parse_gtest(output)
        self.assertEqual(cases["Cuda.Skips"], {"name": "Cuda.Skips", "status": "skipped", "seconds": 0.0,
                                               "message": "no GPU"})
        self.assertEqual(cases["Cuda.Passes"], {"name": "Cuda.Passes", "status": "passed", "seconds": 1.5})
        self.assertEqual(cases["Cuda.Fails"]["status"], "failed")
        self.assertIn("Expected equality", cases["Cuda.Fails"]["message"])
        self.assertEqual(cases["Cuda.Hangs"], {"name": "Cuda.Hangs", "status": "running"})

    def test_merge_gtest_json_takes_statuses_failures_and_times(self):
        cases = {"Cuda.A": {"name": "Cuda.A", "status": "running"}}
        report = {"testsuites": [{"name": "Cuda", "testsuite": [
            {"name": "A", "status": "RUN", "result": "COMPLETED", "time": "0.25s",
             "failures": [{"failure": "x.cpp:1\nExpected 1"}]},
            {"name": "B", "status": "RUN", "result": "SKIPPED", "time": "0s"},
            {"name": "C", "status": "RUN", "result": "COMPLETED", "time": "1.5s"}]}]}
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "cuda_tests.json")
            with open(path, "w") as f:
                json.dump(report, f)
            gpu_check.merge_gtest_json(cases, path)
            gpu_check.merge_gtest_json(cases, os.path.join(tmp, "missing.json"))  # a killed run: no file
        self.assertEqual(cases["Cuda.A"], {"name": "Cuda.A", "status": "failed", "message": "x.cpp:1\nExpected 1",
                                           "seconds": 0.25})
        self.assertEqual(cases["Cuda.B"]["status"], "skipped")
        self.assertEqual(cases["Cuda.C"], {"name": "Cuda.C", "status": "passed", "seconds": 1.5})

    def test_assemble_report_summarises_the_steps(self):
        steps = [
            {"name": "cuda_tests", "status": "passed", "seconds": 3.0},
            {"name": "run_pipeline model_parallel", "status": "passed", "seconds": 9.0, "output": "all of it",
             "figures": {"training": [{"epoch": 0, "rank": 0, "seconds": 2.0, "tokens_per_sec": 512.0}]}},
            {"name": "run_data_parallel --world_size 2 --backend nccl", "status": "skipped",
             "reason": "needs 2 GPUs, 1 here", "seconds": 0.0},
            {"name": "pytest gradients on cuda", "status": "skipped", "reason": "no GPU", "seconds": 0.0,
             "smoke": {"status": "passed"}},
            {"name": "build", "status": "skipped", "reason": "--binaries carried", "seconds": 0.0},
        ]
        base = {"check": "gpu_check", "cuda_tests": {"total": 2, "passed": 0, "failed": 0, "skipped": 2},
                "gpu_single": {"peaks_tflops": {"bf16": 900.0}, "runs": [
                    {"tokens": 1024, "precision": "bf16", "batch_size": 8, "tokens_per_second": 1e5,
                     "mfu_vs_bf16_peak": 0.4, "peak_memory_allocated_bytes": 7, "largest_batch_that_fits": 8}]}}
        r = gpu_check.assemble_report(base, steps, 12.345)
        self.assertIs(r, base)
        self.assertEqual(r["seconds"], 12.3)
        self.assertNotIn("output", r["steps"][1])
        self.assertEqual(r["figures"]["run_pipeline model_parallel"], {"tokens_per_sec": [512.0], "seconds": [2.0]})
        self.assertEqual(r["figures"]["gpu_single"], {
            "1024 tokens bf16": {"batch_size": 8, "tokens_per_second": 1e5, "mfu_vs_bf16_peak": 0.4,
                                 "peak_memory_allocated_bytes": 7},
            "peaks_tflops": {"bf16": 900.0}})
        self.assertEqual(r["summary"], {
            "steps": {"passed": 2, "skipped": 3}, "ok": True,
            "cuda_cases": {"total": 2, "passed": 0, "failed": 0, "skipped": 2},
            "every_cuda_case_skipped": True,
            "gpu_steps_skipped": ["run_data_parallel --world_size 2 --backend nccl", "pytest gradients on cuda"],
            "cpu_smoke_failed": []})
        # A failed CPU stand-in fails the check, as does a step that timed out.
        steps[3]["smoke"]["status"] = "failed"
        self.assertFalse(gpu_check.assemble_report({}, steps, 1.0)["summary"]["ok"])
        steps[3]["smoke"]["status"] = "passed"
        steps.append({"name": "cuda_tests#2", "status": "timed_out", "seconds": 100.0})
        r = gpu_check.assemble_report({}, steps, 1.0)
        self.assertFalse(r["summary"]["ok"])
        self.assertEqual(r["summary"]["cuda_cases"], {"total": None, "passed": None, "failed": None, "skipped": None})
        self.assertFalse(r["summary"]["every_cuda_case_skipped"])

    def test_extract_debs_unpacks_the_data_member(self):
        def member(name, body):
            header = f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(body):<10}`\n".encode()
            return header + body + (b"\n" if len(body) % 2 else b"")
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w:xz") as tar:
            payload = b"#pragma once\n"
            info = tarfile.TarInfo("./usr/include/thing.h")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        with tempfile.TemporaryDirectory() as tmp:
            deb = os.path.join(tmp, "thing.deb")
            with open(deb, "wb") as f:
                f.write(b"!<arch>\n" + member("debian-binary", b"2.0\n") + member("control.tar.xz", b"x")
                        + member("data.tar.xz", data.getvalue()))
            prefix = os.path.join(tmp, "prefix")
            proc = subprocess.run(CHECK + ["--extract-debs", prefix, deb], capture_output=True, text=True,
                                  timeout=60)
            self.assertEqual(proc.returncode, 0, proc.stderr)
            self.assertIn("unpacked 1 packages", proc.stdout)
            with open(os.path.join(prefix, "usr", "include", "thing.h")) as f:
                self.assertEqual(f.read(), "#pragma once\n")
            with open(deb, "wb") as f:
                f.write(b"not a deb")
            proc = subprocess.run(CHECK + ["--extract-debs", prefix, deb], capture_output=True, text=True,
                                  timeout=60)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn("not an ar archive", proc.stderr)

    def test_compare_gradients_accepts_fp32_rounding_and_names_a_larger_difference(self):
        try:
            import torch
        except ImportError:
            self.skipTest("needs torch")
        with tempfile.TemporaryDirectory() as tmp:
            a, b, c = (os.path.join(tmp, n) for n in "abc")
            w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
            for folder, grads in ((a, {"wte.weight": w}), (b, {"wte.weight": w * (1 + 1e-7)}),
                                  (c, {"wte.weight": w + 1})):
                os.makedirs(folder)
                torch.save(grads, os.path.join(folder, "model0_gradients.pth"))
            ok = subprocess.run([sys.executable, CHECK[1], "--compare-gradients", a, b], capture_output=True,
                                text=True, timeout=120)
            self.assertEqual(ok.returncode, 0, ok.stderr)
            self.assertIn("1 tensors; largest relative difference", ok.stdout)
            bad = subprocess.run([sys.executable, CHECK[1], "--compare-gradients", a, c], capture_output=True,
                                 text=True, timeout=120)
            self.assertNotEqual(bad.returncode, 0)
            self.assertIn("(wte.weight)", bad.stdout)
            self.assertIn("above the fp32 tolerance", bad.stderr)


if __name__ == "__main__":
    unittest.main()
