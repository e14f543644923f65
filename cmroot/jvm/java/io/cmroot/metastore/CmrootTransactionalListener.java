package io.cmroot.metastore;

import io.cmroot.core.Cmroot;
import java.io.IOException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HashSet;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.Set;
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
    Drops.configure(conf);
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
      Stage.stage(getConf(), s, t, Collections.singletonList(key),
          Collections.<Map<String, String>>emptyList(), dirs, outside,
          "table " + Drops.name(t), "DROP_TABLE", Drops.purge(e.getEnvironmentContext(), t));
    } catch (IOException | RuntimeException ex) {
      throw Drops.metaException(ex);
    }
  }

  /**
   * The first partition of a call staging: every partition the call drops from the table (as
   * its pre-events announced them) is staged now, in one request, so that a refusal fails
   * the call before the metastore has processed any of them further.
   */
  @Override
  public void onDropPartition(DropPartitionEvent e) throws MetaException {
    Table t = e.getTable();
    if (!e.getDeleteData() || !Drops.managed(t)) {
      return;
    }
    try {
      Call call = Call.peek();
      List<Partition> parts = new ArrayList<>();
      Set<String> here = new HashSet<>();
      Iterator<Partition> it = e.getPartitionIterator();
      while (it.hasNext()) {
        Partition p = it.next();
        String key = Drops.dropKey(t, p.getValues());
        here.add(key);
        if (call == null || !call.staged(key) && !call.announced(key)) {
          parts.add(p);
        }
      }
      for (Partition p : call == null ? new ArrayList<Partition>()
          : call.takePartitionDrops(t)) {
        // Announced by this call's pre-events: staged only once the transaction dropped it
        // (a partition still in the catalog is live data, whatever was announced).
        String key = Drops.dropKey(t, p.getValues());
        if (!here.contains(key) && Drops.dropped(e, t, p)) {
          parts.add(p);
        }
      }
      stagePartitions(t, parts, Drops.purge(e.getEnvironmentContext(), t));
    } catch (IOException | RuntimeException ex) {
      throw Drops.metaException(ex);
    }
  }

  private void stagePartitions(Table t, List<Partition> parts, boolean purge)
      throws IOException {
    Cmroot.Settings s = Drops.settings(getConf());
    String tableLoc = Drops.location(t);
    List<String> dirs = new ArrayList<>();
    List<String> outside = new ArrayList<>();
    List<Map<String, String>> specs = new ArrayList<>();
    List<String> keys = new ArrayList<>();
    for (Partition p : parts) {
      String dir = Drops.location(t, p);
      Cmroot.refuseRootRemoval(dir, s, "the drop of partition " + p.getValues() + " of "
          + Drops.name(t) + " located at");
      if (dir == null || !Cmroot.protectedLocation(dir, s)
          || !Cmroot.holdsFiles(dir, getConf())) {
        continue; // nothing to keep: its drop is recorded without files
      }
      dirs.add(dir);
      specs.add(Drops.spec(t, p));
      keys.add(Drops.dropKey(t, p.getValues()));
      if (tableLoc == null || !Cmroot.under(dir, tableLoc)) {
        outside.add(dir);
      }
    }
    if (!dirs.isEmpty()) {
      String what = (specs.size() == 1 ? "partition " + specs.get(0) : "partitions " + specs)
          + " of " + Drops.name(t);
      Stage.stage(getConf(), s, t, keys, specs, dirs, outside, what, "DROP_PARTITION", purge);
    }
  }
}
