"""The bench's sampling table: tokens/s of every language-model backbone sampling with its incremental cache (a
key/value cache, or the state the backbone carries) beside the full recomputation (``generate --no-cache``: the
whole window read again for every token), side by side in one loop.

Each call samples :data:`TOKENS` tokens (temperature 1, seed 0) after a one-token prompt, with a window of
:data:`CONTEXT` tokens, from the bench's model of each backbone (``--d-model``, ``--layers``... with its untrained,
initialised weights: sampling costs the same whatever the weights say). The row also says whether the two sampled
the same tokens, which they must.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gatedformer.analysis.bench.options import BenchOptions, BenchSize
from gatedformer.analysis.bench.report import BenchReport
from gatedformer.analysis.bench.runners import bench_model, count_parameters
from gatedformer.analysis.bench.timing import paired_ratio, time_round_robin
from gatedformer.config import backbone_names
from gatedformer.tasks.lm import sample_ids

__all__ = ["CONTEXT", "TOKENS", "bench_sampling"]

TOKENS = 512
"""Tokens sampled per call: the issue's ``generate --tokens 512``."""
CONTEXT = 512
"""The window the model reads (``generate``'s default)."""


def bench_sampling(report: BenchReport, size: BenchSize, options: BenchOptions, device: torch.device,
                   backbones: Sequence[str] | None, progress: Callable[[str], None],
                   tokens: int = TOKENS, context: int = CONTEXT) -> None:
    """Add a ``sampling`` row per backbone to ``report``."""
    for backbone in backbones or backbone_names():
        progress(f"sampling: {backbone} ({tokens} tokens, with and without the cache)")
        torch.manual_seed(options.seed)
        model = bench_model(size.model_config(backbone), size.vocab, options.init).to(device)
        model.eval()

        def run(cached: bool, model: torch.nn.Module = model) -> list[int]:
            return list(sample_ids(model, [0], tokens, seed=0, context=context, cache=cached))

        same = run(True) == run(False)
        # The full recomputation costs seconds a call: one warm-up round is enough for either.
        timings = time_round_robin({"cached": lambda: run(True), "full": lambda: run(False)},
                                   repeats=options.repeats, warmup=min(options.warmup, 1), device=device)
        cached, full = timings["cached"], timings["full"]
        report.rows.append({
            "section": "sampling", "backbone": backbone, "params": count_parameters(model), "tokens": tokens,
            "context": context, "status": "ok", "same_tokens": same,
            **cached.as_dict("cached"), "cached_tokens_per_s": tokens / cached.median,
            **full.as_dict("full"), "full_tokens_per_s": tokens / full.median,
            "cache_speedup": 1.0 / paired_ratio(cached, full),
        })
