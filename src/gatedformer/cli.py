"""The ``gatedformer`` command line: parses, dispatches, prints. The work lives in the library."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from gatedformer.errors import ConfigError, GatedformerError


def _add_config_args(parser: argparse.ArgumentParser, data: bool = True) -> None:
    parser.add_argument("--recipe", required=True, help="a shipped recipe name or a path to a .toml recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set model.d_model=256 (repeatable)")
    if data:
        parser.add_argument("--data", help="corpus to use, e.g. ptb-char, wikitext2, text:notes.txt")
        parser.add_argument("--data-dir", help="folder holding the corpora (default: $GATEDFORMER_DATA, "
                                               "then ../shared/data, then the user cache)")


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = [f"data.corpus={args.data}"] if getattr(args, "data", None) else []
    if getattr(args, "tensorboard", False):
        extra.append("train.tensorboard=true")
    return list(args.overrides) + extra


def _train_flags(args: argparse.Namespace) -> list[str]:
    """``--bf16`` and ``--compile``: shorthands for their ``--set`` values."""
    return (["train.precision=bf16"] if args.bf16 else []) + (["train.compile=true"] if args.compile else [])


def cmd_train(args: argparse.Namespace) -> int:
    from gatedformer.config import build_config, load_recipe
    from gatedformer.train.distributed import is_main_process
    from gatedformer.train.loop import train

    config = build_config(load_recipe(args.recipe), _overrides(args) + _train_flags(args))
    if args.resume and is_main_process() and _nothing_to_resume(Path(args.out)):
        print(f"note: {args.out} holds no checkpoint to resume; starting a new run", file=sys.stderr)
    result = train(config, args.out, data_dir=args.data_dir, resume=args.resume, progress=not args.quiet)
    if not is_main_process():
        return 0  # under torchrun, rank 0 alone prints and plots
    _print_result(result.__dict__)
    from gatedformer.train.lossplot import can_draw

    if can_draw():  # train() drew it
        print(f"loss curve: {Path(args.out) / 'loss.png'}")
    else:
        print("loss curve skipped: install the 'plot' extra (pip install 'gatedformer[plot]')")
    return 0


def _nothing_to_resume(out: Path) -> bool:
    from gatedformer.train.checkpoint import latest_checkpoint
    from gatedformer.train.rundir import held_here

    if (out / "results.json").is_file() or held_here(out):
        return False  # the trainer says the run is finished, or that another process holds it
    try:
        return latest_checkpoint(out) is None
    except GatedformerError:
        return False  # a damaged pointer: the trainer names it


def _print_result(result: dict) -> None:
    metric = result["metric"]
    print(f"valid loss {result['valid_loss']:.4f}  valid {metric} {result['valid_metric']:.4f}")
    if not math.isnan(result["test_loss"]):  # GLUE's test labels are not public: nothing to print
        print(f"test  loss {result['test_loss']:.4f}  test  {metric} {result['test_metric']:.4f}")
    print(f"params {result['params']:,}  {result['seconds_per_step'] * 1000:.1f} ms/step  "
          f"{result['tokens_per_second']:,.0f} tokens/s  results: {result['run_dir']}/results.json")


def cmd_eval(args: argparse.Namespace) -> int:
    from gatedformer.runs import evaluate_run

    scores = evaluate_run(args.run, args.split, args.data_dir, args.device)
    # Strict JSON, as results.json: a non-finite score is null (jq and most languages refuse a NaN).
    scores = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in scores.items()}
    print(json.dumps({"run": str(args.run), "split": args.split, **scores}, allow_nan=False))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from gatedformer.runs import load_trained
    from gatedformer.tasks.lm import generate_stream

    run = load_trained(args.run, args.data_dir, args.device)
    run.require("lm", "generate", f"use `gatedformer translate --run {args.run}` to translate with it, or "
                                  f"`gatedformer eval --run {args.run}` for its loss and BLEU"
                if run.task.name == "translation" else f"use `gatedformer eval --run {args.run}` for its scores")
    for piece in generate_stream(run.model, run.data.vocab, args.prompt, max_tokens=args.tokens,
                                 temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                                 context=args.context, cache=not args.no_cache):
        print(piece, end="", flush=True)  # as it is sampled: a long generation shows from its first token
    print()
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from gatedformer.pretrained import export_run

    folder = export_run(args.run, args.out, args.device, args.data_dir)
    print(f"exported {args.run} to {folder} (config.json, model.safetensors, vocabulary, README.md); load it with "
          f"gatedformer.from_pretrained({str(folder)!r})")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from gatedformer import data

    if args.action == "list" and args.name:
        raise GatedformerError(f"data list takes no corpus name (got {args.name!r}); "
                               f"use `gatedformer data check {args.name}` for one corpus's files")
    if args.action == "list":
        for entry in data.list_corpora():
            print(f"{entry['name']:<16} {entry['level']:<5} {entry['metric']:<4} {entry['description']}")
        return 0
    if args.action == "check":
        results = data.check_corpora(args.data_dir, args.name)
        for entry in results:
            print(f"{entry['name']:<16} {entry['status']:<8} {entry.get('path') or ''} {entry.get('detail') or ''}")
        # Checking every corpus, a missing one is normal (not fetched yet); checking one, it is the answer.
        fine = ("ok",) if args.name else ("ok", "missing")
        return 0 if all(e["status"] in fine for e in results) else 1
    if not args.name:
        raise GatedformerError("data fetch needs a corpus name, e.g. gatedformer data fetch enwik8")
    path = data.fetch_corpus(args.name, args.data_dir, base_url=args.mirror, progress=not args.quiet)
    print(f"{args.name}: ready at {path}")
    return 0


def cmd_params(args: argparse.Namespace) -> int:
    from gatedformer.analysis.params import parameter_report

    report = parameter_report(args.recipe, _overrides(args), data_dir=args.data_dir, vocab_size=args.vocab_size,
                              matched_baseline=args.matched_baseline)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(report["text"])
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from gatedformer.analysis.compare import run_comparison
    from gatedformer.analysis.text_tasks import comparison_for
    from gatedformer.config import load_recipe

    recipe = load_recipe(args.recipe)
    compare_tasks = comparison_for(recipe)  # pretraining and GLUE (Table 2), or sentence classification's folds
    if args.lr_sweep is not None:
        from gatedformer.analysis.lr_sweep import parse_rates, run_lr_sweep

        rates = parse_rates(args.lr_sweep)
        if compare_tasks is not None:
            raise ConfigError(f"--lr-sweep does not apply to {recipe.name}'s comparison (pretraining and fine-tuning, "
                              "or cross-validation); leave it out")
        report = run_lr_sweep(recipe, Path(args.out), rates, seeds=args.seeds, overrides=_overrides(args),
                              data_dir=args.data_dir, progress=not args.quiet, only=args.variants,
                              matched_baseline=args.matched_baseline, step_timing=args.step_timing)
    elif compare_tasks is not None:
        if args.matched_baseline is not None:
            raise ConfigError(f"--matched-baseline does not apply to {recipe.name}'s comparison (pretraining and "
                              "fine-tuning, or cross-validation); leave it out")
        report = compare_tasks(recipe, Path(args.out), seeds=args.seeds,
                               overrides=_overrides(args) + (["train.tensorboard=true"] if args.tensorboard else []),
                               data_dir=args.data_dir, progress=not args.quiet, only=args.variants)
    else:
        report = run_comparison(recipe, args.out, seeds=args.seeds,
                                overrides=_overrides(args), data_dir=args.data_dir, progress=not args.quiet,
                                only=args.variants, matched_baseline=args.matched_baseline,
                                step_timing=args.step_timing)
    print(report.table)
    print(f"\nreport: {report.report_path}")
    for figure in report.figures:
        print(f"figure: {figure}")
    for note in report.notes:
        print(f"note: {note}")
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    from gatedformer.tasks.glue import finetune_config
    from gatedformer.train.loop import train

    config = finetune_config(args.run, args.task, args.overrides, args.data_dir)
    if args.resume and _nothing_to_resume(Path(args.out)):
        print(f"note: {args.out} holds no checkpoint to resume; starting a new run", file=sys.stderr)
    result = train(config, args.out, data_dir=args.data_dir, resume=args.resume, progress=not args.quiet)
    scores = json.loads((Path(args.out) / "results.json").read_text(encoding="utf-8"))
    named = ", ".join(f"{k} {scores[k]:.4f}" for k in ("accuracy", "f1", "matthews", "pearson", "spearman")
                      if scores.get(k) is not None)
    print(f"{config.data.corpus}: best validation evaluation: loss {result.valid_loss:.4f}, {named}")
    print(f"params {result.params:,}  {result.seconds_per_step * 1000:.1f} ms/step  results: {args.out}/results.json, "
          f"dev_predictions.tsv and the test submission file")
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from gatedformer.analysis.gates import analyze_run
    from gatedformer.analysis.measurements import analyze_measurements, check_spike_factor

    check_spike_factor(args.spike_factor)
    if len(args.run) > 1:
        if not args.out:
            raise GatedformerError("analyze with several --run needs --out FOLDER for the figures")
        from gatedformer.analysis.gates import analyze_runs

        analysis = analyze_runs(args.run, args.out)
    else:
        analysis = analyze_run(args.run[0], args.out)
    if any(_is_translation_run(Path(run)) for run in args.run):
        from gatedformer.analysis.attention import analyze_attention

        for run in args.run:
            prefix = f"{Path(run).name}-" if len(args.run) > 1 else ""
            figures, notes = analyze_attention(run, args.out, args.data_dir, prefix)
            analysis.figures += figures
            analysis.notes += notes
    text, figures, notes = analyze_measurements(args.run, args.out, args.data_dir, args.spike_factor)
    print(text)
    analysis.figures += figures
    analysis.notes += notes
    for note in analysis.notes:
        print(note)
    for figure in analysis.figures:
        print(f"figure: {figure}")
    return 0


def _is_translation_run(run: Path) -> bool:
    from gatedformer.config import task_of
    from gatedformer.train.checkpoint import read_run_config

    try:
        return task_of(read_run_config(run)) == "translation"
    except GatedformerError:
        return False  # analyze_run has named what is wrong with the folder


def cmd_init_check(args: argparse.Namespace) -> int:
    from gatedformer.analysis.init_check import format_init_check, init_check
    from gatedformer.config import build_config, load_recipe

    config = build_config(load_recipe(args.recipe), _overrides(args))
    if args.sru_cells:
        from gatedformer.analysis.sru_variance import format_cell_variance, sru_cell_check

        result = sru_cell_check(config, args.data_dir, args.depth, Path(args.figure) if args.figure else None)
        print(json.dumps(result.rows(), indent=2) if args.json else format_cell_variance(result))
        if args.figure:
            print(f"figure: {args.figure}")
        return 0
    rows = init_check(config, data_dir=args.data_dir, batches=args.batches, dropout=not args.no_dropout)
    print(json.dumps(rows, indent=2) if args.json else format_init_check(rows))
    return 0


def cmd_translate(args: argparse.Namespace) -> int:
    from gatedformer.runs import load_trained
    from gatedformer.tasks.translation import source_lines, translate_stream

    figure = None
    if args.attention_plot:
        from gatedformer.analysis.attention import require_plotting

        figure = require_plotting(args.attention_plot)
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    typed = not args.input and sys.stdin.isatty()
    batch_size = args.batch_size or (1 if typed else 64)
    lines = source_lines(args.input or None)  # read as it is translated, a line at most 64 KiB
    run = load_trained(args.run, args.data_dir, args.device)
    run.require("translation", "translate", f"use `gatedformer generate --run {args.run}` to sample from it")
    first: list[str] = []  # the first non-empty line, for the attention figure

    def remembered(lines: Iterable[str]) -> Iterator[str]:
        for line in lines:
            if not first and line.strip():
                first.append(line)
            yield line

    for line in translate_stream(run.model, run.config, run.data, remembered(lines), beam=args.beam,
                                 length_penalty=args.length_penalty, batch_size=batch_size):
        print(line, flush=True)
    if figure is not None:
        from gatedformer.analysis.attention import plot_attention
        from gatedformer.tasks.translation import attention_for_line

        if not first:
            raise GatedformerError("--attention-plot draws the first input sentence, but the input has no non-empty "
                                   "line")
        maps = attention_for_line(run.model, run.config, run.data, first[0], beam=args.beam,
                                  length_penalty=args.length_penalty)
        path = plot_attention(maps, figure, title=f"{Path(args.run).name}: {run.config.model.backbone}")
        print(f"attention figure: {path}", file=sys.stderr)  # stdout keeps one line per input line
    return 0


def cmd_classify(args: argparse.Namespace) -> int:
    from gatedformer.pretrained import classify_input, classify_lines, load

    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    typed = not args.input and sys.stdin.isatty()
    batch_size = args.batch_size or (1 if typed else 64)
    lines = classify_input(args.input or None)  # read as it is classified, a line at most 64 KiB
    model = load(args.run, args.device, args.data_dir)
    for line in classify_lines(model, lines, batch_size, args.probabilities):
        print(line, flush=True)  # a batch's lines as soon as it is classified
    return 0


def cmd_answer(args: argparse.Namespace) -> int:
    from gatedformer.pretrained import load
    from gatedformer.tasks.qa import answer_lines, check_question, question_lines, read_context

    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    single = args.context is not None or args.question is not None
    if single == (args.input is not None) or (single and (args.context is None or args.question is None)):
        raise ConfigError("give --context and --question, or --input FILE of JSON lines (- for standard input), "
                          "not both")
    if args.input is None:
        pairs = [check_question(read_context(args.context), args.question)]  # before the model is loaded
        lines: Iterable[str] = [json.dumps({"context": pairs[0][0], "question": pairs[0][1]})]
    else:
        lines = question_lines(None if args.input == "-" else args.input)
    typed = args.input == "-" and sys.stdin.isatty()
    batch_size = args.batch_size or (1 if typed else 32)
    model = load(args.run, args.device)
    if model.task.name != "qa":  # before a line is read
        raise ConfigError(f"{args.run} is a {model.task.title} run ({model.config.data.corpus}), not a "
                          "question-answering one; answer with a run of a squad recipe")
    for line in answer_lines(model.model, model.config, model.data, lines, model.device, batch_size):
        print(line, flush=True)  # a batch's answers as soon as they are found
    return 0


def cmd_fill_mask(args: argparse.Namespace) -> int:
    from gatedformer.pretrained import load

    model = load(args.run, args.device)
    found = model.fill_mask(args.text, args.top_k)
    for number, candidates in enumerate(found if isinstance(found[0], list) else [found], start=1):
        for piece, probability in candidates:
            print(f"{number}\t{piece}\t{probability:.4f}")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    import gatedformer.tasks  # noqa: F401  (each task claims its corpora as it registers: the recipe's task)
    from gatedformer.config import load_recipe, recipe_names, task_of

    rows = []
    for name in recipe_names():
        recipe = load_recipe(name)
        task = task_of(recipe.config)
        if task == "mlm" and recipe.config.finetune.tasks.strip():
            task = "mlm+glue"  # pretrains, then compare fine-tunes each variant on GLUE (Table 2)
        rows.append({"name": name, "task": task, "corpus": recipe.config.data.corpus,
                     "variants": len(recipe.variants), "mirrors": recipe.published_source})
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return 0
    print(f"{'recipe':<34} {'task':<12} {'corpus':<14} {'variants':>8}  mirrors")
    for row in rows:
        print(f"{row['name']:<34} {row['task']:<12} {row['corpus']:<14} {row['variants']:>8}  {row['mirrors']}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from gatedformer.analysis.bench import run_from_args

    return run_from_args(args)


COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train a recipe into a run folder",
              "gatedformer train --recipe ptb-char-tiny --out runs/sdu --set model.gates='+σ SDU' \\\n"
              "    --set train.steps=300"),
    "eval": ("score a trained run on valid or test (one JSON line)", "gatedformer eval --run runs/sdu --split test"),
    "generate": ("sample text from a trained language model",
                 "gatedformer generate --run runs/sdu --prompt 'the ' --tokens 200 --temperature 0.8"),
    "export": ("write a trained run as a Hugging Face Hub folder",
               "gatedformer export --run runs/sdu --out export/sdu"),
    "data": ("list, check or fetch corpora", "gatedformer data fetch ptb-char\ngatedformer data check"),
    "params": ("count a recipe's parameters, total and per component",
               "gatedformer params --recipe ptb-char-tiny --matched-baseline"),
    "finetune": ("fine-tune a pretrained BERT run on a GLUE task",
                 "gatedformer finetune --run runs/mlm --task mrpc --out runs/mlm-mrpc"),
    "compare": ("train every variant of a recipe and write the paper-style report",
                "gatedformer compare --recipe ptb-char-tiny --out runs/ptb-char-tiny --seeds 3"),
    "analyze": ("gate figures and per-layer measurements of trained runs", "gatedformer analyze --run runs/sdu"),
    "init-check": ("variance ratios at initialisation beside theory's",
                   "gatedformer init-check --recipe multi30k-convs2s-tiny --no-dropout"),
    "translate": ("translate sentences with a trained translation run",
                  "echo 'a man rides a bike .' | gatedformer translate --run runs/multi30k --beam 4"),
    "classify": ("classify sentences with a sentence-classification or GLUE run",
                 "echo 'How tall is the Sears Building ?' | gatedformer classify --run runs/trec"),
    "answer": ("answer a question about a paragraph (question answering)",
               "gatedformer answer --run runs/squad --context paragraph.txt --question 'Who founded it?'"),
    "fill-mask": ("the likeliest pieces for each [MASK] of a text (masked LM run)",
                  "gatedformer fill-mask --run runs/mlm --text 'the [MASK] of the river' --top-k 3"),
    "bench": ("time every backbone and gate beside other libraries' models",
              "gatedformer bench --threads 2 --sections models --backbones transformer"),
    "recipes": ("list the recipes and the paper table each mirrors",
                "gatedformer recipes\ngatedformer recipes --json"),
}
"""Each command's line in ``gatedformer --help`` and the example its own ``--help`` ends with."""


