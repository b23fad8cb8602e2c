"""PyTorch: tensor views for the functional API, ``AdamW``/``SGD`` and ``GradScaler``."""

from ._views import _view, buffer_table, counter, inplace, source, target  # noqa: F401
from .amp import GradScaler  # noqa: F401
from .optim import SGD, AdamW  # noqa: F401
