"""A store on an fsspec filesystem: an object store above all (`s3://bucket/prefix`).

Nothing can be renamed into it, so every file is staged by copy: a server-side copy when
the warehouse file is on the same filesystem (on S3, `CopyObject` conditional on the ETag
that was looked at, so the copy is of that version or fails), an upload otherwise. The
staged copy is then read once to hash it; that read is the only time its bytes pass
through the daemon. Publishing is a server-side copy of the staged object to its
checksum's name, done under the objects' lock and never over an existing object; a
deduplication compares sizes and content MD5s (single-part ETags), else the bytes.
Objects share no inode with any warehouse file, so nothing here ever needs a private copy.

The index and the write lock stay on local disk (`work`, beside the index). The store
root holds an `OWNER` marker naming that index: a second daemon with another index would
sweep objects it does not know of, so it is refused at open, and only the index OWNER
names deletes objects (`owned`)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec

from cmroot import checksum as cks
from cmroot.exceptions import ChecksumMismatch, ConfigError, StoreLocked
from cmroot.store.layout import Layout, StagedInfo, streams_equal
from cmroot.store.layout.local import release_lock, take_lock
from cmroot.store.source import Session
from cmroot.store.source.remote import RemoteSession, changed, fresh_info, identity, spool

# CopyObject copies up to 5 GiB in one call; larger objects are copied in parts.
_COPY_MAX = 5 << 30
_PART = 1 << 30
_GLOB = frozenset("*?[]")
# The user metadata key naming the staged file an object was published from.
_MADE_BY = "cmroot-staged"
# The first word of an OWNER naming two indexes, which no index may delete objects under.
_CONTESTED = "contested:"


class RemoteLayout(Layout):
    local = False
    renames = False

    def __init__(self, root: str, work: str) -> None:
        if _GLOB & set(root):
            raise ConfigError(
                f"store.root {root} has glob characters",
                "fsspec expands * ? [ ] in paths: choose a bucket prefix without them",
            )
        self.fs, path = fsspec.core.url_to_fs(root)
        self.root = root.rstrip("/")
        self.base = path.rstrip("/")
        self.objects = f"{self.base}/objects"
        self.staging = f"{self.base}/staging"
        self.trash = f"{self.base}/trash"
        self.quarantine = f"{self.base}/quarantine"
        self.owner = f"{self.base}/OWNER"
        self.work = work
        self.scratch = os.path.join(work, "scratch")
        os.makedirs(self.scratch, exist_ok=True)
        self._s3 = hasattr(self.fs, "call_s3")
        # Every change to an object's name (publish, heal, quarantine, removal) is made
        # under this lock: a copy then a delete is not atomic as a rename is, so a reader's
        # quarantine must never interleave with a heal of the same object.
        self._names = threading.Lock()
        self._me: str | None = None  # this index's OWNER line, once lock() took the store

    def location(self, checksum: str) -> str:
        url: str = self.fs.unstrip_protocol(self.object_path(checksum))
        return url

    # -- lock, transactions ---------------------------------------------------------------
    def lock(self) -> int:
        """The local lock beside the index, then the store's `OWNER` marker: written if
        absent, else it must name this index."""
        fd = take_lock(os.path.join(self.work, "store.lock"), f"remote:{self.root}", self.root)
        me = f"{self._index_id()} {socket.gethostname()}:{os.path.realpath(self.work)}\n"
        try:
            owner = self._owner(me)
        except BaseException as e:
            release_lock(f"remote:{self.root}", fd)
            if not isinstance(e, Exception):
                raise
            raise ConfigError(
                f"cannot reach the store at {self.root}",
                f"{type(e).__name__}: {e}; check that the bucket exists, the endpoint"
                " (AWS_ENDPOINT_URL or fsspec's config) and the credentials",
            ) from None
        if owner.split(" ", 1)[0] != me.split(" ", 1)[0]:  # the index's id decides, not
            # the host name (a pod restarted on a new host keeps its index volume)
            release_lock(f"remote:{self.root}", fd)
            raise StoreLocked(
                f"store {self.root} belongs to another index: {owner.strip()}",
                "run the daemon whose index that is; if that index is gone for good, delete"
                f" {self.fs.unstrip_protocol(self.owner)} (its objects are then unindexed:"
                " run `cmroot fsck`)",
            )
        self._me = me
        return fd

    def _owner(self, me: str) -> str:
        """OWNER's text, written as `me` first if it is missing: by exclusive create (S3
        If-None-Match), so that of two daemons finding it missing only one writes it."""
        try:
            data: bytes = self.fs.cat_file(self.owner)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError), self.fs.open(self.owner, "xb") as f:
                f.write(me.encode())
            data = self.fs.cat_file(self.owner)
        return data.decode(errors="replace")

    def owned(self) -> bool:
        """Whether OWNER names this index. A marker deleted while the daemon runs is
        written again (it was checked only at open: a second index could take the store
        meanwhile). One naming another index means that happened: each index knows
        objects the other does not, so OWNER is marked contested, naming both, and
        neither deletes anything until an operator keeps one (the other index cannot
        tell on its own: OWNER names it)."""
        if self._me is None:
            return False  # opened read-only: the store was never taken
        owner = self._owner(self._me)
        if owner.split(" ", 1)[0] == self._me.split(" ", 1)[0]:
            return True
        if not owner.startswith(_CONTESTED):
            self.fs.pipe_file(self.owner,
                              f"{_CONTESTED} {owner.strip()} | {self._me.strip()}\n".encode())
        return False

    def _index_id(self) -> str:
        """A random id made once beside the index: what the store's OWNER names."""
        path = os.path.join(self.work, "store.id")
        with contextlib.suppress(FileExistsError), open(path, "x") as f:
            f.write(uuid.uuid4().hex)
        with open(path) as f:
            return f.read().strip()

    def unlock(self, handle: object) -> None:
        assert isinstance(handle, int)
        release_lock(f"remote:{self.root}", handle)

    def writable(self) -> bool:
        try:
            return self.owned()
        except Exception:  # unreachable, refused: not ready, whatever the reason
            return False

    def begin_tx(self, txid: str) -> None:
        # Each recycle puts a deleted OWNER back, or marks it contested if another index
        # took the store meanwhile, even where no readiness probe asks (owned).
        self.owned()
        self.fs.makedirs(self.tx_dir(txid), exist_ok=True)  # a no-op on object stores

    def end_tx(self, txid: str) -> None:
        self.fs.invalidate_cache(self.tx_dir(txid))  # a cached listing would miss files
        with contextlib.suppress(FileNotFoundError):
            paths = self.fs.find(self.tx_dir(txid))
            if paths:
                self.fs.rm(paths)
        with contextlib.suppress(FileNotFoundError, OSError, NotImplementedError):
            self.fs.rmdir(self.tx_dir(txid))  # filesystems that keep directories

    def flush(self) -> None:
        """Nothing to do: an object store acknowledges a write once it is durable."""

    def transactions(self) -> list[str]:
        self.fs.invalidate_cache(self.staging)
        try:
            listed = self.fs.ls(self.staging, detail=False)
        except FileNotFoundError:
            return []
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in listed]

    def staged_files(self, txid: str) -> list[str]:
        self.fs.invalidate_cache(self.tx_dir(txid))
        try:
            return list(self.fs.find(self.tx_dir(txid)))
        except FileNotFoundError:
            return []

    # -- staged files ---------------------------------------------------------------------
    def stage_copy(self, session: Session, rel: str, staged: str) -> tuple[str, str]:
        if isinstance(session, RemoteSession) and session.fs is self.fs:
            ident = self._server_copy(session.source.path(rel), staged)
            return self.hash_staged(staged), ident
        # Another filesystem (a local warehouse, another endpoint): copied out by the
        # source's own verified copy into scratch, uploaded, and the upload read back.
        tmp = os.path.join(self.scratch, uuid.uuid4().hex)
        try:
            checksum, ident = session.copy_out(rel, tmp)
            self.fs.put_file(tmp, staged)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if self.hash_staged(staged) != checksum:
            raise ChecksumMismatch("copy verification failed",
                                   f"{staged} does not hash like the file copied to it")
        return checksum, ident

    def _server_copy(self, src: str, dst: str) -> str:
        """Copy `src` to `dst` on the store's filesystem without the bytes leaving it, and
        return the identity of what was copied: on S3, the copy is conditional on the
        ETag read first, so it is that version or nothing."""
        info = fresh_info(self.fs, src)
        ident = identity(info)
        try:
            if self._s3 and info.get("ETag"):
                self._s3_copy(src, dst, info)
            else:
                self.fs.cp_file(src, dst)
        except FileNotFoundError:
            raise
        except OSError as e:
            if changed(self.fs, src, ident):
                raise ChecksumMismatch("source changed while copied", f"{src}: try again") from e
            raise
        if changed(self.fs, src, ident):  # not conditional (no ETag): looked at after
            self.unlink_staged(dst)
            raise ChecksumMismatch("source changed while copied", f"{src}: try again")
        return ident

    def _s3_copy(self, src: str, dst: str, info: dict[str, Any],
                 metadata: dict[str, str] | None = None) -> None:
        """CopyObject (in parts above 5 GiB) of the version `info` describes, with
        `metadata` in place of the source's when given."""
        bucket, key, _ = self.fs.split_path(src)
        dbucket, dkey, _ = self.fs.split_path(dst)
        source: dict[str, str] = {"Bucket": bucket, "Key": key}
        if info.get("VersionId"):
            source["VersionId"] = info["VersionId"]
        etag = info["ETag"]
        size = int(info.get("size") or 0)
        meta: dict[str, Any] = {} if metadata is None else {"Metadata": metadata}
        if size <= _COPY_MAX:
            if metadata is not None:
                meta["MetadataDirective"] = "REPLACE"
            self.fs.call_s3("copy_object", Bucket=dbucket, Key=dkey, CopySource=source,
                            CopySourceIfMatch=etag, **meta)
            return
        up = self.fs.call_s3("create_multipart_upload", Bucket=dbucket, Key=dkey, **meta)
        try:
            parts = []
            for n, start in enumerate(range(0, size, _PART), 1):
                end = min(start + _PART, size) - 1
                r = self.fs.call_s3(
                    "upload_part_copy", Bucket=dbucket, Key=dkey, UploadId=up["UploadId"],
                    PartNumber=n, CopySource=source, CopySourceIfMatch=etag,
                    CopySourceRange=f"bytes={start}-{end}",
                )
                parts.append({"PartNumber": n, "ETag": r["CopyPartResult"]["ETag"]})
            self.fs.call_s3("complete_multipart_upload", Bucket=dbucket, Key=dkey,
                            UploadId=up["UploadId"], MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.call_s3("abort_multipart_upload", Bucket=dbucket, Key=dkey,
                                UploadId=up["UploadId"])
            raise

    def staged_info(self, staged: str) -> StagedInfo | None:
        try:
            info = fresh_info(self.fs, staged)
        except FileNotFoundError:
            return None
        return StagedInfo(info.get("type") == "file", int(info.get("size") or 0))

    def hash_staged(self, staged: str) -> str:
        return cks.of_file(self.fs, staged)

    def unlink_staged(self, staged: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(staged)

    def put_back(self, session: Session, rel: str, staged: str) -> bool:
        """A taken file goes back by the source's own exclusive create (never over a file
        written there meanwhile), from a local copy of the staged bytes."""
        with self._spooled(staged) as tmp:
            if not session.put_back(rel, tmp):
                return False
        self.unlink_staged(staged)
        return True

    @contextmanager
    def _spooled(self, path: str) -> Iterator[str]:
        tmp = os.path.join(self.scratch, uuid.uuid4().hex)
        try:
            self.fs.get_file(path, tmp)
            yield tmp
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def published(self, staged: str, info: StagedInfo, checksum: str) -> bool:
        """Whether the object is the one published from `staged`: on S3 its metadata
        names that staged file, as an inode does locally, so that a rollback never takes
        another object of the checksum (one a lost index left for fsck to adopt) for its
        own. Other filesystems keep no metadata: any object of the checksum answers."""
        obj = self.object_path(checksum)
        if not self._s3:
            return self.object_exists(checksum)
        try:
            made_by: str | None = self.fs.metadata(obj).get(_MADE_BY)
        except FileNotFoundError:
            return False
        return made_by == self._tag(staged)

    def _tag(self, staged: str) -> str:
        return staged[len(self.staging) + 1 :]  # "<txid>/<seq>": unique to one file

    def _publish_copy(self, staged: str, obj: str) -> None:
        """Copy a staged file to its object's name, tagged with where it came from."""
        info = fresh_info(self.fs, staged) if self._s3 else {}
        if info.get("ETag"):
            self._s3_copy(staged, obj, info, {_MADE_BY: self._tag(staged)})
        else:
            self.fs.cp_file(staged, obj)

    # -- objects --------------------------------------------------------------------------
    def link(self, staged: str, checksum: str) -> bool:
        with self._names:
            if self.object_exists(checksum):
                return False
            self._publish_copy(staged, self.object_path(checksum))
            return True

    def same_content(self, staged: str, checksum: str) -> bool:
        obj = self.object_path(checksum)
        a, b = fresh_info(self.fs, staged), fresh_info(self.fs, obj)
        if int(a.get("size") or 0) != int(b.get("size") or 0):
            return False
        ea, eb = a.get("ETag"), b.get("ETag")
        if ea and ea == eb and "-" not in ea:
            # Both the MD5 of their content, and both hash alike with xxh3-128: a pair
            # colliding on both at once is beyond reach (ETags of multipart uploads are
            # not content MD5s: those are compared byte for byte).
            return True
        with self.fs.open(staged, "rb") as x, self.fs.open(obj, "rb") as y:
            return streams_equal(x, y, cks.CHUNK)

    def hash_object(self, checksum: str) -> str:
        return cks.of_file(self.fs, self.object_path(checksum))

    def heal(self, checksum: str, staged: str, now: float) -> str:
        obj = self.object_path(checksum)
        with self._names:
            bad = self._quarantine_name(checksum, now)
            try:
                self.fs.cp_file(obj, bad)
            except FileNotFoundError:  # quarantined by a reader meanwhile
                pass
            self._publish_copy(staged, obj)
        return str(self.fs.unstrip_protocol(bad))

    def _quarantine_name(self, checksum: str, now: float) -> str:
        """A free name in quarantine: `<checksum>.<unix time>`, `.1`, `.2`... after it,
        so that no quarantined copy ever replaces an earlier one."""
        base = f"{self.quarantine}/{checksum}.{int(now)}"
        name, n = base, 0
        while self.fs.exists(name):
            n += 1
            name = f"{base}.{n}"
        return name

    def object_exists(self, checksum: str) -> bool:
        try:
            return fresh_info(self.fs, self.object_path(checksum)).get("type") == "file"
        except FileNotFoundError:
            return False

    def unlink_object(self, checksum: str) -> None:
        with self._names, contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.object_path(checksum))

    def trash_object(self, checksum: str, day: str) -> None:
        obj = self.object_path(checksum)
        with self._names:
            self.fs.cp_file(obj, f"{self.trash}/{day}/{checksum[:2]}/{checksum}")
            self.fs.rm_file(obj)

    def quarantined(self, checksum: str) -> bool:
        self.fs.invalidate_cache(self.quarantine)
        try:
            names = self.fs.ls(self.quarantine, detail=False)
        except FileNotFoundError:
            return False
        return any(n.rsplit("/", 1)[-1].startswith(checksum + ".") for n in names)

    # -- reads ----------------------------------------------------------------------------
    def spool_object(self, checksum: str) -> tuple[IO[bytes], str, str] | None:
        """Object `checksum` streamed once into an unnamed local file while hashed: the
        file (at its start), the hash of what was read and the identity it was read at.
        None if there is no such object."""
        obj = self.object_path(checksum)
        try:
            ident = identity(fresh_info(self.fs, obj))
            tmp, digest = spool(self.fs, obj, self.scratch)
        except FileNotFoundError:
            return None
        return tmp, digest, ident

    def quarantine_object(self, checksum: str, ident: str, now: float) -> str | None:
        """Move object `checksum` to quarantine if it is still the one read (`ident`)."""
        obj = self.object_path(checksum)
        with self._names:
            if changed(self.fs, obj, ident):
                return None  # healed (or removed) since it was read: not the bytes judged
            bad = self._quarantine_name(checksum, now)
            self.fs.cp_file(obj, bad)
            self.fs.rm_file(obj)
        return str(self.fs.unstrip_protocol(bad))
