"""BufferConfig: a replay buffer's settings, parsed and checked from JSON.

Owns the field list, defaults, validation messages and which fields may change once a
buffer holds items. A bad update raises before anything changes, so a config is never
half applied.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from distorefs.errors import Busy, InvalidArgument, describe
from distorefs.stores.replay.samplers import SAMPLERS

MAX_CAPACITY = 1 << 28
MAX_SHARDS = 64
MAX_BATCH_SIZE = 1 << 20  # items in one batch (as for sample.N)
MAX_RECORD_BYTES = 64 * 1024 * 1024  # one schema record, as one item (formats.MAX_ITEM_BYTES)
RESERVED_FIELDS = ("_index", "_weight")


def parse_schema(name: str, raw: Any) -> np.dtype[Any] | None:
    """Turn `{"obs": {"dtype": "uint8", "shape": [84, 84]}, "reward": "float32"}` into a
    structured dtype (fields in the order given). Also accepted: `[dtype, shape]`."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not raw or not all(isinstance(k, str) for k in raw):
        raise InvalidArgument(f"{name}.schema must be an object of field -> dtype, got {describe(raw)}")
    spec = []
    record_bytes = 0
    for position, (key, value) in enumerate(raw.items(), 1):
        if key in RESERVED_FIELDS:
            raise InvalidArgument(f"{name}.schema: field name {key!r} is reserved")
        shape_raw: Any
        if isinstance(value, str):
            dtype, shape_raw = value, []
        elif isinstance(value, dict) and "dtype" in value:
            dtype, shape_raw = value["dtype"], value.get("shape", [])
        elif isinstance(value, list) and len(value) == 2:
            dtype, shape_raw = value[0], value[1]
        else:
            raise InvalidArgument(
                f"{name}.schema field {position}: expected a dtype, {{dtype, shape}} or [dtype, shape]"
            )
        if not isinstance(dtype, str):
            raise InvalidArgument(f'{name}.schema field {position}: the dtype must be a string such as "float32"')
        try:
            np_dtype = np.dtype(dtype)
        except (TypeError, ValueError, SyntaxError, RecursionError):
            raise InvalidArgument(f"{name}.schema: a field has an unknown dtype, {describe(dtype)}") from None
        if np_dtype.hasobject or np_dtype.itemsize == 0:
            raise InvalidArgument(f"{name}.schema: a field's dtype has no fixed size")
        if not isinstance(shape_raw, list) or len(shape_raw) > 32:
            raise InvalidArgument(f"{name}.schema field {position}: shape must be a list of at most 32 sizes")
        if not all(isinstance(dim, int) and not isinstance(dim, bool) and dim > 0 for dim in shape_raw):
            raise InvalidArgument(f"{name}.schema field {position}: shape must be positive integers")
        shape = tuple(shape_raw)
        record_bytes += np_dtype.itemsize * math.prod(shape)  # Python ints: no overflow
        if record_bytes > MAX_RECORD_BYTES:
            raise InvalidArgument(f"{name}.schema: a record must be at most {MAX_RECORD_BYTES} bytes")
        spec.append((key, np_dtype, shape))
    return np.dtype(spec)


def schema_to_json(dtype: np.dtype[Any] | None) -> dict[str, Any] | None:
    if dtype is None:
        return None
    assert dtype.names is not None
    out = {}
    for key in dtype.names:
        sub = dtype.fields[key][0] if dtype.fields else None
        assert sub is not None
        base, shape = (sub.base, sub.shape) if sub.shape else (sub, ())
        out[key] = {"dtype": base.str, "shape": list(shape)}
    return out


