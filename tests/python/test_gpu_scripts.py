"""The GPU machine's check, tested as far as a CPU allows (issue 15): scripts/gpu_bundle.sh builds
the bundle (Debian packages, nccl.h, the stripped programs) under 64 MiB; scripts/gpu_check.sh
runs end to end with CUDA absent, in a clean prefix unpacked from the bundle alone, builds the
programs from it (every header and library of the bundle's packages taken from the prefix, none
from /usr), reports every CUDA case as skipped with its reason and writes a well-formed report; a
second run takes the bundle's own programs. gpu_throughput refuses without a GPU, naming it.

The work folder is build-gpu-check-test/ in the source tree, the same on every run, so that with
CCACHE_BASEDIR set to the tree ccache finds the previous run's objects: a warm run costs the
configure, the links and the check's own runs (--smoke: gpt2-tiny, one batch)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import unittest

SOURCE = os.environ.get("HARNESS_SOURCE_DIR",
                        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
WORK = os.path.join(SOURCE, "build-gpu-check-test")
BUNDLE = os.path.join(WORK, "bundle")  # kept between runs: its .deb files are not downloaded again
LIMIT = 64 * 1024 * 1024
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
            ["bash", os.path.join(SOURCE, "scripts", "gpu_check.sh"), cls.out, "--bundle", BUNDLE,
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
                     "run_pipeline pipeline_parallel interleaved", "run_data_parallel --world_size 1 --backend nccl",
                     "run_data_parallel --world_size 2 --backend nccl", "pytest gradients on cuda",
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
            ["bash", os.path.join(SOURCE, "scripts", "gpu_check.sh"), out, "--bundle", BUNDLE,
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


if __name__ == "__main__":
    unittest.main()
