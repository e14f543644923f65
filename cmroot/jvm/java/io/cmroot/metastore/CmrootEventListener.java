package io.cmroot.metastore;

import io.cmroot.core.Cmroot;
import java.io.IOException;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hive.metastore.MetaStoreEventListener;
import org.apache.hadoop.hive.metastore.api.Database;
import org.apache.hadoop.hive.metastore.api.MetaException;
import org.apache.hadoop.hive.metastore.api.Partition;
import org.apache.hadoop.hive.metastore.api.Table;
import org.apache.hadoop.hive.metastore.events.AddPartitionEvent;
import org.apache.hadoop.hive.metastore.events.AlterPartitionEvent;
import org.apache.hadoop.hive.metastore.events.AlterTableEvent;
import org.apache.hadoop.hive.metastore.events.CreateDatabaseEvent;
import org.apache.hadoop.hive.metastore.events.CreateTableEvent;
import org.apache.hadoop.hive.metastore.events.DropDatabaseEvent;
import org.apache.hadoop.hive.metastore.events.DropPartitionEvent;
import org.apache.hadoop.hive.metastore.events.DropTableEvent;

/**
 * The metastore's post-event listener
 * ({@code hive.metastore.event.listeners=io.cmroot.metastore.CmrootEventListener}) that
 * records the non-destructive metadata changes replication replays: databases and tables
 * created, altered and dropped, partitions added, renamed and moved, and drops that held no
 * data (drops with data are recorded by their recycle, which the transactional listener
 * prepared). Only successful changes of tables under the warehouse roots are recorded; data
 * files are sent as paths, the daemon hashes them.
 *
 * <p>What moves or adopts data without deleting any is recorded with the files as they are
 * afterwards, so a replica can rebuild it: a table or partition given a new location is an
 * ALTER_LOCATION listing what that location holds; a renamed partition is an ADD_PARTITION
 * of the new one with its files, then a DROP_PARTITION (metadata only) of the old one; a
 * table created over a directory that already holds data lists those files. For a drop made outside an engine's statement it also settles the call's
 * recycles: committed when the metastore reports success, aborted when it reports a failure
 * (the files are back).
 *
 * <p>These events fire after the metastore committed the change: a failure to record one
 * cannot undo it. With cmroot.failOpen=false the call (or statement) then fails with an
 * error saying so; with failOpen=true it is logged and counted.
 */
public class CmrootEventListener extends MetaStoreEventListener {

  // Table parameters the metastore and Spark keep up to date themselves: an ALTER that only
  // changes these is not a change a replica needs to replay.
  private static final List<String> STATS_PARAMETERS = Arrays.asList("transient_lastDdlTime",
      "numFiles", "numFilesErasureCoded", "totalSize", "numRows", "rawDataSize",
      "COLUMN_STATS_ACCURATE", "last_modified_by", "last_modified_time");
  private static final String SPARK_STATS_PREFIX = "spark.sql.statistics.";

  public CmrootEventListener(Configuration conf) {
    super(conf);
    Drops.configure(conf);
  }

  @Override
  public void onCreateDatabase(CreateDatabaseEvent e) throws MetaException {
    Cmroot.Settings s = Cmroot.settings(getConf());
    if (!e.getStatus() || !s.enabled) {
      return;
    }
    Database d = e.getDatabase();
    Map<String, Object> body = event("CREATE_DATABASE", d.getName(), null);
    String loc = Drops.place(d.getLocationUri());
    if (Cmroot.protectedLocation(loc, s)) {
      body.put("location", loc);
    }
    record(body, s, "database " + d.getName());
  }

  @Override
  public void onDropDatabase(DropDatabaseEvent e) throws MetaException {
    Cmroot.Settings s = Cmroot.settings(getConf());
    if (!e.getStatus() || !s.enabled) {
      return;
    }
    String db = e.getDatabase().getName();
    record(event("DROP_DATABASE", db, null), s, "database " + db);
  }

