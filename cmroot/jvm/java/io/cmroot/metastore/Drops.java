package io.cmroot.metastore;

import io.cmroot.core.Cmroot;
import io.cmroot.core.Json;
import java.lang.reflect.Method;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hive.metastore.api.EnvironmentContext;
import org.apache.hadoop.hive.metastore.api.FieldSchema;
import org.apache.hadoop.hive.metastore.api.MetaException;
import org.apache.hadoop.hive.metastore.api.NoSuchObjectException;
import org.apache.hadoop.hive.metastore.api.Partition;
import org.apache.hadoop.hive.metastore.api.Table;
import org.apache.hadoop.hive.metastore.events.PreEventContext;

/** What the listeners share about a drop: names, keys, places and the purge flag. */
public final class Drops {
  private Drops() {}

  static Cmroot.Settings settings(Configuration conf) {
    return Cmroot.settings(conf);
  }

  /** Remember the metastore's configuration (each listener does, when constructed). */
  static void configure(Configuration conf) {
    Cmroot.useHadoop(conf);
  }

  /** A location placed as cmroot compares it, resolved through the metastore's Hadoop. */
  static String place(String location) {
    return Cmroot.where(location);
  }

  /** The key of a drop (a table, or one of its partitions by values) within a call. */
  static String dropKey(Table t, List<String> values) {
    return dropKey(t.getDbName(), t.getTableName(), values);
  }

  public static String dropKey(String db, String table, List<String> values) {
    // The values as JSON: joined with a separator, ['a/b', 'c'] and ['a', 'b/c'] would be
    // one key, and one of two dropped partitions taken for the other.
    return Cmroot.tableKey(db, table) + (values == null ? "" : Json.write(values));
  }

