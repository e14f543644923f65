package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.catalyst.plans.logical.DropNamespace;
import org.apache.spark.sql.catalyst.plans.logical.DropTable;
import org.apache.spark.sql.catalyst.plans.logical.LogicalPlan;
import org.apache.spark.sql.execution.command.AlterTableDropPartitionCommand;
import org.apache.spark.sql.execution.command.DropDatabaseCommand;
import org.apache.spark.sql.execution.command.DropTableCommand;

/**
 * Spark over a remote (standalone) Hive metastore ({@code hive.metastore.uris}): there the
 * metastore itself deletes a dropped table's or partition's data, in its own process, where
 * only the cmroot metastore plugin ({@code cmroot metastore-conf}) can keep it. Spark's hook
 * then leaves drops to the plugin (one unit per metastore call) and keeps what only Spark
 * does: overwrites, truncates, loads and plain file deletes. Declared with
 * {@code spark.cmroot.metastorePlugin=true}; without it such drops are refused rather than
 * left unprotected.
 */
final class RemoteMetastore {
  private RemoteMetastore() {}

  /** The metastore's URIs when this session's catalog is a remote Hive metastore; else null. */
  static String uris(SparkSession session) {
    if (!"hive".equals(session.sparkContext().conf().get("spark.sql.catalogImplementation",
        "in-memory"))) {
      return null;
    }
    String uris = session.sparkContext().hadoopConfiguration().get("hive.metastore.uris");
    return uris == null || uris.trim().isEmpty() ? null : uris.trim();
  }

  /** Does the remote metastore run the cmroot plugin (as the application declares)? */
  static boolean pluginProtects(SparkSession session) {
    return uris(session) != null
        && Boolean.parseBoolean(Cmroot.conf(null, "metastorePlugin", "false"));
  }

  /** Is `plan` a drop whose data the metastore deletes? */
  static boolean deletesInMetastore(LogicalPlan plan) {
    if (plan instanceof DropTableCommand || plan instanceof DropTable) {
      return true;
    }
    if (plan instanceof AlterTableDropPartitionCommand) {
      return !((AlterTableDropPartitionCommand) plan).retainData();
    }
    if (plan instanceof DropDatabaseCommand) {
      return ((DropDatabaseCommand) plan).cascade();
    }
    return plan instanceof DropNamespace && ((DropNamespace) plan).cascade();
  }

  /** Refuse `plan` when the remote metastore would delete its data unkept. */
  static void refuseUnprotected(SparkSession session, LogicalPlan plan, Cmroot.Settings s) {
    if (!s.enabled || !deletesInMetastore(plan)) {
      return;
    }
    String uris = uris(session);
    if (uris == null || pluginProtects(session)) {
      return;
    }
    throw new IllegalStateException("cmroot refuses " + plan.nodeName() + ": this "
        + "application's metastore is remote (hive.metastore.uris=" + uris + "), and a remote "
        + "metastore deletes the data of a drop in its own process, where Spark's hook cannot "
        + "keep it. Nothing was dropped. Install the cmroot plugin in that metastore (`cmroot "
        + "metastore-conf` prints its hive-site.xml settings), then start this application "
        + "with spark.cmroot.metastorePlugin=true (`cmroot spark-conf --metastore-plugin`).");
  }
}
