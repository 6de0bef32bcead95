"""Every gate variant against its own baseline, in the same loop: measured extra step time beside the gate's
extra FLOPs. Defaults to the Transformer LM; ``--backbones transformer rtransformer transformer-xl`` for more.

    python benchmarks/gates_overhead.py --threads 1 --repeats 21

Any ``gatedformer bench`` option can be added (``--variants``, ``--compile``, ``--json``, ...).
"""

import sys

from gatedformer.analysis.bench import main

if __name__ == "__main__":
    raise SystemExit(main(["--sections", "models", "--backbones", "transformer", *sys.argv[1:]]))
