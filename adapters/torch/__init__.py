"""srround for PyTorch: ``AdamW`` and ``SGD`` (fused ``torch.optim.Optimizer`` s) and
``GradScaler`` (a drop-in for ``torch.amp.GradScaler``). ``srround.stochastic_round(tensor)``
etc. take tensors directly (``_views.py``); ``stochastic_round`` here is the same rounding as a
custom op that torch.compile traces (``_ops.py``)."""

from ._ops import stochastic_round
from .amp import GradScaler
from .optim import SGD, AdamW

__all__ = ["AdamW", "GradScaler", "SGD", "stochastic_round"]
