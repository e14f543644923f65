package io.cmroot.metastore;

import io.cmroot.core.Cmroot;
import io.cmroot.core.CmrootFaults;
import io.cmroot.core.CmrootTransaction;
import java.io.File;
import java.io.IOException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hive.metastore.MetaStoreEventListener;
import org.apache.hadoop.hive.metastore.api.MetaException;
import org.apache.hadoop.hive.metastore.api.Partition;
import org.apache.hadoop.hive.metastore.api.Table;
import org.apache.hadoop.hive.metastore.events.DropPartitionEvent;
import org.apache.hadoop.hive.metastore.events.DropTableEvent;

/**
 * The metastore's transactional listener
 * ({@code hive.metastore.transactional.event.listeners=
 * io.cmroot.metastore.CmrootTransactionalListener}): it stages the data of a dropped table
 * or partition (a prepared recycle: moved into the daemon's staging, seen by nobody) inside
 * the metastore's transaction, after the metadata change and before the metastore commits
 * it and deletes the directories.
 *
 * <p>A refusal (or an unreachable daemon, unless cmroot.failOpen) throws: the metastore rolls
 * the drop back and both the catalog entry and every file stay as they were. Nothing is
 * published yet: the recycle is committed once the metastore reports the call's success
 * ({@link CmrootEventListener}, {@link CmrootEndFunctionListener}), or aborted with every file
 * back when it reports a failure. The later delete by the metastore finds only the empty
 * directory. Inside an engine's statement ({@link Statement}), the drop joins the statement
 * instead, and is settled with it.
 */
public class CmrootTransactionalListener extends MetaStoreEventListener {

  public CmrootTransactionalListener(Configuration conf) {
    super(conf);
  }

  @Override
  public void onDropTable(DropTableEvent e) throws MetaException {
    Table t = e.getTable();
    if (!e.getDeleteData() || !Drops.managed(t) || t.getSd() == null) {
      return;
    }
    try {
      Cmroot.Settings s = Drops.settings(getConf());
      String key = Drops.dropKey(t, null);
      Call call = Call.peek();
      List<String> dirs = new ArrayList<>();
      dirs.add(Drops.location(t));
      List<String> outside = call == null ? Collections.<String>emptyList()
          : call.plannedPartitionDirs(key);
      dirs.addAll(outside);
      stage(s, t, null, Collections.<Map<String, String>>emptyList(), dirs, outside,
          "table " + Drops.name(t), "DROP_TABLE", Drops.purge(e.getEnvironmentContext(), t));
    } catch (IOException | RuntimeException ex) {
      throw Drops.metaException(ex);
    }
  }

  @Override
  public void onDropPartition(DropPartitionEvent e) throws MetaException {
    Table t = e.getTable();
    if (!e.getDeleteData() || !Drops.managed(t)) {
      return;
    }
    try {
      Cmroot.Settings s = Drops.settings(getConf());
      boolean purge = Drops.purge(e.getEnvironmentContext(), t);
      String tableLoc = Drops.location(t);
      Iterator<Partition> it = e.getPartitionIterator();
      while (it.hasNext()) {
        Partition p = it.next();
        String dir = Drops.location(p);
        if (dir == null) {
          continue;
        }
        Map<String, String> kv = Drops.spec(t, p);
        List<String> outside = tableLoc != null && Cmroot.under(dir, tableLoc)
            ? Collections.<String>emptyList() : Collections.singletonList(dir);
        stage(s, t, p.getValues(), Collections.singletonList(kv),
            Collections.singletonList(dir), outside,
            "partition " + kv + " of " + Drops.name(t), "DROP_PARTITION", purge);
      }
    } catch (IOException | RuntimeException ex) {
      throw Drops.metaException(ex);
    }
  }

  /**
   * Stage what `dirs` hold (their entries: the directories stay for the metastore to
   * delete, which it logs as an error when they are gone) as one part of the call's (or the
   * statement's) recycle. `outside` are those of `dirs` outside the table's directory.
   */
  private void stage(Cmroot.Settings s, Table t, List<String> values,
      List<Map<String, String>> parts, List<String> dirs, List<String> outside, String what,
      String op, boolean purge) throws IOException {
    List<String> paths = new ArrayList<>();
    List<String> reached = new ArrayList<>();
    for (String dir : dirs) {
      Cmroot.refuseRootRemoval(dir, s, "the drop of " + what + " located at");
      if (Cmroot.protectedLocation(dir, s) && Cmroot.holdsFiles(new File(dir).toPath())) {
        paths.addAll(Cmroot.contents(dir));
        if (outside.contains(dir)) {
          reached.add(dir);
        }
      }
    }
    if (paths.isEmpty()) {
      return; // nothing to keep, or already staged by the statement (Spark: DROP PARTITION)
    }
    if (s.debug) {
      Cmroot.debugDelete(s, "metastore drop of " + what, dirs.toString());
    }
    String tableLoc = Drops.location(t);
    String location = Cmroot.protectedLocation(tableLoc, s) ? tableLoc : null;
    String key = Drops.dropKey(t, values);
    Statement st = Statement.Registry.current();
    if (st != null) {
      if (!st.prepare(paths, op, t.getDbName(), t.getTableName(), purge, parts, location,
          what)) {
        return; // failed open: the metastore deletes as usual
      }
      st.markStaged(key);
    } else {
      Call call = Call.get();
      CmrootTransaction tx = call.tx(s, op, t.getDbName(), t.getTableName(), purge, location,
          "the drop of " + what).withPartitionLocations(reached);
      if (!tx.prepare(paths, parts, what)) {
        return;
      }
      call.markStaged(key);
    }
    CmrootFaults.afterPrepare(getConf(), "the drop of " + what);
  }
}