def _listing() -> str:
    # Written out rather than argparse's list of subcommands, which wraps a long name's line onto two.
    lines = [f"  {name:<11} {summary}" for name, (summary, _) in COMMANDS.items()]
    return "commands:\n" + "\n".join(lines)


def _command(commands: argparse._SubParsersAction, name: str, detail: str) -> argparse.ArgumentParser:
    """A subcommand listed by its one line, described in full by its own ``--help`` and ending with an example."""
    example = COMMANDS[name][1]
    # Raw, so that the example keeps its lines; the description is wrapped here instead.
    return commands.add_parser(name, description=textwrap.fill(detail[:1].upper() + detail[1:] + ".",
                                                                             width=100),
                               epilog="example:\n" + textwrap.indent(example, "  "),
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    # Long on purpose: the one declaration of every command and its options, in the order --help lists them.
    from gatedformer import __version__

    parser = argparse.ArgumentParser(prog="gatedformer", description="Gated sequence models: train, compare, "
                                     "evaluate and generate.\n\n" + _listing(),
                                     epilog="example:\n  gatedformer compare --recipe ptb-char-tiny --out "
                                            "runs/ptb-char-tiny\n\n`gatedformer COMMAND --help` shows a command's "
                                            "options and an example.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gatedformer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     help="one of the commands above")

    train = _command(commands, "train", detail="train a recipe into a run directory")
    _add_config_args(train)
    train.add_argument("--out", required=True, help="run directory to create (or continue with --resume)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--bf16", action="store_true", help="bfloat16 autocast on CPU or CUDA (same as --set "
                       "train.precision=bf16)")
    train.add_argument("--compile", action="store_true", help="torch.compile the model (same as --set "
                       "train.compile=true)")
    train.add_argument("--tensorboard", action="store_true", help="also log scalars to OUT/tensorboard "
                       "(same as --set train.tensorboard=true; needs the tensorboard package)")
    train.set_defaults(handler=cmd_train)

    evaluate = _command(commands, "eval", detail="score a trained run on valid or test; prints one JSON line")
    evaluate.add_argument("--run", required=True, help="a run directory written by train")
    evaluate.add_argument("--split", choices=("valid", "test"), default="valid")
    evaluate.add_argument("--data-dir")
    evaluate.add_argument("--device", default="auto")
    evaluate.set_defaults(handler=cmd_eval)

    generate = _command(commands, "generate", detail="sample text from a trained run")
    generate.add_argument("--run", required=True)
    generate.add_argument("--prompt", default="")
    generate.add_argument("--tokens", type=int, default=200, help="how many tokens to sample")
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--context", type=int, default=512,
                          help="the most tokens the model reads at once (default 512)")
    generate.add_argument("--no-cache", action="store_true",
                          help="read the whole window again for every token (no key/value cache or carried "
                               "state): slower, the same text")
    generate.add_argument("--data-dir")
    generate.add_argument("--device", default="auto")
    generate.set_defaults(handler=cmd_generate)

    export = _command(commands, "export", detail="write a trained run as a Hugging Face Hub folder (config.json, "
                                                "model.safetensors, vocabulary, model card)")
    export.add_argument("--run", required=True)
    export.add_argument("--out", required=True, help="a new or empty folder (or an earlier export, overwritten)")
    export.add_argument("--data-dir")
    export.add_argument("--device", default="cpu")
    export.set_defaults(handler=cmd_export)

    data = _command(commands, "data", detail="list, check or fetch corpora")
    data.add_argument("action", choices=("list", "check", "fetch"))
    data.add_argument("name", nargs="?", help="corpus to fetch, or to check alone")
    data.add_argument("--data-dir")
    data.add_argument("--mirror", help="fetch from this base URL instead of the canonical address")
    data.add_argument("--quiet", action="store_true")
    data.set_defaults(handler=cmd_data)

    params = _command(commands, "params", detail="parameter counts, total and per component")
    _add_config_args(params)
    params.add_argument("--vocab-size", type=int, metavar="N",
                        help="count for this vocabulary size instead of reading the corpus")
    params.add_argument("--matched-baseline", nargs="?", const="", default=None, metavar="VARIANT",
                        help="also count the first variant at the parameter count of VARIANT (default: the largest)")
    params.add_argument("--json", action="store_true")
    params.set_defaults(handler=cmd_params)

    finetune = _command(commands, "finetune", detail="fine-tune a pretrained BERT run on a GLUE task (best validation "
                                   "evaluation in results.json, dev predictions and the GLUE submission file)")
    finetune.add_argument("--run", required=True, help="a finished masked-LM pretraining run (gatedformer train)")
    finetune.add_argument("--task", required=True, choices=("cola", "sst2", "mrpc", "stsb", "rte", "wnli", "qnli"))
    finetune.add_argument("--out", required=True, help="run directory to create (or continue with --resume)")
    finetune.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                          help="override a field of the fine-tuning run, e.g. --set finetune.epochs=2 (repeatable)")
    finetune.add_argument("--data-dir", help="folder holding glue/ (default: as for train)")
    finetune.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    finetune.add_argument("--quiet", action="store_true", help="no progress bar")
    finetune.set_defaults(handler=cmd_finetune)

    compare = _command(commands, "compare", detail="train every variant of a recipe and report them side by side")
    _add_config_args(compare)
    compare.add_argument("--out", required=True, help="folder for the runs, report.md and figures")
    compare.add_argument("--seeds", type=int, default=1, help="seeds per variant")
    compare.add_argument("--variants", nargs="+", help="train only these variants (by name)")
    compare.add_argument("--matched-baseline", nargs="?", const="", default=None, metavar="VARIANT",
                         help="add the first variant at the parameter count of VARIANT (default: the largest), its "
                              "feed-forward width solved for")
    compare.add_argument("--lr-sweep", metavar="RATES",
                         help="train every variant at each of these learning rates (comma-separated, e.g. "
                              "1e-3,3e-3,1e-2), each rate in OUT/lr-<rate>; OUT/report.md sets the final loss and the "
                              "diverged runs per rate side by side (a diverged run is recorded and the sweep goes on)")
    compare.add_argument("--no-step-timing", dest="step_timing", action="store_false",
                         help="skip timing every variant's step interleaved for the training-time table")
    compare.add_argument("--quiet", action="store_true")
    compare.add_argument("--tensorboard", action="store_true", help="also log every run's scalars to "
                         "OUT/<variant>/seed-<k>/tensorboard (needs the tensorboard package)")
    compare.set_defaults(handler=cmd_compare)

    analyze = _command(commands, "analyze", detail="gate figures of a run: bias heatmap, t-SNE of the biases, "
                                  "gate activation during training; attention sink, largest activation and gate "
                                  "sparsity per layer, loss spikes; for a translation run, its decoder attention")
    analyze.add_argument("--run", required=True, action="append",
                         help="a run directory written by train (or compare); repeat it to draw several runs' gate "
                              "biases side by side")
    analyze.add_argument("--out", help="folder for the figures (default: the run directory)")
    analyze.add_argument("--data-dir", help="corpus folder, for the measurements on validation text and a translation "
                                            "run's attention figure (its first test sentence)")
    analyze.add_argument("--spike-factor", type=float, default=1.25, metavar="F",
                         help="a training-loss record above F × the mean of the 10 before it counts as a loss spike "
                              "(default 1.25)")
    analyze.set_defaults(handler=cmd_analyze)

    init_check = _command(commands, "init-check", detail="per-layer forward/backward variance ratios at "
                                     "initialisation, beside what theory predicts")
    _add_config_args(init_check)
    init_check.add_argument("--batches", type=int, default=4, help="training windows to measure over")
    init_check.add_argument("--no-dropout", action="store_true",
                            help="measure in evaluation mode (dropout off), beside what theory predicts there")
    init_check.add_argument("--sru-cells", action="store_true",
                            help="an SRU recipe: Var[c]/Var[x] per layer of a deep stack (the SRU appendix's Fig. 6)")
    init_check.add_argument("--depth", type=int, default=20, help="layers of the stack --sru-cells measures")
    init_check.add_argument("--figure", help="with --sru-cells: draw the ratios per layer to this PNG file")
    init_check.add_argument("--json", action="store_true")
    init_check.set_defaults(handler=cmd_init_check)

    translate = _command(commands, "translate", detail="translate sentences (one a line; an empty line gives an "
                                    "empty line) with a trained translation run")
    translate.add_argument("--run", required=True, help="a translation run directory written by train")
    translate.add_argument("--input", help="UTF-8 file of source sentences, one a line (default: stdin)")
    translate.add_argument("--beam", type=int, help="beam size (1: greedy; default: the run's translation.decode)")
    translate.add_argument("--length-penalty", type=float, metavar="ALPHA",
                           help="beam scores divided by ((5 + length) / 6)^ALPHA (0: none; default: the run's "
                                "translation.length_penalty)")
    translate.add_argument("--batch-size", type=int, metavar="N",
                           help="lines decoded together, each batch printed as soon as it is decoded (default: 64; 1 "
                                "when typing at a terminal, so that each line is answered at once)")
    translate.add_argument("--data-dir", help="corpus folder, needed only if the run has no vocab.json")
    translate.add_argument("--attention-plot", metavar="FILE.png",
                           help="also draw every decoder layer's attention over the first input sentence (needs the "
                                "plot extra)")
    translate.add_argument("--device", default="auto")
    translate.set_defaults(handler=cmd_translate)

    classify = _command(commands, "classify", detail="classify sentences (one a line, or two with a tab between for "
                                   "a GLUE pair task; an empty line gives an empty line) with a trained "
                                   "sentence-classification or GLUE run")
    classify.add_argument("--run", required=True, help="a sentence-classification or GLUE fine-tuning run directory")
    classify.add_argument("--input", help="UTF-8 file of sentences, one a line (default: stdin)")
    classify.add_argument("--probabilities", action="store_true",
                          help="print a tab and the probability of the class after its name")
    classify.add_argument("--batch-size", type=int, metavar="N",
                          help="lines classified together (default: 64; 1 when typing at a terminal)")
    classify.add_argument("--data-dir", help="corpus folder, needed only if the run has no vocab.json")
    classify.add_argument("--device", default="auto")
    classify.set_defaults(handler=cmd_classify)

    answer = _command(commands, "answer", detail="answer a question about a paragraph with a trained question-"
                                 "answering run: one JSON line of the answer, its characters in the paragraph and its "
                                 "probability")
    answer.add_argument("--run", required=True, help="a question-answering (qa) run directory written by train")
    answer.add_argument("--context", metavar="FILE_OR_TEXT", help="the paragraph: a UTF-8 file, or the text itself")
    answer.add_argument("--question", metavar="TEXT", help="the question about the paragraph")
    answer.add_argument("--input", metavar="FILE", help='JSON lines instead, {"context": ..., "question": ...} each '
                        "(an \"id\" is copied to its answer; - for standard input); an answer line for each")
    answer.add_argument("--batch-size", type=int, metavar="N",
                        help="questions answered together (default: 32; 1 when typing at a terminal)")
    answer.add_argument("--device", default="auto")
    answer.set_defaults(handler=cmd_answer)

    fill = _command(commands, "fill-mask", detail="the likeliest pieces for each [MASK] of a text, with a trained "
                               "masked-language-model run (a line each: the mask's number, the piece, its probability)")
    fill.add_argument("--run", required=True, help="a masked-language-model run directory written by train")
    fill.add_argument("--text", required=True, help="text with one or more [MASK], e.g. 'the cat sat on the [MASK] .'")
    fill.add_argument("--top-k", type=int, default=5, metavar="K", help="pieces shown for each mask (default: 5)")
    fill.add_argument("--device", default="auto")
    fill.set_defaults(handler=cmd_fill_mask)

    recipes = _command(commands, "recipes", detail="list the shipped recipes (src/gatedformer/recipes/*.toml), each "
                       "with its task, corpus, number of variants and the published table it mirrors (its "
                       "published_source); train one with `gatedformer train --recipe NAME`, or all its variants "
                       "with `gatedformer compare --recipe NAME`")
    recipes.add_argument("--json", action="store_true", help="one JSON list of the recipes instead of the table")
    recipes.set_defaults(handler=cmd_recipes)

    from gatedformer.analysis.bench import add_arguments as add_bench_arguments

    bench = _command(commands, "bench", detail="training/eval throughput, MFU and peak memory of every backbone and "
                                "gate variant, beside plain-PyTorch, x-transformers, sru, LSTM and GRU peers")
    add_bench_arguments(bench)
    bench.set_defaults(handler=cmd_bench)
    return parser


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure (CPU allocator, CUDA out of memory or Python's MemoryError)."""
    text = str(err).lower()
    return isinstance(err, MemoryError) or any(sign in text for sign in ("out of memory", "can't allocate memory",
                                                                         "bad_alloc"))


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      line: str | None = None) -> str:
    # gatedformer's own warnings read like its errors: one line, no source location.
    text = str(message)
    if text.startswith("gatedformer:"):
        return "gatedformer: warning: " + text.removeprefix("gatedformer:").strip().replace("\n", " ") + "\n"
    return _format_warning(message, category, filename, lineno, line)


_format_warning = warnings.formatwarning


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    warnings.formatwarning = _one_line_warning
    try:
        return args.handler(args)
    except GatedformerError as err:
        print(f"gatedformer: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("gatedformer: interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as err:
        if not _out_of_memory(err):
            raise
        reason = (str(err).strip().splitlines() or ["no detail"])[0][:200]
        fix = ("use a smaller --beam" if args.command == "translate" else
               "lower the model's sizes (model.d_model, model.d_ffn, model.n_layers) or data.batch_size / data.seq_len")
        print(f"gatedformer: error: out of memory ({reason}); {fix}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader of our output went away (``| head``): nothing is left to say, and nobody to say it to.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
