"""The ``gatedformer bench`` command line (shared with the scripts in ``benchmarks/``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gatedformer.analysis.bench.options import (
    DEFAULT_SECTIONS,
    GATE_VARIANTS,
    MEMORY_METHODS,
    OPTIMIZERS,
    SECTIONS,
    BenchOptions,
    BenchSize,
    RNNSize,
)
from gatedformer.analysis.bench.report import format_report
from gatedformer.analysis.bench.sections import run_bench
from gatedformer.config import INIT_SCHEMES, backbone_names
from gatedformer.errors import GatedformerError
from gatedformer.io import make_folder

DESCRIPTION = "Speed and memory benchmarks: throughput, MFU and peak memory of every backbone and gate variant."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gatedformer bench`` options (shared by the CLI and the scripts in ``benchmarks/``)."""
    size, rnn, options = BenchSize(), RNNSize(), BenchOptions()
    group = parser.add_argument_group("model size")
    group.add_argument("--d-model", type=int, default=size.d_model)
    group.add_argument("--layers", type=int, default=size.n_layers)
    group.add_argument("--heads", type=int, default=size.n_heads)
    group.add_argument("--d-ffn", type=int, default=size.d_ffn, help="0: 4 x d-model")
    group.add_argument("--seq-len", type=int, default=size.seq_len)
    group.add_argument("--batch", type=int, default=size.batch)
    group.add_argument("--vocab", type=int, default=size.vocab)
    group.add_argument("--dropout", type=float, default=size.dropout)
    group.add_argument("--mem-len", type=int, default=size.mem_len, help="Transformer-XL memory (-1: seq-len)")
    group.add_argument("--rnn-window", type=int, default=size.rnn_window, help="R-Transformer LocalRNN window")
    group.add_argument("--rnn-type", choices=("gru", "lstm", "rnn"), default=size.rnn_type,
                       help="R-Transformer LocalRNN cell")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(DEFAULT_SECTIONS),
                        help=f"default: {' '.join(DEFAULT_SECTIONS)} (sampling, qa: by name)")
    parser.add_argument("--backbones", nargs="+", help=f"default: all ({', '.join(backbone_names())})")
    parser.add_argument("--variants", nargs="+",
                        help=f"gate variants by name ({', '.join(GATE_VARIANTS)}) or any gate spec; default: all")
    parser.add_argument("--repeats", type=int, default=options.repeats, help="timed rounds (median + IQR)")
    parser.add_argument("--warmup", type=int, default=options.warmup, help="untimed rounds first")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--device", default=options.device)
    parser.add_argument("--threads", type=int, default=options.threads, help="torch CPU threads (0: default)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=options.optimizer)
    parser.add_argument("--memory", choices=MEMORY_METHODS, default=options.memory)
    parser.add_argument("--init", choices=INIT_SCHEMES, default=options.init,
                        help="weight init of every LM, ours and peers (default: xavier, as the -tiny recipes; "
                             "'default' keeps each library's own)")
    parser.add_argument("--flush-denormal", action="store_true", help="flush denormal floats to zero (CPU)")
    parser.add_argument("--rnn-hidden", type=int, default=rnn.hidden)
    parser.add_argument("--rnn-len", type=int, default=rnn.length)
    parser.add_argument("--rnn-batch", type=int, default=rnn.batch)
    parser.add_argument("--rnn-layers", type=int, default=rnn.layers)
    parser.add_argument("--mem-lens", type=int, nargs="+", default=[0, 64, 128, 256])
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 3, 7, 15])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run_from_args(args: argparse.Namespace) -> int:
    size = BenchSize(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, d_ffn=args.d_ffn,
                     seq_len=args.seq_len, batch=args.batch, vocab=args.vocab, dropout=args.dropout,
                     mem_len=args.mem_len, rnn_window=args.rnn_window, rnn_type=args.rnn_type)
    options = BenchOptions(repeats=args.repeats, warmup=args.warmup, device=args.device, compile=args.compile,
                           bf16=args.bf16, optimizer=args.optimizer, memory=args.memory, threads=args.threads,
                           init=args.init, flush_denormal=args.flush_denormal)
    rnn = RNNSize(hidden=args.rnn_hidden, length=args.rnn_len, batch=args.rnn_batch, layers=args.rnn_layers)

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"[bench] {message}", file=sys.stderr, flush=True)

    report = run_bench(size, options, sections=args.sections, backbones=args.backbones, variants=args.variants,
                       rnn=rnn, mem_lens=args.mem_lens, windows=args.windows, progress=progress)
    print(report.to_json() if args.json else format_report(report))
    return 0


def run_script(prog: str, body: Callable[[], int]) -> int:
    """Run a benchmark script's ``body`` as the CLI runs a command: a problem with the user's input is one line
    on stderr, ``prog: error: ...``, and the error's exit code, not a traceback."""
    try:
        return body()
    except GatedformerError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return err.exit_code


def json_destination(path: str | None) -> Path | None:
    """The ``--json`` file of a script, its folder created now so that a path that cannot be written fails
    before the measurements rather than after them."""
    if path is None:
        return None
    destination = Path(path)
    make_folder(destination.parent, f"folder for {destination.name}")
    return destination


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m gatedformer.analysis.bench``, the ``benchmarks/`` scripts)."""
    parser = argparse.ArgumentParser(prog="gatedformer bench", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_script("gatedformer bench", lambda: run_from_args(args))
