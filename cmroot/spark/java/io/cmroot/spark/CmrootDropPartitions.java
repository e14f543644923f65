package io.cmroot.spark;

import java.io.File;
import java.io.IOException;
import java.math.BigDecimal;
import java.math.RoundingMode;
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
import org.apache.spark.sql.types.ByteType;
import org.apache.spark.sql.types.DecimalType;
import org.apache.spark.sql.types.DoubleType;
import org.apache.spark.sql.types.FloatType;
import org.apache.spark.sql.types.IntegerType;
import org.apache.spark.sql.types.LongType;
import org.apache.spark.sql.types.ShortType;
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
        if (!Cmroot.protectedLocation(loc, s) || !Cmroot.holdsFiles(new File(loc).toPath())) {
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
        Cmroot.protectedLocation(tableLoc, s) ? tableLoc : null, what)) {
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
   * The partitions `spec` names, as the drop will find them: for a full spec, the
   * metastore's match of the values as Spark reads them for the columns' types (PARTITION (p='03') of an INT column drops p=3, which a match of the
   * text "03" misses; p=3 does not drop a partition stored as "03", which a comparison of
   * numbers would take). A partition missed here would be staged only when the metastore
   * reaches it, after earlier ones had already left the catalog; one matched here that the
   * drop does not remove would lose its files. A partial spec is matched as written only, as
   * Spark matches it.
   */
  static List<CatalogTablePartition> matching(SessionCatalog catalog,
      CatalogTable table, TableIdentifier qualified,
      scala.collection.immutable.Map<String, String> spec) {
    scala.collection.immutable.Map<String, String> typed =
        spec.size() < table.partitionColumnNames().size() ? null : typed(table, spec);
    return CollectionConverters.asJava(
        catalog.listPartitions(qualified, Option.apply(typed == null ? spec : typed)));
  }

  /**
   * `spec` with each value spelled as Spark spells the column type's value it casts the text
   * to ("03" of an INT is "3", "1.50" of a DOUBLE "1.5"); null values stay null. Null when
   * a value is no value of its type: then only the spec as written can match.
   */
  @SuppressWarnings("unchecked") // Map.updated's Scala signature reaches Java as a raw Map
  private static scala.collection.immutable.Map<String, String> typed(CatalogTable table,
      scala.collection.immutable.Map<String, String> spec) {
    scala.collection.immutable.Map<String, String> out = spec;
    for (scala.Tuple2<String, String> kv : CollectionConverters.asJava(spec.toList())) {
      String v = kv._2();
      if (v == null) {
        continue;
      }
      DataType t = type(table, kv._1());
      String text;
      try {
        if (t instanceof ByteType || t instanceof ShortType || t instanceof IntegerType
            || t instanceof LongType) {
          text = new BigDecimal(v.trim()).toBigIntegerExact().toString();
        } else if (t instanceof DoubleType) {
          text = Double.toString(Double.parseDouble(v.trim()));
        } else if (t instanceof FloatType) {
          text = Float.toString(Float.parseFloat(v.trim()));
        } else if (t instanceof DecimalType) {
          text = new BigDecimal(v.trim())
              .setScale(((DecimalType) t).scale(), RoundingMode.HALF_UP).toPlainString();
        } else {
          text = v;
        }
      } catch (NumberFormatException | ArithmeticException e) {
        return null;
      }
      out = out.updated(kv._1(), text);
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
