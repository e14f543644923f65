package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import io.cmroot.metastore.CmrootPreEventListener;
import io.cmroot.metastore.CmrootTransactionalListener;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import org.apache.hadoop.hive.conf.HiveConf;
import org.apache.hadoop.hive.metastore.HiveMetaStoreClient;
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
 * only the cmroot metastore plugin ({@code cmroot metastore-conf}) can keep it, and Spark
 * drops tables where no statement of its own is seen (a DataFrame {@code saveAsTable} in
 * overwrite mode). So with a remote metastore the hook runs only when the application
 * declares the plugin ({@code spark.cmroot.metastorePlugin=true}) and the metastore confirms
 * it runs it; otherwise every statement is refused, saying what to install, rather than a
 * drop going ahead unkept. Spark's hook keeps what only Spark does: overwrites, truncates,
 * loads, plain file deletes, and the up-front staging of a multi-partition drop.
 */
final class RemoteMetastore {
  // The metastores (by URIs) that confirmed they run the plugin.
  private static final Map<String, Boolean> CONFIRMED = new ConcurrentHashMap<>();

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

  /**
   * Refuse `plan` (any statement) when this application's metastore is remote and does not
   * keep drops: declared by spark.cmroot.metastorePlugin, confirmed by the metastore's own
   * listener settings.
   */
  static void refuseUnprotected(SparkSession session, LogicalPlan plan, Cmroot.Settings s) {
    String uris = s.enabled ? uris(session) : null;
    if (uris == null) {
      return;
    }
    String why;
    if (!Boolean.parseBoolean(Cmroot.conf(null, "metastorePlugin", "false"))) {
      why = "spark.cmroot.metastorePlugin is not set";
    } else if (!confirmed(session, uris, deletesInMetastore(plan))) {
      why = "spark.cmroot.metastorePlugin=true, but the metastore's hive.metastore.*listeners"
          + " do not name the cmroot plugin";
    } else {
      return;
    }
    throw new IllegalStateException("cmroot refuses " + plan.nodeName() + ": this "
        + "application's metastore is remote (hive.metastore.uris=" + uris + ") and " + why
        + ". A remote metastore deletes the data of a drop in its own process (DROP TABLE, "
        + "DROP PARTITION, a saveAsTable overwrite), where only the cmroot metastore plugin "
        + "can keep it. Nothing was run. Install the plugin in that metastore (`cmroot "
        + "metastore-conf` prints its hive-site.xml settings), then start this application "
        + "with spark.cmroot.metastorePlugin=true (`cmroot spark-conf --metastore-plugin`); "
        + "or run it with spark.cmroot.enabled=false.");
  }

  /**
   * Does the metastore run the plugin? Asked afresh before each drop (a metastore restarted
   * without it must not drop unkept); for other statements a yes is kept, a no asked again.
   */
  private static boolean confirmed(SparkSession session, String uris, boolean fresh) {
    if (!fresh && CONFIRMED.containsKey(uris)) {
      return true;
    }
    boolean yes = runsPlugin(session);
    if (yes) {
      CONFIRMED.put(uris, Boolean.TRUE);
    } else {
      CONFIRMED.remove(uris);
    }
    return yes;
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

  /** Does the metastore list the plugin's listeners in its own settings? */
  private static boolean runsPlugin(SparkSession session) {
    HiveMetaStoreClient client = null;
    try {
      client = new HiveMetaStoreClient(new HiveConf(session.sparkContext().hadoopConfiguration(),
          HiveConf.class));
      String pre = client.getConfigValue("hive.metastore.pre.event.listeners", "");
      String tx = client.getConfigValue("hive.metastore.transactional.event.listeners", "");
      return pre.contains(CmrootPreEventListener.class.getName())
          && tx.contains(CmrootTransactionalListener.class.getName());
    } catch (Exception e) {
      Cmroot.LOG.error("cmroot: cannot ask the metastore whether it runs the cmroot plugin: "
          + "{}", e.toString());
      return false;
    } finally {
      if (client != null) {
        client.close();
      }
    }
  }
}
