package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import java.util.concurrent.atomic.AtomicBoolean;
import org.apache.spark.sql.catalyst.plans.logical.Command;
import org.apache.spark.sql.catalyst.plans.logical.LogicalPlan;
import scala.jdk.javaapi.CollectionConverters;

/**
 * Warehouse roots on another file system than the local one (s3a://, hdfs://, abfs://...):
 * Spark deletes the data of drops, overwrites and truncates there through file systems the
 * hook does not replace, so nothing of them would be kept. Every command (anything that can
 * write or drop; queries still run) is refused instead, saying so, unless the application
 * fails open, which logs it once and runs unprotected.
 */
final class ForeignRoots {
  private static final AtomicBoolean WARNED = new AtomicBoolean();

  private ForeignRoots() {}

  static void refuse(LogicalPlan plan, Cmroot.Settings s) {
    if (!s.enabled || s.foreignRoots.isEmpty() || !writes(plan)) {
      return;
    }
    String msg = "the warehouse roots " + s.foreignRoots + " are not on the local file system"
        + ", and cmroot's Spark hook keeps files of the local file system (file:) only: a drop"
        + " or overwrite there would delete its data unkept";
    if (s.failOpen) {
      if (WARNED.compareAndSet(false, true)) {
        Cmroot.LOG.error("cmroot: {}; spark.cmroot.failOpen=true: running unprotected", msg);
      }
      return;
    }
    throw new IllegalStateException("cmroot refuses " + plan.nodeName() + ": " + msg
        + ". Nothing was run. Keep the warehouse roots (spark.cmroot.warehouseRoots, else "
        + "spark.sql.warehouse.dir) on local paths, or start the application with "
        + "spark.cmroot.failOpen=true to run unprotected.");
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
