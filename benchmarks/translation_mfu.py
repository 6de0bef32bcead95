"""The translation recipe's training-step MFU: ``multi30k-tiny``'s model, optimiser and real batches, as
``gatedformer train`` runs them, timed in one loop with the float32 matrix product that gives the peak.

    python benchmarks/translation_mfu.py --threads 2 [--data-dir ../shared/data] [--batches 8] [--repeats 5]

One timed call trains on the first ``--batches`` batches of the recipe's first epoch (length-bucketed, so their
shapes vary). Its FLOPs are counted by ``torch.utils.flop_counter`` over the same batches' forward and backward
passes, with the PyTorch operations in place of the compiled CPU kernels (which the counter cannot see): the
arithmetic is the same. Padded positions count, as the model computes them; the share of padding is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from gatedformer.analysis.bench import BenchOptions, time_round_robin
from gatedformer.analysis.bench.command import json_destination, run_script
from gatedformer.analysis.bench.options import check_at_least
from gatedformer.analysis.bench.report import cpu_model
from gatedformer.analysis.bench.timing import measured_peaks, peak_contenders
from gatedformer.config import build_config, load_recipe
from gatedformer.data.translation import PAD_ID, collate, length_batches
from gatedformer.fused import fuse
from gatedformer.io import atomic_write_text
from gatedformer.kernels.build import pytorch_operations
from gatedformer.tasks.translation import build_seq2seq, load_data
from gatedformer.train.init import initialise
from gatedformer.train.optim import build_optimizer, build_scheduler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="multi30k-tiny")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, as for gatedformer train")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--batches", type=int, default=8, help="batches per timed call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    return run_script(parser.prog, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    options = BenchOptions(repeats=args.repeats, warmup=args.warmup, threads=args.threads)
    options.check()
    check_at_least("--batches", args.batches, 1)
    config = build_config(load_recipe(args.recipe), args.set)
    destination = json_destination(args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = load_data(config, args.data_dir)
    torch.manual_seed(config.train.seed)
    model = fuse(build_seq2seq(config, len(data.src_vocab), len(data.tgt_vocab)))  # as training runs it
    initialise(model, config.init)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.train.steps, config.model.d_model)
    tr = config.translation
    indices = length_batches(data.train, config.data.batch_size, tr.max_tokens, config.train.seed, 0)[:args.batches]
    batches = [collate(data.train, i) for i in indices]

    def loss_of(src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        return model(src, tgt_in, targets=tgt_out, ignore_index=PAD_ID, label_smoothing=tr.label_smoothing).loss

    def train_batches() -> None:
        for src, tgt_in, tgt_out in batches:
            optimizer.zero_grad(set_to_none=True)
            loss_of(src, tgt_in, tgt_out).backward()
            optimizer.step()
            scheduler.step()

    model.train()
    with pytorch_operations(), FlopCounterMode(display=False) as counter:
        for batch in batches:
            loss_of(*batch).backward()
    optimizer.zero_grad(set_to_none=True)
    flops = counter.get_total_flops()

    contenders, peak_flops = peak_contenders(torch.device("cpu"), options)
    contenders["train"] = train_batches
    times = time_round_robin(contenders, repeats=args.repeats, warmup=args.warmup)
    peak, _ = measured_peaks(times, peak_flops)
    train = times["train"]
    tokens = sum(int(t.numel()) for _, _, t in batches)
    real = sum(int((t != PAD_ID).sum()) for _, _, t in batches)
    result = {
        "recipe": args.recipe, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "batches": len(batches), "target_positions": tokens, "padding_share": 1 - real / tokens,
        "step_ms": 1e3 * train.median / len(batches), "step_q1_ms": 1e3 * train.quartiles[0] / len(batches),
        "step_q3_ms": 1e3 * train.quartiles[1] / len(batches), "gflop_per_step": flops / len(batches) / 1e9,
        "peak_gflops": peak / 1e9, "train_mfu": flops / train.median / peak,
    }
    print(f"{args.recipe}: {len(batches)} batches, {100 * result['padding_share']:.1f}% of target positions padding; "
          f"step {result['step_ms']:.1f} ms ({result['step_q1_ms']:.1f}-{result['step_q3_ms']:.1f}), "
          f"{result['gflop_per_step']:.2f} GFLOP, peak {result['peak_gflops']:.1f} GFLOP/s, "
          f"MFU {100 * result['train_mfu']:.1f}%  ({result['threads']} threads)")
    if destination is not None:
        atomic_write_text(destination, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
