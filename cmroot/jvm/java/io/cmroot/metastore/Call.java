package io.cmroot.metastore;

import io.cmroot.core.Cmroot;
import io.cmroot.core.CmrootTransaction;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.apache.hadoop.hive.metastore.api.Partition;
import org.apache.hadoop.hive.metastore.api.Table;

/**
 * One metastore call that drops data (a Thrift request, on the handler thread that serves
 * it), outside any engine statement: everything it drops is staged in one recycle per
 * (op, db, table, purge) and settled when the metastore reports how the call ended:
 * committed on success, aborted (every file back) on failure. So a call is all-or-nothing,
 * a drop of many partitions in one request included.
 *
 * <p>The post-event listener settles the call; the end-function listener forgets it. Some
 * calls have no end function (drop_partitions_req): a settled call is then forgotten when
 * the next drop call on the thread begins (its first pre-event), and one never settled (a
 * listener before cmroot's failed the call) is aborted there, its files back.
 */
final class Call {
  private static final ThreadLocal<Call> CURRENT = new ThreadLocal<>();

  private final Map<String, CmrootTransaction> txs = new LinkedHashMap<>();
  // The drops (table or partition keys) whose data the call staged.
  private final Set<String> staged = new HashSet<>();
  // Directories a table's drop also deletes: its partitions' own locations outside its
  // directory, read by the pre-event while the partitions were still in the catalog.
  private final Map<String, List<String>> partitionDirs = new LinkedHashMap<>();
  // The partitions the call drops, by table key, announced by its pre-events (all of them
  // come before any is staged): staged together at the first one's transactional event.
  private final Map<String, Map<String, Partition>> dropping = new LinkedHashMap<>();
  private final Set<String> taken = new HashSet<>();
  // The drops whose post-event came: a drop reported twice is a later call's, which this
  // one must not answer for (a call without an end function and no pre-event seen).
  private final Set<String> reported = new HashSet<>();
  private boolean settled;

  private Call() {}

  /**
   * A drop call begins (its pre-event): a call the thread still holds from before is over.
   * Kept only while it has staged nothing and is not settled: the pre-events of one call
   * that drops many partitions all come before any of its data is staged.
   */
  static void begin() {
    Call c = CURRENT.get();
    if (c == null || !c.settled && c.txs.isEmpty()) {
      return;
    }
    CURRENT.remove();
    if (!c.settled) {
      for (CmrootTransaction tx : c.txs.values()) {
        tx.abort("the metastore call that staged it never reported its end");
      }
    }
  }

  /** This thread's call, begun on first use (afresh after a settled one). */
  static Call get() {
    Call c = CURRENT.get();
    if (c == null || c.settled) {
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

  /**
   * The post-event of a drop: false when this call already had that drop's post-event, so
   * the drop is a later call's (the thread's call is then forgotten).
   */
  static boolean report(String dropKey) {
    Call c = CURRENT.get();
    if (c == null) {
      return false;
    }
    if (!c.reported.add(dropKey)) {
      CURRENT.remove();
      return false;
    }
    return true;
  }

  void planPartitionDirs(String dropKey, List<String> dirs) {
    partitionDirs.put(dropKey, new ArrayList<>(dirs));
  }

  void planPartitionDrop(Table t, Partition p) {
    String table = Drops.dropKey(t, null);
    Map<String, Partition> parts = dropping.get(table);
    if (parts == null) {
      parts = new LinkedHashMap<>();
      dropping.put(table, parts);
    }
    parts.put(Drops.dropKey(t, p.getValues()), p);
  }

  /** The partitions of `t` the call drops and has not staged yet (taken: staged once). */
  List<Partition> takePartitionDrops(Table t) {
    Map<String, Partition> parts = dropping.remove(Drops.dropKey(t, null));
    if (parts == null) {
      return new ArrayList<>();
    }
    taken.addAll(parts.keySet());
    return new ArrayList<>(parts.values());
  }

  /** Was the partition (drop key) among those a pre-event announced and staging took? */
  boolean announced(String dropKey) {
    return taken.contains(dropKey);
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
    settled = true;
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
