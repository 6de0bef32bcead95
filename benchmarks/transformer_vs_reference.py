"""gatedformer's baseline Transformer LM against an equally sized ``torch.nn.TransformerEncoder`` LM and, when
installed, x-transformers' ``TransformerWrapper(Decoder)``: training and evaluation steps, timed side by side.

    python benchmarks/transformer_vs_reference.py --threads 1 --repeats 21

Any ``gatedformer bench`` option can be added (``--compile``, ``--bf16``, ``--json``, sizes, ...).
"""

import sys

from gatedformer.analysis.bench import main

if __name__ == "__main__":
    raise SystemExit(main(["--sections", "transformer-peers", *sys.argv[1:]]))
