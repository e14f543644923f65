package io.cmroot.spark;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

/**
 * One destructive statement while it runs: what it does ({@link Cmroot.Ctx}: op, table,
 * purge, location) and the prepared recycles of every delete it makes, one
 * {@link CmrootTransaction} per (op, db, table, purge), committed together once the
 * statement succeeded and aborted together when it failed (invariant 2: a statement is one
 * unit). {@link CmrootStatementCommand} opens one around each destructive command, with
 * try/finally, so a statement's context never outlives it.
 *
 * <p>The current statement is inherited by threads started while it runs (Hive deletes a
 * table's old files from a pool it starts for the call); a thread that outlives it finds it
 * closed and ignores it.
 */
public final class CmrootStatement {
  private static final InheritableThreadLocal<CmrootStatement> CURRENT =
      new InheritableThreadLocal<>();

  final Cmroot.Ctx ctx;
  private final Cmroot.Settings s;
  private final CmrootStatement outer;
  private final Map<String, CmrootTransaction> txs = new LinkedHashMap<>();
  // Drops (table or partition keys) whose data this statement staged: the metastore's
  // post-event then has no metadata-only drop to record.
  private final Set<String> staged = ConcurrentHashMap.newKeySet();
  // A CTAS writes its files before it creates its table: its INSERT event waits here, keyed
  // db.table, until the metastore listener has recorded the CREATE_TABLE.
  private final Map<String, Map<String, Object>> deferredInserts = new ConcurrentHashMap<>();
  private volatile boolean open = true;
  private volatile String failure;

  private CmrootStatement(Cmroot.Ctx ctx, Cmroot.Settings s, CmrootStatement outer) {
    this.ctx = ctx;
    this.s = s;
    this.outer = outer;
  }

  /** Open a statement on this thread; {@link #close} it in a finally block. */
  static CmrootStatement open(Cmroot.Ctx ctx, Cmroot.Settings s) {
    CmrootStatement st = new CmrootStatement(ctx, s, current());
    CURRENT.set(st);
    return st;
  }

  /** The statement running on this thread, or null. */
  public static CmrootStatement current() {
    CmrootStatement st = CURRENT.get();
    return st != null && st.open ? st : null;
  }

  /** The context of the current statement, if `path` belongs to its table; else null. */
  static Cmroot.Ctx contextFor(String path) {
    CmrootStatement st = current();
    return st == null ? null : st.ctx.appliesTo(path);
  }

  /**
   * Stage `paths` as a part of this statement: they join its transaction for (op, db, table,
   * purge). Returns false when failed open (the caller deletes as Spark would).
   */
  boolean prepare(List<String> paths, String op, String db, String table, boolean purge,
      List<Map<String, String>> partitions, String location, String part)
      throws Cmroot.RecycleException {
    if (failure != null) {
      throw new Cmroot.RecycleException("cmroot: " + failure, null);
    }
    CmrootTransaction tx;
    synchronized (txs) {
      tx = txs.computeIfAbsent(CmrootTransaction.key(op, db, table, purge),
          k -> new CmrootTransaction(s, op, db, table, purge, location, "the statement " + ctx));
    }
    return tx.prepare(paths, partitions, part);
  }

  void markStaged(String dropKey) {
    staged.add(dropKey);
  }

  boolean staged(String dropKey) {
    return staged.contains(dropKey);
  }

  void deferInsert(String db, String table, Map<String, Object> body) {
    deferredInserts.put(Cmroot.tableKey(db, table), body);
  }

  Map<String, Object> takeDeferredInsert(String db, String table) {
    return deferredInserts.remove(Cmroot.tableKey(db, table));
  }

  /**
   * A part of the statement failed where Spark may not see it (the metastore reports a failed
   * drop to its post-event listeners): put everything back now; the commit then fails.
   */
  void fail(String why) {
    failure = why;
    abort(why);
  }

  /** Publish every prepared recycle of the statement, in the order they were opened. */
  void commit() throws Cmroot.RecycleException {
    if (failure != null) {
      abort(failure);
      throw new Cmroot.RecycleException("cmroot: " + failure + "; nothing was recycled", null);
    }
    List<CmrootTransaction> all;
    synchronized (txs) {
      all = new ArrayList<>(txs.values());
    }
    for (int i = 0; i < all.size(); i++) {
      try {
        all.get(i).commit();
      } catch (Cmroot.RecycleException e) {
        for (CmrootTransaction later : all.subList(i + 1, all.size())) {
          later.abort("an earlier recycle of the statement could not be committed");
        }
        throw e;
      }
    }
  }

  /** Put back every file the statement staged (never throws; see CmrootTransaction.abort). */
  void abort(String why) {
    List<CmrootTransaction> all;
    synchronized (txs) {
      all = new ArrayList<>(txs.values());
    }
    for (CmrootTransaction tx : all) {
      tx.abort(why);
    }
  }

  /** End the statement on this thread; the statement it was nested in (if any) is current. */
  void close() {
    open = false;
    if (outer != null) {
      CURRENT.set(outer);
    } else {
      CURRENT.remove();
    }
  }

  @Override
  public String toString() {
    return String.valueOf(ctx);
  }
}
