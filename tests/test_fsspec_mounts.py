"""Which filesystem a ``file://`` tier's root is on (``/proc/self/mountinfo``), and
``nowait=auto``: on for local filesystems, off for network and FUSE mounts."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.fsspec import FsspecTier
from kvtier.tiers.mounts import (
    LOCAL_FSTYPES,
    Mount,
    check_local,
    mount_of,
    parse_mountinfo,
    read_mountinfo,
)
from tests.helpers.tmpfs import mounted_tmpfs

HAS_NOWAIT = hasattr(os, "RWF_NOWAIT")
NETWORK_FSTYPES = ["nfs", "nfs4", "cifs", "smb3", "ceph", "lustre", "gpfs", "beegfs",
                   "wekafs", "9p", "virtiofs", "fuse", "fuse.sshfs", "fuse.juicefs", "fuseblk",
                   "glusterfs", "autofs", "somethingnew"]


def _escape(path: str) -> str:
    return (path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
            .replace("\n", "\\012"))


def line(mount_id: int, parent: int, mount_point: str | Path, fstype: str,
         root: str = "/", source: str = "src", optional: str = "shared:1") -> str:
    opt = f" {optional}" if optional else ""
    return (f"{mount_id} {parent} 0:{mount_id} {_escape(root)} {_escape(str(mount_point))} "
            f"rw,relatime{opt} - {fstype} {_escape(source)} rw")


def mounts(*lines: str) -> list[Mount]:
    return parse_mountinfo("\n".join(lines) + "\n")


# ------------------------------------------------------------------ the parser
def test_parse_reads_fields_escapes_and_optional_fields() -> None:
    text = (
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard\n"
        "\n"
        "36 27 98:0 /exports/kv\\040a /mnt/my\\040weka\\011x rw,noatime shared:1 master:2 "
        "- wekafs weka\\134src rw\n"
        "40 27 0:50 / /mnt/fuse rw unbindable - fuse.sshfs user@host:/d rw\n")
    root, weka, fuse = parse_mountinfo(text)
    assert root == Mount(27, 1, "/", "/", "ext4", "/dev/vda")
    assert weka == Mount(36, 27, "/exports/kv a", "/mnt/my weka\tx", "wekafs", "weka\\src")
    assert (fuse.mount_point, fuse.fstype, fuse.source) == ("/mnt/fuse", "fuse.sshfs",
                                                           "user@host:/d")


@pytest.mark.parametrize("bad", [
    "27 1 254:0 / / rw,relatime ext4 /dev/vda rw",   # no "-" separator
    "27 1 254:0 / / rw,relatime -",                   # nothing after it
    "x 1 254:0 / / rw,relatime - ext4 /dev/vda rw",   # mount id not a number
    "27 1 254:0 / - ext4 /dev/vda rw",                # too few fields before "-"
])
def test_malformed_mountinfo_is_refused_and_means_unknown(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mountinfo line 2"):
        parse_mountinfo(line(1, 0, "/", "ext4") + "\n" + bad)
    path = tmp_path / "mountinfo"
    path.write_text(line(1, 0, "/", "ext4") + "\n" + bad + "\n")
    assert read_mountinfo(str(path)) is None


def test_missing_mountinfo_means_unknown_so_not_local(tmp_path: Path) -> None:
    assert read_mountinfo(str(tmp_path / "absent")) is None
    check = check_local(str(tmp_path), None)
    assert (check.fstype, check.local) == (None, False)


def test_longest_prefix_by_whole_components() -> None:
    table = mounts(line(1, 0, "/", "ext4"), line(2, 1, "/mnt", "xfs"),
                   line(3, 2, "/mnt/weka", "wekafs"), line(4, 3, "/mnt/weka/scratch", "tmpfs"))

    def fstype(path: str) -> str | None:
        found = mount_of(path, table)
        return None if found is None else found.fstype

    assert fstype("/") == "ext4"
    assert fstype("/home/x") == "ext4"
    assert fstype("/mnt") == "xfs"
    assert fstype("/mnt/wekafoo/kv") == "xfs"  # a string prefix, not a component prefix
    assert fstype("/mnt/weka") == "wekafs"
    assert fstype("/mnt/weka/kv/ab") == "wekafs"
    assert fstype("/mnt/weka/scratch/kv") == "tmpfs"
    assert mount_of("/x", mounts(line(2, 1, "/mnt", "xfs"))) is None


def test_the_mount_on_top_of_a_stack_wins_whatever_the_order() -> None:
    under, over = line(7, 1, "/data", "nfs4"), line(9, 7, "/data", "ext4")
    for order in ((under, over), (over, under)):
        found = mount_of("/data/kv", mounts(line(1, 0, "/", "ext4"), *order))
        assert found is not None and found.fstype == "ext4"


# ------------------------------------------------------------------ check_local
@pytest.mark.parametrize("fstype", sorted(LOCAL_FSTYPES))
def test_local_filesystems_are_local(fstype: str, tmp_path: Path) -> None:
    table = mounts(line(1, 0, "/", "ext4"), line(2, 1, tmp_path, fstype))
    check = check_local(str(tmp_path / "kv"), table)
    assert (check.fstype, check.local) == (fstype, True)


@pytest.mark.parametrize("fstype", NETWORK_FSTYPES)
def test_network_fuse_and_unknown_filesystems_are_not(fstype: str, tmp_path: Path) -> None:
    table = mounts(line(1, 0, "/", "ext4"), line(2, 1, tmp_path, fstype))
    check = check_local(str(tmp_path / "kv"), table)
    assert (check.fstype, check.local) == (fstype, False)


def test_a_network_mount_under_a_local_one(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    table = mounts(line(1, 0, "/", "ext4"), line(2, 1, tmp_path / "net", "nfs4"))
    assert check_local(str(tmp_path / "net" / "kv"), table).fstype == "nfs4"
    assert check_local(str(tmp_path / "net" / "kv"), table).local is False
    assert check_local(str(tmp_path / "local"), table).local is True
    # The tier's files under tmp_path would include the NFS subtree.
    beneath = check_local(str(tmp_path), table)
    assert (beneath.fstype, beneath.local) == ("ext4", False)
    assert "nfs4" in beneath.reason


def test_a_root_that_does_not_exist_yet_takes_its_nearest_ancestor(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    table = mounts(line(1, 0, "/", "ext4"), line(2, 1, tmp_path / "a", "xfs"))
    check = check_local(str(tmp_path / "a" / "b" / "c" / ".." / "d"), table)
    assert (check.fstype, check.local) == ("xfs", True)
    assert not (tmp_path / "a" / "b").exists()  # looked at, not created


def test_escaped_mount_points_match_real_paths(tmp_path: Path) -> None:
    spaced = tmp_path / "my dir\\x"
    spaced.mkdir()
    table = mounts(line(1, 0, "/", "ext4"), line(2, 1, spaced, "cifs"))
    assert check_local(str(spaced / "kv"), table).fstype == "cifs"


def test_a_bind_mount_is_its_source_filesystem(tmp_path: Path) -> None:
    (tmp_path / "bind").mkdir()
    table = mounts(line(1, 0, "/", "ext4"),
                   line(2, 1, tmp_path / "bind", "nfs4", root="/exports/kv", source="srv:/"))
    assert table[1].root == "/exports/kv"
    assert check_local(str(tmp_path / "bind" / "t"), table).local is False


def test_symbolic_links_are_followed_into_the_mount_they_reach(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "fast").mkdir()
    (tmp_path / "sub").mkdir()
    (tmp_path / "to-net").symlink_to(tmp_path / "net")            # absolute
    (tmp_path / "sub" / "to-fast").symlink_to("../fast")         # relative, with ".."
    (tmp_path / "loop").symlink_to("loop")
    table = mounts(line(1, 0, "/", "ext4"), line(2, 1, tmp_path / "net", "nfs4"),
                   line(3, 1, tmp_path / "fast", "tmpfs"))
    to_net = check_local(str(tmp_path / "to-net" / "kv"), table)
    assert (to_net.fstype, to_net.local) == ("nfs4", False)
    to_fast = check_local(str(tmp_path / "sub" / "to-fast" / "kv"), table)
    assert (to_fast.fstype, to_fast.local) == ("tmpfs", True)
    # ".." after a link climbs from where the link led (realpath), not lexically.
    (tmp_path / "fast" / "deep").mkdir()
    (tmp_path / "to-deep").symlink_to(tmp_path / "fast" / "deep")
    up = check_local(str(tmp_path / "to-deep" / ".." / "kv"), table)
    assert (up.fstype, up.local) == ("tmpfs", True)
    looped = check_local(str(tmp_path / "loop" / "kv"), table)
    assert (looped.fstype, looped.local) == (None, False)


def test_a_path_through_a_network_mount_is_not_looked_up(tmp_path: Path) -> None:
    # Resolution stops at the first non-local mount: the link below it is never read, so a
    # hung server cannot block the check; the answer is the network mount, conservatively.
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "back").symlink_to(tmp_path / "local")
    table = mounts(line(1, 0, "/", "ext4"), line(2, 1, tmp_path / "net", "nfs"))
    assert check_local(str(tmp_path / "net" / "back" / "kv"), table).fstype == "nfs"


@pytest.mark.skipif(shutil.which("findmnt") is None or read_mountinfo() is None,
                    reason="needs Linux and findmnt")
def test_agrees_with_findmnt_on_this_machine(tmp_path: Path) -> None:
    for path in (tmp_path, Path("/"), Path("/dev/shm"), Path("/proc")):
        if not path.exists():
            continue
        expected = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", str(path)],
                                  capture_output=True, text=True, check=True).stdout.split()
        # findmnt lists every mount stacked on the point, the top one last.
        assert check_local(str(path), read_mountinfo()).fstype == expected[-1], path


# ------------------------------------------------------------------ the tier
def _block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, 64 << 10, dtype=np.uint8)


async def _get_counts(tier: FsspecTier) -> int:
    """Put and get a block; how many reads ran on the loop (checked against the stats)."""
    await tier.put(b"k", _block(0))
    got = await tier.get(b"k")
    assert got is not None and np.array_equal(got, _block(0))
    stats = tier.stats()
    await tier.aclose()
    # On, a cached file is read on the loop, unless the filesystem refused RWF_NOWAIT
    # reads (EOPNOTSUPP), which turns nowait off for good.
    assert stats["reads_nowait"] == (1 if stats["nowait"] else 0)
    reads: int = stats["reads_nowait"]
    return reads


async def test_auto_follows_the_filesystem_of_tmp_path(tmp_path: Path) -> None:
    root = tmp_path / "t"  # created by the tier
    tier = FsspecTier.from_url(f"file://{root}")
    expected = check_local(str(root), read_mountinfo())
    stats = tier.stats()
    assert stats["fstype"] == expected.fstype
    assert stats["nowait"] is (expected.local and HAS_NOWAIT)
    await _get_counts(tier)


@pytest.mark.skipif(not HAS_NOWAIT, reason="needs RWF_NOWAIT")
async def test_auto_is_on_for_a_real_tmpfs(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "mnt", "4m") as mnt:
        tier = FsspecTier.from_url(f"file://{mnt}/kv?nowait=auto")
        assert (tier.stats()["fstype"], tier.stats()["nowait"]) == ("tmpfs", True)
        await _get_counts(tier)  # 1 where tmpfs has RWF_NOWAIT reads (not on every kernel)


async def test_zero_and_one_force_it(tmp_path: Path) -> None:
    off = FsspecTier.from_url(f"file://{tmp_path}/t?nowait=0")
    assert off.stats()["nowait"] is False
    assert off.stats()["fstype"] == check_local(str(tmp_path), read_mountinfo()).fstype
    assert await _get_counts(off) == 0
    on = FsspecTier(f"file://{tmp_path}/t", nowait=True)
    assert on.stats()["nowait"] is HAS_NOWAIT
    await _get_counts(on)


@pytest.mark.parametrize("value", ["maybe", "2", "", "autoo"])
def test_bad_nowait_values_are_refused(value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nowait: expected 0, 1 or auto"):
        FsspecTier.from_url(f"file://{tmp_path}/t?nowait={value}")


@pytest.mark.parametrize("value", [2, 1.5, None, "sometimes"])
def test_bad_nowait_keywords_are_refused(value: object, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nowait: expected 0, 1 or auto"):
        FsspecTier(f"file://{tmp_path}/t", nowait=value)  # type: ignore[arg-type]


def test_auto_on_other_protocols_is_off_and_one_is_refused() -> None:
    assert FsspecTier.from_url("memory://x?nowait=auto").nowait is False
    assert FsspecTier("memory://x", nowait="AUTO").nowait is False
    assert FsspecTier("memory://x").nowait is False
    with pytest.raises(ConfigError, match="nowait: only for file://"):
        FsspecTier.from_url("memory://x?nowait=1")
