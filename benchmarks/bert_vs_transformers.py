"""gatedformer's BERT against Hugging Face transformers' of the same size: the masked-LM training step
(``BertForMaskedLM``) and the GLUE fine-tuning step (``BertForSequenceClassification``), timed side by side.

    python benchmarks/bert_vs_transformers.py --d-model 128 --layers 2 --heads 2 --d-ffn 512 --threads 1 --repeats 21

Any ``gatedformer bench`` option can be added (sizes, ``--threads``, ``--json``, ...); needs
``pip install 'gatedformer[bench]'``.
"""

import sys

from gatedformer.analysis.bench import main

if __name__ == "__main__":
    raise SystemExit(main(["--sections", "bert", *sys.argv[1:]]))