  static String name(Table t) {
    return t.getDbName() + "." + t.getTableName();
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

  /** Does the metastore delete this table's data when it drops it (not an external one)? */
  static boolean managed(Table t) {
    String ext = t.getParameters() == null ? null : t.getParameters().get("EXTERNAL");
    return !"EXTERNAL_TABLE".equals(t.getTableType()) && !"TRUE".equalsIgnoreCase(ext);
  }

  /** The table's directory as cmroot places it ({@link Cmroot#place}), or null. */
  static String location(Table t) {
    return t.getSd() == null ? null : place(t.getSd().getLocation());
  }

  /**
   * A partition's directory. Its metastore location is spelt as a URI or as a Hadoop path
   * (see Cmroot.existingLocalPath): the spelling that reads as the partition's default
   * place (k=v/... below the table, escaped as Hive does) wins, since a partition's own
   * value decoded may name another partition's directory.
   */
  static String location(Table t, Partition p) {
    if (p.getSd() == null || p.getSd().getLocation() == null) {
      return null;
    }
    String loc = p.getSd().getLocation();
    String placed = place(loc);
    if (placed != null && !Cmroot.isLocal(placed)) {
      return placed; // another file system: read as Hadoop reads it, one spelling
    }
    String tableDir = location(t);
    if (tableDir != null && p.getValues() != null) {
      try {
        String dflt = Cmroot.localPath(tableDir + "/"
            + org.apache.hadoop.hive.metastore.Warehouse.makePartName(t.getPartitionKeys(),
                p.getValues()));
        String raw = loc.startsWith("file:") ? Cmroot.localPath(loc.substring(5)) : null;
        if (dflt != null && (dflt.equals(Cmroot.localPath(loc)) || dflt.equals(raw))) {
          return dflt;
        }
      } catch (MetaException | RuntimeException e) {
        // no default place to compare with: read the location alone
      }
    }
    return Cmroot.existingLocalPath(loc);
  }


  /**
   * Whether the drop purges, as the metastore decides it for its own delete: the call's
   * "ifPurge" (DROP ... PURGE), else the table's auto.purge parameter.
   */
  static boolean purge(EnvironmentContext env, Table t) {
    Map<String, String> props = env == null ? null : env.getProperties();
    if (props != null && "true".equalsIgnoreCase(props.get("ifPurge"))) {
      return true;
    }
    String auto = t.getParameters() == null ? null : t.getParameters().get("auto.purge");
    return "true".equalsIgnoreCase(auto);
  }

  /**
   * The table's partitions, read from the metastore's store in the call's own transaction
   * (no nested call, so no events): by reflection, as the store's API differs between Hive
   * 2 and 3 (3 adds a catalog name). Refuses the drop when they cannot be read: its own
   * locations would be deleted unkept.
   */
  static List<Partition> partitions(PreEventContext event, Table t) throws MetaException {
    try {
      Object ms = store(event);
      Object got;
      try {
        Method m = ms.getClass().getMethod("getPartitions", String.class, String.class,
            int.class);
        got = m.invoke(ms, t.getDbName(), t.getTableName(), -1);
      } catch (NoSuchMethodException e) {
        Method m = ms.getClass().getMethod("getPartitions", String.class, String.class,
            String.class, int.class);
        String cat = (String) t.getClass().getMethod("getCatName").invoke(t);
        got = m.invoke(ms, cat == null ? "hive" : cat, t.getDbName(), t.getTableName(), -1);
      }
      List<Partition> out = new ArrayList<>();
      for (Object o : (List<?>) got) {
        out.add((Partition) o);
      }
      return out;
    } catch (ReflectiveOperationException | RuntimeException e) {
      Throwable cause = e instanceof java.lang.reflect.InvocationTargetException
          ? e.getCause() : e;
      MetaException me = new MetaException("cmroot cannot list the partitions of "
          + name(t) + " that DROP TABLE deletes (" + cause + "): nothing was dropped");
      me.initCause(cause);
      throw me;
    }
  }

  /** The names of the database's tables, read like {@link #partitions}. */
  static List<String> tables(PreEventContext event, String db) throws MetaException {
    try {
      Object ms = store(event);
      Object got;
      try {
        got = ms.getClass().getMethod("getAllTables", String.class).invoke(ms, db);
      } catch (NoSuchMethodException e) {
        got = ms.getClass().getMethod("getAllTables", String.class, String.class)
            .invoke(ms, "hive", db);
      }
      List<String> out = new ArrayList<>();
      for (Object o : (List<?>) got) {
        out.add(String.valueOf(o));
      }
      return out;
    } catch (ReflectiveOperationException | RuntimeException e) {
      Throwable cause = e instanceof java.lang.reflect.InvocationTargetException
          ? e.getCause() : e;
      MetaException me = new MetaException("cmroot cannot list the tables of database " + db
          + " before its drop (" + cause + "): nothing was dropped");
      me.initCause(cause);
      throw me;
    }
  }

  /**
   * Is the partition gone from the catalog in the call's transaction (the metastore dropped
   * it)? Read like {@link #partitions}; a partition that cannot be looked up counts as live.
   */
  static boolean dropped(Object event, Table t, Partition p) {
    try {
      Object ms = store(event);
      try {
        ms.getClass().getMethod("getPartition", String.class, String.class, List.class)
            .invoke(ms, t.getDbName(), t.getTableName(), p.getValues());
      } catch (NoSuchMethodException e) {
        ms.getClass().getMethod("getPartition", String.class, String.class, String.class,
            List.class).invoke(ms, "hive", t.getDbName(), t.getTableName(), p.getValues());
      }
      return false;
    } catch (java.lang.reflect.InvocationTargetException e) {
      return e.getCause() instanceof NoSuchObjectException;
    } catch (ReflectiveOperationException | RuntimeException e) {
      return false;
    }
  }

  /** The metastore's store (RawStore) of the call, in its transaction. */
  private static Object store(Object event) throws ReflectiveOperationException {
    // getHandler()'s declared type differs between Hive 2 and 3: called by name.
    Object handler = event.getClass().getMethod("getHandler").invoke(event);
    return handler.getClass().getMethod("getMS").invoke(handler);
  }

  /** `ex` as the metastore's error: the call fails with cmroot's message. */
  static MetaException metaException(Exception ex) {
    String msg = ex instanceof Cmroot.RecycleException || ex.getMessage() != null
        && ex.getMessage().startsWith("cmroot") ? ex.getMessage() : "cmroot: " + ex;
    MetaException me = new MetaException(msg);
    me.initCause(ex);
    return me;
  }
}