  @Override
  public void onCreateTable(CreateTableEvent e) throws MetaException {
    Table t = e.getTable();
    Cmroot.Settings s = Cmroot.settings(getConf());
    String loc = location(t);
    if (!e.getStatus() || !Cmroot.protectedLocation(loc, s)) {
      return;
    }
    Statement st = Statement.Registry.current();
    Map<String, Object> insert = st == null ? null
        : st.takeDeferredInsert(t.getDbName(), t.getTableName());
    Map<String, Object> body = event("CREATE_TABLE", t.getDbName(), t.getTableName());
    body.put("location", loc);
    body.put("tableObj", Cmroot.tableMap(t));
    // A table created over data (an external table on a landing directory) holds it from
    // now on: a replica needs those files. A CTAS's own files follow in its INSERT; a
    // partitioned table's data arrives with its partitions (ADD_PARTITION lists theirs).
    boolean adopts = insert == null && t.getPartitionKeysSize() == 0;
    record(body, s, "table " + name(t), adopts ? () -> files(loc, s, getConf()) : null);
    if (insert != null) {
      record(insert, s, "the data written by CREATE TABLE " + name(t) + " AS SELECT");
    }
  }

  @Override
  public void onAlterTable(AlterTableEvent e) throws MetaException {
    Table old = e.getOldTable();
    Table t = e.getNewTable();
    Cmroot.Settings s = Cmroot.settings(getConf());
    String loc = location(t);
    boolean inside = Cmroot.protectedLocation(loc, s);
    // A table moved out of the roots is still news to a replica that holds it.
    if (!e.getStatus() || !(inside || Cmroot.protectedLocation(location(old), s))
        || !replicaVisible(old, t)) {
      return;
    }
    // A new location (not a rename, which takes the data along): what the table holds from
    // now on is what that location holds.
    boolean moved = name(old).equalsIgnoreCase(name(t))
        && !String.valueOf(location(old)).equals(String.valueOf(loc));
    Map<String, Object> body = event(moved ? "ALTER_LOCATION" : "ALTER_TABLE", old.getDbName(),
        old.getTableName());
    String was = location(old);
    if (!name(old).equalsIgnoreCase(name(t)) && Cmroot.protectedLocation(was, s)) {
      // A rename: where the files were (tableObj says where they are now), so that the
      // daemon finds the files of earlier events at their new place (Store.resolve).
      body.put("location", was);
    } else if (inside) {
      body.put("location", loc);
    }
    body.put("tableObj", Cmroot.tableMap(t));
    boolean flat = t.getPartitionKeysSize() == 0;
    // A rename into another database brings the table into that database's scope: its
    // replica takes the table from this event alone, so the event carries all its files.
    boolean crossDb = !old.getDbName().equalsIgnoreCase(t.getDbName());
    record(body, s, "the change of table " + name(old),
        moved ? () -> flat ? files(loc, s, getConf()) : Collections.<String>emptyList() : crossDb ? () -> files(loc, s, getConf()) : null);
  }

  /**
   * A partition renamed (ALTER TABLE ... PARTITION ... RENAME TO PARTITION: the metastore
   * moved its directory) or given a new location. Changes of its statistics only (every
   * insert into an existing partition makes one) are not news to a replica.
   */
  @Override
  public void onAlterPartition(AlterPartitionEvent e) throws MetaException {
    Table t = e.getTable();
    Partition before = e.getOldPartition();
    Partition after = e.getNewPartition();
    Cmroot.Settings s = Cmroot.settings(getConf());
    String loc = location(t);
    if (!e.getStatus() || !Cmroot.protectedLocation(loc, s) || before == null || after == null) {
      return;
    }
    String was = Drops.location(t, before);
    String now = Drops.location(t, after);
    Statement st = Statement.Registry.current();
    String key = Drops.dropKey(t, after.getValues());
    if (!before.getValues().equals(after.getValues())) {
      if (st != null) {
        st.renamedTo(key, now);
      }
      Map<String, Object> add = event("ADD_PARTITION", t.getDbName(), t.getTableName());
      add.put("location", loc);
      add.put("partitions", Collections.singletonList(Drops.spec(t, after)));
      String what = "the rename of partition " + before.getValues() + " of " + name(t);
      // Listed when recorded: at the statement's end, where the files ended up.
      record(add, s, what, () -> {
        String dir = st == null ? now : st.renamedLocation(key);
        add.put("partitionLocations", places(Collections.singletonList(String.valueOf(dir)), s));
        return files(dir, s, getConf());
      });
      Map<String, Object> drop = event("DROP_PARTITION", t.getDbName(), t.getTableName());
      drop.put("location", loc);
      drop.put("partitions", Collections.singletonList(Drops.spec(t, before)));
      record(drop, s, what);
    } else if (!String.valueOf(was).equals(String.valueOf(now))) {
      if (st != null && st.renamedLocation(key) != null) {
        st.renamedTo(key, now); // the rename's own second move
        return;
      }
      Map<String, Object> body = event("ALTER_LOCATION", t.getDbName(), t.getTableName());
      body.put("location", loc);
      body.put("partitions", Collections.singletonList(Drops.spec(t, after)));
      // Null when moved out of the roots: a replica must not take it as emptied.
      body.put("partitionLocations", places(Collections.singletonList(String.valueOf(now)), s));
      body.put("tableObj", Cmroot.tableMap(t));
      record(body, s, "the new location of partition " + after.getValues() + " of " + name(t),
          () -> files(now, s, getConf()));
    }
  }

