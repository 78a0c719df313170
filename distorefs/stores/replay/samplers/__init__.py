"""Samplers, one module each behind samplers/base.py's protocol; `make_sampler` picks one
from a buffer's config once, when the config is applied."""

from __future__ import annotations

from distorefs.stores.replay.samplers.base import Ring, Sampler
from distorefs.stores.replay.samplers.fifo import FifoSampler
from distorefs.stores.replay.samplers.lifo import LifoSampler
from distorefs.stores.replay.samplers.prioritized import PrioritizedSampler
from distorefs.stores.replay.samplers.uniform import UniformSampler

SAMPLERS: dict[str, type[Sampler]] = {
    cls.name: cls for cls in (UniformSampler, PrioritizedSampler, FifoSampler, LifoSampler)
}


def make_sampler(name: str) -> Sampler:
    """The sampler a config names (the config has validated the name)."""
    return SAMPLERS[name]()


__all__ = ["SAMPLERS", "Ring", "Sampler", "make_sampler"]
