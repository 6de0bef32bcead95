"""Building blocks the models are made of: the gated residual sublayer, attention, dropout, the SRU layer.

Modules here call the fused paths of :mod:`gatedformer.ops`; they never import a model or anything of training.
"""
