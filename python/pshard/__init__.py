"""pshard from Python: a trainer's connection to the shard servers of a job
(``pshard._pshard``, the C++ client), and ``pshard.torch``, which puts a
``torch.nn.Module``'s parameters on those servers."""

from ._paths import BIN_DIR

__all__ = ["BIN_DIR"]
