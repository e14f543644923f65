package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.atomic.AtomicBoolean;
import org.apache.hadoop.conf.Configuration;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.catalyst.plans.logical.Command;
import org.apache.spark.sql.catalyst.plans.logical.LogicalPlan;
import org.apache.spark.sql.execution.command.LoadDataCommand;
import scala.jdk.javaapi.CollectionConverters;

/**
 * Warehouse roots on another file system than the local one (hdfs://, s3a://, abfs://...).
 * Where that scheme's file system is cmroot's hook for it (`cmroot spark-conf --scheme`,
 * {@link SchemeHook}), Spark's deletes there are kept like local ones, but for LOAD DATA,
 * which is refused there. Where it is not, Spark deletes the data of drops, overwrites and
 * truncates through a file system cmroot does not see, so every command (anything that can
 * write or drop; queries still run) is refused instead, saying so, unless the application
 * fails open, which logs it once and runs unprotected.
 */
final class ForeignRoots {
  private static final AtomicBoolean WARNED = new AtomicBoolean();

  private ForeignRoots() {}

  static void refuse(SparkSession session, LogicalPlan plan, Cmroot.Settings s) {
    if (!s.enabled || s.foreignRoots.isEmpty() || !writes(plan)) {
      return;
    }
    Configuration conf = session.sparkContext().hadoopConfiguration();
    Cmroot.useHadoop(conf);
    List<String> bare = new ArrayList<>();
    for (String root : s.foreignRoots) {
      if (!hooked(root, conf)) {
        bare.add(root);
      }
    }
    if (bare.isEmpty()) {
      refuseLoads(session, plan, s);
      return;
    }
    String msg = "the warehouse roots " + bare + " are on file systems whose deletes cmroot"
        + " does not see (no cmroot hook for their schemes): a drop or overwrite there would "
        + "delete its data unkept";
    if (s.failOpen) {
      if (WARNED.compareAndSet(false, true)) {
        Cmroot.LOG.error("cmroot: {}; spark.cmroot.failOpen=true: running unprotected", msg);
      }
      return;
    }
    throw new IllegalStateException("cmroot refuses " + plan.nodeName() + ": " + msg
        + ". Nothing was run. Start the application with the conf `cmroot spark-conf --scheme "
        + "SCHEME` prints for each of those schemes, keep the warehouse roots "
        + "(spark.cmroot.warehouseRoots, else spark.sql.warehouse.dir) on local paths, or "
        + "start it with spark.cmroot.failOpen=true to run unprotected.");
  }

  /** Is the file system Spark uses for `root` cmroot's hook of its scheme? */
  private static boolean hooked(String root, Configuration conf) {
    try {
      return new org.apache.hadoop.fs.Path(root).getFileSystem(conf)
          instanceof Cmroot.RawDeletes;
    } catch (java.io.IOException | RuntimeException e) {
      return false; // no file system for it here: nothing to route deletes through
    }
  }

  /**
   * LOAD DATA moving files into or out of a root on another file system: not kept there
   * (the file system hook keeps deletes and replaced files, not a load's moves), refused.
   */
  private static void refuseLoads(SparkSession session, LogicalPlan plan, Cmroot.Settings s) {
    if (plan instanceof LoadDataCommand) {
      LoadDataCommand c = (LoadDataCommand) plan;
      Ctx ctx = CmrootCommands.contextOf(plan, session);
      String from = c.isLocal() ? null : Cmroot.where(c.path());
      for (String at : new String[] {ctx == null ? null : ctx.location, from}) {
        if (at != null && !Cmroot.isLocal(at) && Cmroot.protectedLocation(at, s)) {
          throw new IllegalStateException("cmroot refuses LOAD DATA into "
              + c.table().unquotedString() + ": " + at + " is on " + Cmroot.scheme(at)
              + "://, where cmroot keeps deletes and replaced files but not a load's moves. "
              + "Nothing was loaded. Write the data with INSERT ... SELECT instead.");
        }
      }
    }
    for (LogicalPlan child : CollectionConverters.asJava(plan.children())) {
      refuseLoads(session, child, s);
    }
  }

  /** Does the plan hold a command (a write, drop, truncate, load, alter...)? */
  private static boolean writes(LogicalPlan plan) {
    if (plan instanceof Command) {
      return true;
    }
    for (LogicalPlan child : CollectionConverters.asJava(plan.children())) {
      if (writes(child)) {
        return true;
      }
    }
    return false;
  }
}
