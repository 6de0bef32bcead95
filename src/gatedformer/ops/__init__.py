"""Fused paths: functions and autograd functions that compute what the :mod:`gatedformer.nn` modules would,
in fewer passes, on the compiled kernels of :mod:`gatedformer.kernels`. Each checks its case and declines
(returning ``None`` or falling back to PyTorch operations) where it does not apply."""
