package io.cmroot.spark;

import io.cmroot.metastore.Drops;
import io.cmroot.core.Cmroot;
import io.cmroot.core.CmrootFaults;
import java.io.File;
import java.io.IOException;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
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
import org.apache.spark.sql.util.PartitioningUtils;
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
    String tableLoc = Cmroot.where(table.location());
    List<String> columns = CollectionConverters.asJava(table.partitionColumnNames());
    boolean purge = cmd.purge() || "true".equalsIgnoreCase(
        table.properties().getOrElse("auto.purge", () -> "false"));
    List<String> paths = new ArrayList<>();
    List<Map<String, String>> parts = new ArrayList<>();
    List<String> keys = new ArrayList<>();
    for (scala.collection.immutable.Map<String, String> spec
        : CollectionConverters.asJava(cmd.specs())) {
      scala.collection.immutable.Map<String, String> normalized = normalize(session, table, spec);
      if (normalized == null) {
        return; // not a partition column: the command itself says so
      }
      for (CatalogTablePartition p : matching(catalog, qualified, normalized)) {
        String loc = Cmroot.where(p.location());
        Cmroot.refuseRootRemoval(loc, s, "the drop of partition");
        if (!Cmroot.protectedLocation(loc, s) || !Cmroot.holdsFiles(loc, Cmroot.hadoop())) {
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
        keys.add(Drops.dropKey(db, qualified.table(), values));
      }
    }
    if (paths.isEmpty()) {
      return;
    }
    String what = "partitions " + parts + " of " + db + "." + id.table();
    if (st.prepare(paths, "DROP_PARTITION", db, id.table(), purge, parts,
        Cmroot.protectedLocation(tableLoc, s) ? tableLoc : null, what)) {
      keys.forEach(st::markStaged);
      CmrootFaults.afterPrepare(null, "the drop of " + what);
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
   * The partitions `spec` (as normalized) names: what the drop or truncate will find, as it
   * asks the catalog the same question. A partition missed here would be staged only when
   * the metastore reaches it, after earlier ones had already left the catalog; one matched
   * here that the statement does not remove would lose its files.
   */
  static List<CatalogTablePartition> matching(SessionCatalog catalog,
      TableIdentifier qualified, scala.collection.immutable.Map<String, String> spec) {
    return CollectionConverters.asJava(catalog.listPartitions(qualified, Option.apply(spec)));
  }

  /**
   * `spec` as the command itself normalizes it before it drops or truncates (Spark's own
   * PartitioningUtils.normalizePartitionSpec): keys spelled as the partition columns, values
   * cast to the columns' types and spelled back as text (PARTITION (p='03') of an INT column
   * names p=3, of a DATE column '2024-1-5' names 2024-01-05). Null when Spark refuses it (no
   * such column, a value its type cannot hold): then the command fails by itself.
   */
  static scala.collection.immutable.Map<String, String> normalize(SparkSession session,
      CatalogTable table, scala.collection.immutable.Map<String, String> spec) {
    try {
      return PartitioningUtils.normalizePartitionSpec(spec, table.partitionSchema(),
          table.identifier().quotedString(), session.sessionState().conf().resolver());
    } catch (Exception e) { // AnalysisException (undeclared in Scala) or a failed cast
      return null;
    }
  }
}