@dataclass(frozen=True)
class BufferConfig:
    """Settings of one buffer; `config` reads and writes these as JSON."""

    capacity: int = 100_000
    sampler: str = "uniform"
    batch_size: int = 32
    alpha: float = 0.6
    beta: float = 0.4
    epsilon: float = 1e-6
    max_times_sampled: int = 0
    min_size_to_sample: int = 1
    samples_per_insert: float | None = None
    error_margin: float | None = None
    sample_timeout: float = 10.0
    schema: dict[str, Any] | None = None
    compression: str = "none"
    sync: bool = False
    shards: int = 1
    dtype: np.dtype[Any] | None = field(default=None, compare=False, repr=False)

    @property
    def itemsize(self) -> int | None:
        return None if self.dtype is None else self.dtype.itemsize

    @property
    def zstd_level(self) -> int | None:
        if self.compression == "none":
            return None
        return int(self.compression.split(":", 1)[1]) if ":" in self.compression else 3

    @property
    def margin(self) -> float:
        """The rate limiter's error margin (default: twice the larger of batch and ratio)."""
        if self.error_margin is not None:
            return self.error_margin
        return 2.0 * max(float(self.batch_size), self.samples_per_insert or 1.0)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["dtype"]
        return out

    def dumps(self) -> str:
        # Never sort keys: the schema's field order is its dtype's layout.
        return json.dumps(self.to_json())

    @classmethod
    def from_json(cls, name: str, raw: dict[str, Any]) -> BufferConfig:
        return cls().updated(name, raw, has_items=False)

    @classmethod
    def restored(cls, name: str, raw: dict[str, Any]) -> tuple[BufferConfig, list[str]]:
        """A saved config, as valid as the rules of this version allow: where the whole of
        it no longer passes (a release tightened a limit), each field is applied on its
        own and the ones refused keep their defaults. Returns the config and what was
        dropped, so a buffer always comes back rather than stopping the daemon."""
        try:
            return cls.from_json(name, raw), []
        except (InvalidArgument, Busy):
            pass
        config, dropped = cls(), []
        for key in ["schema", *(k for k in raw if k != "schema")]:
            if key not in raw:
                continue
            try:
                config = config.updated(name, {key: raw[key]}, has_items=False)
            except (InvalidArgument, Busy) as exc:
                dropped.append(f"{key} ({exc.message})")
        return config, dropped

    def updated(self, name: str, changes: Any, has_items: bool) -> BufferConfig:
        """A new config with `changes` applied and checked; self is untouched.

        Raises InvalidArgument (EINVAL) for unknown fields or bad values, Busy (EBUSY) for
        a change that cannot happen while the buffer holds items.
        """
        if not isinstance(changes, dict):
            raise InvalidArgument(f"{name}: config must be a JSON object, got {type(changes).__name__}")
        known = {f.name for f in fields(self)} - {"dtype"}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidArgument(
                f"{name}: an unknown config field, {describe(unknown[0])} (known: {', '.join(sorted(known))})"
            )
        new = replace(self, **changes)
        new._check(name)
        dtype = parse_schema(name, new.schema)
        object.__setattr__(new, "dtype", dtype)
        object.__setattr__(new, "schema", schema_to_json(dtype))
        if has_items:
            if new.schema != self.schema:
                raise Busy(f"{name}: schema cannot change while the buffer holds items")
            if new.shards != self.shards:
                raise Busy(f"{name}: shards cannot change while the buffer holds items")
            if new.compression != self.compression:
                raise Busy(f"{name}: compression cannot change while the buffer holds items")
            if new.capacity < self.capacity:
                raise Busy(
                    f"{name}: capacity cannot shrink while the buffer holds items ({self.capacity} -> {new.capacity})"
                )
        return new

    def _check(self, name: str) -> None:
        def bad(field_name: str, rule: str, value: Any) -> InvalidArgument:
            return InvalidArgument(f"{name}.{field_name} must be {rule}, got {describe(value)}")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_num(value: Any) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

        if not is_int(self.capacity) or not 0 < self.capacity <= MAX_CAPACITY:
            raise bad("capacity", f"an integer in 1..{MAX_CAPACITY}", self.capacity)
        if not isinstance(self.sampler, str) or self.sampler not in SAMPLERS:
            raise bad("sampler", f"one of {', '.join(SAMPLERS)}", self.sampler)
        if not is_int(self.batch_size) or not 0 < self.batch_size <= MAX_BATCH_SIZE:
            raise bad("batch_size", f"an integer in 1..{MAX_BATCH_SIZE}", self.batch_size)
        for key in ("alpha", "beta", "epsilon"):
            value = getattr(self, key)
            if not is_num(value) or value < 0:
                raise bad(key, "a number >= 0", value)
        if not is_int(self.max_times_sampled) or self.max_times_sampled < 0:
            raise bad("max_times_sampled", "an integer >= 0 (0 = unbounded)", self.max_times_sampled)
        if not is_int(self.min_size_to_sample) or self.min_size_to_sample < 1:
            raise bad("min_size_to_sample", "an integer >= 1", self.min_size_to_sample)
        if self.samples_per_insert is not None and (
            not is_num(self.samples_per_insert) or self.samples_per_insert <= 0
        ):
            raise bad("samples_per_insert", "a number > 0 or null", self.samples_per_insert)
        if self.error_margin is not None and (not is_num(self.error_margin) or self.error_margin < 0):
            raise bad("error_margin", "a number >= 0 or null", self.error_margin)
        if self.samples_per_insert is not None and 2 * self.margin < self.samples_per_insert + self.batch_size:
            raise InvalidArgument(
                f"{name}.error_margin must be >= (samples_per_insert + batch_size) / 2 ="
                f" {(self.samples_per_insert + self.batch_size) / 2}, got {self.margin} (the limiter would deadlock)"
            )
        if not is_num(self.sample_timeout) or self.sample_timeout < 0:
            raise bad("sample_timeout", "a number of seconds >= 0", self.sample_timeout)
        if not is_int(self.shards) or not 1 <= self.shards <= MAX_SHARDS:
            raise bad("shards", f"an integer in 1..{MAX_SHARDS}", self.shards)
        if not isinstance(self.sync, bool):
            raise bad("sync", "true or false", self.sync)
        compression = self.compression
        if compression != "none":
            level = compression.split(":", 1)[1] if isinstance(compression, str) and ":" in compression else "3"
            if (
                not isinstance(compression, str)
                or not compression.startswith("zstd")
                or not (level.isascii() and level.isdigit() and len(level) <= 2)
                or not 1 <= int(level) <= 22
            ):
                raise bad("compression", '"none", "zstd" or "zstd:LEVEL" (1..22)', compression)
