"""A warehouse root on any fsspec filesystem (object stores above all). Nothing there can
be renamed into the local store, so every file is staged by copy. A move then takes the
source away once its copy is journaled, and only while its identity (ETag, version id) is
the one copied: a prepared delete is a delete, as a rename makes it locally. A rollback
uploads it back, never over an object written there meanwhile."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec
import xxhash

from cmroot import checksum as cks
from cmroot.exceptions import ChecksumMismatch, NotFound
from cmroot.store.source import Session, Source, SourceFile
from cmroot.vocab import Method, Mode

log = logging.getLogger(__name__)
_WARNED = False  # the log line about a store without conditional deletes is said once


def remote_ident(info: dict[str, Any]) -> str | None:
    """An object store file's identity: its version id or ETag, else (weakest) size and
    modification time; None when the filesystem gives none of them."""
    for key in ("VersionId", "version_id", "ETag", "etag", "generation"):
        # "null" is the version of every object written while versioning was off or
        # suspended: a rewrite keeps it, so it names no version and the ETag must.
        if info.get(key) and info[key] != "null":
            return f"{key.lower()}:{info[key]}"
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
    if mtime is None:
        return None
    t = mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime)
    return f"size-mtime:{int(info.get('size') or 0)}:{int(t * 1e9)}"


def fresh_info(fs: Any, path: str) -> dict[str, Any]:
    """`path`'s info as the filesystem has it now. A listing cache (s3fs keeps one per
    client) answers with what a listing saw: an object rewritten since would pass for
    unchanged, and be deleted or served as the old one."""
    fs.invalidate_cache(path)
    info: dict[str, Any] = fs.info(path)
    return info


def identity(info: dict[str, Any]) -> str:
    """The identity recorded for a copied source: remote_ident, or its size alone."""
    return remote_ident(info) or f"size:{info.get('size')}"


def changed(fs: Any, path: str, ident: str) -> bool:
    """Whether `path` no longer has identity `ident` (or is gone)."""
    try:
        return identity(fresh_info(fs, path)) != ident
    except FileNotFoundError:
        return True


def spool(fs: Any, path: str, scratch: str) -> tuple[IO[bytes], str]:
    """`path` streamed once into an unnamed file in the local directory `scratch` while
    hashed: the file (at its start) and the hash of exactly what it holds, the bytes a
    verified read then serves. FileNotFoundError (or NotADirectoryError) if it is gone."""
    h = xxhash.xxh3_128()
    tmp = tempfile.TemporaryFile(dir=scratch)  # noqa: SIM115 - returned open
    try:
        with fs.open(path, "rb") as f:
            while chunk := f.read(cks.CHUNK):
                h.update(chunk)
                tmp.write(chunk)
        tmp.flush()
        tmp.seek(0)
    except BaseException:
        tmp.close()
        raise
    return tmp, h.hexdigest()


class RemoteSource(Source):
    local = False

    def __init__(self, url: str) -> None:
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root_path = root.rstrip("/")

    def path(self, rel: str) -> str:
        return f"{self.root_path}/{rel}" if rel else self.root_path

    def method(self, mode: Mode) -> Method:
        return Method.TAKE if mode == Mode.MOVE else Method.COPY

    @contextmanager
    def session(self) -> Iterator[RemoteSession]:
        yield RemoteSession(self)

    def expand(self, rel: str, key: str) -> tuple[list[SourceFile], bool]:
        try:
            info = self.fs.info(self.path(rel))
        except FileNotFoundError:
            raise NotFound("no such file", f"{key} does not exist") from None
        if info["type"] != "directory":
            return [SourceFile(key, rel, int(info.get("size") or 0))], False
        out = []
        base = self.path(rel)
        for p, d in self.fs.find(base, detail=True).items():
            if p.endswith("/") or d.get("type") == "directory":
                continue  # a directory marker (S3A, the console): no file of the table
            sub = p[len(base) :].lstrip("/")
            out.append(
                SourceFile(f"{key.rstrip('/')}/{sub}", f"{rel}/{sub}" if rel else sub,
                           int(d.get("size") or 0))
            )
        return out, True


class RemoteSession(Session):
    def __init__(self, source: RemoteSource) -> None:
        self.source = source
        self.fs = source.fs

    def rename_out(self, rel: str, staged: str) -> None:
        raise OSError(18, "a remote file cannot be renamed into the local store", rel)

    def copy_out(self, rel: str, staged: str) -> tuple[str, str]:
        path = self.source.path(rel)
        ident = identity(fresh_info(self.fs, path))
        h = xxhash.xxh3_128()
        try:
            with self.fs.open(path, "rb") as fin, open(staged, "xb") as out:
                while chunk := fin.read(cks.CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        except OSError as e:
            # An object store refuses the rest of a read once the object changed (S3: 412
            # on the ETag it began with): that is a change, not a failure.
            if changed(self.fs, path, ident):
                raise ChecksumMismatch("source changed while copied", f"{path}: try again") from e
            raise
        if changed(self.fs, path, ident):
            raise ChecksumMismatch("source changed while copied", f"{path}: try again")
        checksum = h.hexdigest()
        if cks.of_local_file(staged) != checksum:
            raise ChecksumMismatch(
                "copy verification failed", f"{staged} does not hash like {path}"
            )
        return checksum, ident


    def put_back(self, rel: str, staged: str) -> bool:
        """Upload a taken file back, never over an object written there meanwhile (an
        exclusive create: S3's If-None-Match). True when `rel` holds the staged bytes
        (put back now, or by a try a crash cut short, or never taken)."""
        path = self.source.path(rel)
        try:
            with open(staged, "rb") as fin, self.fs.open(path, "xb") as out:
                shutil.copyfileobj(fin, out, cks.CHUNK)
        except FileExistsError:
            if not self._holds(path, staged):
                return False
        os.unlink(staged)
        return True

    def _holds(self, path: str, staged: str) -> bool:
        """Whether the object at `path` has the staged file's bytes."""
        try:
            if fresh_info(self.fs, path).get("type") != "file":
                return False
            there = cks.of_file(self.fs, path)
        except FileNotFoundError:
            return False
        return there == cks.of_local_file(staged)

    def remove_if_unchanged(self, rel: str, ident: str, tag: str, resumed: bool = False
                            ) -> bool:
        path = self.source.path(rel)
        try:
            if identity(fresh_info(self.fs, path)) != ident:
                return False
            if hasattr(self.fs, "call_s3"):
                return self._s3_delete(path, ident)
            # No conditional delete in fsspec's API: a writer landing between the check
            # and this delete loses its file (README, "The store on an object store").
            self.fs.rm_file(path)  # one path, as named: `rm` expands glob characters
        except FileNotFoundError:
            return False
        return True

    def _s3_delete(self, path: str, ident: str) -> bool:
        """Delete exactly the object version that was copied: by its version id, or
        conditional on its ETag (S3's If-Match), so a version written since the check
        survives. False when the object is no longer that one."""
        bucket, key, _ = self.fs.split_path(path)
        kind, _, value = ident.partition(":")
        if kind == "versionid":
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, VersionId=value)
            return True
        if kind != "etag":  # no ETag: only the size was seen, nothing to condition on
            self.fs.rm_file(path)
            return True
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=value)
        except OSError as e:
            if e.errno == errno.ENOSYS:
                return self._unconditional(path, e)
            if changed(self.fs, path, ident):  # 412: another version is there now
                return False
            raise
        return True

    def _unconditional(self, path: str, e: OSError) -> bool:
        """A server without conditional deletes (501): the check-then-delete of other
        filesystems, said once in the log."""
        global _WARNED
        if not _WARNED:
            _WARNED = True
            log.warning("the object store refuses conditional deletes: a file written"
                        " between a take's check and its delete would be lost",
                        extra={"path": path, "error": str(e)})
        self.fs.rm_file(path)
        return True

    def remove_empty_dirs(self, rel: str, keep: Callable[[str], bool]) -> None:
        # Object stores have no directories to leave behind; for filesystems that do,
        # remove the named directory only if nothing is left under it.
        # Never a recursive delete: a file written after any emptiness check would go too.
        path = self.source.path(rel)
        if keep(rel):
            return
        try:
            self.fs.rmdir(path)
        except (FileNotFoundError, OSError, NotImplementedError):
            pass
