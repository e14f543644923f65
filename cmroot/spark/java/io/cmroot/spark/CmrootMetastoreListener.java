package io.cmroot.spark;

import java.io.File;
import java.io.IOException;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hive.metastore.MetaStorePreEventListener;
import org.apache.hadoop.hive.metastore.api.FieldSchema;
import org.apache.hadoop.hive.metastore.api.MetaException;
import org.apache.hadoop.hive.metastore.api.Partition;
import org.apache.hadoop.hive.metastore.api.Table;
import org.apache.hadoop.hive.metastore.events.PreDropPartitionEvent;
import org.apache.hadoop.hive.metastore.events.PreDropTableEvent;
import org.apache.hadoop.hive.metastore.events.PreEventContext;

/**
 * A Hive metastore pre-event listener for the metastore Spark embeds
 * ({@code spark.hadoop.hive.metastore.pre.event.listeners=io.cmroot.spark.CmrootMetastoreListener}).
 *
 * <p>The metastore deletes a dropped table's (or partition's) directory only after it has
 * committed the metadata change, and it ignores a failed delete. So the data is recycled here,
 * before the metastore changes anything: if cmroot refuses, the listener throws, the drop
 * fails and both the metadata and the files stay as they were. The later delete by the
 * metastore finds nothing left to delete.
 *
 * <p>It also notes, per thread, which drops it recycled data for: the post-event listener
 * ({@link CmrootMetastoreEvents}) records a metadata-only drop for the others.
 */
public class CmrootMetastoreListener extends MetaStorePreEventListener {

  // Keys of the tables / partitions whose drop recycled data on this thread (the embedded
  // metastore runs pre and post events on the statement's thread).
  private static final ThreadLocal<Set<String>> RECYCLED =
      ThreadLocal.withInitial(HashSet::new);

  public CmrootMetastoreListener(Configuration conf) {
    super(conf);
  }

  static String dropKey(Table t, List<String> values) {
    return Cmroot.tableKey(t.getDbName(), t.getTableName())
        + (values == null ? "" : "/" + String.join("/", values));
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

  /** Whether this thread's pre-event recycled the data of that drop; forgets it. */
  static boolean takeRecycled(String key) {
    return RECYCLED.get().remove(key);
  }

  @Override
  public void onEvent(PreEventContext event) throws MetaException {
    try {
      if (event instanceof PreDropTableEvent) {
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
    Cmroot.Ctx ctx = Cmroot.context();
    if (ctx != null && t.getTableName().equalsIgnoreCase(ctx.table)
        && t.getDbName().equalsIgnoreCase(ctx.db)) {
      return ctx.purge;
    }
    String auto = t.getParameters() == null ? null : t.getParameters().get("auto.purge");
    return "true".equalsIgnoreCase(auto);
  }

  private void dropTable(Table t) throws IOException {
    if (!managed(t) || t.getSd() == null) {
      return;
    }
    Cmroot.Settings s = Cmroot.settings(getConf());
    String loc = Cmroot.localPath(t.getSd().getLocation());
    if (!Cmroot.protectedPath(loc, s) || !Cmroot.holdsFiles(new File(loc).toPath())) {
      return;
    }
    if (s.debug) {
      Cmroot.debugDelete(s, "metastore drop table", loc);
    }
    if (Cmroot.recycle(children(loc), "DROP_TABLE", t.getDbName(), t.getTableName(), purge(t),
        List.of(), loc, s, "table " + t.getDbName() + "." + t.getTableName())) {
      RECYCLED.get().add(dropKey(t, null));
    }
  }

  /**
   * What a directory holds, so that the directory itself stays for the metastore to delete
   * (it logs an error when the directory it drops is already gone).
   */
  private static List<String> children(String dir) throws IOException {
    String[] names = new File(dir).list();
    List<String> out = new ArrayList<>();
    if (names == null) {
      out.add(dir);
      return out;
    }
    java.util.Arrays.sort(names);
    for (String n : names) {
      File f = new File(dir, n);
      if (Cmroot.holdsFiles(f.toPath())) {
        out.add(f.getPath());
      }
    }
    return out;
  }

  private void dropPartition(Table t, Partition p) throws IOException {
    if (!managed(t) || p.getSd() == null) {
      return;
    }
    Cmroot.Settings s = Cmroot.settings(getConf());
    String loc = Cmroot.localPath(p.getSd().getLocation());
    if (!Cmroot.protectedPath(loc, s) || !Cmroot.holdsFiles(new File(loc).toPath())) {
      return;
    }
    Map<String, String> kv = spec(t, p);
    List<Map<String, String>> parts = new ArrayList<>();
    parts.add(kv);
    String tableLoc = t.getSd() == null ? null : Cmroot.localPath(t.getSd().getLocation());
    if (Cmroot.recycle(children(loc), "DROP_PARTITION", t.getDbName(), t.getTableName(),
        purge(t), parts, Cmroot.protectedPath(tableLoc, s) ? tableLoc : null, s,
        "partition " + kv + " of " + t.getDbName() + "." + t.getTableName())) {
      RECYCLED.get().add(dropKey(t, p.getValues()));
    }
  }
}
