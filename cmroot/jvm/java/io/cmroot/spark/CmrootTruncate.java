package io.cmroot.spark;

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
import org.apache.spark.sql.catalyst.catalog.CatalogTable;
import org.apache.spark.sql.catalyst.catalog.CatalogTablePartition;
import org.apache.spark.sql.catalyst.catalog.SessionCatalog;
import org.apache.spark.sql.execution.command.TruncateTableCommand;
import scala.Option;
import scala.jdk.javaapi.CollectionConverters;

/**
 * The data files a {@code TRUNCATE TABLE} empties, staged in one prepare request before the
 * command deletes anything. The command deletes (and re-creates) one partition directory at a
 * time: staged per directory, a truncate of a table of many partitions would cost one daemon
 * round trip per partition. The directories stay, so the command finds them as it expects
 * (it keeps their permissions) and its deletes find nothing left to keep.
 */
final class CmrootTruncate {
  private CmrootTruncate() {}

  static void stage(SparkSession session, TruncateTableCommand cmd, CmrootStatement st,
      Cmroot.Settings s) throws IOException {
    SessionCatalog catalog = session.sessionState().catalog();
    TableIdentifier id = cmd.tableName();
    CatalogTable table = CmrootDropPartitions.managedTable(catalog, id);
    if (table == null) {
      return; // the command refuses a missing or external table, or a view
    }
    TableIdentifier qualified = table.identifier();
    String db = qualified.database().get();
    String tableLoc = Cmroot.where(table.location());
    List<String> columns = CollectionConverters.asJava(table.partitionColumnNames());
    List<String> dirs = new ArrayList<>();
    List<Map<String, String>> parts = new ArrayList<>();
    if (columns.isEmpty()) {
      dirs.add(tableLoc);
    } else {
      Option<scala.collection.immutable.Map<String, String>> spec = cmd.partitionSpec();
      List<CatalogTablePartition> found;
      if (spec.isDefined()) {
        scala.collection.immutable.Map<String, String> normalized =
            CmrootDropPartitions.normalize(session, table, spec.get());
        if (normalized == null) {
          return; // not a partition column: the command itself says so
        }
        found = CmrootDropPartitions.matching(catalog, qualified, normalized);
      } else {
        found = CollectionConverters.asJava(catalog.listPartitions(qualified, Option.empty()));
      }
      for (CatalogTablePartition p : found) {
        dirs.add(Cmroot.where(p.location()));
        Map<String, String> kv = new LinkedHashMap<>();
        for (String c : columns) {
          kv.put(c, p.spec().getOrElse(c, () -> null));
        }
        parts.add(kv);
      }
    }
    List<String> files = new ArrayList<>();
    List<Map<String, String>> emptied = new ArrayList<>();
    for (int i = 0; i < dirs.size(); i++) {
      String dir = dirs.get(i);
      if (dir == null) {
        continue;
      }
      Cmroot.refuseRootRemoval(dir, s, "TRUNCATE TABLE " + db + "." + id.table() + " of");
      if (!Cmroot.protectedLocation(dir, s)) {
        continue;
      }
      List<String> in = Cmroot.filesUnder(dir);
      files.addAll(in);
      if (!in.isEmpty() && !parts.isEmpty()) {
        emptied.add(parts.get(i));
      }
    }
    if (files.isEmpty()) {
      return;
    }
    String what = "TRUNCATE TABLE " + db + "." + id.table();
    if (st.prepare(files, "TRUNCATE", db, id.table(), false, emptied,
        Cmroot.protectedLocation(tableLoc, s) ? tableLoc : null, what)) {
      CmrootFaults.afterPrepare(null, what);
    }
  }
}
