"""End-to-end checks of the two programs as a user runs them: SPEC §7's printed lines and files,
the a5_1_2 gradient check with Python's torch.load, data parallelism's equivalence to one rank,
failure handling of the launcher, and clear errors for bad flags. Uses gpt2-tiny and a few
examples so that each run takes seconds."""
import json
import os
import re
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from after_adamw import gradient_problems, weight_problems  # noqa: E402  two runs compared as AdamW guarantees

SOURCE = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
DP = os.path.join(BINARY, "run_data_parallel")
PP = os.path.join(BINARY, "run_pipeline")

NUMBER = r"(-?\d+(?:\.\d+)?)"
DP_TRAIN = re.compile(rf"^Epoch (\d+) on Rank (\d+): Training Time = {NUMBER}, Tokens_per_sec = {NUMBER}$")
DP_LOSS = re.compile(rf"^Epoch (\d+) on Rank (\d+): Validation Loss = {NUMBER}$")
DP_BLEU = re.compile(rf"^Epoch (\d+) on Rank (\d+): BLEU = {NUMBER}$")
DP_SUMMARY = re.compile(rf"^Rank (\d+) training time: avg:{NUMBER}, std:{NUMBER}, tokens_per_second: avg: {NUMBER}, std:{NUMBER}$")
PP_TRAIN = re.compile(rf"^Epoch (\d+): Training Time = {NUMBER}, Tokens_per_sec = {NUMBER}$")
PP_LOSS = re.compile(rf"^Epoch (\d+): Validation Loss = {NUMBER}$")
PP_BLEU = re.compile(rf"^Epoch (\d+): BLEU = {NUMBER}$")
PP_SUMMARY = re.compile(rf"^Training time: avg:{NUMBER}, std:{NUMBER}, tokens_per_second: avg: {NUMBER}, std:{NUMBER}$")

TINY = ["--model", "gpt2-tiny", "--model_max_length", "40", "--train_size", "64",
        "--validation_size", "16", "--test_size", "4", "--no_progress"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, timeout=300, check=True):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def matching(pattern, stdout):
    return [m for m in (pattern.match(line) for line in stdout.splitlines()) if m]


def torch_module():
    import torch
    return torch


