"""The fault table's scenarios (scripts/fault_injection.py) as tests: kill -9 and SIGSTOP of a rank,
a rank that never arrives, a port in use, a corrupted dataset, a full disk, a kill in the middle of
a checkpoint write. Each must end non-zero (the resume: zero) within its bound, say what failed,
and leave nothing running."""
import os
import sys
import unittest

SOURCE = os.environ.get("HARNESS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BINARY = os.environ.get("HARNESS_BINARY_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "scripts"))
import fault_injection  # noqa: E402


class FaultTable(unittest.TestCase):
    runner = None

    @classmethod
    def setUpClass(cls):
        cls.runner = fault_injection.Runner(BINARY)

    def check(self, name):
        outcome = getattr(self.runner, name)()
        self.assertTrue(outcome.passed, fault_injection.markdown([outcome]) + f"\nexit code {outcome.exit_code}")

    def test_kill_9(self):
        self.check("kill_9")

    def test_sigstop(self):
        self.check("sigstop")

    def test_missing_rank(self):
        self.check("missing_rank")

    def test_port_in_use(self):
        self.check("port_in_use")

    def test_corrupt_dataset(self):
        self.check("corrupt_dataset")

    def test_disk_full(self):
        self.check("disk_full")

    def test_kill_during_save(self):
        self.check("kill_during_save")

    def test_every_scenario_has_a_test(self):
        tested = {name[len("test_"):] for name in dir(self) if name.startswith("test_")}
        self.assertLessEqual(set(fault_injection.Runner.SCENARIOS), tested)


if __name__ == "__main__":
    unittest.main(verbosity=2)
