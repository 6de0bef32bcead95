"""Where a Transformer-XL recipe's training step goes: the compiled layer stack's two calls (forward and backward,
``relative_stack_forward`` and ``relative_stack_backward``), everything around them, the rest alone (the two calls
made no-ops, so what is timed is the Python, autograd and optimiser work), and the step side by side with the Python
layer stack.

    python benchmarks/xl_step.py --recipe enwik8-xl12-tiny --threads 2 [--steps 40] [--data-dir ../shared/data]

The recipe's baseline model at its size, stepped as ``gatedformer bench``'s models table steps it (memory full).
The rest alone runs on whatever the skipped calls leave in their outputs: only its time means anything. Where the
compiled stack does not apply (no MKL, or shapes it does not split) the script says so and stops.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipes_mfu import recipe_size  # noqa: E402

from gatedformer.analysis.bench import BenchOptions, time_round_robin, training_step  # noqa: E402
from gatedformer.analysis.bench.command import json_destination, run_script  # noqa: E402
from gatedformer.analysis.bench.options import check_at_least  # noqa: E402
from gatedformer.errors import ConfigError  # noqa: E402
from gatedformer.io import atomic_write_text  # noqa: E402
from gatedformer.kernels import epilogue as _epilogue_kernel  # noqa: E402
from gatedformer.ops import layer_stack  # noqa: E402

_CALLS = ("relative_stack_forward_f32", "relative_stack_backward_f32")


class _Calls:
    """The epilogue kernel's library with the stack's two calls timed (or skipped); everything else passed on."""

    def __init__(self, library: object, skip: bool) -> None:
        self._library, self._skip = library, skip
        self.seconds = dict.fromkeys(_CALLS, 0.0)

    def __getattr__(self, name: str) -> object:
        call = getattr(self._library, name)
        if name not in _CALLS:
            return call

        def timed(*args: object) -> object:
            started = time.perf_counter()
            result = 0 if self._skip else call(*args)
            self.seconds[name] += time.perf_counter() - started
            return result

        return timed


@contextlib.contextmanager
def _watched(skip: bool = False) -> Iterator[_Calls]:
    kernel = _epilogue_kernel.KERNEL
    calls = _Calls(kernel.library(), skip)
    kernel.library = lambda **kwargs: calls  # an instance attribute over the method, removed below
    try:
        yield calls
    finally:
        del kernel.library


@contextlib.contextmanager
def _python_stack() -> Iterator[None]:
    streams = layer_stack._streams_whole_stack
    layer_stack._streams_whole_stack = lambda *args: False
    try:
        yield
    finally:
        layer_stack._streams_whole_stack = streams


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _profile(step: Callable[[], None], steps: int, skip: bool) -> dict[str, float]:
    """Medians over ``steps`` steps (garbage collection off, as the bench times): the step, and the two calls."""
    rows: list[tuple[float, float, float]] = []
    with _watched(skip) as calls:
        step()
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(steps):
                calls.seconds = dict.fromkeys(_CALLS, 0.0)
                started = time.perf_counter()
                step()
                rows.append((time.perf_counter() - started, *calls.seconds.values()))
        finally:
            if enabled:
                gc.enable()
    total, forward, backward = (_median_ms(list(column)) for column in zip(*rows, strict=True))
    return {"step_ms": total, "forward_call_ms": forward, "backward_call_ms": backward}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="enwik8-xl12-tiny")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--steps", type=int, default=40, help="steps timed for each profile")
    parser.add_argument("--repeats", type=int, default=15, help="rounds of the side-by-side timing")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    return run_script(parser.prog, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    BenchOptions(repeats=args.repeats, threads=args.threads).check()
    check_at_least("--steps", args.steps, 1)
    backbone, size = recipe_size(args.recipe, args.data_dir)
    destination = json_destination(args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    if backbone != "transformer-xl":
        raise ConfigError(f"{args.recipe} is a {backbone} recipe; this script looks inside Transformer-XL's step: "
                          "pass --recipe enwik8-xl12-tiny or another transformer-xl recipe")
    step = training_step(size, backbone, BenchOptions(device="cpu"))
    for _ in range(3):
        step()
    whole = _profile(step, args.steps, skip=False)
    if whole["forward_call_ms"] == 0.0:
        print("the compiled layer stack does not run here (no MKL, or shapes it does not split): nothing to split")
        return 1
    rest = _profile(step, args.steps, skip=True)["step_ms"]

    def python_step() -> None:
        with _python_stack():
            step()

    times = time_round_robin({"compiled": step, "python": python_step}, repeats=args.repeats)
    pairs = sorted(p / c for c, p in zip(times["compiled"].samples, times["python"].samples, strict=True))
    figures = {
        "recipe": args.recipe, "threads": torch.get_num_threads(), **whole,
        "around_calls_ms": whole["step_ms"] - whole["forward_call_ms"] - whole["backward_call_ms"],
        "rest_alone_ms": rest, "python_stack_speedup": times["python"].median / times["compiled"].median,
        "python_stack_pair_quartiles": [pairs[len(pairs) // 4], pairs[3 * len(pairs) // 4]],
    }
    print(f"{args.recipe}, {figures['threads']} thread(s), medians of {args.steps} steps:")
    print(f"  training step                      {whole['step_ms']:8.2f} ms")
    print(f"  compiled stack, forward call       {whole['forward_call_ms']:8.2f} ms")
    print(f"  compiled stack, backward call      {whole['backward_call_ms']:8.2f} ms")
    print(f"  everything around the two calls    {figures['around_calls_ms']:8.2f} ms")
    print(f"  the step with the calls skipped    {rest:8.2f} ms  (Python, autograd, optimiser)")
    low, high = figures["python_stack_pair_quartiles"]
    print(f"  side by side, {args.repeats} rounds: the compiled stack {figures['python_stack_speedup']:.3f}x as fast "
          f"as the Python layer stack (pair quartiles {low:.3f}-{high:.3f})")
    if destination is not None:
        atomic_write_text(destination, json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
