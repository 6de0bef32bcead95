"""Building blocks the models are made of: the gated residual sublayer, attention, dropout, the SRU layer.

Each module's ``forward`` is its equation in plain PyTorch (the reference); faster implementations are bound onto
them from outside (:mod:`gatedformer.fused`). Only the SRU layer's recurrence and the dropout masks call
:mod:`gatedformer.ops`, as the ``sru`` package's module does its ``csrc``. Nothing here imports a model or anything
of training.
"""