  /** The data files under `dir`, if it is under the warehouse roots; else none. */
  private static List<String> files(String dir, Cmroot.Settings s,
      org.apache.hadoop.conf.Configuration conf) {
    try {
      return Cmroot.protectedLocation(dir, s) ? Cmroot.dataFiles(dir, true, null, conf)
          : Collections.<String>emptyList();
    } catch (IOException e) {
      throw new java.io.UncheckedIOException(e); // out of record()'s Supplier: see there
    }
  }

  /** Each of `dirs` if it is under the warehouse roots; else null (nothing recorded there). */
  static List<String> places(List<String> dirs, Cmroot.Settings s) {
    List<String> out = new ArrayList<>();
    for (String d : dirs) {
      out.add(Cmroot.protectedLocation(d, s) ? d : null);
    }
    return out;
  }

  @Override
  public void onAddPartition(AddPartitionEvent e) throws MetaException {
    Table t = e.getTable();
    Cmroot.Settings s = Cmroot.settings(getConf());
    String loc = location(t);
    if (!e.getStatus() || !Cmroot.protectedLocation(loc, s)) {
      return;
    }
    List<Map<String, String>> parts = new ArrayList<>();
    List<String> dirs = new ArrayList<>();
    List<String> files = new ArrayList<>();
    Iterator<Partition> it = e.getPartitionIterator();
    while (it.hasNext()) {
      Partition p = it.next();
      parts.add(Drops.spec(t, p));
      String dir = Drops.location(t, p);
      dirs.add(String.valueOf(dir));
      if (Cmroot.protectedLocation(dir, s)) {
        files.addAll(files(dir, s, getConf()));
      }
    }
    if (parts.isEmpty()) {
      return; // MSCK REPAIR with nothing to add still calls the metastore with no partitions
    }
    Map<String, Object> body = event("ADD_PARTITION", t.getDbName(), t.getTableName());
    body.put("location", loc);
    body.put("partitions", parts);
    body.put("partitionLocations", places(dirs, s));
    body.put("files", Cmroot.fileRefs(files));
    record(body, s, "partitions " + parts + " of " + name(t));
  }

  @Override
  public void onDropTable(DropTableEvent e) throws MetaException {
    Table t = e.getTable();
    boolean recycled = settle(Drops.dropKey(t, null), e.getStatus(),
        "the drop of table " + name(t));
    Cmroot.Settings s = Cmroot.settings(getConf());
    String loc = location(t);
    if (!e.getStatus() || recycled || !Cmroot.protectedLocation(loc, s)) {
      return;
    }
    Map<String, Object> body = event("DROP_TABLE", t.getDbName(), t.getTableName());
    body.put("location", loc);
    record(body, s, "the drop of table " + name(t));
  }

