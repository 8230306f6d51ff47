#!/usr/bin/env python3
"""The one prepared command for a GPU machine without network. From the source tree and the bundle
scripts/gpu_bundle.sh made (.gpu_bundle/), within --budget seconds (default 450):
  1. records the machine (GPUs, driver, compilers, the python3 torch) and unpacks the bundle's
     Debian packages with dpkg -x into a prefix (never into /);
  2. takes the bundle's prebuilt programs when they were built from this very tree and load here,
     and builds them anyway in the background (niced), against this machine's LibTorch
     (python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') and the prefix, with all
     cores, only cuda_tests, run_pipeline, run_data_parallel and gpu_throughput; without usable
     prebuilt programs that build comes first;
  3. runs the CUDA tier (tests/cuda: cuda_tests, resumed past a case that hangs);
  4. runs run_pipeline on gpt2 (124M) in every mode (one device with evaluation, model parallel,
     pipeline parallel with GPipe, 1F1B with activation checkpointing, interleaved 1F1B, and the
     zero-bubble zb1p and zbv) and
     run_data_parallel --world_size 1 --backend nccl --device cuda for a few batches (and 2 ranks
     with 2 GPUs), and the --pytest gradient files of a GPU run, checked against a CPU run;
  5. runs the single-GPU throughput benchmark (scripts/run_benchmarks.py --gpu-single);
  6. writes gpu_check_report.json and gpu_check.log into $OUT, or the folder given.
Every step has its own timeout; a failure is recorded and the later steps still run. Without a
GPU every GPU step is reported as skipped ("no GPU"); --smoke then runs CPU stand-ins of the
program steps too (gpt2-tiny), so that the whole path is exercised on a CPU-only machine.

Usage: python3 scripts/gpu_check.py [OUT_DIR] [--bundle DIR] [--work DIR] [--build-dir DIR]
                                    [--binaries auto|carried|build] [--smoke] [--budget S] [--jobs N]
  --build-dir DIR  use the programs already built in this CMake binary dir (no build at all)
  --binaries       auto (default, as above) | carried (the bundle's only) | build (build first)
  --work DIR       scratch space: prefix, build, runs (default /tmp/gpu_check)
  --smoke          limit the work (gpt2-tiny, one batch; the build unoptimised) for the CPU-side test
                   of this script
       python3 scripts/gpu_check.py --source-hash
                   prints the hash of the sources the programs are compiled from (gpu_bundle.sh
                   records it beside the programs it carries)
Exit status: 0 when no step failed or timed out, 1 otherwise, 2 on bad arguments.

Only the standard library and scripts/bench_common.py (the parser of the programs' printed lines)
are imported at the top: the GPU machine has python3 with torch and nothing else, and torch is
imported only by the steps that run under the python that has it.
"""
import argparse
import datetime
import glob
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time

from bench_common import free_port, printed_figures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = ("cuda_tests", "run_pipeline", "run_data_parallel", "gpu_throughput")
BUILD_TARGETS = ("cuda_tests", "run_pipeline", "run_data_parallel", "gpu_throughput")
# What the programs are compiled from: the folders (and file) searched, and the files counted.
SOURCE_TOPS = ("CMakeLists.txt", "cmake", "include", "src", "apps", "tests", "fuzz")
SOURCE_SUFFIXES = (".cpp", ".h", ".hpp")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gpu_check.py")
    p.add_argument("out_dir", nargs="?", default=None)
    p.add_argument("--bundle", default=os.path.join(ROOT, ".gpu_bundle"))
    p.add_argument("--work", default="/tmp/gpu_check")
    p.add_argument("--build-dir", default=None)
    p.add_argument("--binaries", choices=("auto", "carried", "build"), default="auto")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--budget", type=float, default=450.0)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    a.out_dir = os.path.abspath(a.out_dir or os.environ.get("OUT") or os.path.join(ROOT, "gpu_check_out"))
    a.bundle, a.work = os.path.abspath(a.bundle), os.path.abspath(a.work)
    if a.build_dir:
        a.build_dir = os.path.abspath(a.build_dir)
    return a


def tail(text, lines=40, chars=6000):
    return "\n".join(text.splitlines()[-lines:])[-chars:]


def source_files(root):
    """The files the programs are compiled from, relative to `root`, in byte order: what
    `find CMakeLists.txt cmake include src apps tests fuzz -type f` lists of *.cpp, *.h, *.hpp and
    CMakeLists.txt (symbolic links neither counted nor followed; a missing folder is no error)."""
    found = []
    for top in SOURCE_TOPS:
        full = os.path.join(root, top)
        if os.path.isfile(full) and not os.path.islink(full):
            walk = [(root, [], [top])] if _is_source(top) else []
        elif os.path.isdir(full) and not os.path.islink(full):
            walk = ((os.path.relpath(d, root), [], names) for d, _, names in os.walk(full))
        else:
            continue
        for folder, _, names in walk:
            for name in names:
                rel = name if folder == root else os.path.join(folder, name)
                path = os.path.join(root, rel)
                if _is_source(name) and os.path.isfile(path) and not os.path.islink(path):
                    found.append(rel)
    return sorted(found, key=lambda rel: rel.encode())


def _is_source(name):
    return name == "CMakeLists.txt" or name.endswith(SOURCE_SUFFIXES)


