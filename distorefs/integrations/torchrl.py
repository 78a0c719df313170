"""TorchRL: a Storage, a Sampler and a Writer backed by a distorefs buffer.

    rb = TensorDictReplayBuffer(
        storage=DistoreStorage("/mnt/distore/buffers/x", max_size=100_000),
        sampler=DistoreSampler(),      # the daemon draws: uniform or prioritized, per config
        writer=DistoreWriter(),
        batch_size=64,
    )
    rb.extend(tensordict)              # one append of N records
    batch = rb.sample()                # batch["index"] are the buffer's item indices
    rb.update_priority(batch["index"], td_error.abs())

Owns the mapping of a TensorDict's leaves (keys flattened with ".") onto a schema buffer,
made at the first write from that data's fields, dtypes and shapes, and back. With the
Sampler, one read of `sample.N` gives the batch and its indices at once; the Storage
serves that batch without reading again. With TorchRL's own samplers (RandomSampler)
the Storage maps their positions 0..len-1 onto the live items (oldest first) and reads
`items/<i>`: correct, slower. Items are appended in order by any number of processes;
the writer cannot know the indices the daemon gives them (other writers append too),
so `extend` returns -1 for each. Everything is in the mount: `state_dict` is the path,
and a new process with the same path continues with the same buffer.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage, StoreStorage
from torchrl.data.replay_buffers.writers import Writer

from distorefs import client
from distorefs.stores.replay.config import parse_schema, schema_to_json

SEPARATOR = "."


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        result: dict[str, Any] = json.load(f)
        return result


class DistoreStorage(StoreStorage):
    """The distorefs buffer at `path` (made if missing, with capacity `max_size`).

    A StoreStorage (TorchRL's storage over an external key-value store) in kind: its
    `get` returns whole batches, so TorchRL picks the identity collate for it. None of
    StoreStorage's Redis machinery is used; every method it defines is defined here."""

    def __init__(self, path: str | os.PathLike[str], max_size: int | None = None, sampler: str = "uniform") -> None:
        self.path = str(path)
        os.makedirs(self.path, exist_ok=True)
        config = _read_json(os.path.join(self.path, "config"))
        if max_size is not None and config.get("schema") is None and config["capacity"] != max_size:
            self._write_config({"capacity": int(max_size), "sampler": sampler})
            config = _read_json(os.path.join(self.path, "config"))
        elif config.get("schema") is None and sampler != config["sampler"]:
            self._write_config({"sampler": sampler})
        Storage.__init__(self, max_size=int(config["capacity"]))
        self._dtype = parse_schema(self.path, config.get("schema"))
        self.last_batch: tuple[torch.Tensor, np.ndarray] | None = None  # set by DistoreSampler

    def _write_config(self, fields: dict[str, Any]) -> None:
        with open(os.path.join(self.path, "config"), "w", encoding="utf-8") as f:
            f.write(json.dumps(fields))

    # --- writing --------------------------------------------------------------------------

    def _records(self, data: TensorDictBase) -> np.ndarray:
        flat = data.flatten_keys(SEPARATOR)
        leaves = {key: flat.get(key) for key in sorted(flat.keys(include_nested=True, leaves_only=True))}
        if data.batch_dims == 0:  # one item
            leaves = {k: v.unsqueeze(0) for k, v in leaves.items()}
        if self._dtype is None:
            fields = [(k, v.detach().cpu().numpy().dtype, tuple(v.shape[1:])) for k, v in leaves.items()]
            self._dtype = np.dtype(fields)
            self._write_config({"schema": schema_to_json(self._dtype)})
        count = len(next(iter(leaves.values())))
        records = np.zeros(count, dtype=self._dtype)
        if sorted(leaves) != sorted(self._dtype.names or ()):
            raise ValueError(f"{self.path}: the data's keys {sorted(leaves)} are not the buffer's {self._dtype.names}")
        for key, value in leaves.items():
            records[key] = value.detach().cpu().numpy()
        return records

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Append `data` (a TensorDict of one item or a batch); `cursor` is ignored: the
        daemon gives the indices."""
        if not isinstance(data, TensorDictBase):
            raise TypeError(f"DistoreStorage stores TensorDicts, got {type(data).__name__}")
        client.append(self.path, self._records(data))

    # --- reading --------------------------------------------------------------------------

    def _tensordict(self, records: np.ndarray) -> TensorDict:
        assert self._dtype is not None
        fields = {name: torch.as_tensor(np.ascontiguousarray(records[name])) for name in self._dtype.names or ()}
        return TensorDict(fields, batch_size=[len(records)]).unflatten_keys(SEPARATOR)

    def get(self, index: Any) -> Any:
        """Items by the buffer's indices (a DistoreSampler's batch is served as drawn), or,
        for another sampler, by position 0..len-1 among the live items, oldest first."""
        last = self.last_batch
        if last is not None and isinstance(index, torch.Tensor) and index is last[0]:
            return self._tensordict(last[1])
        positions = torch.as_tensor(index).reshape(-1).tolist()
        stats = _read_json(os.path.join(self.path, "stats"))
        first = int(stats["next_index"]) - int(stats["size"])
        assert self._dtype is not None
        records = np.zeros(len(positions), dtype=self._dtype)
        for i, position in enumerate(positions):
            with open(os.path.join(self.path, "items", str(first + int(position))), "rb") as f:
                records[i] = np.frombuffer(f.read(), dtype=self._dtype)[0]
        out = self._tensordict(records)
        return out[0] if isinstance(index, int) else out

    def __len__(self) -> int:
        return int(_read_json(os.path.join(self.path, "stats"))["size"])

    def contains(self, item: Any) -> Any:
        return os.path.exists(os.path.join(self.path, "items", str(int(item))))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "last_batch": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"DistoreStorage({self.path!r}, max_size={self.max_size})"

    def state_dict(self) -> dict[str, Any]:
        return {"path": self.path}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("path") != self.path:
            raise ValueError(f"this storage is {self.path}, the state is of {state_dict.get('path')}")

    def _empty(self) -> None:
        """Remove every item (the buffer and its config stay)."""
        for name in os.listdir(os.path.join(self.path, "items")):
            os.remove(os.path.join(self.path, "items", name))

    def dumps(self, path: Any) -> None:
        """Nothing to dump: the items are in the mount."""

    def loads(self, path: Any) -> None:
        """Nothing to load: the items are in the mount."""


class DistoreSampler(Sampler):
    """Batches drawn by the daemon (one read of `sample.N`), with `_weight` in the info;
    `update_priority` writes the buffer's `priority` file."""

    def sample(self, storage: Storage, batch_size: int) -> tuple[Any, dict[str, Any]]:
        if not isinstance(storage, DistoreStorage):
            raise TypeError("DistoreSampler draws from a DistoreStorage")
        batch = client.sample(storage.path, batch_size)
        index = torch.as_tensor(np.ascontiguousarray(batch["_index"]))
        storage.last_batch = (index, batch)
        return index, {"_weight": torch.as_tensor(np.ascontiguousarray(batch["_weight"]))}

    def update_priority(self, index: Any, priority: Any, *, storage: Storage | None = None) -> None:
        if not isinstance(storage, DistoreStorage):
            raise TypeError("DistoreSampler updates priorities of a DistoreStorage")
        indices = torch.as_tensor(index).reshape(-1).tolist()
        values = torch.as_tensor(priority, dtype=torch.float64).reshape(-1).tolist()
        client.update_priorities(storage.path, indices, values)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the priorities are in the mount."""

    def _empty(self) -> None:
        """Nothing to empty: the storage's items carry their priorities."""

    def dumps(self, path: Any) -> None:
        """Nothing to dump."""

    def loads(self, path: Any) -> None:
        """Nothing to load."""


class DistoreWriter(Writer):
    """Appends through the storage; returns -1 per item (the daemon gives the indices)."""

    def add(self, data: Any) -> Any:
        assert self._storage is not None
        self._storage.set(None, data)
        return -1

    def extend(self, data: Any) -> Any:
        assert self._storage is not None
        self._storage.set(None, data)
        return torch.full((len(data),), -1, dtype=torch.long)

    def _empty(self, empty_write_count: bool = True) -> None:
        """Nothing to reset: the buffer has no cursor of ours."""

    def dumps(self, path: Any) -> None:
        """Nothing to dump."""

    def loads(self, path: Any) -> None:
        """Nothing to load."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load."""
