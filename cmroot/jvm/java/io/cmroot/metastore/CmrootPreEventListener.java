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
 * one: its recursive delete would take the warehouse), and notes what the call drops: the
 * partitions (a call may drop many; they are staged together), and the directories a
 * table's drop deletes besides the table's own (its partitions' own locations, gone from the
 * catalog by the time the data is staged).
 *
 * <p>The data itself is staged by {@link CmrootTransactionalListener}, inside the metastore's
 * transaction, where the call's purge flag is known and a refusal rolls the drop back.
 */
public class CmrootPreEventListener extends MetaStorePreEventListener {
  static {
    Cmroot.addAuditPart(CmrootPreEventListener::audit);
  }

  /**
   * The metastore's part of the audit: the user the call runs as and the address of the
   * Thrift client that made it (when the metastore serves Thrift without SASL; an embedded
   * metastore has none).
   */
  private static java.util.Map<String, String> audit() {
    java.util.Map<String, String> m = new java.util.LinkedHashMap<>();
    try {
      m.put("user",
          org.apache.hadoop.security.UserGroupInformation.getCurrentUser().getShortUserName());
    } catch (java.io.IOException e) {
      Cmroot.LOG.debug("cmroot: no metastore user for the audit", e);
    }
    try {
      Object ip = Class.forName("org.apache.hadoop.hive.metastore.HiveMetaStore$HMSHandler")
          .getMethod("getThreadLocalIpAddress").invoke(null);
      if (ip != null) {
        m.put("host", ip.toString());
      }
    } catch (ReflectiveOperationException | RuntimeException e) {
      Cmroot.LOG.debug("cmroot: no client address for the audit", e);
    }
    return m;
  }


  public CmrootPreEventListener(Configuration conf) {
    super(conf);
    Drops.configure(conf);
    Cmroot.Settings s = Drops.settings(conf);
    if (s.enabled && s.roots.isEmpty()) {
      // Every location is then outside the roots: drops would go ahead unkept, silently.
      Cmroot.LOG.error("cmroot: no warehouse root (cmroot.warehouseRoots or "
          + "hive.metastore.warehouse.dir = {}): the plugin keeps nothing; set "
          + "cmroot.warehouseRoots to the warehouse directories",
          conf.get("hive.metastore.warehouse.dir"));
    } else if (s.enabled) {
      Cmroot.LOG.info("cmroot: the metastore plugin keeps the drops under {} at {}", s.roots,
          s.url);
    }
  }

  @Override
  public void onEvent(PreEventContext event) throws MetaException {
    try {
      if (event instanceof PreDropDatabaseEvent || event instanceof PreDropTableEvent
          || event instanceof PreDropPartitionEvent) {
        Call.begin(); // every drop, with data or not: what an earlier call left is over
      }
      if (event instanceof PreDropDatabaseEvent) {
        dropDatabase(((PreDropDatabaseEvent) event).getDatabase(), event);
      } else if (event instanceof PreDropTableEvent) {
        PreDropTableEvent e = (PreDropTableEvent) event;
        if (e.getDeleteData() && Drops.managed(e.getTable())) {
          dropTable(e.getTable(), event);
        }
      } else if (event instanceof PreDropPartitionEvent) {
        PreDropPartitionEvent e = (PreDropPartitionEvent) event;
        Table t = e.getTable();
        if (e.getDeleteData() && Drops.managed(t)) {
          Cmroot.Settings s = Drops.settings(getConf());
          Iterator<Partition> it = e.getPartitionIterator();
          while (it.hasNext()) {
            Partition p = it.next();
            refuse(Drops.location(t, p), s, "the drop of partition " + p.getValues() + " of "
                + Drops.name(t) + " located at");
            Call.get().planPartitionDrop(t, p);
          }
        }
      }
    } catch (java.io.IOException ex) { // a refusal (RecycleException), or a listing failed
      throw Drops.metaException(ex);
    } catch (RuntimeException ex) {
      throw Drops.metaException(ex); // a bad setting: refuse rather than delete unprotected
    }
  }

  /**
   * Refuse the drop of `place` when it deletes a warehouse root (or a directory holding
   * one), or names a root's files by another scheme, which the roots would not cover.
   */
  private static void refuse(String place, Cmroot.Settings s, String what)
      throws Cmroot.RecycleException {
    Cmroot.refuseAlias(place, s, what);
    Cmroot.refuseRootRemoval(place, s, what);
  }