def source_hash(root):
    """16 hex digits over the sources' contents and paths, the same on any machine the tree travels
    to (git may be absent there): sha256 of sha256sum's listing of source_files(root)."""
    listing = hashlib.sha256()
    for rel in source_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        listing.update(f"{digest}  {rel}\n".encode())
    return listing.hexdigest()[:16]


GTEST_LINE = re.compile(r"^\[\s*(RUN|OK|SKIPPED|FAILED)\s*\] ([\w/.]+)(?: \((\d+) ms\))?")


def parse_gtest(output):
    """Per case: status and seconds from a gtest run's console output (also of a killed run), the
    skip or failure message from the lines between RUN and the result."""
    cases, current, message = {}, None, []
    for line in output.splitlines():
        m = GTEST_LINE.match(line)
        if not m:
            if current:
                message.append(line)
            continue
        kind, name = m[1], m[2]
        if kind == "RUN":
            current, message = name, []
            cases[name] = {"name": name, "status": "running"}
        elif current == name:
            text = "\n".join(message).strip()
            if kind == "SKIPPED":
                text = "\n".join(l for l in message if not re.search(r":\d+: Skipped$", l)).strip()
            cases[name].update({"status": {"OK": "passed", "SKIPPED": "skipped", "FAILED": "failed"}[kind],
                                "seconds": int(m[3]) / 1000 if m[3] else None})
            if text and kind != "OK":
                cases[name]["message"] = text[-3000:]
            current = None
    return cases


