"""``labkit train --strategy ddp --watchdog 3`` on 2 ranks, where rank 1 stops inside its third optimizer step:
the program of test_faults' watchdog-in-training test (run by labkit.faults.runner)."""
import os
import time

import torch

from labkit.cli import main as labkit


def main():
    step, calls = torch.optim.SGD.step, []

    def third_step_stops(self, *args, **kwargs):
        """Rank 1 stops in its third step; rank 0's steps take 0.3 s, over the stop check's 0.2 s, so that rank 0
        launches a stop check after every step, and has one in flight when it waits in the gradient all-reduce."""
        calls.append(1)
        if len(calls) == 3 and os.environ["RANK"] == "1":
            time.sleep(600)
        time.sleep(0.3)
        return step(self, *args, **kwargs)

    torch.optim.SGD.step = third_step_stops
    labkit(["train", "--strategy", "ddp", "--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "512",
            "--test-size", "32", "--batch-size", "32", "--device", "cpu", "--log-every", "1000",
            "--watchdog", "3", "--out", os.environ["LABKIT_TEST_OUT"]])