  @Override
  public void onDropPartition(DropPartitionEvent e) throws MetaException {
    Table t = e.getTable();
    List<Map<String, String>> parts = new ArrayList<>();
    Iterator<Partition> it = e.getPartitionIterator();
    while (it.hasNext()) {
      Partition p = it.next();
      if (!settle(Drops.dropKey(t, p.getValues()), e.getStatus(),
          "the drop of partition " + p.getValues() + " of " + name(t))) {
        parts.add(Drops.spec(t, p));
      }
    }
    Cmroot.Settings s = Cmroot.settings(getConf());
    String loc = location(t);
    if (!e.getStatus() || parts.isEmpty() || !Cmroot.protectedLocation(loc, s)) {
      return;
    }
    Map<String, Object> body = event("DROP_PARTITION", t.getDbName(), t.getTableName());
    body.put("location", loc);
    body.put("partitions", parts);
    record(body, s, "the drop of partitions " + parts + " of " + name(t));
  }

  /**
   * Settle the recycle of a drop's data: the call's recycles (outside an engine statement)
   * are committed when the drop succeeded, aborted when it failed; one staged by the running
   * statement is the statement's to commit, unless the drop failed. Returns whether the drop's
   * data was staged (its event is then the recycle's, not a metadata-only one).
   */
  private static boolean settle(String key, boolean success, String what) throws MetaException {
    Call call = Call.report(key) ? Call.peek() : null;
    if (call != null) {
      // Settled whether or not this drop staged anything: the call is over, and nothing it
      // announced may be taken for a later call's.
      try {
        call.settle(success, "the metastore could not complete " + what);
      } catch (Cmroot.RecycleException ex) {
        MetaException me = new MetaException(ex.getMessage() + " The metastore DID complete "
            + what + ": the files are back in its directory, outside the catalog.");
        me.initCause(ex);
        throw me;
      }
      if (call.staged(key)) {
        return true;
      }
    }
    Statement st = Statement.Registry.current();
    if (st != null && st.staged(key)) {
      if (!success) {
        st.fail("the metastore could not complete " + what);
      }
      return true;
    }
    return false;
  }

  private static Map<String, Object> event(String type, String db, String table) {
    Map<String, Object> body = new LinkedHashMap<>();
    body.put("eventType", type);
    body.put("db", db);
    if (table != null) {
      body.put("table", table);
    }
    return body;
  }

  /**
   * Record `body` now, or, inside a statement, once its recycles are settled: a replica
   * replays the log in order, so the metadata changes a statement made (the partitions an
   * overwrite added and emptied) follow its INSERT_OVERWRITE and INSERT. They are recorded
   * when the statement fails too: the metastore made them.
   */
  private static void record(Map<String, Object> body, Cmroot.Settings s, String what)
      throws MetaException {
    record(body, s, what, null);
  }

  /** record(body, ...), its "files" listed by `files` at the time it is recorded. */
  private static void record(Map<String, Object> body, Cmroot.Settings s, String what,
      java.util.function.Supplier<List<String>> files) throws MetaException {
    Statement.Action add = () -> {
      if (files != null) {
        try {
          body.put("files", Cmroot.fileRefs(files.get()));
        } catch (java.io.UncheckedIOException u) {
          throw u.getCause(); // a listing that failed: the event is not recorded, saying why
        }
      }
      Cmroot.addEvent(body, s, what);
    };
    Statement st = Statement.Registry.current();
    if (st != null) {
      st.afterEnd(add);
      return;
    }
    try {
      add.run();
    } catch (IOException ex) {
      MetaException me = new MetaException(ex.getMessage());
      me.initCause(ex);
      throw me;
    }
  }

  private static String location(Table t) {
    return Drops.location(t);
  }

  private static String name(Table t) {
    return t.getDbName() + "." + t.getTableName();
  }

  /** Did anything a replica keeps change: name, schema, location, format or user parameters. */
  static boolean replicaVisible(Table old, Table t) {
    return !withoutStats(Cmroot.tableMap(old)).equals(withoutStats(Cmroot.tableMap(t)));
  }

  @SuppressWarnings("unchecked")
  private static Map<String, Object> withoutStats(Map<String, Object> table) {
    Map<String, String> params = (Map<String, String>) table.get("parameters");
    params.keySet().removeIf(k -> STATS_PARAMETERS.contains(k) || k.startsWith(SPARK_STATS_PREFIX));
    return table;
  }
}
