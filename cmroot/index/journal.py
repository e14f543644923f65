"""The recycle journal's tables: a transaction, its files, and the one SQLite
transaction that turns staged files into recorded ones. The state machine that drives
them lives in `cmroot.store.journal`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from cmroot.index.catalog import Catalog
from cmroot.index.events import EventLog
from cmroot.index.records import Entry, Event, JournalRow, PendingTx
from cmroot.vocab import TxState


class JournalTables(Catalog, EventLog):
    def journal_begin(
        self,
        txid: str,
        started: float,
        mode: str,
        request: dict[str, Any],
        dirs: Sequence[str],
        rows: Iterable[tuple[int, str, str, str]],
    ) -> None:
        """Record a transaction and its (seq, source, staged, method) rows, durably,
        before any file moves."""
        with self.transaction() as db:
            db.execute(
                "INSERT INTO txs (txid, started, mode, request, state, dirs)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (txid, started, str(mode), json.dumps(request), TxState.OPEN.value,
                 json.dumps(list(dirs))),
            )
            db.executemany(
                "INSERT INTO journal (txid, seq, source, staged, method) VALUES (?, ?, ?, ?, ?)",
                ((txid, seq, src, staged, str(m)) for seq, src, staged, m in rows),
            )

    def journal_join(
        self,
        txid: str,
        request: dict[str, Any],
        dirs: Sequence[str],
        rows: Iterable[tuple[int, str, str, str]],
    ) -> bool:
        """Add files to a prepared transaction (another recycle of the same statement),
        durably, before they move. The transaction is open again until they are staged:
        a crash meanwhile rolls back all of it, as the statement failed. False if
        `txid` is not prepared (committed, aborted, expired or unknown)."""
        with self.transaction() as db:
            cur = db.execute(
                "UPDATE txs SET state = ?, request = ?, dirs = ? WHERE txid = ? AND state = ?",
                (TxState.OPEN.value, json.dumps(request), json.dumps(list(dirs)), txid,
                 TxState.PREPARED.value),
            )
            if cur.rowcount != 1:
                return False
            db.executemany(
                "INSERT INTO journal (txid, seq, source, staged, method) VALUES (?, ?, ?, ?, ?)",
                ((txid, seq, src, staged, str(m)) for seq, src, staged, m in rows),
            )
        return True

    def journal_prepared(
        self, txid: str, lease: float, rows: Iterable[tuple[int, str, int, str | None]]
    ) -> None:
        """Every file of the transaction is staged and hashed: record (seq, checksum,
        size, identity of a copied source) and wait for commit or abort until `lease` (a
        time; a later part never shortens the statement's lease)."""
        with self.transaction() as db:
            db.executemany(
                "UPDATE journal SET checksum = ?, size = ?, ident = ? WHERE txid = ? AND seq = ?",
                ((c, size, ident, txid, seq) for seq, c, size, ident in rows),
            )
            db.execute(
                "UPDATE txs SET state = ?, lease = max(coalesce(lease, 0), ?) WHERE txid = ?",
                (TxState.PREPARED.value, lease, txid),
            )

    def take_key(self) -> bytes:
        """A random key of this index, made at its first use and never shown: what makes
        the name a take hides a source under (store.journal.take_tag) one no warehouse
        writer can guess and plant a file at."""
        with self.transaction() as db:
            db.execute("INSERT OR IGNORE INTO settings VALUES"
                       " ('take_key', lower(hex(randomblob(16))))")
            row = db.execute("SELECT value FROM settings WHERE key = 'take_key'").fetchone()
        return bytes.fromhex(row[0])

    def journal_copied(self, txid: str, seq: int, checksum: str, size: int, ident: str) -> None:
        """One file's copy is complete and verified (checksum, size, the identity of the
        source copied): recorded before a take removes the source, so a rollback knows
        the staged copy is whole and may put it back."""
        with self.transaction() as db:
            db.execute(
                "UPDATE journal SET checksum = ?, size = ?, ident = ? WHERE txid = ? AND seq = ?",
                (checksum, size, ident, txid, seq),
            )

    def journal_reopen(self, txid: str) -> None:
        """A prepared transaction is being rolled back: open again, so a crash meanwhile
        is rolled back by recovery and a late commit finds nothing to commit."""
        with self.transaction() as db:
            db.execute(
                "UPDATE txs SET state = ? WHERE txid = ? AND state = ?",
                (TxState.OPEN.value, txid, TxState.PREPARED.value),
            )

    def journal_renew(self, txid: str, lease: float) -> bool:
        """Extend a prepared transaction's lease; False if it is not prepared."""
        with self.transaction() as db:
            cur = db.execute(
                "UPDATE txs SET lease = max(coalesce(lease, 0), ?) WHERE txid = ? AND state = ?",
                (lease, txid, TxState.PREPARED.value),
            )
            return cur.rowcount == 1

    def tx_state(self, txid: str) -> str | None:
        """A transaction's state (vocab.TxState), None once it left the journal."""
        rows = self._query("SELECT state FROM txs WHERE txid = ?", (txid,))
        return str(rows[0][0]) if rows else None

    def expired_prepared(self, now: float) -> list[str]:
        """Prepared transactions whose lease has passed, oldest first."""
        return [
            r[0]
            for r in self._query(
                "SELECT txid FROM txs WHERE state = ? AND lease < ? ORDER BY started",
                (TxState.PREPARED.value, now),
            )
        ]

    def journal_set_method(self, txid: str, seq: int, method: str) -> None:
        """Change how a file will be staged, before it is (a rename refused with EXDEV)."""
        with self.transaction() as db:
            db.execute(
                "UPDATE journal SET method = ? WHERE txid = ? AND seq = ?",
                (str(method), txid, seq),
            )

    def commit_recycle(
        self,
        txid: str | None,
        event: Event | None,
        entries: Sequence[Entry],
    ) -> int:
        """Atomically: record the event (None: entries without an event), its entries and
        objects, and mark the transaction committed. Returns the event id (0 without an
        event)."""
        with self.transaction() as db:
            event_id = self._insert_event(db, event, txid) if event is not None else 0
            self._record_entries(db, entries, event_id)
            if txid is not None:
                db.execute(
                    "UPDATE txs SET state = ?, error = NULL WHERE txid = ?",
                    (TxState.COMMITTED.value, txid),
                )
        return event_id

    def journal_end(self, txid: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM journal WHERE txid = ?", (txid,))
            db.execute("DELETE FROM txs WHERE txid = ?", (txid,))

    def quarantine_tx(self, txid: str, error: str) -> None:
        """Mark a transaction whose rollback failed: left as it is, reported, retried."""
        with self.transaction() as db:
            db.execute(
                "UPDATE txs SET state = ?, error = ? WHERE txid = ? AND state != ?",
                (TxState.QUARANTINED.value, error, txid, TxState.COMMITTED.value),
            )
            db.execute(
                "UPDATE txs SET error = ? WHERE txid = ? AND state = ?",
                (error, txid, TxState.COMMITTED.value),
            )

    def pending_txids(self) -> list[str]:
        """The transactions in the journal, oldest first, without their (possibly
        millions of) file rows: callers load one at a time with `pending(txid)`."""
        return [r[0] for r in self._query("SELECT txid FROM txs ORDER BY started, txid", ())]

    def pending(self, txid: str | None = None, rows: bool = True) -> list[PendingTx]:
        """Transactions in the journal (all, or the one named), oldest first. Without
        `rows`, their file rows are left out (an empty list): enough to check a
        transaction's state and lease without reading every file it staged, never to
        roll it back or commit it."""
        txs = self._query(
            "SELECT txid, started, mode, request, state, error, dirs, lease FROM txs"
            + (" WHERE txid = ?" if txid is not None else "")
            + " ORDER BY started",
            (txid,) if txid is not None else (),
        )
        out = []
        for tid, started, mode, request, state, error, dirs, lease in txs:
            files = [
                JournalRow(*r)
                for r in self._query(
                    "SELECT txid, seq, source, staged, method, ident, checksum, size"
                    " FROM journal WHERE txid = ? ORDER BY seq",
                    (tid,),
                )
            ] if rows else []
            out.append(
                PendingTx(tid, started, mode, json.loads(request), state, error,
                          json.loads(dirs), files, lease)
            )
        return out

    def troubled_txs(self) -> int:
        """Transactions recovery could not finish (quarantined, or committed with an
        error): the `cmroot_quarantined_transactions` gauge."""
        return int(
            self._query(
                "SELECT count(*) FROM txs WHERE state = ? OR error IS NOT NULL",
                (TxState.QUARANTINED.value,),
            )[0][0]
        )
