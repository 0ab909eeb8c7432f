"""``labkit train --strategy ddp --watchdog 3`` on 2 ranks, where rank 1 stops inside its third optimizer step:
the program of test_faults' watchdog-in-training test (run by labkit.faults.runner)."""
import os
import time

import torch

from labkit.cli import main as labkit


def main():
    if os.environ["RANK"] == "1":
        step, calls = torch.optim.SGD.step, []

        def third_step_stops(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                time.sleep(600)
            return step(self, *args, **kwargs)

        torch.optim.SGD.step = third_step_stops
    labkit(["train", "--strategy", "ddp", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "512",
            "--test-size", "32", "--batch-size", "32", "--device", "cpu", "--log-every", "1000", "--no-checkpoint",
            "--watchdog", "3", "--out", os.environ["LABKIT_TEST_OUT"]])
