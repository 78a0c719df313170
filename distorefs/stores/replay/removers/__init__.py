"""Removers, one module each behind removers/base.py's protocol; `make_remover` picks one
from a buffer's config once, when the config is applied."""

from __future__ import annotations

from distorefs.stores.replay.removers.base import Remover
from distorefs.stores.replay.removers.keep import KeepRemover
from distorefs.stores.replay.removers.max_times_sampled import MaxTimesSampledRemover


def make_remover(max_times_sampled: int) -> Remover:
    return MaxTimesSampledRemover(max_times_sampled) if max_times_sampled > 0 else KeepRemover()


__all__ = ["Remover", "make_remover"]
