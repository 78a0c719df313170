"""Permissions of buffers, models and datasets, tried as a second user (`nobody`) through
`--allow-other`: their directories honour chmod and chown like POSIX directories, and
their control files follow the directory, so only who may write a buffer may change its
state, sampling included."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from distorefs import client
from tests.conftest import Mount, fuse_missing, mounted_at

NOBODY = 65534

# Runs as nobody, under Debian's own python3 (the project's venv lives under /root, which
# nobody cannot enter): each named operation, and its errno (0 when it went through).
SYSTEM_PYTHON = "/usr/bin/python3"
PROBE = textwrap.dedent(
    """
    import errno, json, os, sys
    base = sys.argv[1]
    record = (1).to_bytes(8, "little")
    def attempt(fn):
        try:
            fn()
            return 0
        except OSError as exc:
            return exc.errno
    def write(path, data):
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    def read(path):
        with open(path, "rb") as f:
            return f.read()
    b = base + "/buffers/shared"
    m = base + "/weights/policy"
    d = base + "/datasets/corpus"
    operations = {
        "sample": lambda: read(b + "/sample"),
        "append": lambda: write(b + "/append", record),
        "priority": lambda: write(b + "/priority", b"0 2.0\\n"),
        "config write": lambda: write(b + "/config", b'{"capacity": 7}'),
        "item write": lambda: write(b + "/items/0", record),
        "item unlink": lambda: os.unlink(b + "/items/1"),
        "stats": lambda: read(b + "/stats"),
        "config read": lambda: read(b + "/config"),
        "item read": lambda: read(b + "/items/0"),
        "rmdir buffer": lambda: os.rmdir(b),
        "publish": lambda: write(m + "/w.bin", b"evil"),
        "create in model": lambda: open(m + "/new.bin", "wb").close(),
        "read weights": lambda: read(m + "/w.bin"),
        "dataset append": lambda: write(d + "/append", record),
        "dataset records": lambda: read(d + "/records/0"),
        "mkdir own buffer": lambda: os.mkdir(base + "/buffers/nobodys"),
    }
    wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else list(operations)
    print(json.dumps({name: attempt(operations[name]) for name in wanted}))
    """
)


@pytest.fixture
def shared_mount(tmp_path: Path) -> Iterator[Mount]:
    """A mount with --allow-other at a path `nobody` can reach (pytest's tmp dirs are 0700)."""
    why = fuse_missing()
    if why:
        pytest.skip(why)
    if os.geteuid() != 0:
        pytest.skip("needs root to run a probe as another user")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} (Debian's python3) is missing: nothing to run the probe as nobody")
    top = Path(tempfile.mkdtemp(prefix="distorefs-perm-", dir="/tmp"))
    os.chmod(top, 0o755)
    try:
        with mounted_at(top / "mnt", tmp_path / "data", "--allow-other") as mount:
            os.chmod(mount.path, 0o755)
            yield mount
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)


def probe(mount: Mount, *only: str) -> dict[str, int]:
    result = subprocess.run(
        [SYSTEM_PYTHON, "-c", PROBE, str(mount.path), *([",".join(only)] if only else [])],
        user=NOBODY,
        group=NOBODY,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )
    assert result.returncode == 0, result.stderr
    out: dict[str, int] = json.loads(result.stdout)
    return out


def make_objects(mount: Mount) -> None:
    b = mount.path / "buffers" / "shared"
    b.mkdir()
    (b / "config").write_text(json.dumps({"schema": {"x": "int64"}, "batch_size": 2}))
    client.append(b, np.arange(4, dtype=np.int64).astype([("x", "<i8")]))
    m = mount.path / "weights" / "policy"
    m.mkdir()
    (m / "w.bin").write_bytes(b"weights v1")
    d = mount.path / "datasets" / "corpus"
    d.mkdir()
    (d / "config").write_text(json.dumps({"schema": {"x": "int64"}}))
    with open(d / "append", "wb") as f:
        f.write(np.arange(3, dtype=np.int64).tobytes())
    (d / "state").write_text("seal\n")


def state_of(mount: Mount) -> dict[str, object]:
    stats = json.loads(client.read_all(mount.path / "buffers" / "shared" / "stats"))
    return {
        "samples": stats["samples"],
        "size": stats["size"],
        "priority": stats["total_priority"],
        "config": (mount.path / "buffers" / "shared" / "config").read_text(),
        "weights": (mount.path / "weights" / "policy" / "w.bin").read_bytes(),
    }


def test_without_write_permission_nobody_cannot_change_a_buffers_state(shared_mount: Mount) -> None:
    mount = shared_mount
    make_objects(mount)
    before = state_of(mount)
    got = probe(mount)
    for denied in (
        "sample", "append", "priority", "config write", "item write", "item unlink", "publish", "create in model",
        "dataset append",
    ):  # fmt: skip
        assert got[denied] == errno.EACCES, (denied, got)
    assert got["rmdir buffer"] == errno.EPERM  # buffers/ is sticky (1777): only the owner removes
    for allowed in ("stats", "config read", "item read", "read weights", "dataset records", "mkdir own buffer"):
        assert got[allowed] == 0, (allowed, got)
    assert state_of(mount) == before
    mine = mount.path / "buffers" / "nobodys"
    assert mine.stat().st_uid == NOBODY  # who makes a buffer owns it
    assert stat.S_IMODE((mount.path / "buffers").stat().st_mode) == 0o1777


