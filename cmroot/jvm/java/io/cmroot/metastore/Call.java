package io.cmroot.metastore;

import io.cmroot.core.Cmroot;
import io.cmroot.core.CmrootTransaction;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;

/**
 * One metastore call that drops data (a Thrift request, on the handler thread that serves
 * it), outside any engine statement: everything it drops is staged in one recycle per
 * (op, db, table, purge) and settled when the metastore reports how the call ended:
 * committed on success, aborted (every file back) on failure. So a call is all-or-nothing,
 * a drop of many partitions in one request included. A call the post-event listener did not
 * settle (a later listener failed the call first) is settled by the end-function listener.
 */
final class Call {
  private static final ThreadLocal<Call> CURRENT = new ThreadLocal<>();

  private final Map<String, CmrootTransaction> txs = new LinkedHashMap<>();
  // The drops (table or partition keys) whose data the call staged.
  private final Set<String> staged = new HashSet<>();
  // Directories a table's drop also deletes: its partitions' own locations outside its
  // directory, read by the pre-event while the partitions were still in the catalog.
  private final Map<String, List<String>> partitionDirs = new LinkedHashMap<>();

  private Call() {}

  /** This thread's call, begun on first use. */
  static Call get() {
    Call c = CURRENT.get();
    if (c == null) {
      c = new Call();
      CURRENT.set(c);
    }
    return c;
  }

  /** This thread's call, if one began; null otherwise. */
  static Call peek() {
    return CURRENT.get();
  }

  /** The recycle of this call for (op, db, table, purge), made on first use. */
  CmrootTransaction tx(Cmroot.Settings s, String op, String db, String table, boolean purge,
      String location, String what) {
    String key = CmrootTransaction.key(op, db, table, purge);
    CmrootTransaction tx = txs.get(key);
    if (tx == null) {
      tx = new CmrootTransaction(s, op, db, table, purge, location, what);
      txs.put(key, tx);
    }
    return tx;
  }

  void markStaged(String dropKey) {
    staged.add(dropKey);
  }

  boolean staged(String dropKey) {
    return staged.contains(dropKey);
  }

  void planPartitionDirs(String dropKey, List<String> dirs) {
    partitionDirs.put(dropKey, new ArrayList<>(dirs));
  }

  List<String> plannedPartitionDirs(String dropKey) {
    List<String> dirs = partitionDirs.get(dropKey);
    return dirs == null ? new ArrayList<String>() : dirs;
  }

  /**
   * Commit every recycle of the call when the metastore call succeeded, abort them all when
   * it failed (again: settled ones stay as they are). A commit that fails (the daemon rolled
   * the recycle back) aborts the rest and throws: the metastore DID complete the call.
   */
  void settle(boolean success, String why) throws Cmroot.RecycleException {
    Cmroot.RecycleException failed = null;
    for (CmrootTransaction tx : txs.values()) {
      if (!success || failed != null) {
        tx.abort(failed != null ? "another recycle of the same call failed" : why);
        continue;
      }
      try {
        tx.commit();
      } catch (Cmroot.RecycleException e) {
        failed = e;
      }
    }
    if (failed != null) {
      throw failed;
    }
  }

  /** Settle this thread's call (see {@link #settle}) and forget it: the call ended. */
  static void end(boolean success, String why) throws Cmroot.RecycleException {
    Call c = CURRENT.get();
    CURRENT.remove();
    if (c != null) {
      c.settle(success, why);
    }
  }
}
