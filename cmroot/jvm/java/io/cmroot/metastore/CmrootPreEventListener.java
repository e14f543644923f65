package io.cmroot.metastore;

import io.cmroot.core.Cmroot;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hive.metastore.MetaStorePreEventListener;
import org.apache.hadoop.hive.metastore.api.Database;
import org.apache.hadoop.hive.metastore.api.MetaException;
import org.apache.hadoop.hive.metastore.api.Partition;
import org.apache.hadoop.hive.metastore.api.Table;
import org.apache.hadoop.hive.metastore.events.PreDropDatabaseEvent;
import org.apache.hadoop.hive.metastore.events.PreDropPartitionEvent;
import org.apache.hadoop.hive.metastore.events.PreDropTableEvent;
import org.apache.hadoop.hive.metastore.events.PreEventContext;

/**
 * The metastore's pre-event listener
 * ({@code hive.metastore.pre.event.listeners=io.cmroot.metastore.CmrootPreEventListener}):
 * before the metastore changes anything for a drop, it refuses one that would delete a
 * warehouse root (a database, table or partition located at one, or at a directory holding
 * one: its recursive delete would take the warehouse), and notes the directories a table's
 * drop deletes besides the table's own (its partitions' own locations, gone from the catalog
 * by the time the data is staged).
 *
 * <p>The data itself is staged by {@link CmrootTransactionalListener}, inside the metastore's
 * transaction, where the call's purge flag is known and a refusal rolls the drop back.
 */
public class CmrootPreEventListener extends MetaStorePreEventListener {

  public CmrootPreEventListener(Configuration conf) {
    super(conf);
  }

  @Override
  public void onEvent(PreEventContext event) throws MetaException {
    try {
      if (event instanceof PreDropDatabaseEvent) {
        Database d = ((PreDropDatabaseEvent) event).getDatabase();
        Cmroot.Settings s = Drops.settings(getConf());
        Cmroot.refuseRootRemoval(Cmroot.localPath(d.getLocationUri()), s,
            "DROP DATABASE " + d.getName() + " located at");
      } else if (event instanceof PreDropTableEvent) {
        PreDropTableEvent e = (PreDropTableEvent) event;
        if (e.getDeleteData() && Drops.managed(e.getTable())) {
          dropTable(e.getTable(), event);
        }
      } else if (event instanceof PreDropPartitionEvent) {
        PreDropPartitionEvent e = (PreDropPartitionEvent) event;
        if (e.getDeleteData() && Drops.managed(e.getTable())) {
          Cmroot.Settings s = Drops.settings(getConf());
          Iterator<Partition> it = e.getPartitionIterator();
          while (it.hasNext()) {
            Partition p = it.next();
            Cmroot.refuseRootRemoval(Drops.location(p), s, "the drop of partition "
                + p.getValues() + " of " + Drops.name(e.getTable()) + " located at");
          }
        }
      }
    } catch (Cmroot.RecycleException ex) {
      throw Drops.metaException(ex);
    } catch (RuntimeException ex) {
      throw Drops.metaException(ex); // a bad setting: refuse rather than delete unprotected
    }
  }

  private void dropTable(Table t, PreEventContext event)
      throws Cmroot.RecycleException, MetaException {
    Cmroot.Settings s = Drops.settings(getConf());
    String loc = Drops.location(t);
    Cmroot.refuseRootRemoval(loc, s, "DROP TABLE " + Drops.name(t) + " located at");
    if (t.getPartitionKeysSize() == 0 || !s.enabled) {
      return;
    }
    List<String> outside = new ArrayList<>();
    for (Partition p : Drops.partitions(event, t)) {
      String dir = Drops.location(p);
      if (dir != null && (loc == null || !Cmroot.under(dir, loc))) {
        Cmroot.refuseRootRemoval(dir, s, "DROP TABLE " + Drops.name(t) + ", whose partition "
            + p.getValues() + " is located at");
        outside.add(dir);
      }
    }
    if (!outside.isEmpty()) {
      Call.get().planPartitionDirs(Drops.dropKey(t, null), outside);
    }
  }
}
