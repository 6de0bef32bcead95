"""Speed and memory benchmarks behind ``gatedformer bench``.

One module a concern: :mod:`~.options` (sizes, options, gate variants), :mod:`~.timing` (the round-robin loop and
the peak product), :mod:`~.flops`, :mod:`~.memory`, :mod:`~.runners` (our models' steps), :mod:`~.peers` (the
models we are measured against), :mod:`~.sections` (the four tables and :func:`run_bench`), :mod:`~.report` (JSON
and text) and :mod:`~.command` (the command line).

What a row measures
-------------------
* **training step**: forward, cross-entropy (on float32 logits, as the trainer), ``zero_grad``, backward and one
  optimiser step (by default the trainer's AdamW, :class:`~gatedformer.train.grouped_adam.GroupedAdam`, one fused
  call per parameter group; ``optimizer="adamw-fused"`` is torch's fused AdamW, ``"adamw"`` torch's default
  implementation, ``"none"`` leaves the step out) on one ``(batch, seq_len)``
  window of random tokens. **Evaluation step**: forward and loss in eval mode under ``torch.no_grad``.
* **timing**: every contender of a table runs in the same process, round-robin. After ``warmup`` rounds, each of
  ``repeats`` rounds calls every contender once, in an order shuffled afresh every round (seeded), so the slow
  phases of a shared machine fall on all of them alike, and so does the cold cache the peak product leaves behind
  (in a fixed order the contender after it would pay for that in every other round). Rows give the median and the
  interquartile range (IQR); ratios are taken between medians of the same run. A gate's extra time is also taken
  round by round (:func:`paired_ratio`, the median of each round's variant over its baseline), which cancels the
  drift both calls of a round share; the gate target is judged on that one.
* **FLOPs** are counted analytically per layer by :func:`count_flops`: every matrix product ``m×k @ k×n`` is
  ``2·m·k·n`` FLOPs; attention scores (QK) and weighted values (AV) are counted over the (query, key) pairs a
  causal query can see (``T(T+1)/2`` per head and sequence, plus ``T·M`` memory pairs for Transformer-XL),
  so kernels that compute the full square do work that is not counted. Element-wise work (norms, softmax,
  activations, gates' sigmoids, dropout, the optimiser) and embedding look-ups are not counted. A training
  step is 3× the forward FLOPs (the backward pass computes two products per forward product).
* **MFU** (model FLOPs utilisation) = the model's FLOPs per second divided by the FLOPs per second of a large
  float32 matrix product (``n×n @ n×n``; n = 1024 on CPU, 4096 on CUDA) timed as one more contender in the
  same round-robin loop: the peak is measured under the same load as the model, never a datasheet figure.
* **memory**: on CUDA, ``torch.cuda.max_memory_allocated`` over one step minus what was allocated before it.
  On CPU (``"tensors"``, the default) the peak of the bytes of tensor storage created by PyTorch operators
  during one step and still alive, tracked by a dispatch mode with weak references: activations saved for
  backward, gradients, temporaries; not the parameters, optimiser state or inputs that existed before the
  step, nor scratch memory a kernel frees before it returns. ``"rss"`` runs each model in a fresh
  subprocess and reports the rise of the resident set's high-water mark over one step (after a warm-up
  step, with the mark reset through ``/proc/self/clear_refs``, and glibc told to map blocks of 64 KiB or more
  one by one so that freed memory leaves the RSS): page rounding and library buffers included.
* **initialisation**: every language model, ours and the peers, gets the same weights scheme (``init``, by
  default the ``xavier`` of the ``-tiny`` recipes, through the trainer's own initialiser). Speed depends on it
  on the CPU: with PyTorch's default ``N(0, 1)`` embeddings scaled by ``sqrt(d)`` the first attention layer's
  softmax is so peaked that its backward pass computes on denormal floats, several times slower.
* **peers**: :class:`TorchReferenceLM` (``torch.nn.TransformerEncoder``, exactly our parameter count),
  x-transformers' ``TransformerWrapper(Decoder)`` of the same size, the official ``sru`` package,
  ``torch.nn.LSTM`` and ``torch.nn.GRU``. The optional ones (``pip install 'gatedformer[bench]'``) are reported
  as skipped when they cannot be imported.
"""

from gatedformer.analysis.bench.command import add_arguments, main, run_from_args
from gatedformer.analysis.bench.flops import FlopCount, count_flops
from gatedformer.analysis.bench.memory import measure_memory
from gatedformer.analysis.bench.options import GATE_VARIANTS, SECTIONS, BenchOptions, BenchSize, RNNSize
from gatedformer.analysis.bench.peers import TorchReferenceLM
from gatedformer.analysis.bench.report import BenchReport, format_report
from gatedformer.analysis.bench.runners import training_step
from gatedformer.analysis.bench.sections import run_bench
from gatedformer.analysis.bench.timing import Timing, paired_ratio, time_round_robin

__all__ = [
    "GATE_VARIANTS",
    "SECTIONS",
    "BenchOptions",
    "BenchReport",
    "BenchSize",
    "FlopCount",
    "RNNSize",
    "Timing",
    "TorchReferenceLM",
    "add_arguments",
    "count_flops",
    "format_report",
    "main",
    "measure_memory",
    "paired_ratio",
    "run_bench",
    "run_from_args",
    "time_round_robin",
    "training_step",
]
