"""Checkpoints and resuming, end to end with real processes and real `kill -9`: a run killed after
a checkpoint and restarted with --resume auto ends bit-identical to the same run left alone
(dropout on) in every layout; a kill in the middle of a checkpoint write, corrupted, truncated and
mismatched checkpoints; another world size or tensor-parallel size; the launcher's --max_restarts;
and real torchrun with --max-restarts. Uses gpt2-tiny and a few batches so that each run takes
seconds."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

SOURCE = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "scripts"))
from fault_injection import descendants  # noqa: E402  every process below a pid, from /proc
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from after_adamw import weight_problems  # noqa: E402  weights of two runs compared as AdamW guarantees
DP = os.path.join(BINARY, "run_data_parallel")
PP = os.path.join(BINARY, "run_pipeline")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

NUMBER = r"(-?\d+(?:\.\d+)?)"
LOSS = re.compile(rf"^Epoch (\d+)(?: on Rank (\d+))?: Validation Loss = {NUMBER}$")
BLEU = re.compile(rf"^Epoch (\d+)(?: on Rank (\d+))?: BLEU = {NUMBER}$")
TRAIN = re.compile(rf"^Epoch (\d+)(?: on Rank (\d+))?: Training Time = {NUMBER}, Tokens_per_sec = {NUMBER}$")
SAVED = re.compile(r"checkpoint: saved (\S+) \(step (\d+),")

# Two epochs of four batches of 8, dropout on, a checkpoint after every optimizer step.
TINY = ["--model", "gpt2-tiny", "--model_max_length", "40", "--train_size", "32", "--validation_size", "8",
        "--test_size", "2", "--no_progress", "--batch_size", "8", "--n_epochs", "2", "--max_batches", "4",
        "--dropout", "0.1", "--learning_rate", "3e-3", "--checkpoint_every", "1"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, timeout=300, check=True, env=None):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def weights(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def environ_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return {}


class Watched:
    """A program running in the background whose stderr lines are collected as they come."""

    def __init__(self, args, env=None):
        # The program's temporary folder is its own, removed in finish(): a launcher killed with
        # everything it started (kill_all, a machine lost) cannot remove its scratch folder.
        self.tmp = tempfile.mkdtemp(prefix="watched-")
        env = dict(os.environ if env is None else env, TMPDIR=self.tmp)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        self.err, self.out = [], []
        self.changed = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True)]
        for r in self.readers:
            r.start()

    def _read(self, stream, lines):
        for line in stream:
            with self.changed:
                lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, predicate, timeout=180):
        deadline = time.time() + timeout
        with self.changed:
            while True:
                for line in self.err:
                    m = predicate(line)
                    if m:
                        return m
                if self.proc.poll() is not None and not any(r.is_alive() for r in self.readers):
                    raise AssertionError("the program ended first:\n" + "\n".join(self.err[-30:]))
                left = deadline - time.time()
                if left <= 0:
                    raise AssertionError("timed out; stderr:\n" + "\n".join(self.err[-30:]))
                self.changed.wait(min(left, 1.0))

    def kill_all(self):
        """kill -9 to the program and everything it started."""
        for pid in [self.proc.pid] + descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.finish()

    def finish(self, timeout=300):
        self.proc.wait(timeout=timeout)
        for r in self.readers:
            r.join(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return self.proc.returncode


def saved_step_at_least(k):
    def predicate(line):
        m = SAVED.search(line)
        return m if m and int(m[2]) >= k else None
    return predicate


def resume_without_learning(test, layout, checkpoint, tmp, name, epochs):
    """Resumes `checkpoint` (4 * (epochs - 1) steps of TINY in) under `layout` for one more epoch at
    learning rate 0, checks that the run ends with the checkpoint's weights bit for bit, and returns
    the checkpoint that epoch ends with."""
    torch = __import__("torch")
    work = os.path.join(tmp, name)
    proc = run([DP, "--master_port", str(free_port()), "--workdir", work, "--resume", checkpoint] + layout + TINY +
               ["--learning_rate", "0", "--n_epochs", str(epochs)], timeout=600)
    test.assertIn("continuing from " + checkpoint, proc.stderr)
    a, b = weights(checkpoint), weights(work)
    test.assertEqual(sorted(a), sorted(b), name)
    for key in a:
        test.assertTrue(torch.equal(a[key], b[key]), f"{name}: {key}")
    return os.path.join(work, "checkpoints", "step-%08d" % (4 * epochs))


def lines(pattern, text):
    return {(int(m[1]), m[2]): m[3] for m in (pattern.match(l) for l in text.splitlines()) if m}


class ResumeIsExact(unittest.TestCase):
    """Killed after step k (k = 3: inside the first epoch; k = 5: inside the second), resumed with
    --resume auto: the final weights equal the undisturbed run's bit for bit, and so do the
    validation losses and BLEU printed after the resume."""

    def check_layout(self, program, extra, kill_after=3, env=None):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            ports = lambda: ["--master_port", str(free_port())] if program == DP else []
            plain = os.path.join(tmp, "plain")
            undisturbed = run([program, "--workdir", plain] + ports() + TINY + extra)
            work = os.path.join(tmp, "killed")
            watched = Watched([program, "--workdir", work] + ports() + TINY + extra, env=env)
            try:
                watched.wait_for(saved_step_at_least(kill_after))
            finally:
                watched.kill_all()
            resumed = run([program, "--workdir", work, "--resume", "auto"] + ports() + TINY + extra)
            m = re.search(r"resume: continuing from (\S+) \(step (\d+), epoch (\d+), batch (\d+)\)", resumed.stderr)
            self.assertIsNotNone(m, resumed.stderr)
            self.assertGreaterEqual(int(m[2]), kill_after)
            a, b = weights(plain), weights(work)
            self.assertEqual(set(a), set(b))
            for name in a:
                self.assertTrue(torch.equal(a[name], b[name]), f"{name} differs after the resume")
            first_epoch = int(m[3])
            for pattern in (LOSS, BLEU):
                before, after = lines(pattern, undisturbed.stdout), lines(pattern, resumed.stdout)
                expected = {k: v for k, v in before.items() if k[0] >= first_epoch}
                self.assertEqual(after, expected)
            # The summary covers every epoch, the resumed ones included.
            self.assertRegex(resumed.stdout, r"raining time: avg:")
            self.assertEqual(len(lines(TRAIN, resumed.stdout)), len([k for k in lines(TRAIN, undisturbed.stdout) if k[0] >= first_epoch]))
            return resumed

    def test_data_parallel_one_rank(self):
        self.check_layout(DP, ["--world_size", "1"])

    def test_data_parallel_two_ranks_bucketed(self):
        self.check_layout(DP, ["--world_size", "2", "--grad_sync", "bucketed"], kill_after=5)

    def test_data_parallel_two_ranks_naive(self):
        self.check_layout(DP, ["--world_size", "2", "--grad_sync", "naive"])

    def test_tensor_parallel_two(self):
        self.check_layout(DP, ["--world_size", "2", "--tensor_parallel_size", "2"], kill_after=5)

    def test_pipeline_program_single_device(self):
        self.check_layout(PP, [])

    def test_pipeline_program_model_parallel(self):
        self.check_layout(PP, ["--model_parallel_mode", "model_parallel", "--devices", "cpu:0,cpu:1"], kill_after=5)

    def test_pipeline_program_pipeline_parallel(self):
        # Dropout on: each (step, micro-batch, stage) draws from its own stream, derived from
        # --seed and the step, so thread timing cannot change the masks and a resumed run draws
        # the ones the undisturbed run drew.
        self.check_layout(PP, ["--model_parallel_mode", "pipeline_parallel", "--devices", "cpu:0,cpu:1",
                               "--n_chunk", "2"])

    def test_pipeline_program_interleaved_with_checkpointing(self):
        self.check_layout(PP, ["--model_parallel_mode", "pipeline_parallel", "--devices", "cpu:0,cpu:1",
                               "--n_chunk", "2", "--pipeline_schedule", "interleaved", "--virtual_stages", "2",
                               "--model", "gpt2-mini", "--activation_checkpointing", "except_last"])


class BrokenCheckpoints(unittest.TestCase):
    def test_a_new_run_refuses_checkpoints_of_an_earlier_one_before_training(self):
        # Pruning would keep the earlier run's later steps as the newest and delete this run's own.
        with tempfile.TemporaryDirectory() as tmp:
            work = os.path.join(tmp, "w")
            run([PP, "--workdir", work] + TINY)
            proc = run([PP, "--workdir", work] + TINY, check=False)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn("holds checkpoints of another run beyond step 0", proc.stderr)
            self.assertIn("--resume auto", proc.stderr)
            self.assertNotIn("Training Time", proc.stdout)
            # Continuing it is what --resume auto is for.
            resumed = run([PP, "--workdir", work, "--resume", "auto"] + TINY)
            self.assertIn("resume: continuing from", resumed.stderr)

    def test_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            plain = os.path.join(tmp, "plain")
            run([PP, "--workdir", plain] + TINY)
            work = os.path.join(tmp, "killed")
            env = dict(os.environ, HARNESS_TEST_CHECKPOINT_STALL_MS="5000")
            watched = Watched([PP, "--workdir", work] + TINY, env=env)
            try:
                # The first checkpoint completes after its stall; kill inside the second's.
                watched.wait_for(saved_step_at_least(1))
                writing = watched.wait_for(lambda l: re.search(r"checkpoint: writing (\S+step-00000002\S*)", l))
            finally:
                watched.kill_all()
            root = os.path.join(work, "checkpoints")
            self.assertTrue(os.path.isdir(writing[1]), "the half-written folder should be there")
            self.assertEqual(sorted(d for d in os.listdir(root) if not d.startswith(".")), ["step-00000001"])
            resumed = run([PP, "--workdir", work, "--resume", "auto"] + TINY)
            self.assertIn("continuing from " + os.path.join(root, "step-00000001"), resumed.stderr)
            a, b = weights(plain), weights(work)
            for name in a:
                self.assertTrue(torch.equal(a[name], b[name]), name)
            self.assertFalse(os.path.exists(writing[1]), "the stale temporary folder should be pruned")

    def two_checkpoints(self, tmp):
        work = os.path.join(tmp, "w")
        run([PP, "--workdir", work] + TINY + ["--n_epochs", "1"])
        root = os.path.join(work, "checkpoints")
        names = sorted(os.listdir(root))
        self.assertEqual(names, ["step-00000003", "step-00000004"])  # --keep_checkpoints 2
        return work, [os.path.join(root, n) for n in names]

    def test_corrupted_and_truncated_files_are_refused_and_auto_falls_back(self):
        with tempfile.TemporaryDirectory() as tmp:
            work, (older, newest) = self.two_checkpoints(tmp)
            target = os.path.join(newest, "optimizer.safetensors")
            with open(target, "r+b") as f:
                f.seek(os.path.getsize(target) // 2)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x5A]))
            proc = run([PP, "--workdir", work, "--resume", newest] + TINY, check=False)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn("optimizer.safetensors", proc.stderr)
            self.assertIn("SHA-256", proc.stderr)
            self.assertNotIn("Training Time", proc.stdout)  # refused before any training
            proc = run([PP, "--workdir", work, "--resume", "auto"] + TINY)
            self.assertIn("refused " + newest, proc.stderr)
            self.assertIn("falling back", proc.stderr)
            self.assertIn("continuing from " + older, proc.stderr)

        with tempfile.TemporaryDirectory() as tmp:
            work, (older, newest) = self.two_checkpoints(tmp)
            target = os.path.join(newest, "model.safetensors")
            size = os.path.getsize(target)
            os.truncate(target, size - 100)
            proc = run([PP, "--workdir", work, "--resume", newest] + TINY, check=False)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn(f"model.safetensors has {size - 100} bytes", proc.stderr)
            proc = run([PP, "--workdir", work, "--resume", "auto"] + TINY)
            self.assertIn("continuing from " + older, proc.stderr)

    def test_a_checkpoint_of_another_model_or_tokenizer_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            work, (_, newest) = self.two_checkpoints(tmp)
            other = [a if a != "gpt2-tiny" else "gpt2-mini" for a in TINY]
            proc = run([PP, "--workdir", os.path.join(tmp, "o"), "--resume", newest] + other, check=False)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn("the model differs", proc.stderr)
            self.assertIn("n_embd", proc.stderr)
            fewer = [a if a != "32" else "24" for a in TINY]  # --train_size: another tokenizer
            proc = run([PP, "--workdir", os.path.join(tmp, "t"), "--resume", newest] + fewer, check=False)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn("tokenizer.model differs", proc.stderr)
            proc = run([PP, "--workdir", os.path.join(tmp, "n"), "--resume", "auto"] + TINY)
            self.assertIn("no usable complete checkpoint", proc.stderr)

    def test_the_manifest_describes_every_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            _, (_, newest) = self.two_checkpoints(tmp)
            with open(os.path.join(newest, "manifest.json")) as f:
                manifest = json.load(f)
            self.assertEqual(manifest["format_version"], 1)
            self.assertEqual(manifest["global_step"], 4)
            self.assertEqual(manifest["program"], "run_pipeline")
            names = {f["name"] for f in manifest["files"]}
            self.assertEqual(names, {"model.safetensors", "config.json", "optimizer.safetensors", "tokenizer.model",
                                     "trainer_state.json", "rank_states.json"})
            import hashlib
            for f in manifest["files"]:
                with open(os.path.join(newest, f["name"]), "rb") as data:
                    blob = data.read()
                self.assertEqual(len(blob), f["size"])
                self.assertEqual(hashlib.sha256(blob).hexdigest(), f["sha256"])
            # The model folder loads in Hugging Face on its own, and the optimizer state has both
            # moments of every parameter under Hugging Face names.
            from transformers import GPT2LMHeadModel
            GPT2LMHeadModel.from_pretrained(newest)
            from safetensors import safe_open
            with safe_open(os.path.join(newest, "optimizer.safetensors"), "pt") as f:
                keys = set(f.keys())
                meta = f.metadata()
            self.assertIn("transformer.h.1.mlp.c_fc.weight.exp_avg", keys)
            self.assertIn("transformer.wte.weight.exp_avg_sq", keys)
            self.assertEqual(meta["transformer.wte.weight.step"], "4")


class AnotherLayout(unittest.TestCase):
    """A checkpoint is replicated, unsplit state: it resumes on another world size, another
    tensor-parallel size, and in the other program. With --learning_rate 0 the resumed run must
    end with exactly the checkpoint's weights (so everything loaded where it belongs)."""

    def checkpoint_of(self, tmp, args):
        work = os.path.join(tmp, "src")
        run(args + ["--workdir", work] + TINY + ["--n_epochs", "1"])
        return work, os.path.join(work, "checkpoints", "step-00000004")

    def resume_without_learning(self, args, checkpoint, tmp, name):
        torch = __import__("torch")
        work = os.path.join(tmp, name)
        proc = run(args + ["--workdir", work, "--resume", checkpoint] + TINY + ["--learning_rate", "0"])
        self.assertIn("continuing from " + checkpoint, proc.stderr)
        a, b = weights(checkpoint), weights(work)
        for key in a:
            self.assertTrue(torch.equal(a[key], b[key]), f"{name}: {key}")
        return proc

    def test_world_size_two_resumes_on_one_and_four_ranks_and_in_run_pipeline(self):
        with tempfile.TemporaryDirectory() as tmp:
            _, checkpoint = self.checkpoint_of(tmp, [DP, "--world_size", "2", "--master_port", str(free_port())])
            for world in ("1", "4"):
                proc = self.resume_without_learning([DP, "--world_size", world, "--master_port", str(free_port())],
                                                    checkpoint, tmp, "ws" + world)
                self.assertIn("world size 2", proc.stderr)
                trained = lines(TRAIN, proc.stdout)
                self.assertEqual(sorted(trained), [(1, str(r)) for r in range(int(world))])  # epoch 1 only
            self.resume_without_learning([PP, "--model_parallel_mode", "pipeline_parallel", "--devices", "cpu:0,cpu:1",
                                          "--n_chunk", "2"], checkpoint, tmp, "pp")

    def test_tensor_parallel_checkpoint_resumes_unsplit_and_continues_like_the_split_run(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            tp = [DP, "--world_size", "2", "--tensor_parallel_size", "2"]
            nodrop = ["--dropout", "0"]
            plain = os.path.join(tmp, "plain")
            run(tp + ["--master_port", str(free_port()), "--workdir", plain] + TINY + nodrop)
            work = os.path.join(tmp, "w")
            run(tp + ["--master_port", str(free_port()), "--workdir", work] + TINY + nodrop + ["--n_epochs", "1"])
            kept = os.path.join(tmp, "tp2-step4")
            shutil.copytree(os.path.join(work, "checkpoints", "step-00000004"), kept)
            # The same data order (one data-parallel rank), unsplit: weights and AdamW state must
            # carry over, so the second epoch ends where the split run's did (up to rounding).
            proc = run([DP, "--world_size", "1", "--master_port", str(free_port()), "--workdir", work, "--resume", "auto"]
                       + TINY + nodrop)
            self.assertIn("tensor-parallel size 2", proc.stderr)
            # 8 AdamW steps of lr 3e-3 (2 epochs of 4), split then unsplit against split all along:
            # compared as AdamW guarantees (after_adamw.py), each tensor's difference within 1e-3 of
            # the steps' update and every element within what 8 steps can move it. The key third of c_attn.bias gets a zero
            # gradient in exact arithmetic (it adds the same q.b to every score of a query, which
            # softmax ignores), so it holds AdamW-scaled rounding noise, different split and
            # unsplit: it must stay noise in both runs.
            a, b = weights(plain), weights(work)
            self.assertEqual(weight_problems(b, a, lr=3e-3, steps=8), [])
            for key in (k for k in a if k.endswith("attn.c_attn.bias")):
                for noise in (a[key][64:128], b[key][64:128]):
                    self.assertLess(float(noise.abs().max()), 1e-4, key)
            self.resume_without_learning([DP, "--world_size", "2", "--tensor_parallel_size", "2", "--master_port",
                                          str(free_port())], kept, tmp, "tp2")


class Restarts(unittest.TestCase):
    def test_max_restarts_survives_two_killed_workers(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            plain = os.path.join(tmp, "plain")
            run([DP, "--world_size", "2", "--master_port", str(free_port()), "--workdir", plain] + TINY)
            work = os.path.join(tmp, "w")
            watched = Watched([DP, "--world_size", "2", "--master_port", str(free_port()), "--workdir", work,
                               "--max_restarts", "2"] + TINY)
            try:
                for k in (2, 6):
                    watched.wait_for(saved_step_at_least(k))
                    workers = [p for p in descendants(watched.proc.pid) if environ_of(p).get(b"RANK") == b"1"]
                    self.assertTrue(workers, "no rank 1 worker found")
                    os.kill(workers[0], signal.SIGKILL)
                    watched.wait_for(lambda l, n=(2 if k == 6 else 1): f"restart {n} of 2" in l)
                code = watched.finish()
            finally:
                if watched.proc.poll() is None:
                    watched.kill_all()
            self.assertEqual(code, 0, "\n".join(watched.err[-30:]))
            a, b = weights(plain), weights(work)
            for key in a:
                self.assertTrue(torch.equal(a[key], b[key]), key)

    def test_real_torchrun_restarts_and_resumes(self):
        torch = __import__("torch")
        with tempfile.TemporaryDirectory() as tmp:
            plain = os.path.join(tmp, "plain")
            run([DP, "--world_size", "2", "--master_port", str(free_port()), "--workdir", plain] + TINY)
            work = os.path.join(tmp, "w")
            watched = Watched([TORCHRUN, "--nnodes", "1", "--nproc_per_node", "2", "--max-restarts", "1",
                               "--master_port", str(free_port()), "--no-python", DP, "--workdir", work, "--resume", "auto"] + TINY)
            try:
                watched.wait_for(saved_step_at_least(3))
                workers = [p for p in descendants(watched.proc.pid) if environ_of(p).get(b"RANK") == b"1"
                           and os.path.realpath(f"/proc/{p}/exe") == os.path.realpath(DP)]
                self.assertTrue(workers, "no rank 1 worker found")
                os.kill(workers[0], signal.SIGKILL)
                code = watched.finish()
            finally:
                if watched.proc.poll() is None:
                    watched.kill_all()
            self.assertEqual(code, 0, "\n".join(watched.err[-40:]))
            self.assertTrue(any("resume: continuing from" in l for l in watched.err), "\n".join(watched.err[-40:]))
            a, b = weights(plain), weights(work)
            for key in a:
                self.assertTrue(torch.equal(a[key], b[key]), key)


if __name__ == "__main__":
    unittest.main(verbosity=2)
