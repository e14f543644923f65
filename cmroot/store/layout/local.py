"""A store in a local (POSIX) directory: files staged by rename where the warehouse is on
the same filesystem, objects published by hard link (atomic, never replacing one), one
syncfs(2) to make a commit durable.

Objects are at `objects/ab/<checksum>`: 256 shard directories, each made on its first
use. The two-level `objects/ab/cd/<checksum>` of stores made before needs up to 65,536,
and a new store's first 10,000 recycled files made ~9,500 of them: a mkdir took ~130 us
where publishing an object (a hard link) took ~15 us, so they cost a new store three
times its recycles' other work. A store says which it is in its `LAYOUT` file, written
before `objects/` exists; a store with `objects/` and no `LAYOUT` is of the two-level
kind, and is kept so (unless its objects say otherwise: a LAYOUT lost).

An object may still sit at the other layout's place: a release that knew no LAYOUT file
(a downgrade, then an upgrade) put it there. Reads, existence checks and removals look
there too (`object_rels`), and `cmroot fsck --repair` moves it to its place."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
from collections.abc import Iterator

from cmroot import checksum as cks
from cmroot.durable import fsync_dir, sync_filesystem
from cmroot.exceptions import ConfigError, Conflict, StoreLocked
from cmroot.store import confined
from cmroot.store.layout import OBJECT_NAME, SHARD_NAME, Layout, StagedInfo, same_bytes, shard_of
from cmroot.store.source import Session

log = logging.getLogger(__name__)

# Stores this process holds the write lock of, by real path.
_HELD: dict[str, int] = {}
_HELD_LOCK = threading.Lock()

LAYOUT_FILE = "LAYOUT"
# What a LAYOUT file may say, and the shard levels it stands for.
LAYOUTS = {"objects/ab/<checksum>": 1, "objects/ab/cd/<checksum>": 2}
NEW_LAYOUT = "objects/ab/<checksum>"
# What a look at the other layout's place may meet where no object is there: nothing, or
# a symlink on the way (never followed out of the store).
_NOT_THERE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV})


class LocalLayout(Layout):
    local = True
    renames = True

    def __init__(self, root: str) -> None:
        self.root = root
        self.objects = os.path.join(root, "objects")
        self.staging = os.path.join(root, "staging")
        self.trash = os.path.join(root, "trash")
        self.quarantine = os.path.join(root, "quarantine")
        self.scratch = self.staging
        os.makedirs(root, exist_ok=True)
        self.shard_levels = shard_levels(root)
        # Shard directories seen with no subdirectory (see _may_hold_other).
        self._bare_shards: dict[str, bool] = {}
        for d in (self.objects, self.staging):
            os.makedirs(d, exist_ok=True)

    def make_shard(self, checksum: str) -> None:
        """Create the object's directory. Callers try their link first and call this only
        when the directory is missing, so a shard is created on its first use, once."""
        os.makedirs(f"{self.objects}/{self.shard_of(checksum)}", exist_ok=True)

    # -- lock, transactions ---------------------------------------------------------------
    def lock(self) -> int:
        """Take the store's write lock (released when the process dies, even by kill -9).
        A second writer in this very process is refused too, by name: flock would refuse
        it as "in use by pid <our own pid>", and its recovery would roll back our own
        in-flight recycles."""
        return take_lock(os.path.join(self.root, "LOCK"), os.path.realpath(self.root), self.root)

    def unlock(self, handle: object) -> None:
        assert isinstance(handle, int)
        release_lock(os.path.realpath(self.root), handle)

    def writable(self) -> bool:
        return os.access(self.staging, os.W_OK)

    def begin_tx(self, txid: str) -> None:
        os.makedirs(self.tx_dir(txid), exist_ok=True)

    def end_tx(self, txid: str) -> None:
        shutil.rmtree(self.tx_dir(txid), ignore_errors=True)

    def flush(self) -> None:
        sync_filesystem(self.root)

    def transactions(self) -> list[str]:
        return os.listdir(self.staging)

    def staged_files(self, txid: str) -> list[str]:
        return [os.path.join(d, n) for d, _, names in os.walk(self.tx_dir(txid)) for n in names]

    # -- staged files ---------------------------------------------------------------------
    def stage_copy(self, session: Session, rel: str, staged: str) -> tuple[str, str]:
        return session.copy_out(rel, staged)

    def staged_info(self, staged: str) -> StagedInfo | None:
        try:
            st = os.lstat(staged)
        except FileNotFoundError:
            return None
        return StagedInfo(stat.S_ISREG(st.st_mode), st.st_size, st.st_nlink, st)

    def hash_staged(self, staged: str) -> str:
        return cks.of_local_file(staged)

    def unlink_staged(self, staged: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)

    def put_back(self, session: Session, rel: str, staged: str) -> bool:
        return session.put_back(rel, staged)

    def published(self, staged: str, info: StagedInfo, checksum: str) -> bool:
        assert info.st is not None
        private = private_name(staged)  # a copy published for a hard-linked source
        names = [info.st] + ([os.lstat(private)] if os.path.lexists(private) else [])
        # Published at the other layout's place by a release that knew no LAYOUT file (its
        # crash, recovered here): brought to its place, where the recovery acts on it. If
        # its place holds another object, that name of the staged file goes (the file
        # stays staged): no store name may be left on a file the recovery puts back.
        self._bring_home(checksum)
        with self._other_place(checksum) as found:
            if found is not None:
                st = os.stat(found[1], dir_fd=found[0], follow_symlinks=False)
                if any(_same_file(st, n) for n in names):
                    os.unlink(found[1], dir_fd=found[0])
        obj = self.object_path(checksum)
        return any(_same_inode(n, obj) for n in names)

    def needs_private(self, staged: str, nlink: int, fresh: bool = False) -> bool:
        """Yes when the file has other names in the warehouse (writes through them would
        change the stored bytes), or once prepare copied it so (the other names may have
        gone since; the copy stays)."""
        return nlink > 1 or (not fresh and os.path.lexists(private_name(staged)))

    def private_copy(self, staged: str, checksum: str) -> str:
        """A copy of `staged` beside it, fsynced and hashing to `checksum`: what gets
        linked as the object of a file with other names in the warehouse. Made once (a
        prepared recycle makes it when it hashes the file; its commit reuses it); a copy
        whose bytes differ (written through another name since the hash) is refused."""
        copy = private_name(staged)
        if os.path.exists(copy):
            return copy
        tmp = f"{copy}.tmp"
        with open(staged, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, cks.CHUNK)
            dst.flush()
            os.fsync(dst.fileno())
        if cks.of_local_file(tmp) != checksum:
            os.unlink(tmp)
            raise Conflict(
                "a file changed while it was recycled",
                f"{staged} was written to (through another hard link) after it was hashed:"
                " the recycle is rolled back; try again",
            )
        os.rename(tmp, copy)
        return copy

    def break_link(self, txid: str, seq: int, staged: str, checksum: str) -> None:
        """Give object `checksum`, a hard link of the warehouse file `staged`, bytes of its
        own (a rollback puts the file back while the object stays)."""
        tmp = os.path.join(self.tx_dir(txid), f"{seq}.object")
        with open(staged, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, cks.CHUNK)
            dst.flush()
            os.fsync(dst.fileno())
        obj = self.object_path(checksum)
        os.rename(tmp, obj)
        # Durable now: a commit that deduplicated against this object may skip its flush
        # (published ahead), and the object must never fall back to the warehouse inode.
        fsync_dir(os.path.dirname(obj))

    # -- objects --------------------------------------------------------------------------
    def link(self, staged: str, checksum: str) -> bool:
        # An object at the other layout's place comes to its own first: it is then
        # deduplicated against (bytes compared), never published a second time beside.
        self._bring_home(checksum)
        obj = self.object_path(checksum)
        # A hard link publishes atomically and, unlike rename, never replaces an object
        # that is already there.
        try:
            try:
                os.link(staged, obj)
            except FileNotFoundError:  # the shard's first object
                self.make_shard(checksum)
                os.link(staged, obj)
        except FileExistsError:
            return False
        return True

    def same_content(self, staged: str, checksum: str) -> bool:
        return same_bytes(staged, self.object_path(checksum))

    def hash_object(self, checksum: str) -> str:
        return cks.of_local_file(self.object_path(checksum))

    def heal(self, checksum: str, staged: str, now: float) -> str:
        os.makedirs(self.quarantine, exist_ok=True)
        obj = self.object_path(checksum)
        bad = os.path.join(self.quarantine, f"{checksum}.{int(now)}")
        tmp = f"{staged}.heal"
        os.link(staged, tmp)
        try:
            with contextlib.suppress(FileExistsError):
                os.link(obj, bad)
            os.rename(tmp, obj)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return bad

    def object_rels(self, checksum: str) -> tuple[str, str]:
        other = 3 - self.shard_levels
        return self.object_rel(checksum), f"{shard_of(checksum, other)}/{checksum}"

    def find_object(self, checksum: str) -> str | None:
        home = self.object_path(checksum)
        if os.path.exists(home):
            return home
        with self._other_place(checksum) as found:
            if found is not None:
                return f"{self.objects}/{self.object_rels(checksum)[1]}"
        # Moved home between the two looks (`_bring_home` links, then unlinks)?
        return home if os.path.exists(home) else None

    def object_exists(self, checksum: str) -> bool:
        return self.find_object(checksum) is not None

    def unlink_object(self, checksum: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.object_path(checksum))
        self._unlink_other(checksum)

    def trash_object(self, checksum: str, day: str) -> None:
        dest = os.path.join(self.trash, day, checksum[:2])
        os.makedirs(dest, exist_ok=True)
        try:
            os.rename(self.object_path(checksum), os.path.join(dest, checksum))
        except FileNotFoundError:
            with self._other_place(checksum) as found:
                if found is None:
                    raise
                os.rename(found[1], os.path.join(dest, checksum), src_dir_fd=found[0])
            return
        self._unlink_other(checksum)  # a second copy of what went to the trash

    # -- the other layout's place ---------------------------------------------------------
    @contextlib.contextmanager
    def _other_place(self, checksum: str) -> Iterator[tuple[int, str] | None]:
        """Object `checksum` at the other layout's place as (directory descriptor, name),
        reached with no symlink followed; None unless a regular file is there. A lone
        lstat says "nothing" first, as it does for nearly every object."""
        rel = self.object_rels(checksum)[1]
        found: tuple[int, str] | None = None
        with contextlib.ExitStack() as stack:
            if os.path.lexists(f"{self.objects}/{rel}"):
                try:
                    ofd = stack.enter_context(confined.directory(self.objects))
                    dfd, name = stack.enter_context(confined.parent_of(ofd, rel))
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        found = (dfd, name)
                except OSError as e:
                    if e.errno not in _NOT_THERE:
                        raise
            yield found

    def _unlink_other(self, checksum: str) -> None:
        if not self._may_hold_other(checksum):
            return
        with self._other_place(checksum) as found:
            if found is not None:
                os.unlink(found[1], dir_fd=found[0])

    def _may_hold_other(self, checksum: str) -> bool:
        """Whether a copy may be at the other layout's place. In a one-level store it can
        only be below a subdirectory of its shard, and a shard directory with a link count
        of 2 has none (ext4, XFS; others give 1, and are looked at). Remembered per shard
        while this process runs: only a release that knew no LAYOUT file makes such
        directories, and it cannot write while this one holds the store (its lock). A
        sweep of 100,000 objects spent a second and a half on the look otherwise."""
        if self.shard_levels != 1:
            return True
        top = checksum[:2]
        known = self._bare_shards.get(top)
        if known is None:
            try:
                known = os.lstat(f"{self.objects}/{top}").st_nlink == 2
            except FileNotFoundError:
                known = True  # no shard directory: nothing below it either
            self._bare_shards[top] = known
        return not known

    def _bring_home(self, checksum: str) -> None:
        """Move object `checksum` from the other layout's place to its own, unless its
        own holds one already (both are then left for fsck to compare). A name gone
        meanwhile (moved home by another publish, swept, quarantined by a reader) ends
        the move: there is nothing left to bring."""
        with self._other_place(checksum) as found:
            if found is None:
                return
            dfd, name = found
            home = self.object_path(checksum)
            for attempt in range(2):
                try:
                    os.link(name, home, src_dir_fd=dfd, follow_symlinks=False)
                    break
                except FileExistsError:
                    return
                except FileNotFoundError:
                    if attempt or os.path.isdir(os.path.dirname(home)):
                        return  # the source is gone, not the shard
                    self.make_shard(checksum)
            fsync_dir(os.path.dirname(home))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)

    def quarantined(self, checksum: str) -> bool:
        try:
            return any(n.startswith(checksum + ".") for n in os.listdir(self.quarantine))
        except FileNotFoundError:
            return False


def shard_levels(root: str) -> int:
    """The shard levels of the store at `root` (see the module's docstring). A new store
    (no `objects/` yet) is given the one-level layout: its LAYOUT file is made durable
    before `objects/` exists, so that no crash or concurrent opener sees a one-level
    store's `objects/` without its LAYOUT."""
    path = os.path.join(root, LAYOUT_FILE)
    said = _read_layout(path)
    if said is None:
        objects = os.path.join(root, "objects")
        if not _exists(objects):
            _write_layout(root, path)
            return LAYOUTS[NEW_LAYOUT]
        # Read again: another opener of this new store may have written LAYOUT and made
        # `objects/` since the first look.
        said = _read_layout(path)
        if said is None:
            return _levels_held(root, objects)
    if said not in LAYOUTS:
        raise ConfigError(
            f"the store's layout file {path} says {said[:80]!r}, which this cmroot does not"
            " know",
            f"use the cmroot that made this store; this one knows {', '.join(LAYOUTS)}",
        )
    return LAYOUTS[said]


def _read_layout(path: str) -> str | None:
    """LAYOUT's line, or None if there is no LAYOUT. Opened without blocking and read only
    if it is a regular file (a FIFO there would hang every open of the store)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"the store's layout file {path} is not a regular file",
                              f"make it a file holding the line {NEW_LAYOUT!r}")
        return os.read(fd, 256).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise _unreadable(path, e) from None
    finally:
        os.close(fd)


def _unreadable(path: str, e: BaseException) -> ConfigError:
    return ConfigError(
        f"cannot read the store's layout file {path}: {e}",
        f"make it a file readable by this user holding one line, such as {NEW_LAYOUT!r}",
    )


def _exists(path: str) -> bool:
    """Whether anything is at `path`; an error to look is not an answer (lexists would
    take it for absence, and a new LAYOUT would be written over an old store)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise ConfigError(f"cannot look at the store's {path}: {e}",
                          "make the store's directory readable by this user") from None
    return True


def _levels_held(root: str, objects: str) -> int:
    """The levels of a store with `objects/` and no LAYOUT, as its first object or
    second-level directory says: 2 (made before LAYOUT files) unless objects lie right
    below `objects/ab/` (a one-level store whose LAYOUT was lost)."""
    try:
        with os.scandir(objects) as tops:
            for top in tops:
                if not (SHARD_NAME.fullmatch(top.name) and top.is_dir(follow_symlinks=False)):
                    continue
                with os.scandir(top.path) as entries:
                    for e in entries:
                        if OBJECT_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                            log.warning(
                                "the store has no LAYOUT file; its objects are one-level",
                                extra={"store": root, "fix": f"write the line {NEW_LAYOUT}"
                                       f" to {os.path.join(root, LAYOUT_FILE)}"})
                            return 1
                        if SHARD_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
                            return 2
    except OSError as e:
        raise ConfigError(f"cannot read the store's {objects}: {e}",
                          "make it a directory readable by this user") from None
    return 2


def _write_layout(root: str, path: str) -> None:
    """Write LAYOUT durably, as one rename (two processes making one store write the
    same text)."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(NEW_LAYOUT + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(root)


def take_lock(path: str, key: str, name: str) -> int:
    """flock `path` for the store known as `name` (`key`: its identity in this process)."""
    with _HELD_LOCK:
        if key in _HELD:
            raise StoreLocked(
                f"store {name} is already open for writing in this process",
                "use the Store already open (or close it first), or open this one with"
                " readonly=True",
            )
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StoreLocked(
                f"store {name} is in use by pid {holder}",
                "stop that process, or act through the running daemon with --url",
            ) from None
        _HELD[key] = fd
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def release_lock(key: str, fd: int) -> None:
    with _HELD_LOCK:
        _HELD.pop(key, None)
    os.close(fd)


def private_name(staged: str) -> str:
    """Where `private_copy` keeps its copy of a staged file."""
    return f"{staged}.private"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _same_inode(st: os.stat_result, path: str) -> bool:
    try:
        other = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)