class DataParallelProgram(unittest.TestCase):
    def test_a5_1_2_pytest_gradients_load_with_torch_load_and_are_bit_identical(self):
        torch = torch_module()
        with tempfile.TemporaryDirectory() as tmp:
            grads = os.path.join(tmp, "grads")
            run([DP, "--world_size", "2", "--pytest", "--grad_dir", grads, "--batch_size", "16",
                 "--workdir", os.path.join(tmp, "work"), "--master_port", str(free_port())] + TINY)
            g0 = torch.load(os.path.join(grads, "model0_gradients.pth"))
            g1 = torch.load(os.path.join(grads, "model1_gradients.pth"))
            self.assertIsInstance(g0, dict)
            self.assertEqual(set(g0), set(g1))
            self.assertIn("transformer.wte.weight", g0)
            self.assertIn("transformer.h.1.attn.c_attn.weight", g0)
            self.assertEqual(len(g0), 4 + 12 * 2)  # wte, wpe, ln_f (2) and 12 tensors per block
            for name in g0:
                self.assertTrue(torch.equal(g0[name], g1[name]), name)
            self.assertGreater(sum(float(g.abs().sum()) for g in g0.values()), 0.0)
            check = run([sys.executable, os.path.join(SOURCE, "scripts", "check_gradients.py"), grads])
            self.assertEqual(check.returncode, 0)

    def pytest_gradients(self, tmp, name, extra, log=None, batch_size=16):
        torch = torch_module()
        grads = os.path.join(tmp, name)
        proc = run([DP, "--pytest", "--grad_dir", grads, "--batch_size", str(batch_size), "--dropout", "0",
             "--workdir", os.path.join(tmp, name + "_work"), "--master_port", str(free_port())] + TINY + extra)
        if log is not None:
            log.append(proc.stderr)
        return torch.load(os.path.join(grads, "model0_gradients.pth"))

    def assert_same_gradients(self, actual, expected, rtol):
        torch = torch_module()
        self.assertEqual(set(actual), set(expected))
        for name in expected:
            self.assertTrue(torch.allclose(actual[name], expected[name], rtol=rtol, atol=1e-7), name)

    def test_several_buckets_give_the_naive_all_reduces_gradients(self):
        # 0.01 MB buckets: gpt2-tiny's 28 gradients go out in many buckets, overlapped with backward.
        with tempfile.TemporaryDirectory() as tmp:
            naive = self.pytest_gradients(tmp, "naive", ["--world_size", "2", "--grad_sync", "naive"])
            bucketed = self.pytest_gradients(tmp, "bucketed", ["--world_size", "2", "--grad_sync", "bucketed",
                                                               "--bucket_cap_mb", "0.01"])
            self.assert_same_gradients(bucketed, naive, rtol=1e-5)

    def test_debug_sync_checks_every_collective_and_changes_no_gradient(self):
        # The world group and the tensor-parallel groups are checked; the gradients stay bit-identical.
        torch = torch_module()
        with tempfile.TemporaryDirectory() as tmp:
            logs = []
            buckets = ["--world_size", "2", "--bucket_cap_mb", "0.01"]
            plain = self.pytest_gradients(tmp, "plain", buckets)
            checked = self.pytest_gradients(tmp, "checked", buckets + ["--debug_sync"], log=logs)
            self.assertEqual(set(plain), set(checked))
            for name in plain:
                self.assertTrue(torch.equal(plain[name], checked[name]), name)
            alone = self.pytest_gradients(tmp, "alone", ["--world_size", "1"])
            split = self.pytest_gradients(tmp, "split", ["--world_size", "2", "--tensor_parallel_size", "2",
                                                         "--debug_sync"], log=logs)
            self.assert_same_gradients(split, alone, rtol=1e-4)
            for log in logs:
                counts = re.findall(r"--debug_sync: (\d+) collectives of the world group matched on every rank", log)
                self.assertEqual(len(counts), 1, log)
                self.assertGreater(int(counts[0]), 2, log)

    def test_gradient_accumulation_equals_the_larger_batch_and_trains(self):
        # 2 batches of 8 accumulated (synchronised once) give the --pytest gradients of one batch of 16.
        with tempfile.TemporaryDirectory() as tmp:
            for kind in ("bucketed", "naive"):
                sync = ["--world_size", "2", "--grad_sync", kind]
                large = self.pytest_gradients(tmp, kind + "_large", sync)
                accumulated = self.pytest_gradients(tmp, kind + "_accumulated",
                                                    sync + ["--gradient_accumulation_steps", "2"], batch_size=8)
                self.assert_same_gradients(accumulated, large, rtol=1e-5)
            # Training: 5 batches per epoch in steps of 2, 2 and 1; checkpoints count optimizer steps.
            work = os.path.join(tmp, "train")
            proc = run([DP, "--world_size", "2", "--batch_size", "8", "--max_batches", "5", "--n_epochs", "1",
                        "--gradient_accumulation_steps", "2", "--benchmark_only", "--checkpoint_every", "2",
                        "--workdir", work, "--master_port", str(free_port())] + TINY)
            self.assertEqual(len(matching(DP_TRAIN, proc.stdout)), 2)
            self.assertIn("gradient_accumulation_steps=2", proc.stderr)
            self.assertEqual(sorted(os.listdir(os.path.join(work, "checkpoints"))), ["step-00000002", "step-00000003"])
            # Communication: the same bytes per optimizer step as without accumulation, so 3 steps
            # for 5 batches instead of 5.
            single = run([DP, "--world_size", "2", "--batch_size", "8", "--max_batches", "5", "--n_epochs", "1",
                          "--benchmark_only", "--workdir", os.path.join(tmp, "single"),
                          "--master_port", str(free_port())] + TINY)
            sent = re.compile(r"gradient sync put (\d+) bytes into all-reduces in (\d+) optimizer steps \((\d+) per step\)")
            accumulated_bytes, accumulated_steps, per_step = map(int, sent.search(proc.stderr).groups())
            single_bytes, single_steps, single_per_step = map(int, sent.search(single.stderr).groups())
            self.assertEqual((accumulated_steps, single_steps), (3, 5))
            self.assertEqual(per_step, single_per_step)
            self.assertEqual(accumulated_bytes * 5, single_bytes * 3)

    def test_bf16_precision_and_reduction_stay_close_to_fp32_in_every_layout(self):
        # Autocast bf16 forward, gradients all-reduced in bf16: both ranks hold the same gradients,
        # within bf16's rounding of fp32's; tensor parallelism runs under autocast too.
        torch = torch_module()
        with tempfile.TemporaryDirectory() as tmp:
            fp32 = self.pytest_gradients(tmp, "fp32", ["--world_size", "2"])
            bf16 = self.pytest_gradients(tmp, "bf16", ["--world_size", "2", "--precision", "bf16",
                                                       "--grad_reduce_dtype", "bf16"])
            other = torch.load(os.path.join(tmp, "bf16", "model1_gradients.pth"))
            for name, g in fp32.items():
                self.assertEqual(bf16[name].dtype, torch.float32, name)
                self.assertTrue(torch.equal(bf16[name], other[name]), name)
                if g.dim() == 2 and g.norm() > 0:
                    self.assertLess(float((bf16[name] - g).norm() / g.norm()), 0.1, name)
            self.assertFalse(all(torch.equal(bf16[n], fp32[n]) for n in fp32))
            split = self.pytest_gradients(tmp, "split", ["--world_size", "2", "--tensor_parallel_size", "2",
                                                         "--precision", "bf16"])
            alone = self.pytest_gradients(tmp, "alone", ["--world_size", "1", "--precision", "bf16"])
            for name, g in alone.items():
                if g.dim() == 2 and g.norm() > 0:
                    self.assertLess(float((split[name] - g).norm() / g.norm()), 0.1, name)
            proc = run([DP, "--world_size", "1", "--precision", "fp16"] + TINY, check=False)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn("--precision fp16", proc.stderr)

    def test_zero_stage_1_takes_the_replicated_steps_and_resumes_either_way(self):
        torch = torch_module()
        from safetensors.torch import load_file
        with tempfile.TemporaryDirectory() as tmp:
            def train(name, world, zero, epochs, resume=False, extra=()):
                work = os.path.join(tmp, name)
                proc = run([DP, "--world_size", str(world), "--zero_stage", str(zero), "--batch_size", "16",
                            "--max_batches", "2", "--n_epochs", str(epochs), "--benchmark_only", "--dropout", "0",
                            "--learning_rate", "1e-3", "--workdir", work, "--master_port", str(free_port())]
                           + (["--resume", "auto"] if resume else []) + TINY + list(extra))
                return work, proc

            def weights(work):
                return load_file(os.path.join(work, "model.safetensors"))

            def assert_same_weights(actual, expected):
                # 4 AdamW steps of lr 1e-3 (2 epochs of 2), compared as AdamW guarantees: each
                # tensor's difference within 1e-5 of the steps' update (the two sum the same
                # gradients in other orders), every element within what 4 steps can move it.
                self.assertEqual(weight_problems(actual, expected, lr=1e-3, steps=4, update_fraction=1e-5), [])

            for world in (2, 4):
                replicated, _ = train(f"replicated{world}", world, 0, 2)
                sharded, proc = train(f"sharded{world}", world, 1, 2)
                assert_same_weights(weights(sharded), weights(replicated))
                state = re.search(r"--zero_stage 1 keeps (\d+) bytes of AdamW state on rank 0 \(replicated: (\d+)", proc.stderr)
                mine, full = int(state[1]), int(state[2])
                self.assertLessEqual(mine, full / world + 2 * 4 * world)  # 1/N, plus each bucket's padding
            # Checkpoints keep the unsharded format: sharded for epoch 0, replicated for epoch 1, and back.
            for first, second in ((1, 0), (0, 1)):
                work, _ = train(f"mixed{first}{second}", 2, first, 1)
                train(f"mixed{first}{second}", 2, second, 2, resume=True)
                assert_same_weights(weights(work), weights(os.path.join(tmp, "replicated2")))
            # --pytest gradients are the replicated run's.
            plain = self.pytest_gradients(tmp, "plain", ["--world_size", "2"])
            zero = self.pytest_gradients(tmp, "zero", ["--world_size", "2", "--zero_stage", "1"])
            self.assert_same_gradients(zero, plain, rtol=1e-6)
            proc = run([DP, "--world_size", "2", "--zero_stage", "1", "--grad_sync", "naive"] + TINY, check=False)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn("--zero_stage 1 reduce-scatters gradient buckets: it needs --grad_sync bucketed", proc.stderr)
            self.assertNotIn("[rank", proc.stderr)

    def test_tensor_parallel_gradients_equal_one_ranks(self):
        # One replica split over two ranks sees the whole batch, as one rank alone does: the
        # unsplit gradients must agree (a constant factor or a missing all-reduce would not).
        with tempfile.TemporaryDirectory() as tmp:
            alone = self.pytest_gradients(tmp, "alone", ["--world_size", "1"])
            split = self.pytest_gradients(tmp, "split", ["--world_size", "2", "--tensor_parallel_size", "2"])
            self.assert_same_gradients(split, alone, rtol=1e-4)

    def test_a5_1_2_original_spelling_pytest_true_writes_config_at_start(self):
        torch = torch_module()
        with tempfile.TemporaryDirectory() as tmp:
            grads, work = os.path.join(tmp, "grads"), os.path.join(tmp, "work")
            run([DP, "--world_size", "2", "--pytest", "True", "--grad_dir", grads, "--batch_size", "16",
                 "--workdir", work, "--master_port", str(free_port())] + TINY)
            g0 = torch.load(os.path.join(grads, "model0_gradients.pth"))
            g1 = torch.load(os.path.join(grads, "model1_gradients.pth"))
            for name in g0:
                self.assertTrue(torch.equal(g0[name], g1[name]), name)
            with open(os.path.join(work, "config.json")) as f:  # written at start, as the original
                self.assertEqual(json.load(f)["n_layer"], 2)
            off = os.path.join(tmp, "off")
            proc = run([DP, "--world_size", "1", "--pytest", "False", "--grad_dir", off, "--n_epochs", "1",
                        "--max_batches", "1", "--batch_size", "8", "--benchmark_only", "--workdir", os.path.join(tmp, "w2"),
                        "--master_port", str(free_port())] + TINY)
            self.assertFalse(os.path.exists(off), "--pytest False must train normally")
            self.assertEqual(len(matching(DP_TRAIN, proc.stdout)), 1)

    def test_spec_lines_files_and_a_model_that_transformers_loads(self):
        with tempfile.TemporaryDirectory() as work:
            proc = run([DP, "--world_size", "2", "--n_epochs", "2", "--batch_size", "16", "--workdir", work,
                        "--master_port", str(free_port()), "--learning_rate", "1e-3"] + TINY)
            train = matching(DP_TRAIN, proc.stdout)
            self.assertEqual(sorted((int(m[1]), int(m[2])) for m in train), [(0, 0), (0, 1), (1, 0), (1, 1)])
            self.assertEqual(len(matching(DP_LOSS, proc.stdout)), 4)
            self.assertEqual(len(matching(DP_BLEU, proc.stdout)), 4)
            self.assertEqual(sorted(int(m[1]) for m in matching(DP_SUMMARY, proc.stdout)), [0, 1])
            for rank in (0, 1):
                for epoch in (0, 1):
                    with open(os.path.join(work, f"rank{rank}_results_epoch{epoch}.json")) as f:
                        results = json.load(f)
                    self.assertEqual(set(results), {"validation_loss", "bleu", "training_time", "tokens_per_sec"})
                    with open(os.path.join(work, f"rank{rank}_gen_epoch{epoch}.json")) as f:
                        gens = json.load(f)
                    self.assertEqual(len(gens), 4)
                    self.assertEqual(set(gens[0]), {"example", "gen"})
                    self.assertEqual(set(gens[0]["example"]), {"de", "en"})
            for name in ("tokenizer.model", "model.safetensors", "config.json"):
                self.assertTrue(os.path.isfile(os.path.join(work, name)), name)
            # Every rank evaluates the same replicated model: the same loss on both ranks.
            losses = {(int(m[1]), int(m[2])): m[3] for m in matching(DP_LOSS, proc.stdout)}
            self.assertEqual(losses[(1, 0)], losses[(1, 1)])
            from transformers import GPT2LMHeadModel
            model = GPT2LMHeadModel.from_pretrained(work)
            self.assertEqual(model.config.n_layer, 2)

    def test_two_ranks_with_half_the_batch_take_the_same_step_as_one_rank(self):
        torch = torch_module()
        from safetensors.torch import load_file
        with tempfile.TemporaryDirectory() as tmp:
            # 16 examples whose targets all have the same length, so both halves weigh the same.
            data = os.path.join(tmp, "data")
            os.makedirs(data)
            words = ["hund", "katze", "haus", "baum", "auto", "buch", "tisch", "stuhl"]
            for split, n in (("train", 16), ("validation", 4), ("test", 2)):
                with open(os.path.join(data, f"{split}.jsonl"), "w") as f:
                    for i in range(n):
                        de = f"der {words[i % 8]} ist {'sehr ' * (i // 8)}gross ."
                        f.write(json.dumps({"translation": {"de": de, "en": "the thing is big ."}}) + "\n")
            common = ["--dataset", data, "--model", "gpt2-tiny", "--model_max_length", "40", "--dropout", "0",
                      "--batch_size", "16", "--n_epochs", "1", "--max_batches", "1", "--benchmark_only",
                      "--no_progress", "--grad_sync", "naive"]
            out = {}
            for world in (1, 2):
                work = os.path.join(tmp, f"w{world}")
                grads = os.path.join(tmp, f"g{world}")
                run([DP, "--world_size", str(world), "--workdir", work, "--master_port", str(free_port())] + common)
                run([DP, "--world_size", str(world), "--workdir", work + "p", "--pytest", "--grad_dir", grads,
                     "--master_port", str(free_port())] + common)
                out[world] = (load_file(os.path.join(work, "model.safetensors")),
                              torch.load(os.path.join(grads, "model0_gradients.pth")))
            (w1, g1), (w2, g2) = out[1], out[2]
            self.assertEqual(set(g1), set(g2))
            self.assertEqual(gradient_problems(g2, g1, floor=1e-8), [])
            # After one AdamW step of the default lr 1e-4, as AdamW guarantees (after_adamw.py).
            self.assertEqual(weight_problems(w2, w1, lr=1e-4, steps=1), [])

    def test_after_three_steps_both_ranks_hold_bit_identical_parameters(self):
        torch = torch_module()
        from safetensors.torch import load_file
        with tempfile.TemporaryDirectory() as work:
            run([DP, "--world_size", "2", "--workdir", work, "--master_port", str(free_port()), "--batch_size", "8",
                 "--n_epochs", "1", "--max_batches", "3", "--benchmark_only", "--save_every_rank",
                 "--learning_rate", "1e-3"] + TINY)
            w0 = load_file(os.path.join(work, "model.safetensors"))
            w1 = load_file(os.path.join(work, "rank1", "model.safetensors"))
            self.assertEqual(set(w0), set(w1))
            for name in w0:
                self.assertTrue(torch.equal(w0[name], w1[name]), name)

    def test_ring_allreduce_with_resharding_keeps_replicas_identical(self):
        torch = torch_module()
        from safetensors.torch import load_file
        for grad_sync in ("naive", "bucketed"):
            with self.subTest(grad_sync=grad_sync), tempfile.TemporaryDirectory() as work:
                proc = run([DP, "--world_size", "2", "--workdir", work, "--master_port", str(free_port()),
                            "--batch_size", "8", "--n_epochs", "2", "--max_batches", "2", "--benchmark_only",
                            "--save_every_rank", "--allreduce", "ring", "--grad_sync", grad_sync,
                            "--reshuffle_each_epoch"] + TINY)
                self.assertIn("allreduce=ring", proc.stderr)
                self.assertEqual(len(matching(DP_TRAIN, proc.stdout)), 4)
                w0 = load_file(os.path.join(work, "model.safetensors"))
                w1 = load_file(os.path.join(work, "rank1", "model.safetensors"))
                for name in w0:
                    self.assertTrue(torch.equal(w0[name], w1[name]), name)

    def test_exported_corpus_feeds_back_through_dataset(self):
        with tempfile.TemporaryDirectory() as tmp:
            data = os.path.join(tmp, "corpus")
            run([DP, "--export_dataset", data] + TINY)
            for split, n in (("train", 64), ("validation", 16), ("test", 4)):
                with open(os.path.join(data, f"{split}.jsonl")) as f:
                    rows = [json.loads(line) for line in f]
                self.assertEqual(len(rows), n)
                self.assertEqual(set(rows[0]["translation"]), {"de", "en"})
            proc = run([PP, "--dataset", data, "--workdir", os.path.join(tmp, "w"), "--n_epochs", "1",
                        "--batch_size", "8", "--max_batches", "2"] + TINY)
            self.assertEqual(len(matching(PP_BLEU, proc.stdout)), 1)
            # A size given beyond what a split holds is refused before training, with both numbers.
            more = [a if a != "64" else "100" for a in TINY]
            proc = run([PP, "--dataset", data, "--workdir", os.path.join(tmp, "w2"), "--n_epochs", "1"] + more,
                       check=False)
            self.assertNotEqual(proc.returncode, 0)
            self.assertIn("training split has 64 pairs, fewer than --train_size 100", proc.stderr)
            self.assertNotIn("Training Time", proc.stdout)

    def start_two_ranks_training(self, work, extra=()):
        """run_data_parallel with 2 ranks for a long time; returns (launcher, {rank: pid}) once
        both ranks train (their first epoch lines)."""
        proc = subprocess.Popen([DP, "--world_size", "2", "--workdir", work, "--master_port", str(free_port()),
                                 "--n_epochs", "1000", "--batch_size", "8", "--benchmark_only"] + TINY + list(extra),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        seen = 0
        while time.time() < deadline and seen < 2:
            if proc.stdout.readline().startswith("Epoch "):
                seen += 1
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        self.assertEqual(len(children), 2, "the launcher should have two workers")
        ranks = {}
        for pid in children:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            ranks[int(env[b"RANK"])] = pid
        return proc, ranks

    def assert_no_worker_left(self, pids):
        time.sleep(0.5)
        for pid in pids:
            self.assertFalse(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z",
                             f"worker {pid} still running")

    def test_sigkill_of_one_worker_stops_the_run_promptly_and_leaves_no_worker(self):
        with tempfile.TemporaryDirectory() as work:
            proc, ranks = self.start_two_ranks_training(work)
            try:
                os.kill(ranks[1], signal.SIGKILL)
                start = time.time()
                _, err = proc.communicate(timeout=30)
                self.assertLess(time.time() - start, 30)
                self.assertNotEqual(proc.returncode, 0)
                self.assertRegex(err, r"rank \d .*signal 9|rank \d.*SIGKILL")
                self.assert_no_worker_left(ranks.values())
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    def test_a_rank_stopped_with_sigstop_ends_the_run_naming_it(self):
        timeout_s = 5
        with tempfile.TemporaryDirectory() as work:
            proc, ranks = self.start_two_ranks_training(work, ["--dist_timeout_s", str(timeout_s)])
            try:
                os.kill(ranks[1], signal.SIGSTOP)
                start = time.time()
                _, err = proc.communicate(timeout=timeout_s + 60)
                elapsed = time.time() - start
                self.assertNotEqual(proc.returncode, 0)
                self.assertLess(elapsed, timeout_s + 15, err[-2000:])
                self.assertIn("rank 1 was stopped by SIGSTOP", err)
                self.assert_no_worker_left(ranks.values())
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    def test_bad_flags_get_clear_errors(self):
        proc = run([DP, "--world_size", "3", "--batch_size", "100", "--master_port", str(free_port())] + TINY,
                   check=False)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("--batch_size 100 is not divisible by --world_size 3", proc.stdout + proc.stderr)
        # Refused by the launcher before any worker starts (a worker would print its rank's line).
        self.assertNotIn("[rank", proc.stdout + proc.stderr)
        self.assertEqual(proc.stderr.count("not divisible"), 1, proc.stderr)
        proc = run([DP, "--world_size", "1", "--dataset", "/nonexistent/corpus"] + TINY, check=False)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("/nonexistent/corpus", proc.stdout + proc.stderr)

    def test_every_check_runs_before_any_worker_starts(self):
        # Each run is refused by the launching process, once, naming the values at fault; no worker
        # (which would print "[rank") starts.
        with tempfile.TemporaryDirectory() as tmp:
            model = os.path.join(tmp, "model")
            run([DP, "--world_size", "1", "--n_epochs", "1", "--max_batches", "1", "--batch_size", "8",
                 "--benchmark_only", "--fit_vocab", "--workdir", model, "--master_port", str(free_port())] + TINY)
            with open(os.path.join(model, "config.json")) as f:
                config = json.load(f)
            small_vocab = os.path.join(tmp, "small_vocab")  # its tokenizer has more pieces than config.json's vocab
            shutil.copytree(model, small_vocab)
            with open(os.path.join(small_vocab, "config.json"), "w") as f:
                json.dump({**config, "vocab_size": 40}, f)
            deeper = os.path.join(tmp, "deeper")  # config.json says 3 layers, the weights have 2
            shutil.copytree(model, deeper)
            os.remove(os.path.join(deeper, "tokenizer.model"))
            with open(os.path.join(deeper, "config.json"), "w") as f:
                json.dump({**config, "n_layer": 3}, f)
            a_file = os.path.join(tmp, "a_file")
            open(a_file, "w").close()
            tiny = [a for a in TINY if a not in ("--model_max_length", "40")]
            cases = [
                (["--model", "gpt2-tiny", "--model_max_length", "129", "--no_progress"],
                 "--model_max_length 129 needs n_positions >= 129 but the model has n_positions 128: "
                 "pass --model_max_length 128 or less"),
                (TINY + ["--workdir", os.path.join(a_file, "work")], "--workdir " + os.path.join(a_file, "work")),
                (TINY + ["--workdir", "/proc/self"], "--workdir /proc/self is not writable"),
                (TINY + ["--pytest", "--grad_dir", os.path.join(a_file, "g")], "--grad_dir " + os.path.join(a_file, "g")),
                ([a if a != "64" else "100" for a in TINY] + ["--dataset", os.path.join(tmp, "data")],
                 "training split has 64 pairs, fewer than --train_size 100"),
                (tiny + ["--model_path", small_vocab, "--model_max_length", "40"],
                 os.path.join(small_vocab, "tokenizer.model") + " has "),
                (tiny + ["--model_path", deeper, "--model_max_length", "40"], os.path.join(deeper, "model.safetensors")),
            ]
            if not torch_module().cuda.is_available():
                cases.append((TINY + ["--device", "cuda"], "--device cuda but no GPU is present"))
            export = os.path.join(tmp, "data")
            run([DP, "--export_dataset", export] + TINY)
            for extra, expected in cases:
                with self.subTest(extra=extra):
                    args = [DP, "--world_size", "2", "--batch_size", "8", "--master_port", str(free_port())]
                    if "--workdir" not in extra:
                        args += ["--workdir", os.path.join(tmp, "w")]
                    proc = run(args + extra, check=False)
                    out = proc.stdout + proc.stderr
                    self.assertNotEqual(proc.returncode, 0, out)
                    self.assertIn(expected, out)
                    self.assertNotIn("[rank", out)


class PipelineProgram(unittest.TestCase):
    def run_mode(self, work, mode, extra=()):
        args = [PP, "--workdir", work, "--batch_size", "8", "--n_epochs", "1", "--devices", "cpu:0,cpu:1"] + TINY
        if mode:
            args += ["--model_parallel_mode", mode]
        return run(args + list(extra))

    def test_every_mode_prints_spec_lines_and_writes_its_files(self):
        for mode in ("", "model_parallel", "pipeline_parallel"):
            with self.subTest(mode=mode or "single device"), tempfile.TemporaryDirectory() as work:
                trace = os.path.join(work, "trace.json")
                proc = self.run_mode(work, mode, ["--trace", trace, "--n_chunk", "2"])
                self.assertEqual(len(matching(PP_TRAIN, proc.stdout)), 1)
                self.assertEqual(len(matching(PP_LOSS, proc.stdout)), 1)
                self.assertEqual(len(matching(PP_BLEU, proc.stdout)), 1)
                self.assertEqual(len(matching(PP_SUMMARY, proc.stdout)), 1)
                with open(os.path.join(work, "eval_results_epoch0.json")) as f:
                    self.assertEqual(set(json.load(f)), {"validation_loss", "bleu", "training_time", "tokens_per_sec"})
                with open(os.path.join(work, "gen_epoch0.json")) as f:
                    self.assertEqual(len(json.load(f)), 4)
                for name in ("tokenizer.model", "model.safetensors", "config.json"):
                    self.assertTrue(os.path.isfile(os.path.join(work, name)), name)
                with open(trace) as f:
                    events = json.load(f)["traceEvents"]
                if mode == "pipeline_parallel":
                    stages = {e["args"].get("stage") for e in events if e.get("name") == "forward"}
                    self.assertEqual(stages, {0, 1})
                    tracks = {e.get("tid") for e in events if e.get("name") == "backward"}
                    self.assertEqual(len(tracks), 2)

    def test_same_seed_gives_the_same_validation_loss_in_every_mode(self):
        losses = {}
        for mode in ("", "model_parallel", "pipeline_parallel"):
            with tempfile.TemporaryDirectory() as work:
                proc = self.run_mode(work, mode, ["--dropout", "0", "--max_batches", "3"])
                losses[mode] = float(matching(PP_LOSS, proc.stdout)[0][2])
        self.assertAlmostEqual(losses[""], losses["model_parallel"], places=4)
        self.assertAlmostEqual(losses[""], losses["pipeline_parallel"], places=4)

    def test_learning_rate_zero_leaves_the_loaded_weights_exactly(self):
        from safetensors.torch import load_file
        torch = torch_module()
        with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
            self.run_mode(first, "", ["--benchmark_only", "--max_batches", "2"])
            self.run_mode(second, "", ["--model_path", first, "--learning_rate", "0", "--max_batches", "2"])
            a = load_file(os.path.join(first, "model.safetensors"))
            b = load_file(os.path.join(second, "model.safetensors"))
            self.assertEqual(set(a), set(b))
            for name in a:
                self.assertTrue(torch.equal(a[name], b[name]), name)

    def test_fit_vocab_sizes_a_fresh_model_to_the_tokenizer(self):
        with tempfile.TemporaryDirectory() as work:
            # gpt2-mini's vocab_size (4096) is only the cap: 64 pairs fill far fewer pieces.
            proc = self.run_mode(work, "", ["--benchmark_only", "--max_batches", "1", "--fit_vocab",
                                            "--model", "gpt2-mini"])
            vocab = int(re.search(r"vocab=(\d+)", proc.stderr)[1])
            with open(os.path.join(work, "config.json")) as f:
                self.assertEqual(json.load(f)["vocab_size"], vocab)
            self.assertLess(vocab, 4096)

    def test_bf16_trains_every_mode(self):
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("", "model_parallel", "pipeline_parallel"):
                proc = self.run_mode(os.path.join(tmp, mode or "single"), mode, ["--precision", "bf16", "--max_batches", "2",
                                                  "--gradient_accumulation_steps", "2"])
                self.assertIn("precision=bf16", proc.stderr)
                self.assertEqual(len(matching(PP_LOSS, proc.stdout)), 1)

    def test_bad_flags_get_clear_errors(self):
        cases = [
            (["--model_parallel_mode", "pipeline_parallel", "--n_chunk", "0"], "--n_chunk 0"),
            (["--model_parallel_mode", "pipeline_parallel", "--n_chunk", "9", "--batch_size", "8"], "--n_chunk 9"),
            (["--model_parallel_mode", "sideways"], "--model_parallel_mode 'sideways'"),
            (["--model_parallel_mode", "model_parallel", "--devices", "cpu:0,cpu:0"], "listed twice"),
            (["--model_parallel_mode", "model_parallel", "--devices", "cpu:0,cpu:1,cpu:2"], "n_layer"),
            (["--model", "gpt2-huge"], "gpt2-huge"),
        ]
        for extra, expected in cases:
            with self.subTest(extra=extra), tempfile.TemporaryDirectory() as work:
                proc = run([PP, "--workdir", work] + TINY + extra, check=False)
                self.assertNotEqual(proc.returncode, 0)
                self.assertIn(expected, proc.stdout + proc.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
