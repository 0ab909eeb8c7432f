"""``labkit check gpipe-exercise [FILE]``: is the GPipe hands-on exercise complete and correct?

    labkit check gpipe-exercise                                    # jobs/gpipe/mnist_gpipe_exercise.py
    labkit check gpipe-exercise my_copy.py

The checker imports FILE (its ``main()`` stays guarded, nothing trains), calls its ``build_model(devices)``
with two CPU devices and its ``place_batch(x, y, devices)``, and checks the five steps:

1. the model handed to GPipe is an ``nn.Sequential``;
2. ``build_model`` no longer moves the model with ``.to()`` / ``.cuda()`` (GPipe places the partitions);
3. the layers are split over all the devices (a balance with one entry per device);
4. the model is a ``torchgpipe.GPipe``;
5. the input goes to the first device and the target to the last (checked with devices ``cpu`` and
   ``meta``, so the two are told apart without GPUs).

Then the partitioned model must compute what the unpartitioned one does with the same parameters:
the same outputs and parameter gradients (``atol 1e-5 + rtol 1e-4``, float32) on a random batch of one
digit per micro-batch. The reference runs each micro-batch separately, because BatchNorm normalises over
a micro-batch in GPipe.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import nn
from torchgpipe import GPipe

from labkit.errors import ConfigError
from labkit.exercises import import_file, parse_file

DEFAULT_FILE = Path("jobs/gpipe/mnist_gpipe_exercise.py")
STEPS = {
    1: "the model is an nn.Sequential",
    2: "no model.to(device): GPipe places the partitions",
    3: "the layers are split over the devices",
    4: "the model is wrapped in torchgpipe.GPipe",
    5: "input on the first device, target on the last",
}
HINTS = {
    1: "build it flat: get_model(..., sequential=True)",
    2: "delete model.to(...) in build_model",
    3: "give GPipe a balance with one layer count per device, e.g. balance_by_time(len(devices), model, sample)",
    4: "return GPipe(model, balance, devices=devices, chunks=chunks)",
    5: "in place_batch, send x to devices[0] and y to devices[-1]",
}
ATOL, RTOL = 1e-5, 1e-4


def find_file(argv: list[str]) -> Path:
    """FILE from the arguments, else the exercise in this directory or next to the labkit sources."""
    if argv:
        path = Path(argv[0])
    else:
        repo = Path(__file__).resolve().parents[2]
        path = next((p for p in (DEFAULT_FILE, repo / DEFAULT_FILE) if p.exists()), DEFAULT_FILE)
    if not path.is_file():
        raise ConfigError(f"no exercise file {path}; pass its path: labkit check gpipe-exercise FILE")
    return path.resolve()


def load(path: Path) -> ModuleType:
    """Import ``path`` as a module without running its training (needs the ``__main__`` guard)."""
    parse_file(path)  # a syntax error is named with its line before the guard is looked for
    if "__name__ == \"__main__\"" not in path.read_text() and "__name__ == '__main__'" not in path.read_text():
        raise ConfigError(f"{path} has no `if __name__ == \"__main__\":` guard, so importing it would train; "
                          "keep the guard around main()")
    module = import_file(path, f"_gpipe_exercise_{abs(hash(path))}")
    for name in ("build_model", "place_batch"):
        if not callable(getattr(module, name, None)):
            raise ConfigError(f"{path} defines no function {name}(); start again from the exercise file")
    return module


def build(module: ModuleType, path: Path, devices: list[str]) -> tuple[object, list[str]]:
    """``build_model(devices)`` and the ``.to()`` / ``.cuda()`` calls FILE made on modules meanwhile."""
    moves: list[str] = []
    originals = {name: getattr(nn.Module, name) for name in ("to", "cuda")}

    def spy(name: str):
        def method(self, *args, **kwargs):
            frame = sys._getframe(1)
            if Path(frame.f_code.co_filename).resolve() == path:
                moves.append(f"line {frame.f_lineno}: .{name}(...)")
            return originals[name](self, *args, **kwargs)
        return method

    try:
        for name in originals:
            setattr(nn.Module, name, spy(name))
        torch.manual_seed(0)
        return module.build_model(devices), moves
    except Exception as exc:  # the learner's code: report it as a step, not a traceback
        return exc, moves
    finally:
        for name, original in originals.items():
            setattr(nn.Module, name, original)


def compare(model: GPipe) -> str | None:
    """None if GPipe equals the unpartitioned model (outputs, gradients), else what differs."""
    reference = nn.Sequential(*[copy.deepcopy(layer) for layer in model]).train()
    model.train()
    torch.manual_seed(1)
    batch = model.chunks  # one digit per micro-batch: enough to compare, cheap on a CPU
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    out = model(x.to(model.devices[0]))  # placement is step (5)'s business, checked on its own
    nn.functional.cross_entropy(out, y.to(out.device)).backward()
    ref_out = torch.cat([reference(chunk) for chunk in x.cpu().chunk(model.chunks)])
    nn.functional.cross_entropy(ref_out, y.cpu()).backward()
    if not torch.allclose(out.cpu(), ref_out, atol=ATOL, rtol=RTOL):
        return f"outputs differ by up to {(out.cpu() - ref_out).abs().max().item():.3g}"
    for (name, p), q in zip(nn.Sequential(*model).named_parameters(), reference.parameters()):
        if p.grad is None or not torch.allclose(p.grad.cpu(), q.grad, atol=ATOL, rtol=RTOL):
            return f"the gradient of {name} differs from the unpartitioned model's"
    return None


def check(path: Path) -> tuple[dict[int, str | None], str | None]:
    """Per step: None (done) or what is missing; then the equivalence verdict (None: equal)."""
    module = load(path)
    devices = ["cpu", "cpu"]
    model, moves = build(module, path, devices)
    if isinstance(model, Exception):
        step, text = _diagnose(model, path)
        missing: dict[int, str | None] = {s: "not checked: build_model failed" for s in (1, 2, 3, 4)}
        missing[step] = text
    else:
        wrapped = isinstance(model, GPipe)
        kind = type(model).__name__
        missing = {
            1: None if wrapped or isinstance(model, nn.Sequential) else f"build_model returns a {kind}",
            2: f"build_model still moves the model ({'; '.join(moves)})" if moves else None,
            3: None if wrapped and len(model.partitions) == len(devices) else
            f"{len(model.partitions)} partition(s) for {len(devices)} devices" if wrapped else "no balance yet",
            4: None if wrapped else f"build_model returns a {kind}, not a GPipe",
        }
    missing[5] = _placement(module)
    verdict = "skipped until steps (1)-(4) are done"
    if not any(missing[s] for s in (1, 2, 3, 4)):
        verdict = compare(model)
    return missing, verdict


def _diagnose(exc: Exception, path: Path) -> tuple[int, str]:
    """Which step an exception from build_model points at, and a one-line description."""
    frames = [(f, n) for f, n in _frames(exc.__traceback__) if Path(f.f_code.co_filename).resolve() == path]
    where = f" (line {frames[-1][1]})" if frames else ""
    text = f"build_model raised {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}{where}"
    message = str(exc)
    for step, marker in ((1, "must be nn.Sequential"), (2, "denied to move"), (3, "balance"),
                         (4, "too few devices")):
        if marker in message:
            return step, text
    return 1, text


def _frames(tb):
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _placement(module: ModuleType) -> str | None:
    x, y = torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long)
    try:
        x, y = module.place_batch(x, y, ["cpu", "meta"])
    except Exception as exc:  # the learner's code
        return f"place_batch raised {type(exc).__name__}: {exc}"
    where = f"input on {x.device.type}, target on {y.device.type} for devices ['cpu', 'meta']"
    return None if (x.device.type, y.device.type) == ("cpu", "meta") else where


def main(argv: list[str]) -> int:
    """Print the five steps and the verdict; 0 if everything is done and correct, else 1."""
    path = find_file(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # micro-batches of one digit: thread wake-ups would cost more than they save
    try:
        missing, verdict = check(path)
    finally:
        torch.set_num_threads(threads)
    print(f"Checking {path}")
    for step, title in STEPS.items():
        status = "ok" if missing[step] is None else f"MISSING: {missing[step]}"
        print(f"  ({step}) {title:<50} {status}")
    equal = verdict is None
    print(f"  same outputs and gradients as the unpartitioned model: {'ok' if equal else verdict}")
    todo = [s for s in STEPS if missing[s] is not None]
    if todo:
        print(f"Not done yet: step ({todo[0]}) is missing -- {HINTS[todo[0]]}. "
              f"Still to do: {', '.join(f'({s})' for s in todo)}.")
        return 1
    if not equal:
        print(f"All steps are there, but the pipelined model computes something else: {verdict}.")
        return 1
    print("All five steps done: the GPipe model computes exactly what the unpartitioned model does.")
    return 0
