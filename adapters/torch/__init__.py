"""srround for PyTorch: ``AdamW`` and ``SGD`` (fused ``torch.optim.Optimizer`` s) and
``GradScaler`` (a drop-in for ``torch.amp.GradScaler``). ``srround.stochastic_round(tensor)``
etc. take tensors directly (``_views.py``)."""

from .amp import GradScaler
from .optim import SGD, AdamW

__all__ = ["AdamW", "GradScaler", "SGD"]
