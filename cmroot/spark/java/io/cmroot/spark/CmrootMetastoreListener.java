package io.cmroot.spark;

import java.io.File;
import java.io.IOException;
import java.util.HashMap;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hive.metastore.MetaStorePreEventListener;
import org.apache.hadoop.hive.metastore.api.Database;
import org.apache.hadoop.hive.metastore.api.FieldSchema;
import org.apache.hadoop.hive.metastore.api.MetaException;
import org.apache.hadoop.hive.metastore.api.Partition;
import org.apache.hadoop.hive.metastore.api.Table;
import org.apache.hadoop.hive.metastore.events.PreDropDatabaseEvent;
import org.apache.hadoop.hive.metastore.events.PreDropPartitionEvent;
import org.apache.hadoop.hive.metastore.events.PreDropTableEvent;
import org.apache.hadoop.hive.metastore.events.PreEventContext;

/**
 * A Hive metastore pre-event listener for the metastore Spark embeds
 * ({@code spark.hadoop.hive.metastore.pre.event.listeners=io.cmroot.spark.CmrootMetastoreListener}).
 *
 * <p>The metastore deletes a dropped table's (or partition's) directory only after it has
 * committed the metadata change, and it ignores a failed delete. So the data is staged here
 * (a prepared recycle), before the metastore changes anything: if cmroot refuses, the
 * listener throws, the drop fails and both the metadata and the files stay as they were. The
 * recycle is committed only once the drop succeeded: by the statement that runs it
 * ({@link CmrootStatement}), or, for a drop outside one, by the post-event listener
 * ({@link CmrootMetastoreEvents}) when the metastore reports success; a failed drop aborts it
 * and the files are back. The later delete by the metastore finds nothing left to delete.
 *
 * <p>A drop of a database located at a warehouse root or at a directory containing one is
 * refused before the metastore drops anything: its recursive delete would take the warehouse.
 */
public class CmrootMetastoreListener extends MetaStorePreEventListener {

  // The recycle a pre-event prepared for a drop outside any statement, until the post-event
  // of the same drop settles it (the embedded metastore runs both on the caller's thread).
  private static final ThreadLocal<Map<String, CmrootTransaction>> PENDING =
      ThreadLocal.withInitial(HashMap::new);

  public CmrootMetastoreListener(Configuration conf) {
    super(conf);
  }

  static String dropKey(Table t, List<String> values) {
    return dropKey(t.getDbName(), t.getTableName(), values);
  }

  static String dropKey(String db, String table, List<String> values) {
    return Cmroot.tableKey(db, table) + (values == null ? "" : "/" + String.join("/", values));
  }

  /** The partition's {key: value}. */
  static Map<String, String> spec(Table t, Partition p) {
    Map<String, String> kv = new LinkedHashMap<>();
    List<FieldSchema> keys = t.getPartitionKeys();
    List<String> values = p.getValues();
    for (int i = 0; i < keys.size() && i < values.size(); i++) {
      kv.put(keys.get(i).getName(), values.get(i));
    }
    return kv;
  }

  /** The recycle this thread's pre-event prepared for that drop outside a statement. */
  static CmrootTransaction takePending(String key) {
    return PENDING.get().remove(key);
  }

  @Override
  public void onEvent(PreEventContext event) throws MetaException {
    try {
      if (event instanceof PreDropDatabaseEvent) {
        Database d = ((PreDropDatabaseEvent) event).getDatabase();
        Cmroot.refuseRootRemoval(Cmroot.localPath(d.getLocationUri()),
            Cmroot.settings(getConf()), "DROP DATABASE " + d.getName() + " located at");
      } else if (event instanceof PreDropTableEvent) {
        PreDropTableEvent e = (PreDropTableEvent) event;
        if (e.getDeleteData()) {
          dropTable(e.getTable());
        }
      } else if (event instanceof PreDropPartitionEvent) {
        PreDropPartitionEvent e = (PreDropPartitionEvent) event;
        if (e.getDeleteData()) {
          Iterator<Partition> it = e.getPartitionIterator();
          while (it.hasNext()) {
            dropPartition(e.getTable(), it.next());
          }
        }
      }
    } catch (Cmroot.RecycleException ex) {
      MetaException me = new MetaException(ex.getMessage());
      me.initCause(ex);
      throw me;
    } catch (IOException ex) {
      MetaException me = new MetaException("cmroot: " + ex);
      me.initCause(ex);
      throw me;
    }
  }