  /**
   * Refuse a database drop that would delete a warehouse root, the data of tables still in
   * it, or files left in its directory: the metastore's CASCADE drops the tables without
   * their data (wherever they are located), then deletes the database directory
   * recursively, whatever it holds (another database's table placed there, say), so nothing
   * would be kept. Engines' clients (Spark, Hive) drop each table first, each drop kept, and
   * reach here with an empty database.
   */
  private void dropDatabase(Database d, PreEventContext event)
      throws java.io.IOException, MetaException {
    Cmroot.Settings s = Drops.settings(getConf());
    String loc = Drops.place(d.getLocationUri());
    refuse(loc, s, "DROP DATABASE " + d.getName() + " located at");
    if (!s.enabled) {
      return;
    }
    List<String> tables = Drops.tables(event, d.getName());
    if (!tables.isEmpty()) {
      throw new MetaException("cmroot refuses DROP DATABASE " + d.getName() + " while it "
          + "holds tables (" + String.join(", ", tables.subList(0, Math.min(5,
          tables.size()))) + (tables.size() > 5 ? ", ..." : "") + "): a CASCADE drop in the "
          + "metastore deletes their data with the database directory, unkept. Nothing was "
          + "dropped. Drop the tables first (DROP TABLE keeps their files), or drop the "
          + "database from Spark or Hive, whose clients do so.");
    }
    if (Cmroot.protectedLocation(loc, s)) {
      List<String> left = Cmroot.dataFiles(loc, true, null, getConf());
      if (!left.isEmpty()) {
        throw new MetaException("cmroot refuses DROP DATABASE " + d.getName() + ": its "
            + "directory " + loc + " still holds data files (" + left.get(0)
            + (left.size() > 1 ? " and " + (left.size() - 1) + " more" : "") + "), which the "
            + "metastore would delete with it, unkept: another database's table located "
            + "there, or files no table owns. Nothing was dropped. Move them out, or drop "
            + "their table, first.");
      }
    }
  }

  private void dropTable(Table t, PreEventContext event)
      throws Cmroot.RecycleException, MetaException {
    Cmroot.Settings s = Drops.settings(getConf());
    String loc = Drops.location(t);
    refuse(loc, s, "DROP TABLE " + Drops.name(t) + " located at");
    if (!s.enabled) {
      return;
    }
    List<String> outside = new ArrayList<>();
    if (t.getPartitionKeysSize() == 0) {
      stageInStatement(s, t, loc, outside);
      return;
    }
    for (Partition p : Drops.partitions(event, t)) {
      String dir = Drops.location(t, p);
      Cmroot.refuseAlias(dir, s, "DROP TABLE " + Drops.name(t) + ", whose partition "
          + p.getValues() + " is located at");
      if (dir != null && (loc == null || !Cmroot.under(dir, loc))) {
        Cmroot.refuseRootRemoval(dir, s, "DROP TABLE " + Drops.name(t) + ", whose partition "
            + p.getValues() + " is located at");
        outside.add(dir);
      }
    }
    if (!outside.isEmpty()) {
      Call.get().planPartitionDirs(Drops.dropKey(t, null), outside);
    }
    stageInStatement(s, t, loc, outside);
  }

  /**
   * Inside an engine's statement (Spark's embedded metastore), the table's data is staged
   * now as well, before the metastore changes anything: a file written into the directory
   * meanwhile (after the transactional listener's last look) would reach Spark's file
   * system hook only from the metastore's delete, after the drop was committed, where a
   * refusal could no longer undo it. The transactional listener stages what came since.
   */
  private void stageInStatement(Cmroot.Settings s, Table t, String loc, List<String> outside)
      throws MetaException {
    Statement st = Statement.Registry.current();
    if (st == null || t.getSd() == null) {
      return;
    }
    List<String> dirs = new ArrayList<>();
    dirs.add(loc);
    dirs.addAll(outside);
    Boolean purge = st.purgeOf(t.getDbName(), t.getTableName());
    String auto = t.getParameters() == null ? null : t.getParameters().get("auto.purge");
    try {
      Stage.stage(getConf(), s, t, java.util.Collections.singletonList(Drops.dropKey(t, null)),
          java.util.Collections.<java.util.Map<String, String>>emptyList(), dirs, outside,
          "table " + Drops.name(t), "DROP_TABLE",
          Boolean.TRUE.equals(purge) || "true".equalsIgnoreCase(auto));
    } catch (java.io.IOException e) {
      throw Drops.metaException(e);
    }
  }
}
