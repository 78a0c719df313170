"""fs/kernel.py's page-cache store in parts: where a store is cut, and what goes to the
device, read back from a plain file standing in for /dev/fuse."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distorefs.fs import kernel


@settings(max_examples=300, deadline=None)
@given(size=st.integers(0, 40 << 20), parts=st.integers(1, 8))
def test_a_store_is_cut_on_whole_folios_and_never_leaves_a_small_part(size: int, parts: int) -> None:
    bounds = kernel.store_cuts(size, parts)
    assert bounds[0] == 0
    assert bounds[-1] == size
    assert 1 <= len(bounds) - 1 <= parts
    cuts = bounds[1:-1]
    assert cuts == sorted(set(cuts))
    assert all(cut % kernel.STORE_CUT == 0 and 0 < cut <= size - kernel.STORE_PART_MIN for cut in cuts)
    if size >= kernel.STORE_CUT + kernel.STORE_PART_MIN and parts > 1:
        assert cuts, "a store that can be cut is cut"


def test_a_dqn_batch_goes_in_two_parts_the_first_the_larger() -> None:
    size = 3_520_576  # 32 records of 110,000 bytes and their index and weight, as .npy
    assert kernel.store_cuts(size, 2) == [0, kernel.STORE_CUT, size]
    assert kernel.store_cuts(size, 4) == [0, kernel.STORE_CUT, size]  # no part under STORE_PART_MIN
    assert kernel.store_cuts(1 << 20, 4) == [0, 1 << 20]  # small: whole
    assert kernel.store_cuts(16 << 20, 4) == [0, 4 << 20, 8 << 20, 12 << 20, 16 << 20]


def written_notices(path: Path) -> dict[int, tuple[int, bytes]]:
    """The store notifications in `path`, by offset: (inode, bytes)."""
    data, found, at = path.read_bytes(), {}, 0
    while at < len(data):
        length, code, unique, ino, offset, size, _pad = kernel.STORE_HEAD.unpack_from(data, at)
        assert (code, unique) == (kernel.FUSE_NOTIFY_STORE, 0)
        assert length == kernel.STORE_HEAD.size + size
        assert offset not in found
        found[offset] = (ino, data[at + kernel.STORE_HEAD.size : at + length])
        at += length
    assert at == len(data)
    return found


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_the_parts_written_at_once_hold_every_byte_once(tmp_path: Path, threads: int) -> None:
    """The pieces (a batch's records, cut anywhere by the cuts) land whole: each part a
    notification of its own at its offset, written by a helper or by the caller."""
    pieces = [os.urandom(n) for n in (128, 1_000_003, 4096, 3_000_001, 77, 2_500_000, 5)]
    whole = b"".join(pieces)
    helpers = kernel.StoreHelpers(threads) if threads else None
    device = tmp_path / "device"
    fd = os.open(device, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        parts = kernel.write_store(fd, 42, [bytearray(pieces[0]), *map(memoryview, pieces[1:])], helpers)
    finally:
        os.close(fd)
        if helpers is not None:
            helpers.stop()
    notices = written_notices(device)
    assert parts == len(notices) == len(kernel.store_cuts(len(whole), threads + 1)) - 1
    assert parts == min(threads + 1, 3)  # 6.6 MB: cuts at 2 and 4 MiB at most
    offsets = sorted(notices)
    for offset, end in zip(offsets, [*offsets[1:], len(whole)], strict=True):
        ino, data = notices[offset]
        assert ino == 42
        assert len(data) == end - offset
        assert data == whole[offset:end], f"the part at {offset} holds other bytes"


def test_a_part_that_fails_fails_the_store_and_the_helpers_go_on(tmp_path: Path) -> None:
    helpers = kernel.StoreHelpers(1)
    try:
        fd = os.open(tmp_path / "device", os.O_RDONLY | os.O_CREAT)  # writes fail: EBADF
        try:
            with pytest.raises(OSError) as failed:
                kernel.write_store(fd, 1, [bytes(5 << 20)], helpers)
            assert failed.value.errno == errno.EBADF
        finally:
            os.close(fd)
        fd = os.open(tmp_path / "device", os.O_WRONLY | os.O_APPEND)
        try:
            assert kernel.write_store(fd, 1, [bytes(5 << 20)], helpers) == 2
        finally:
            os.close(fd)
        assert sorted(written_notices(tmp_path / "device")) == [0, kernel.STORE_CUT]
    finally:
        helpers.stop()


def test_a_part_that_breaks_its_helper_still_answers_the_caller(tmp_path: Path) -> None:
    """Whatever a helper's write raises, the caller gets an OSError back (it never waits
    for ever) and the helper goes on with the next store."""
    helpers = kernel.StoreHelpers(1)
    fd = os.open(tmp_path / "device", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with pytest.raises(OSError) as failed:
            helpers.write(fd, [[b"first"], [object()]])  # type: ignore[list-item]  # not a buffer: TypeError
        assert failed.value.errno == errno.EIO
        helpers.write(fd, [[b"a"], [b"b"]])
    finally:
        os.close(fd)
        helpers.stop()
    assert sorted((tmp_path / "device").read_bytes()) == sorted(b"firstab")