  private static boolean managed(Table t) {
    String ext = t.getParameters() == null ? null : t.getParameters().get("EXTERNAL");
    return !"EXTERNAL_TABLE".equals(t.getTableType()) && !"TRUE".equalsIgnoreCase(ext);
  }

  private boolean purge(Table t) {
    Cmroot.Ctx ctx = CmrootStatement.current() == null ? null : CmrootStatement.current().ctx;
    if (ctx != null && t.getTableName().equalsIgnoreCase(ctx.table)
        && t.getDbName().equalsIgnoreCase(ctx.db)) {
      return ctx.purge;
    }
    String auto = t.getParameters() == null ? null : t.getParameters().get("auto.purge");
    return "true".equalsIgnoreCase(auto);
  }

  /** Stage the data of a dropped table (again: only what is left is staged). */
  void dropTable(Table t) throws IOException {
    if (!managed(t) || t.getSd() == null) {
      return;
    }
    Cmroot.Settings s = Cmroot.settings(getConf());
    String loc = Cmroot.localPath(t.getSd().getLocation());
    Cmroot.refuseRootRemoval(loc, s, "DROP TABLE " + t.getDbName() + "." + t.getTableName()
        + " located at");
    if (!Cmroot.protectedLocation(loc, s) || !Cmroot.holdsFiles(new File(loc).toPath())) {
      return;
    }
    if (s.debug) {
      Cmroot.debugDelete(s, "metastore drop table", loc);
    }
    stage(s, t, null, List.of(), loc, "table " + t.getDbName() + "." + t.getTableName(),
        "DROP_TABLE");
  }

  /** Stage the data of a dropped partition (again: only what is left is staged). */
  void dropPartition(Table t, Partition p) throws IOException {
    if (!managed(t) || p.getSd() == null) {
      return;
    }
    Cmroot.Settings s = Cmroot.settings(getConf());
    String loc = Cmroot.localPath(p.getSd().getLocation());
    Cmroot.refuseRootRemoval(loc, s, "the drop of partition");
    if (!Cmroot.protectedLocation(loc, s) || !Cmroot.holdsFiles(new File(loc).toPath())) {
      return; // nothing to keep, or already staged by the statement (CmrootDropPartitions)
    }
    Map<String, String> kv = spec(t, p);
    stage(s, t, p.getValues(), List.of(kv), loc,
        "partition " + kv + " of " + t.getDbName() + "." + t.getTableName(), "DROP_PARTITION");
  }

  /** Prepare the recycle of what `dir` holds, in the statement or for the post-event. */
  private void stage(Cmroot.Settings s, Table t, List<String> values,
      List<Map<String, String>> parts, String dir, String what, String op) throws IOException {
    String tableLoc = t.getSd() == null ? null : Cmroot.localPath(t.getSd().getLocation());
    String location = Cmroot.protectedLocation(tableLoc, s) ? tableLoc : null;
    String key = dropKey(t, values);
    CmrootStatement st = CmrootStatement.current();
    if (st != null) {
      if (!st.prepare(Cmroot.contents(dir), op, t.getDbName(), t.getTableName(), purge(t),
          parts, location, what)) {
        return; // failed open: the metastore deletes as usual
      }
      st.markStaged(key);
    } else {
      CmrootTransaction tx = PENDING.get().get(key); // staged by the pre-event: join it
      if (tx == null) {
        tx = new CmrootTransaction(s, op, t.getDbName(), t.getTableName(), purge(t), location,
            "the drop of " + what);
      }
      if (!tx.prepare(Cmroot.contents(dir), parts, what)) {
        return;
      }
      PENDING.get().put(key, tx);
    }
    CmrootFaults.afterPrepare("the drop of " + what);
  }
}
