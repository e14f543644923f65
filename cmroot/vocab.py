"""The words cmroot's API, index and logs share: event types, recycle modes, resolve
statuses and the states of the recycle journal. One module, so a name is spelled once.

Every enum is a `str` subclass: members compare equal to their JSON spelling and encode
as it, so `EventType("DROP_TABLE") == "DROP_TABLE"` and rows written by older releases
read back unchanged."""

from __future__ import annotations

from enum import Enum


class _Name(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


class EventType(_Name):
    """Every event of the log. The destructive ones are also the `op` of a recycle."""

    DROP_TABLE = "DROP_TABLE"
    DROP_PARTITION = "DROP_PARTITION"
    TRUNCATE = "TRUNCATE"
    INSERT_OVERWRITE = "INSERT_OVERWRITE"
    ALTER_LOCATION = "ALTER_LOCATION"
    DELETE = "DELETE"  # a plain file delete seen by a filesystem hook
    CREATE_DATABASE = "CREATE_DATABASE"
    CREATE_TABLE = "CREATE_TABLE"
    ADD_PARTITION = "ADD_PARTITION"
    INSERT = "INSERT"
    ALTER_TABLE = "ALTER_TABLE"
    DROP_DATABASE = "DROP_DATABASE"


# The ops of POST /v1/recycle: each removes files, which go into the store.
DESTRUCTIVE = frozenset(
    {
        EventType.DROP_TABLE,
        EventType.DROP_PARTITION,
        EventType.TRUNCATE,
        EventType.INSERT_OVERWRITE,
        EventType.ALTER_LOCATION,
        EventType.DELETE,
    }
)
# Drops of a table or partition that held no data (empty, external, outside the roots):
# nothing to recycle, but replication must still replay them (POST /v1/events).
METADATA_DROPS = frozenset({EventType.DROP_TABLE, EventType.DROP_PARTITION})
# A table or partition given a new location: POST /v1/events records it with the files
# that location holds (nothing was deleted); a recycle with this op lists what was removed.
RELOCATIONS = frozenset({EventType.ALTER_LOCATION})
# What POST /v1/events records.
RECORDABLE = (frozenset(EventType) - DESTRUCTIVE) | METADATA_DROPS | RELOCATIONS


class Mode(_Name):
    """How a recycle takes a file: `move` it out of the warehouse, or `copy` it."""

    MOVE = "move"
    COPY = "copy"


class Status(_Name):
    """Where the bytes of a (path, checksum) pair are."""

    ORIGINAL = "original"  # still at its path, with that checksum
    CMROOT = "cmroot"  # recorded for that path, object present in the store
    MISSING = "missing"


class Method(_Name):
    """How one file of a recycle was staged, written to the journal before it moves, so
    recovery never has to guess: a rename takes the source away, a copy leaves it (until
    clean-up after the commit, when it moves), a take copies it and then removes it once
    the copy is journaled (a move off a filesystem the store cannot rename from: an object
    store), so that a prepared delete is a delete there too."""

    RENAME = "rename"
    COPY = "copy"
    TAKE = "take"


class TxState(_Name):
    """A recycle transaction in the journal."""

    OPEN = "open"  # files may be staged; nothing is recorded: roll back on failure
    PREPARED = "prepared"  # staged and hashed; waits for commit or abort until its lease
    COMMITTED = "committed"  # event and entries recorded; clean-up may remain
    QUARANTINED = "quarantined"  # rollback failed: left in place, reported, retried


class FileState(_Name):
    """One file of a recycle, as recovery observes it (journal row + what is on disk)."""

    PLANNED = "planned"  # journaled; nothing moved yet
    STAGED_BY_RENAME = "staged-by-rename"  # the source itself is in staging
    STAGED_BY_COPY = "staged-by-copy"  # a copy (maybe partial) is; the source stayed
    PUBLISHED = "published"  # the staged bytes are also the object of their checksum
    COMMITTED = "committed"  # recorded with its event: the store owns it
    CLEANED = "cleaned"  # staging name and (for a copy moved) the source removed
