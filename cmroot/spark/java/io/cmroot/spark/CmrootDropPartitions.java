package io.cmroot.spark;

import java.io.File;
import java.io.IOException;
import java.math.BigDecimal;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.catalyst.TableIdentifier;
import org.apache.spark.sql.catalyst.analysis.NoSuchNamespaceException;
import org.apache.spark.sql.catalyst.analysis.NoSuchTableException;
import org.apache.spark.sql.catalyst.catalog.CatalogTable;
import org.apache.spark.sql.catalyst.catalog.CatalogTablePartition;
import org.apache.spark.sql.catalyst.catalog.CatalogTableType;
import org.apache.spark.sql.catalyst.catalog.SessionCatalog;
import org.apache.spark.sql.execution.command.AlterTableDropPartitionCommand;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.NumericType;
import org.apache.spark.sql.types.StructField;
import scala.Option;
import scala.jdk.javaapi.CollectionConverters;

/**
 * The data of every partition an {@code ALTER TABLE ... DROP PARTITION} names, staged in one
 * prepare request before the metastore drops any of them. The metastore drops partitions one
 * call (and one metastore transaction) at a time: if the data were staged per call, a
 * partition the daemon refuses would be found after the earlier ones had left the catalog.
 * Staged together, a refusal leaves every partition, data and catalog entry, as it was.
 */
final class CmrootDropPartitions {
  private CmrootDropPartitions() {}

  static void stage(SparkSession session, AlterTableDropPartitionCommand cmd, CmrootStatement st,
      Cmroot.Settings s) throws IOException {
    if (cmd.retainData()) {
      return;
    }
    SessionCatalog catalog = session.sessionState().catalog();
    TableIdentifier id = cmd.tableName();
    CatalogTable table = managedTable(catalog, id);
    if (table == null) {
      return; // the metastore keeps an external table's data; a missing one: the command says so
    }
    TableIdentifier qualified = table.identifier();
    String db = qualified.database().get();
    String tableLoc = Cmroot.localPath(String.valueOf(table.location()));
    List<String> columns = CollectionConverters.asJava(table.partitionColumnNames());
    boolean purge = cmd.purge() || "true".equalsIgnoreCase(
        table.properties().getOrElse("auto.purge", () -> "false"));
    List<String> paths = new ArrayList<>();
    List<Map<String, String>> parts = new ArrayList<>();
    List<String> keys = new ArrayList<>();
    for (scala.collection.immutable.Map<String, String> spec
        : CollectionConverters.asJava(cmd.specs())) {
      scala.collection.immutable.Map<String, String> normalized = normalize(spec, columns);
      if (normalized == null) {
        return; // not a partition column: the command itself says so
      }
      for (CatalogTablePartition p : matching(catalog, table, qualified, normalized)) {
        String loc = Cmroot.localPath(String.valueOf(p.location()));
        Cmroot.refuseRootRemoval(loc, s, "the drop of partition");
        if (!Cmroot.protectedPath(loc, s) || !Cmroot.holdsFiles(new File(loc).toPath())) {
          continue;
        }
        Map<String, String> kv = new LinkedHashMap<>();
        List<String> values = new ArrayList<>();
        for (String c : columns) {
          String v = p.spec().getOrElse(c, () -> null);
          kv.put(c, v);
          values.add(v);
        }
        paths.addAll(Cmroot.contents(loc));
        parts.add(kv);
        keys.add(CmrootMetastoreListener.dropKey(db, qualified.table(), values));
      }
    }
    if (paths.isEmpty()) {
      return;
    }
    String what = "partitions " + parts + " of " + db + "." + id.table();
    if (st.prepare(paths, "DROP_PARTITION", db, id.table(), purge, parts,
        Cmroot.protectedPath(tableLoc, s) ? tableLoc : null, what)) {
      keys.forEach(st::markStaged);
      CmrootFaults.afterPrepare("the drop of " + what);
    }
  }

  /**
   * The managed table `id` names (qualified by the session's database), or null when there is
   * none or it is external or a view: then the command itself refuses, or deletes no data.
   */
  static CatalogTable managedTable(SessionCatalog catalog, TableIdentifier id) {
    String db = id.database().isDefined() ? id.database().get() : catalog.getCurrentDatabase();
    CatalogTable table;
    try {
      table = catalog.getTableMetadata(new TableIdentifier(id.table(), Option.apply(db)));
    } catch (NoSuchTableException | NoSuchNamespaceException e) {
      return null;
    }
    return table.tableType() == CatalogTableType.MANAGED() ? table : null;
  }

  /**
   * The partitions `spec` names, as the drop will find them: the metastore's match of the
   * spec as written, else the spec's values compared as the columns' numbers (Spark drops
   * PARTITION (p='03') of an INT column as p=3, which a match of the text "03" misses; a
   * partition missed here would be staged only when the metastore reaches it, after earlier
   * ones had already left the catalog).
   */
  static List<CatalogTablePartition> matching(SessionCatalog catalog,
      CatalogTable table, TableIdentifier qualified,
      scala.collection.immutable.Map<String, String> spec) {
    List<CatalogTablePartition> exact = CollectionConverters.asJava(
        catalog.listPartitions(qualified, Option.apply(spec)));
    if (!exact.isEmpty() || spec.size() < table.partitionColumnNames().size()) {
      return exact; // a partial spec Spark matches as written: no match is a no-op there too
    }
    List<CatalogTablePartition> out = new ArrayList<>();
    for (CatalogTablePartition p : CollectionConverters.asJava(
        catalog.listPartitions(qualified, Option.empty()))) {
      boolean all = true;
      for (scala.Tuple2<String, String> kv : CollectionConverters.asJava(spec.toList())) {
        String have = p.spec().getOrElse(kv._1(), () -> null);
        all &= have != null && sameValue(kv._2(), have, type(table, kv._1()));
      }
      if (all) {
        out.add(p);
      }
    }
    return out;
  }

  private static DataType type(CatalogTable table, String column) {
    for (StructField f : table.partitionSchema().fields()) {
      if (f.name().equalsIgnoreCase(column)) {
        return f.dataType();
      }
    }
    return DataTypes.StringType;
  }

  /** Do `a` and `b` name the same value of a column of type `t`? */
  private static boolean sameValue(String a, String b, DataType t) {
    if (t instanceof NumericType) {
      try {
        return new BigDecimal(a.trim()).compareTo(new BigDecimal(b.trim())) == 0;
      } catch (NumberFormatException e) {
        return false;
      }
    }
    return a.equals(b);
  }

  /** `spec` with its keys spelled as the table's partition columns; null if one is not. */
  @SuppressWarnings("unchecked") // Map.updated's Scala signature reaches Java as a raw Map
  static scala.collection.immutable.Map<String, String> normalize(
      scala.collection.immutable.Map<String, String> spec, List<String> columns) {
    scala.collection.immutable.Map<String, String> out = scala.collection.immutable.Map$.MODULE$
        .empty();
    for (scala.Tuple2<String, String> kv : CollectionConverters.asJava(spec.toList())) {
      String column = null;
      for (String c : columns) {
        if (c.toLowerCase(Locale.ROOT).equals(kv._1().toLowerCase(Locale.ROOT))) {
          column = c;
        }
      }
      if (column == null) {
        return null;
      }
      out = out.updated(column, kv._2());
    }
    return out;
  }
}
