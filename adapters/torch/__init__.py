"""srround for PyTorch: ``AdamW`` and ``SGD`` (fused ``torch.optim.Optimizer`` s) and
``GradScaler`` (a drop-in for ``torch.amp.GradScaler``), DTensor (FSDP2) parameters included;
``assign_stream_offsets`` keys the optimizers' noise to a parameter order (``_dist.py``).
``srround.stochastic_round(tensor)`` etc. take tensors and DTensors directly (``_views.py``);
``stochastic_round`` here is the same rounding as a custom op that torch.compile traces
(``_ops.py``)."""

from ._dist import assign_stream_offsets
from ._ops import stochastic_round
from .amp import GradScaler
from .optim import SGD, AdamW

__all__ = ["AdamW", "GradScaler", "SGD", "assign_stream_offsets", "stochastic_round"]
