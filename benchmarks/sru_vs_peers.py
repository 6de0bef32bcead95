"""gatedformer's SRU against the official ``sru`` package (when installed), ``torch.nn.LSTM`` and
``torch.nn.GRU`` of the same hidden size: forward, and forward + backward, timed side by side.

    python benchmarks/sru_vs_peers.py --threads 1 --repeats 21 --rnn-hidden 256 --rnn-len 128 --rnn-batch 16

Any ``gatedformer bench`` option can be added (``--rnn-layers``, ``--json``, ...).
"""

import sys

from gatedformer.analysis.bench import main

if __name__ == "__main__":
    raise SystemExit(main(["--sections", "rnn-peers", *sys.argv[1:]]))