def test_chmod_and_chown_of_a_buffer_decide_who_samples_and_survive_a_restart(
    shared_mount: Mount, tmp_path: Path
) -> None:
    mount = shared_mount
    make_objects(mount)
    b = mount.path / "buffers" / "shared"
    os.chmod(b, 0o777)
    assert probe(mount, "sample", "priority", "stats") == {"sample": 0, "priority": 0, "stats": 0}
    os.chmod(b, 0o755)
    os.chown(b, NOBODY, NOBODY)
    assert b.stat().st_uid == NOBODY
    assert (b / "sample").stat().st_uid == NOBODY  # control files follow the directory
    assert stat.S_IMODE((b / "sample").stat().st_mode) == 0o400  # readable by who may write
    assert probe(mount, "sample") == {"sample": 0}
    with pytest.raises(PermissionError):
        os.chmod(b / "sample", 0o666)  # a control file's mode follows its directory: EPERM
    assert mount.unmount() == 0
    with mounted_at(mount.path, mount.data_dir, "--allow-other") as again:
        kept = again.path / "buffers" / "shared"
        assert kept.stat().st_uid == NOBODY
        assert stat.S_IMODE(kept.stat().st_mode) == 0o755


SHM_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR)
    print(os.read(fd, 4096).split()[1].decode(), flush=True)
    sys.stdin.readline()
    """
)
SHM_INTRUDER = textwrap.dedent(
    """
    import errno, os, sys
    try:
        os.open(sys.argv[1], os.O_RDONLY)
        print(0)
    except OSError as exc:
        print(exc.errno)
    """
)


def as_user(uid: int, code: str, *args: str, **popen: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [SYSTEM_PYTHON, "-c", code, *args], user=uid, group=uid, text=True,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, **popen,  # type: ignore[call-overload]
    )  # fmt: skip


def test_a_shared_memory_region_belongs_to_the_user_who_opened_sample_shm(shared_mount: Mount) -> None:
    mount = shared_mount
    make_objects(mount)
    b = mount.path / "buffers" / "shared"
    intruder = as_user(NOBODY, SHM_INTRUDER, str(b / "sample.shm"), stdout=subprocess.PIPE)
    assert intruder.communicate(timeout=60)[0].strip() == str(errno.EACCES)  # may not sample this buffer
    os.chmod(b, 0o777)
    holder = as_user(NOBODY, SHM_HOLDER, str(b / "sample.shm"), stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        region = holder.stdout.readline().strip()
        st = os.stat(region)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o600)
        other = as_user(NOBODY - 1, SHM_INTRUDER, region, stdout=subprocess.PIPE)
        assert other.communicate(timeout=60)[0].strip() == str(errno.EACCES)
    finally:
        holder.communicate(input="\n", timeout=60)
    os.chmod(b, 0o755)


SESSION_USER = textwrap.dedent(
    """
    import mmap, os, socket, struct, sys
    def session(path, ticket, draw):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(10)
        conn.connect(path)
        conn.send(ticket)
        if draw:
            conn.send(struct.pack("<IIQ", 1, 0, 0))
        data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 1)
        status = struct.unpack_from("<i", data)[0]
        writable = None
        for fd in fds:  # the arena: it maps for reading, never for writing
            try:
                mmap.mmap(fd, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                writable = True
            except OSError:
                writable = False
            os.close(fd)
        return status, writable
    if sys.argv[1] == "stolen":  # root's ticket
        print(*session(sys.argv[2], sys.argv[3].encode(), False))
    else:  # a ticket of its own, from its own open
        fd = os.open(sys.argv[2], os.O_RDWR)
        os.write(fd, b"session 2\\n")
        _magic, path, ticket = os.read(fd, 4096).split()
        print(*session(path.decode(), ticket, True))
        os.close(fd)
    """
)


def test_a_sampling_session_is_only_for_the_user_who_opened_sample_shm(shared_mount: Mount) -> None:
    """Version 2: a ticket works only for the uid of the open that asked for it (the
    kernel's SO_PEERCRED, not the client's word), and the arena it gets is read-only."""
    mount = shared_mount
    make_objects(mount)
    b = mount.path / "buffers" / "shared"
    fd = os.open(b / "sample.shm", os.O_RDWR)
    try:
        os.write(fd, b"session 2\n")
        _magic, path, ticket = os.read(fd, 4096).split()
        stolen = as_user(NOBODY, SESSION_USER, "stolen", path.decode(), ticket.decode(), stdout=subprocess.PIPE)
        assert stolen.communicate(timeout=60)[0].split() == [str(errno.EACCES), "None"]
    finally:
        os.close(fd)
    os.chmod(b, 0o777)
    own = as_user(NOBODY, SESSION_USER, "own", str(b / "sample.shm"), stdout=subprocess.PIPE)
    assert own.communicate(timeout=60)[0].split() == ["0", "False"]
    os.chmod(b, 0o755)
    assert state_of(mount)["samples"] == 2  # nobody's one batch of 2; the stolen ticket drew nothing


WEIGHTS_READER = textwrap.dedent(
    """
    import errno, mmap, os, socket, struct, sys
    def hand_over(path, ticket):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(10)
        conn.connect(path)
        conn.send(ticket)
        data, fds, _flags, _addr = socket.recv_fds(conn, 4096, 1)
        got = None
        for fd in fds:
            got = os.pread(fd, 100, 0).decode()
            try:  # sealed and read-only: it maps for reading, never for writing
                mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                got += " writable"
            except OSError:
                pass
            os.close(fd)
        return struct.unpack_from("<i", data)[0], got
    if sys.argv[1] == "stolen":  # root's ticket
        print(*hand_over(sys.argv[2], sys.argv[3].encode()), sep="|")
    else:  # a ticket of its own, asked for on the file
        try:
            _magic, path, ticket, version = os.getxattr(sys.argv[2], "user.distore.shm").split()
        except OSError as exc:
            print(exc.errno, None, sep="|")
        else:
            print(*hand_over(path.decode(), ticket), sep="|")
    """
)


def test_a_weights_shared_copy_is_only_for_who_may_read_the_file(shared_mount: Mount) -> None:
    """`map_version`'s shared copy: the ticket comes from a getxattr the kernel allows
    only to who may read the file, the socket takes it only from the uid that asked, and
    the memfd it hands over is sealed."""
    mount = shared_mount
    make_objects(mount)
    m = mount.path / "weights" / "policy"
    _magic, path, ticket, _version = os.getxattr(m / "w.bin", "user.distore.shm").split()
    stolen = as_user(NOBODY, WEIGHTS_READER, "stolen", path.decode(), ticket.decode(), stdout=subprocess.PIPE)
    assert stolen.communicate(timeout=60)[0].strip() == f"{errno.EACCES}|None"
    own = as_user(NOBODY, WEIGHTS_READER, "own", str(m / "w.bin"), stdout=subprocess.PIPE)
    assert own.communicate(timeout=60)[0].strip() == "0|weights v1"  # 0644: nobody reads it, read-only
    os.chmod(m, 0o700)
    try:
        refused = as_user(NOBODY, WEIGHTS_READER, "own", str(m / "w.bin"), stdout=subprocess.PIPE)
        assert refused.communicate(timeout=60)[0].strip() == f"{errno.EACCES}|None"
    finally:
        os.chmod(m, 0o755)


STAGE_INTRUDER = textwrap.dedent(
    """
    import errno, fcntl, os, sys
    target, memfd = sys.argv[1], int(sys.argv[2])
    seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    out = []
    try:  # 1. root's memfd, handed down, named for a file nobody may write
        fd = os.open(target + "/shared.bin", os.O_WRONLY)
        os.setxattr(fd, "user.distore.adopt", str(memfd).encode())
        out.append("adopted")
    except OSError as exc:
        out.append(str(exc.errno))
    try:  # 2. a file nobody may not write: refused at the open ...
        open(target + "/roots.bin", "wb")
        out.append("opened")
    except OSError as exc:
        out.append(str(exc.errno))
    own = os.memfd_create("nobodys", os.MFD_ALLOW_SEALING)
    os.write(own, b"nobody's bytes")
    fcntl.fcntl(own, fcntl.F_ADD_SEALS, seals)
    try:  # 3. ... and at the adopt request on a read-only open of it
        fd = os.open(target + "/roots.bin", os.O_RDONLY)
        os.setxattr(fd, "user.distore.adopt", str(own).encode())
        out.append("adopted")
    except OSError as exc:
        out.append(str(exc.errno))
    print(" ".join(out))
    """
)


def test_staged_files_take_only_the_callers_own_memory_for_files_it_may_write(shared_mount: Mount) -> None:
    """`client.staged_open`'s adopt request: the memfd must belong to the caller (EACCES
    for one handed down by root), and the kernel checks the caller may write the file."""
    top = shared_mount.path / "staged"
    top.mkdir(mode=0o755)
    os.chmod(top, 0o755)
    shared = top / "shared.bin"
    shared.write_bytes(b"kept")
    os.chmod(shared, 0o666)
    roots = top / "roots.bin"
    roots.write_bytes(b"root's")
    os.chmod(roots, 0o644)
    memfd = os.memfd_create("roots", os.MFD_ALLOW_SEALING)
    try:
        os.write(memfd, b"root's memory")
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        intruder = as_user(NOBODY, STAGE_INTRUDER, str(top), str(memfd), stdout=subprocess.PIPE, pass_fds=(memfd,))
        out = intruder.communicate(timeout=60)[0].split()
    finally:
        os.close(memfd)
    assert out == [str(errno.EACCES)] * 3
    assert shared.read_bytes() == b"kept"
    assert roots.read_bytes() == b"root's"
