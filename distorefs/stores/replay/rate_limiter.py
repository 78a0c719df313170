"""RateLimiter: keeps samples and inserts in a ratio, as Reverb's SampleToInsertRatio does.

Owns only arithmetic. The buffer asks `can_insert` / `can_sample` and waits itself.
With `samples_per_insert` = r and margin m, let diff = inserts * r - samples (samples
counted in items). Inserts may go on while diff + r <= r * min_size + m, and samples of
n items while diff - n >= r * min_size - m. So samples block when they run ahead of
inserts, and inserts block when they run ahead of samples. Without a ratio, only
min_size_to_sample applies.
"""

from __future__ import annotations

from dataclasses import dataclass

from distorefs.stores.replay.config import BufferConfig


@dataclass(frozen=True)
class RateLimiter:
    min_size: int
    samples_per_insert: float | None
    margin: float

    @classmethod
    def from_config(cls, config: BufferConfig) -> RateLimiter:
        return cls(config.min_size_to_sample, config.samples_per_insert, config.margin)

    def diff(self, inserts: int, samples: int) -> float:
        return inserts * (self.samples_per_insert or 0.0) - samples

    def can_insert(self, inserts: int, samples: int) -> bool:
        if self.samples_per_insert is None or inserts < self.min_size:
            return True
        r = self.samples_per_insert
        return self.diff(inserts, samples) + r <= r * self.min_size + self.margin

    def can_sample(self, size: int, inserts: int, samples: int, count: int) -> bool:
        if size < max(1, self.min_size):
            return False
        if self.samples_per_insert is None:
            return True
        r = self.samples_per_insert
        return self.diff(inserts, samples) - count >= r * self.min_size - self.margin

    def state(self, size: int, inserts: int, samples: int, batch: int) -> dict[str, object]:
        return {
            "samples_per_insert": self.samples_per_insert,
            "error_margin": self.margin,
            "min_size_to_sample": self.min_size,
            "diff": self.diff(inserts, samples),
            "can_insert": self.can_insert(inserts, samples),
            "can_sample": self.can_sample(size, inserts, samples, batch),
        }
