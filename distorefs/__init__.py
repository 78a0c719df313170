"""distorefs: RL replay buffers, weights, checkpoints and datasets as files (a FUSE daemon)."""

__version__ = "0.1.0"
