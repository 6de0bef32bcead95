"""Peak memory of Transformer-XL against ``mem_len`` and of the R-Transformer against its LocalRNN window,
training and evaluation steps, with a straight-line fit of each.

    python benchmarks/memory.py --mem-lens 0 64 128 256 512 --windows 1 3 7 15 31
    python benchmarks/memory.py --memory rss   # resident-set high-water mark, one subprocess per model

Any ``gatedformer bench`` option can be added (``--json``, sizes, ...).
"""

import sys

from gatedformer.analysis.bench import main

if __name__ == "__main__":
    raise SystemExit(main(["--sections", "memory", *sys.argv[1:]]))
