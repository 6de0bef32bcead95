"""Fused paths: functions and autograd functions that compute what the :mod:`gatedformer.nn` modules would,
in fewer passes, on the compiled kernels of :mod:`gatedformer.kernels`. Each checks its case and declines
(returning ``None`` or falling back to PyTorch operations) where it does not apply: the attention kernels
(:mod:`~gatedformer.ops.attention`, :mod:`~gatedformer.ops.relative_attention`), the LocalRNN's steps and recurrence
(:mod:`~gatedformer.ops.rnn`) and the SRU recurrence (:mod:`~gatedformer.ops.sru`) each hold their autograd function,
their PyTorch reference and the choice between them."""
