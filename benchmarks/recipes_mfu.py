"""The training step's MFU at the size of every language-model ``-tiny`` recipe: each recipe's baseline model
(width, layers, heads, FFN, window, batch, dropout, memory, localRNN window and cell, kernel) and its corpus's
vocabulary, through ``gatedformer bench``'s models table, one recipe after the other.

    python benchmarks/recipes_mfu.py --threads 1 --repeats 15 [--data-dir ../shared/data] [--json out.json]

The vocabulary is read from the corpus (``--data-dir``, ``$GATEDFORMER_DATA`` or the default data directories);
a recipe whose corpus is not there is reported as skipped. Model options that the bench does not size (norm
placement, tied embeddings, bottlenecks) take the bench's defaults; they change no FLOP count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gatedformer.analysis.bench import BenchOptions, BenchSize, run_bench
from gatedformer.analysis.bench.command import json_destination, run_script
from gatedformer.config import build_config, load_recipe, recipe_names
from gatedformer.data.corpora import load_corpus
from gatedformer.errors import DataError
from gatedformer.io import atomic_write_text


def _language_model_recipes() -> list[str]:
    return [name for name in recipe_names() if name.endswith("-tiny") and not name.startswith("multi30k")]


def recipe_size(name: str, data_dir: str | None) -> tuple[str, BenchSize]:
    """The recipe's backbone and its baseline model's size, the vocabulary read from its corpus."""
    config = build_config(load_recipe(name), [])
    model, data = config.model, config.data
    vocab = len(load_corpus(data.corpus, data_dir).vocab)
    size = BenchSize(d_model=model.d_model, n_layers=model.n_layers, n_heads=model.n_heads, d_ffn=model.d_ffn,
                     seq_len=data.seq_len, batch=data.batch_size, vocab=vocab, dropout=model.dropout,
                     mem_len=model.mem_len if model.backbone == "transformer-xl" else -1,
                     rnn_window=model.rnn_window, rnn_type=model.rnn_type, kernel_size=model.kernel_size)
    return model.backbone, size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--recipes", nargs="+", default=None, help="default: every language-model -tiny recipe")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    return run_script(parser.prog, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    options = BenchOptions(repeats=args.repeats, threads=args.threads, memory="none")  # MFU only: no memory probe
    options.check()
    names = args.recipes or _language_model_recipes()
    for name in names:
        load_recipe(name)  # an unknown name stops the run before the first recipe is timed
    destination = json_destination(args.json)
    rows = []
    print(f"{'recipe':32} {'backbone':15} {'vocab':>6} {'train ms':>9} {'tok/s':>8} {'MFU':>6}")
    for name in names:
        try:
            backbone, size = recipe_size(name, args.data_dir)
        except DataError as err:
            print(f"{name:32} skipped: {err}")
            rows.append({"recipe": name, "status": f"skipped: {err}"})
            continue
        report = run_bench(size, options, sections=["models"], backbones=[backbone], variants=["baseline"])
        row = next(r for r in report.rows if r.get("variant") == "baseline")
        print(f"{name:32} {backbone:15} {size.vocab:>6} {row['train_ms']:>9.1f} {row['train_tokens_per_s']:>8.0f} "
              f"{100 * row['train_mfu']:>5.1f}%")
        rows.append({"recipe": name, "backbone": backbone, "size": vars(size), "meta": report.meta, **row})
    if destination is not None:
        atomic_write_text(destination, json.dumps(rows, indent=2) + "\n")
    return 0

if __name__ == "__main__":
    sys.exit(main())
