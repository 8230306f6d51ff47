"""Runs that used to die after training: greedy generation chose ids the tokenizer does not have
(a model vocabulary larger than the tokenizer's, briefly trained), and a vocabulary smaller than
the corpus's characters failed with SentencePiece's own text. Real programs, gpt2-tiny."""
import json
import os
import re
import socket
import subprocess
import tempfile
import unittest

SOURCE = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
DP = os.path.join(BINARY, "run_data_parallel")
PP = os.path.join(BINARY, "run_pipeline")
BLEU = re.compile(r"^Epoch 0(?: on Rank 0)?: BLEU = (-?\d+(?:\.\d+)?)$", re.M)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, check=True):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


class GenerationCompletes(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.small = os.path.join(cls.tmp.name, "small")
        # 600 training pairs over a few words: a tokenizer far smaller than gpt2-tiny's 1,024 ids,
        # as with the user's corpus in the report (646 pieces).
        os.makedirs(cls.small)
        nouns = [("hund", "dog"), ("katze", "cat"), ("haus", "house"), ("baum", "tree"), ("auto", "car"),
                 ("buch", "book"), ("tisch", "table"), ("stuhl", "chair"), ("vogel", "bird"), ("fisch", "fish"),
                 ("ball", "ball"), ("hut", "hat")]
        adjectives = [("gross", "big"), ("klein", "small"), ("alt", "old"), ("neu", "new"), ("rot", "red"),
                      ("blau", "blue")]
        pairs = [(f"der {a} und der {b} sind {c} .", f"the {a2} and the {b2} are {c2} .")
                 for (a, a2) in nouns for (b, b2) in nouns for (c, c2) in adjectives]
        for split, rows in (("train", pairs[:600]), ("validation", pairs[600:616]), ("test", pairs[-16:])):
            with open(os.path.join(cls.small, f"{split}.jsonl"), "w") as f:
                for de, en in rows:
                    f.write(json.dumps({"translation": {"de": de, "en": en}}) + "\n")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_the_reported_command_completes_evaluation(self):
        work = os.path.join(self.tmp.name, "reported")
        proc = run([DP, "--world_size", "1", "--model", "gpt2-tiny", "--model_max_length", "48", "--dataset",
                    self.small, "--n_epochs", "1", "--max_batches", "2", "--batch_size", "16", "--seed", "3",
                    "--dropout", "0", "--workdir", work, "--master_port", str(free_port()), "--no_progress"])
        vocab = int(re.search(r"vocab=(\d+)", proc.stderr)[1])
        self.assertLess(vocab, 1024)  # the model's head has rows the tokenizer never produces
        self.assertIsNotNone(BLEU.search(proc.stdout))
        self.assertTrue(os.path.isfile(os.path.join(work, "model.safetensors")))

    def test_a_sweep_of_seeds_without_fit_vocab_completes_evaluation(self):
        for seed in range(1, 7):
            with self.subTest(seed=seed):
                work = os.path.join(self.tmp.name, f"seed{seed}")
                proc = run([PP, "--model", "gpt2-tiny", "--model_max_length", "48", "--dataset", self.small,
                            "--n_epochs", "1", "--max_batches", "1", "--batch_size", "16", "--seed", str(seed),
                            "--workdir", work, "--no_progress"])
                self.assertIsNotNone(BLEU.search(proc.stdout), proc.stdout)
                with open(os.path.join(work, "gen_epoch0.json")) as f:
                    self.assertEqual(len(json.load(f)), 16)

    def test_a_vocabulary_smaller_than_the_corpus_is_refused_before_training(self):
        model = os.path.join(self.tmp.name, "vocab64")
        os.makedirs(model)
        config = {"model_type": "gpt2", "vocab_size": 64, "n_positions": 128, "n_embd": 32, "n_layer": 1,
                  "n_head": 2, "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.0,
                  "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
                  "architectures": ["GPT2LMHeadModel"]}
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(config, f)
        proc = run([PP, "--model_path", model, "--dataset", self.small, "--model_max_length", "48", "--n_epochs", "1",
                    "--workdir", os.path.join(self.tmp.name, "v64"), "--no_progress"], check=False)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("vocab_size is 64", proc.stderr)
        self.assertIn("--model", proc.stderr)
        self.assertNotIn("character_coverage", proc.stderr)
        self.assertNotIn("Training Time", proc.stdout)

    def test_a_max_length_beyond_the_positions_is_refused_before_training(self):
        proc = run([PP, "--model", "gpt2-tiny", "--model_max_length", "1000", "--dataset", self.small,
                    "--n_epochs", "1", "--max_batches", "1", "--workdir", os.path.join(self.tmp.name, "pos"),
                    "--no_progress"], check=False)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("--model_max_length 1000", proc.stderr)
        self.assertIn("n_positions", proc.stderr)
        self.assertNotIn("Training Time", proc.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