def merge_gtest_json(cases, path):
    """Statuses and failure messages from gtest's JSON report (written when a run completes)."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return
    for suite in report.get("testsuites", []):
        for test in suite.get("testsuite", []):
            name = f"{suite['name']}.{test['name']}"
            case = cases.setdefault(name, {"name": name})
            failures = [f.get("failure", "") for f in test.get("failures", [])]
            if failures:
                case.update(status="failed", message="\n".join(failures)[-3000:])
            elif test.get("result") == "SKIPPED":
                case["status"] = "skipped"
            elif test.get("status") == "RUN":
                case["status"] = "passed"
            time_text = str(test.get("time", "")).rstrip("s")
            if time_text:
                try:
                    case["seconds"] = float(time_text)
                except ValueError:
                    pass


class Check:
    def __init__(self, args, source_hash):
        self.args = args
        self.source_hash = source_hash
        self.t0 = time.monotonic()
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        os.makedirs(args.out_dir, exist_ok=True)
        for sub in ("logs", "runs"):
            shutil.rmtree(os.path.join(args.work, sub), ignore_errors=True)
            os.makedirs(os.path.join(args.work, sub), exist_ok=True)
        self.log = open(os.path.join(args.out_dir, "gpu_check.log"), "w", buffering=1)
        self.steps = []
        self.report = {"check": "gpu_check", "started": self.started, "budget_seconds": args.budget,
                       "smoke": args.smoke, "source_hash": source_hash}
        self.env = dict(os.environ)
        self.env.setdefault("NCCL_DEBUG", "WARN")  # NCCL says why when it fails
        self.background = None  # the background build: (Popen, log path, start)

    # ---- time and output -------------------------------------------------------------------
    def elapsed(self):
        return time.monotonic() - self.t0

    def left(self):
        return self.args.budget - self.elapsed()

    def say(self, text):
        line = f"[gpu_check {self.elapsed():6.1f}s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")

    # ---- steps ------------------------------------------------------------------------------
    def run(self, name, command, cap, minimum=10.0, reserve=0.0, env=None, cwd=None, record=True, **extra):
        """Runs `command` with a timeout of min(cap, time left - reserve); returns the step (a dict,
        'output' holding the whole output, left out of the report)."""
        timeout = min(cap, self.left() - reserve - 5)
        step = {"name": name, "command": " ".join(shlex.quote(str(c)) for c in command), **extra}
        if timeout < minimum:
            step.update(status="skipped", reason=f"time budget: {self.left():.0f} s left, {minimum:.0f} s needed",
                        seconds=0.0, output="")
            self.say(f"{name}: skipped ({step['reason']})")
            return self._record(step) if record else step
        log_path = os.path.join(self.args.work, "logs", re.sub(r"[^\w.-]", "_", name) + ".log")
        start = time.monotonic()
        self.say(f"{name}: {step['command']} (timeout {timeout:.0f} s)")
        with open(log_path, "w") as out:
            try:
                proc = subprocess.Popen([str(c) for c in command], stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env or self.env, cwd=cwd or ROOT,
                                        start_new_session=True)
            except OSError as e:
                step.update(status="failed", reason=f"could not start: {e}", seconds=0.0, output="")
                self.say(f"{name}: failed ({step['reason']})")
                return self._record(step) if record else step
            try:
                rc = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                rc = self._stop(proc)
        seconds = time.monotonic() - start
        with open(log_path, errors="replace") as f:
            output = f.read()
        self._append_log(name, output)
        if timed_out:
            status, reason = "timed_out", f"still running after {timeout:.0f} s (stopped)"
        elif rc == 0:
            status, reason = "passed", None
        else:
            status, reason = "failed", f"exit status {rc}"
        step.update(status=status, exit_code=rc, seconds=round(seconds, 2), output=output, log_tail=tail(output))
        if reason:
            step["reason"] = reason
        self.say(f"{name}: {status} in {seconds:.1f} s" + (f" ({reason})" if reason else ""))
        return self._record(step) if record else step

    @staticmethod
    def _stop(proc):
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                return proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return None

    def _append_log(self, name, output):
        if len(output) > 2_000_000:
            output = output[:1_000_000] + "\n[... cut ...]\n" + output[-1_000_000:]
        self.log.write(f"\n===== {name} =====\n{output}\n===== end of {name} =====\n")

    def _record(self, step):
        self.steps.append(step)
        return step

    def skip(self, name, reason, **extra):
        self.say(f"{name}: skipped ({reason})")
        return self._record({"name": name, "status": "skipped", "reason": reason, "seconds": 0.0, **extra})

    # ---- machine ----------------------------------------------------------------------------
    def machine(self):
        def text(cmd):
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                return (r.stdout + r.stderr).strip()
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"unavailable: {e}"
        self.python = None
        tried = []
        for py in filter(None, [os.environ.get("HARNESS_PYTHON"), "python3", os.path.join(ROOT, ".venv/bin/python")]):
            try:
                r = subprocess.run(self_command(py, "--probe-torch"), capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                tried.append(f"{py}: {e}")
                continue
            if r.returncode == 0:
                self.python, self.torch = py, json.loads(r.stdout.strip().splitlines()[-1])
                break
            tried.append(f"{py}: {tail(r.stderr, 2)}")
        m = {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "uname": " ".join(os.uname()),
             "nvidia_smi": text(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                                 "--format=csv,noheader"]),
             "nvcc": tail(text(["nvcc", "--version"]), 2), "cmake": text(["cmake", "--version"]).splitlines()[0],
             "cxx": text([os.environ.get("CXX", "c++"), "--version"]).splitlines()[0],
             "ninja": text(["ninja", "--version"]), "libc": text(["ldd", "--version"]).splitlines()[0],
             "python": self.python, "python_tried": tried}
        if self.python:
            m.update(self.torch)
        self.gpus = self.torch["gpus"] if self.python else 0
        self.report["machine"] = m
        self.report["gpus"] = self.gpus
        self.say(f"machine: {m['cpus']} cpus, GPUs: {m['nvidia_smi'] if self.gpus else 'none'}; "
                 f"python {self.python} torch {m.get('torch')} (CUDA available: {m.get('cuda_available')})")
        if not self.python:
            self.skip("machine", "no python with torch: " + "; ".join(tried))
        return bool(self.python)

    # ---- the bundle's packages ---------------------------------------------------------------
    def unpack(self):
        prefix = os.path.join(self.args.work, "prefix")
        shutil.rmtree(prefix, ignore_errors=True)
        os.makedirs(prefix)
        self.prefix = prefix
        debs = sorted(glob.glob(os.path.join(self.args.bundle, "debs", "*.deb")))
        arch_lib = os.path.join(prefix, "usr", "lib", "x86_64-linux-gnu")
        self.env["LD_LIBRARY_PATH"] = ":".join(
            [arch_lib, self.torch["torch_lib"]] + [p for p in [os.environ.get("LD_LIBRARY_PATH")] if p])
        self.env["PKG_CONFIG_LIBDIR"] = ":".join([os.path.join(arch_lib, "pkgconfig"),
                                                  os.path.join(prefix, "usr", "share", "pkgconfig")])
        self.env["PKG_CONFIG_PATH"] = ""
        if not debs:
            self.skip("unpack", f"no .deb files in {self.args.bundle}/debs (run scripts/gpu_bundle.sh here first)")
            return
        if shutil.which("dpkg"):
            script = " && ".join(f"dpkg -x {shlex.quote(d)} {shlex.quote(prefix)}" for d in debs)
        else:  # not a Debian-based machine: the same extraction in Python (ar archive, data.tar.*)
            script = " ".join(shlex.quote(c) for c in self_command(sys.executable, "--extract-debs", prefix, *debs))
        step = self.run("unpack", ["bash", "-c", script], cap=90, debs=[os.path.basename(d) for d in debs],
                        tool="dpkg -x" if shutil.which("dpkg") else "python (no dpkg here)")
        # pkg-config files name prefix=/usr: point them at the prefix.
        for pc in glob.glob(os.path.join(prefix, "usr", "**", "*.pc"), recursive=True):
            with open(pc) as f:
                text = f.read()
            with open(pc, "w") as f:
                f.write(re.sub(r"^prefix=/usr\s*$", f"prefix={prefix}/usr", text, flags=re.M))
        return step

    def nccl_include(self):
        """A folder with nccl.h when the CUDA toolkit has none: the torch wheel's NCCL, else the bundle's."""
        cuda_home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
        if os.path.isfile(os.path.join(cuda_home, "include", "nccl.h")):
            return None
        site = os.path.dirname(os.path.dirname(self.torch["torch_lib"]))
        for candidate in glob.glob(os.path.join(site, "nvidia", "**", "include", "nccl.h"), recursive=True) + \
                [os.path.join(self.args.bundle, "include", "nccl.h")]:
            if os.path.isfile(candidate):
                return os.path.dirname(candidate)
        return None

    # ---- programs: carried, built here, or given --------------------------------------------
    def carried_usable(self):
        bindir = os.path.join(self.args.bundle, "bin")
        manifest_path = os.path.join(self.args.bundle, "manifest.json")
        if not all(os.access(os.path.join(bindir, p), os.X_OK) for p in PROGRAMS):
            return None, "the bundle has no prebuilt programs"
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
        except (OSError, ValueError) as e:
            return None, f"no readable manifest.json: {e}"
        if manifest.get("binaries_source_hash") != self.source_hash:
            return None, (f"built from other sources (hash {manifest.get('binaries_source_hash')}, "
                          f"this tree {self.source_hash})")
        if manifest.get("torch_built_against") != self.torch["torch"]:
            return None, f"built against torch {manifest.get('torch_built_against')}, here {self.torch['torch']}"
        # Whether they load here (libc, libstdc++, LibTorch): not a failure of the check if not, the
        # build then comes first.
        step = self.run("the bundle's programs load", [os.path.join(bindir, "cuda_tests"), "--gtest_list_tests"],
                        cap=60, record=False)
        self.report["carried_programs_load"] = {k: step.get(k) for k in ("status", "exit_code", "seconds", "log_tail")}
        if step["status"] != "passed":
            return None, "cuda_tests does not load here: " + tail(step.get("output", ""), 3)
        return bindir, f"built from this tree against torch {manifest['torch_built_against']} ({manifest.get('made')})"

    def configure_command(self, build):
        a = self.args
        usr = os.path.join(self.prefix, "usr")
        arch_lib = os.path.join(usr, "lib", "x86_64-linux-gnu")
        # --smoke (the CPU-side test of this script) compiles without optimisation: the same files,
        # headers and libraries, in a third less compiler time; its runs are gpt2-tiny's.
        cmd = ["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-Wno-dev", "-DCMAKE_BUILD_TYPE=Release",
               f"-DCMAKE_CXX_FLAGS_RELEASE={'-O0' if a.smoke else '-O2'} -DNDEBUG",
               f"-DTorch_DIR={self.torch['cmake_prefix_path']}/Torch", f"-DCMAKE_PREFIX_PATH={usr}",
               f"-Dnlohmann_json_DIR={usr}/share/cmake/nlohmann_json", f"-DGTest_DIR={arch_lib}/cmake/GTest",
               f"-DCXXOPTS_INCLUDE_DIR={usr}/include", f"-DGLOO_INCLUDE_DIR={usr}/include"]
        # The bundle's pkgconf (it would be found first in the prefix anyway) if it runs here, else
        # the machine's pkg-config; either reads only the prefix's .pc files (PKG_CONFIG_LIBDIR).
        pkgconf = os.path.join(usr, "bin", "pkgconf")
        try:
            runs_here = subprocess.run([pkgconf, "--version"], env=self.env, capture_output=True,
                                       timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            runs_here = False
        system = shutil.which("pkg-config", path=self.env.get("PATH")) or shutil.which("pkgconf", path=self.env.get("PATH"))
        if runs_here or system:
            cmd.append(f"-DPKG_CONFIG_EXECUTABLE={pkgconf if runs_here else system}")
        nccl = self.nccl_include()
        if nccl:
            cmd.append(f"-DCMAKE_CXX_FLAGS=-isystem {nccl}")
        return cmd

    def build_script(self, build):
        """configure, then build the four programs with every core (one shell command)."""
        configure = " ".join(shlex.quote(c) for c in self.configure_command(build))
        targets = " ".join(BUILD_TARGETS)
        return (f"set -e; mkdir -p {shlex.quote(build)}; echo '[configure]'; {configure}; "
                f"echo '[build]'; cmake --build {shlex.quote(build)} -j {self.args.jobs} --target {targets}")

    def select_programs(self):
        a = self.args
        self.build = os.path.join(a.work, "build")
        if a.build_dir:
            self.bin = {p: os.path.join(a.build_dir, "tests" if p == "cuda_tests" else "", p) for p in PROGRAMS}
            self.report["programs"] = {"from": "--build-dir", "dir": a.build_dir}
            self.skip("build", "--build-dir given: its programs are used")
            return all(os.access(p, os.X_OK) for p in self.bin.values())
        carried, why = (None, "--binaries build") if a.binaries == "build" else self.carried_usable()
        if carried:
            self.bin = {p: os.path.join(carried, p) for p in PROGRAMS}
            self.report["programs"] = {"from": "bundle", "dir": carried, "why": why}
            self.say(f"programs: the bundle's ({why})")
            if a.binaries == "auto":
                self.start_background_build()
            else:
                self.skip("build", "--binaries carried")
            return True
        self.say(f"programs: building first ({why})")
        if a.binaries == "carried":
            self.skip("build", "--binaries carried, but " + why)
            return False
        shutil.rmtree(self.build, ignore_errors=True)
        # All the time there is, but what the CUDA tier and a program or two need at least.
        step = self.run("build", ["bash", "-c", self.build_script(self.build)], cap=a.budget, minimum=60,
                        reserve=60.0 if a.smoke else 150.0)
        self.report["programs"] = {"from": "built here", "dir": self.build, "why_not_carried": why}
        self.bin = {p: os.path.join(self.build, "tests" if p == "cuda_tests" else "", p) for p in PROGRAMS}
        if step["status"] == "passed":
            return True
        fallback = os.path.join(a.bundle, "bin")
        if all(os.access(os.path.join(fallback, p), os.X_OK) for p in PROGRAMS):
            self.say("build failed: falling back to the bundle's programs, whatever they were built from")
            self.bin = {p: os.path.join(fallback, p) for p in PROGRAMS}
            self.report["programs"].update({"from": "bundle (fallback after a failed build)", "dir": fallback})
            return True
        return False

    def start_background_build(self):
        shutil.rmtree(self.build, ignore_errors=True)
        os.makedirs(self.build, exist_ok=True)
        log_path = os.path.join(self.args.work, "logs", "build.log")
        command = ["nice", "-n", "15", "bash", "-c", self.build_script(self.build)]
        self.say(f"build (background, niced): {' '.join(shlex.quote(c) for c in command)}")
        out = open(log_path, "w")
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, cwd=ROOT, start_new_session=True)
        self.background = (proc, log_path, time.monotonic(), command)

    def finish_background_build(self, reserve):
        if not self.background:
            return
        proc, log_path, start, command = self.background
        timeout = max(0.0, self.left() - reserve)
        self.say(f"build (background): waiting up to {timeout:.0f} s")
        try:
            rc = proc.wait(timeout=timeout)
            status = "passed" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc = self._stop(proc)
            status = "timed_out"
        seconds = time.monotonic() - start
        with open(log_path, errors="replace") as f:
            output = f.read()
        self._append_log("build", output)
        step = {"name": "build", "command": " ".join(shlex.quote(c) for c in command), "status": status,
                "exit_code": rc, "seconds": round(seconds, 2), "log_tail": tail(output),
                "note": "in the background, niced, while the GPU steps ran with the bundle's programs"}
        if status == "timed_out":
            step["reason"] = f"not finished after {seconds:.0f} s (stopped, the benchmark needs the machine)"
        elif status == "failed":
            step["reason"] = f"exit status {rc}"
        self.say(f"build: {status} in {seconds:.1f} s")
        self._record(step)
        self.background = None

    # ---- the CUDA tier --------------------------------------------------------------------------
    def cuda_tier(self, cap, per_run=100.0):
        """cuda_tests; when a run is stopped (a case hung past `per_run` seconds) or dies, again
        without the cases done and that one, while `cap` lasts."""
        binary = self.bin["cuda_tests"]
        cases, hung, runs = {}, [], 0
        deadline = self.elapsed() + min(cap, max(0.0, self.left() - 5))
        json_path = os.path.join(self.args.work, "cuda_tests.json")
        while runs < 4:
            exclude = [n for n, c in cases.items() if c["status"] != "running"] + hung
            flt = "*" if not exclude else "*:-" + ":".join(exclude)
            if os.path.exists(json_path):
                os.remove(json_path)
            step = self.run(f"cuda_tests#{runs + 1}", [binary, f"--gtest_filter={flt}",
                                                       f"--gtest_output=json:{json_path}"],
                            cap=min(per_run, deadline - self.elapsed()), minimum=5, record=False)
            runs += 1
            if step["status"] == "skipped":
                break
            found = parse_gtest(step["output"])
            if step["status"] != "timed_out":
                merge_gtest_json(found, json_path)
            for name, c in found.items():
                if c["status"] == "running":  # the case the run was stopped (or crashed) in
                    c.update(status="timed_out" if step["status"] == "timed_out" else "crashed",
                             message=f"the run was stopped or died inside this case ({step.get('reason')})")
                    hung.append(name)
                cases[name] = c
            if step["status"] != "timed_out" and not any(c["status"] == "crashed" for c in found.values()):
                break
        statuses = [c["status"] for c in cases.values()]
        reasons = {}
        for c in cases.values():
            if c["status"] == "skipped":
                reasons[c.get("message", "")] = reasons.get(c.get("message", ""), 0) + 1
        summary = {"total": len(cases), "passed": statuses.count("passed"), "failed": statuses.count("failed"),
                   "skipped": statuses.count("skipped"), "hung_or_crashed": hung, "runs": runs,
                   "skip_reasons": reasons, "cases": sorted(cases.values(), key=lambda c: c["name"])}
        bad = summary["failed"] or hung
        status = "failed" if bad else ("passed" if cases else "failed")
        reason = None if cases else "no test case ran"
        if bad:
            reason = f"{summary['failed']} failed, {len(hung)} hung or crashed"
        self.report["cuda_tests"] = summary
        step = {"name": "cuda_tests", "status": status, "seconds": round(sum(c.get("seconds") or 0 for c in cases.values()), 2),
                "command": f"{binary} --gtest_output=json:...", "summary": {k: v for k, v in summary.items() if k != "cases"}}
        if reason:
            step["reason"] = reason
        self.say(f"cuda_tests: {summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped"
                 + (f", hung: {hung}" if hung else "") + (f"; skip reasons: {reasons}" if reasons else ""))
        return self._record(step)

    # ---- the programs -------------------------------------------------------------------------
    def program_step(self, name, gpu_args, smoke_args, cap, needs_gpus=1, reserve=0.0, check=None):
        """A program run on the GPU(s); without them skipped, and with --smoke its CPU stand-in
        recorded beside. `check(step)` may add figures and turn a passed step into a failed one."""
        def finish(step):
            # What a run leaves in its work folder (a checkpoint: gpt2's weights and AdamW state,
            # 1.5 GB) is not needed once its output is read.
            shutil.rmtree(os.path.join(self.args.work, "runs", "run"), ignore_errors=True)
            if step.get("status") == "passed" or step.get("exit_code") is not None:
                step["figures"] = printed_figures(step.get("output", ""))
            if check and step["status"] == "passed":
                check(step)
            step.pop("output", None)
            return step
        if self.gpus >= needs_gpus:
            step = self.run(name, gpu_args, cap=cap, reserve=reserve, record=False)
            return self._record(finish(step))
        reason = "no GPU" if self.gpus == 0 else f"needs {needs_gpus} GPUs, {self.gpus} here"
        if self.args.smoke and smoke_args and self.gpus == 0:
            smoke = finish(self.run(name + " (cpu smoke)", smoke_args, cap=cap, reserve=reserve, record=False))
            return self.skip(name, reason, smoke={k: smoke[k] for k in smoke if k != "name"})
        return self.skip(name, reason)

    def programs(self, reserve):
        a = self.args
        model = "gpt2-tiny" if a.smoke else "gpt2"
        devices = "cuda:0,cuda:1" if self.gpus >= 2 else "cuda:0"
        runs = os.path.join(a.work, "runs")
        data = ["--train_size", "512", "--validation_size", "32", "--test_size", "4", "--no_progress",
                "--n_epochs", "1", "--max_batches", "1" if a.smoke else "3"]
        small = ["--model", "gpt2-tiny", "--model_max_length", "64", "--threads_per_device", "1"]
        pp = self.bin["run_pipeline"]
        dp = self.bin["run_data_parallel"]

        def pipeline(name, extra, evaluate=False, lanes="cpu:0,cpu:1"):
            common = data + ["--batch_size", "16"] + ([] if evaluate else ["--benchmark_only"]) + extra
            gpu = [pp, "--model", model, "--devices", devices if "--model_parallel_mode" in extra else "cuda:0",
                   "--workdir", os.path.join(runs, "run")] + common
            cpu = [pp, "--devices", lanes if "--model_parallel_mode" in extra else "cpu:0",
                   "--workdir", os.path.join(runs, "run")] + common + small
            def check(step):
                f = step["figures"]
                if not f.get("training") or (evaluate and not (f.get("validation_loss") and f.get("bleu"))):
                    step.update(status="failed", reason="the SPEC §7 lines are missing from the output")
            self.program_step(name, gpu, cpu, cap=120, reserve=reserve, check=check)

        pipeline("run_pipeline single device (with evaluation)", [], evaluate=True)
        pipeline("run_pipeline model_parallel", ["--model_parallel_mode", "model_parallel"])
        pipeline("run_pipeline pipeline_parallel gpipe",
                 ["--model_parallel_mode", "pipeline_parallel", "--n_chunk", "4", "--pipeline_schedule", "gpipe"])
        pipeline("run_pipeline pipeline_parallel 1f1b except_last",
                 ["--model_parallel_mode", "pipeline_parallel", "--n_chunk", "4", "--pipeline_schedule", "1f1b",
                  "--activation_checkpointing", "except_last"])
        # gpt2-tiny's 2 blocks fill 2 virtual stages of one lane (as on one GPU), not 2 x 2.
        pipeline("run_pipeline pipeline_parallel interleaved",
                 ["--model_parallel_mode", "pipeline_parallel", "--n_chunk", "4", "--pipeline_schedule", "interleaved",
                  "--virtual_stages", "2"], lanes="cpu:0")
        # The split backward: the linear layers' hooks put into a store from autograd's device
        # threads, and each W accumulates through autograd's accumulator.
        pipeline("run_pipeline pipeline_parallel zb1p",
                 ["--model_parallel_mode", "pipeline_parallel", "--n_chunk", "4", "--pipeline_schedule", "zb1p"])
        pipeline("run_pipeline pipeline_parallel zbv",
                 ["--model_parallel_mode", "pipeline_parallel", "--n_chunk", "4", "--pipeline_schedule", "zbv"],
                 lanes="cpu:0")

        def data_parallel(name, world, extra_gpu, extra_cpu, needs):
            common = data + ["--world_size", str(world), "--batch_size", str(32 * world), "--benchmark_only"]
            gpu = [dp, "--model", model, "--workdir", os.path.join(runs, "run"), "--master_port", str(free_port())] + \
                common + extra_gpu
            cpu = [dp, "--workdir", os.path.join(runs, "run"), "--master_port", str(free_port())] + \
                common + small + extra_cpu
            def check(step):
                ranks = {t["rank"] for t in step["figures"].get("training", [])}
                if ranks != set(range(world)):
                    step.update(status="failed", reason=f"training lines for ranks {sorted(ranks)}, expected {world}")
            self.program_step(name, gpu, cpu, cap=150, needs_gpus=needs, reserve=reserve, check=check)

        data_parallel("run_data_parallel --world_size 1 --backend nccl", 1,
                      ["--backend", "nccl", "--device", "cuda"], ["--backend", "gloo", "--device", "cpu"], 1)
        data_parallel("run_data_parallel --world_size 2 --backend nccl", 2,
                      ["--backend", "nccl", "--device", "cuda"], ["--backend", "gloo", "--device", "cpu"], 2)
        # ZeRO-2's reduce-scatter into the chunks and ZeRO-3's units (their storage allocated and
        # freed in place by the CUDA caching allocator, NCCL's all-gather and reduce-scatter).
        for stage in ("2", "3"):
            data_parallel(f"run_data_parallel --zero_stage {stage} --backend nccl", 1,
                          ["--backend", "nccl", "--device", "cuda", "--zero_stage", stage],
                          ["--backend", "gloo", "--device", "cpu", "--zero_stage", stage], 1)
        self.pytest_files(reserve)

    def pytest_files(self, reserve):
        """--pytest gradient files of a GPU run: loadable by torch.load with its defaults, equal to a
        CPU run's to fp32 rounding (dropout off); with 2 GPUs, two NCCL ranks' bit-identical. Without
        a GPU, --smoke compares two CPU runs instead (the same path, nothing measured)."""
        a, dp = self.args, self.bin["run_data_parallel"]
        runs = os.path.join(a.work, "runs")
        base = ["--model", "gpt2-tiny", "--model_max_length", "40", "--train_size", "64", "--validation_size", "16",
                "--test_size", "4", "--no_progress", "--dropout", "0", "--batch_size", "8", "--pytest",
                "--threads_per_device", "1"]

        def command(label, world, backend, device):
            folder = os.path.join(runs, re.sub(r"\W+", "_", label))
            return [dp] + base + ["--world_size", str(world), "--backend", backend, "--device", device,
                                  "--grad_dir", folder + "_grads", "--workdir", folder,
                                  "--master_port", str(free_port())], folder + "_grads"

        gpu_cmd, gpu_dir = command("pytest cuda", 1, "nccl", "cuda")
        smoke_cmd, smoke_dir = command("pytest cpu smoke", 1, "gloo", "cpu")
        gpu = self.program_step("pytest gradients on cuda", gpu_cmd, smoke_cmd, cap=90, reserve=reserve)
        smoke = gpu.get("smoke", {})
        ran = gpu["status"] == "passed" or smoke.get("status") == "passed"
        name = "pytest gradients: cuda equals cpu"
        if ran:
            cpu_cmd, cpu_dir = command("pytest cpu", 1, "gloo", "cpu")
            cpu = self.run("pytest gradients on cpu", cpu_cmd, cap=90, reserve=reserve)
            if cpu["status"] != "passed":
                self.skip(name, "the CPU run failed")
            elif gpu["status"] == "passed":
                self.run(name, self_command(self.python, "--compare-gradients", gpu_dir, cpu_dir), cap=90,
                         reserve=reserve)
            else:
                compared = self.run(name + " (cpu smoke)",
                                    self_command(self.python, "--compare-gradients", smoke_dir, cpu_dir),
                                    cap=90, reserve=reserve, record=False)
                compared.pop("output", None)
                self.skip(name, "no GPU", smoke={k: compared[k] for k in compared if k != "name"})
        else:
            self.skip(name, "no GPU" if self.gpus == 0 else "the GPU run failed")
        two_cmd, two_dir = command("pytest 2 ranks", 2, "nccl", "cuda")
        two = self.program_step("pytest gradients on 2 GPUs (nccl)", two_cmd, None, cap=90, needs_gpus=2,
                                reserve=reserve)
        if two["status"] == "passed":
            self.run("pytest gradients: 2 ranks bit-identical",
                     [self.python, os.path.join(ROOT, "scripts", "check_gradients.py"), two_dir],
                     cap=60, reserve=reserve)
        else:
            self.skip("pytest gradients: 2 ranks bit-identical", two.get("reason", "the 2-rank run failed"))

    # ---- the throughput benchmark ------------------------------------------------------------
    def benchmark(self):
        a = self.args
        bindir = os.path.dirname(self.bin["gpu_throughput"])
        out_dir = os.path.join(a.work, "bench")
        timeout = min(240.0, self.left() - 8)
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "run_benchmarks.py"), "--gpu-single",
               "--build-dir", bindir, "--out-dir", out_dir, "--workdir", os.path.join(a.work, "runs"),
               "--run-timeout", str(int(max(30, timeout - 15)))]
        if self.gpus == 0:
            if not a.smoke:
                return self.skip("gpu_single throughput", "no GPU")
            cmd[3:3] = ["cpu-smoke"]
        step = self.run("gpu_single throughput", cmd, cap=timeout, minimum=30, record=False)
        result_path = os.path.join(out_dir, "gpu_single.json")
        if os.path.isfile(result_path):
            with open(result_path) as f:
                step["result"] = json.load(f)
            if self.gpus:
                self.report["gpu_single"] = step["result"]
        elif step["status"] == "passed":
            step.update(status="failed", reason=f"no {result_path}")
        step.pop("output", None)
        if self.gpus == 0:  # the CPU smoke run is not the step
            return self.skip("gpu_single throughput", "no GPU", smoke={k: step[k] for k in step if k != "name"})
        return self._record(step)

    # ---- the report ---------------------------------------------------------------------------
    def write_report(self):
        report = assemble_report(self.report, self.steps, self.elapsed())
        path = os.path.join(self.args.out_dir, "gpu_check_report.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        ok = report["summary"]["ok"]
        self.say(f"report: {path}; steps {report['summary']['steps']}; {'OK' if ok else 'FAILURES'}")
        return ok


def assemble_report(report, steps, seconds):
    """The report: `report` (machine, programs, cuda_tests, gpu_single, ...) updated with the steps
    (their whole outputs dropped), each program step's training figures, the benchmark's figures
    and the summary. A step failed, timed out, or a CPU stand-in of a skipped one failed: not ok."""
    for s in steps:
        s.pop("output", None)
    counts = {}
    for s in steps:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    tier = report.get("cuda_tests", {})
    gpu_skipped = [s["name"] for s in steps
                   if s["status"] == "skipped" and s.get("reason", "").startswith(("no GPU", "needs"))]
    figures = {}
    for s in steps:
        training = (s.get("figures") or {}).get("training")
        if training:
            figures[s["name"]] = {"tokens_per_sec": [t["tokens_per_sec"] for t in training],
                                  "seconds": [t["seconds"] for t in training]}
    bench = report.get("gpu_single") or {}
    if bench.get("runs"):
        figures["gpu_single"] = {f"{r.get('tokens')} tokens {r.get('precision')}":
                                 {k: r.get(k) for k in ("batch_size", "tokens_per_second", "mfu_vs_bf16_peak",
                                                        "peak_memory_allocated_bytes", "error") if k in r}
                                 for r in bench["runs"]}
        figures["gpu_single"]["peaks_tflops"] = bench.get("peaks_tflops")
    smoke_failed = [s["name"] for s in steps if (s.get("smoke") or {}).get("status") in ("failed", "timed_out")]
    failed = counts.get("failed", 0) + counts.get("timed_out", 0) + len(smoke_failed)
    report.update({
        "seconds": round(seconds, 1),
        "steps": steps,
        "figures": figures,
        "summary": {
            "steps": counts,
            "ok": failed == 0,
            "cuda_cases": {k: tier.get(k) for k in ("total", "passed", "failed", "skipped")},
            "every_cuda_case_skipped": bool(tier.get("total")) and tier.get("skipped") == tier.get("total"),
            "gpu_steps_skipped": gpu_skipped,
            "cpu_smoke_failed": smoke_failed,
        }})
    return report


def extract_debs(prefix, debs):
    """dpkg -x for a machine without dpkg: each .deb's data.tar.* (the ar archive's member) into
    `prefix`."""
    for deb in debs:
        with open(deb, "rb") as f:
            data = f.read()
        if data[:8] != b"!<arch>\n":
            raise SystemExit(deb + ": not an ar archive")
        at = 8
        while at < len(data):
            name, size = data[at:at + 16].decode().strip().rstrip("/"), int(data[at + 48:at + 58].decode().strip())
            body = data[at + 60:at + 60 + size]
            at += 60 + size + (size & 1)
            if name.startswith("data.tar"):
                with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                    if hasattr(tarfile, "data_filter"):
                        tar.extractall(prefix, filter="tar")
                    else:
                        tar.extractall(prefix)
                break
        else:
            raise SystemExit(deb + ": no data.tar member")
    print(f"unpacked {len(debs)} packages into {prefix}")


def compare_gradients(a_dir, b_dir, tolerance=1e-4):
    """The --pytest gradient files of a GPU run (a_dir) against a CPU run's (b_dir): loadable by
    torch.load with its defaults, the same tensors, finite, equal to fp32 rounding. Runs under the
    python that has torch."""
    import torch
    a = torch.load(a_dir + "/model0_gradients.pth")
    b = torch.load(b_dir + "/model0_gradients.pth")
    if not (isinstance(a, dict) and isinstance(b, dict)):
        raise SystemExit("not dicts")
    if not (set(a) == set(b) and a):
        raise SystemExit(f"keys differ: {sorted(set(a) ^ set(b))[:5]}")
    worst = ("", 0.0)
    for name in sorted(a):
        x, y = a[name].double(), b[name].double()
        if x.shape != y.shape:
            raise SystemExit(f"{name}: {list(x.shape)} vs {list(y.shape)}")
        if not torch.isfinite(x).all():
            raise SystemExit(f"{name}: not finite on the GPU")
        err = ((x - y).norm() / max(y.norm().item(), 1e-3)).item()
        worst = max(worst, (name, err), key=lambda t: t[1])
    print(f"{len(a)} tensors; largest relative difference GPU vs CPU {worst[1]:.3g} ({worst[0]})")
    if worst[1] > tolerance:
        raise SystemExit(f"above the fp32 tolerance {tolerance:g}")


def probe_torch():
    """One JSON line: this python's torch, its CUDA and GPUs, where its LibTorch is."""
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "cuda_available": torch.cuda.is_available(), "gpus": n,
                      "names": [torch.cuda.get_device_name(i) for i in range(n)],
                      "cmake_prefix_path": torch.utils.cmake_prefix_path,
                      "torch_lib": os.path.join(os.path.dirname(torch.__file__), "lib")}))


# Steps the check runs as commands of this file (under another python, with their own timeout).
INTERNAL = {"--probe-torch": lambda args: probe_torch(),
            "--compare-gradients": lambda args: compare_gradients(*args),
            "--extract-debs": lambda args: extract_debs(args[0], args[1:])}


def self_command(python, what, *args):
    return [python, os.path.abspath(__file__), what, *map(str, args)]


def main(argv):
    if argv[:1] == ["--source-hash"]:
        print(source_hash(ROOT))
        return 0
    if argv[:1] and argv[0] in INTERNAL:
        INTERNAL[argv[0]](argv[1:])
        return 0
    args = parse_args(argv)
    check = Check(args, source_hash(ROOT))
    check.say(f"gpu_check: tree {ROOT} (sources {check.source_hash}), bundle {args.bundle}, work {args.work}, "
              f"report in {args.out_dir}, budget {args.budget:.0f} s{', smoke' if args.smoke else ''}")
    try:
        if check.machine():
            check.unpack()
            if check.select_programs():
                bench_reserve = 0.0 if (check.gpus == 0 and not args.smoke) else (40.0 if args.smoke else 150.0)
                check.cuda_tier(cap=200)
                check.programs(reserve=bench_reserve)
                check.finish_background_build(reserve=bench_reserve)
                check.benchmark()
            else:
                check.skip("everything after the build", "no programs to run")
    except Exception as e:  # the report is written whatever happens
        import traceback
        check.say("gpu_check: internal error: " + "".join(traceback.format_exception_only(type(e), e)).strip())
        check._record({"name": "gpu_check", "status": "failed", "reason": traceback.format_exc()[-3000:], "seconds": 0.0})
    finally:
        if check.background:
            check._stop(check.background[0])
    ok = check.write_report()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
