package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import java.io.UncheckedIOException;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.SparkSessionExtensions;
import org.apache.spark.sql.catalyst.analysis.ResolvedNamespace;
import org.apache.spark.sql.catalyst.plans.logical.DropNamespace;
import org.apache.spark.sql.catalyst.plans.logical.LogicalPlan;
import org.apache.spark.sql.catalyst.plans.logical.Union;
import org.apache.spark.sql.catalyst.rules.Rule;
import org.apache.spark.sql.connector.catalog.CatalogManager;
import org.apache.spark.sql.execution.command.DropDatabaseCommand;
import org.apache.spark.sql.execution.command.SetCommand;
import org.apache.spark.sql.internal.SQLConf$;
import scala.Function1;
import scala.Option;
import scala.Tuple2;
import scala.runtime.AbstractFunction1;
import scala.runtime.BoxedUnit;

/**
 * {@code spark.sql.extensions=io.cmroot.spark.CmrootExtensions}:
 *
 * <ul>
 *   <li>a post-hoc resolution rule that wraps each destructive command or write
 *       ({@link CmrootCommands}) in a {@link CmrootStatementCommand}, so the command runs as
 *       one statement: its context set around it, its recycles committed together after it
 *       succeeded, aborted when it failed. A command run inside a statement (the write of a
 *       CTAS) is part of that statement and is not wrapped again. A multi-insert (a Union of
 *       writes) is one statement, each write nested in it with its own context.
 *   <li>a check rule refusing DROP DATABASE of a database located at a warehouse root or at
 *       a directory containing one, before anything is dropped.
 *   <li>a check rule refusing every statement when the application's metastore is remote
 *       and does not run the cmroot plugin ({@link RemoteMetastore}), and every command when
 *       a warehouse root is on a file system the hook cannot keep files of
 *       ({@link ForeignRoots}).
 *   <li>the cmroot settings that decide whether and where files are kept
 *       ({@link Cmroot#FIXED_KEYS}) are the application's: registered as static SQL configs,
 *       so {@code spark.conf.set} refuses them, and a check rule refuses {@code SET} of any
 *       spark.cmroot.* key, and of the Hadoop keys that could swap the hooked `file` file
 *       system or route deletes to the trash, with an error saying where to set it.
 * </ul>
 */
public class CmrootExtensions extends AbstractFunction1<SparkSessionExtensions, BoxedUnit> {

  @Override
  public BoxedUnit apply(SparkSessionExtensions ext) {
    for (String key : Cmroot.FIXED_KEYS) {
      SQLConf$.MODULE$.registerStaticConfigKey("spark.cmroot." + key);
    }
    ext.injectPostHocResolutionRule(
        new AbstractFunction1<SparkSession, Rule<LogicalPlan>>() {
          @Override
          public Rule<LogicalPlan> apply(SparkSession session) {
            return new WrapStatements(session);
          }
        });
    ext.injectCheckRule(
        new AbstractFunction1<SparkSession, Function1<LogicalPlan, BoxedUnit>>() {
          @Override
          public Function1<LogicalPlan, BoxedUnit> apply(SparkSession session) {
            return new RefuseSettingChanges();
          }
        });
    ext.injectCheckRule(
        new AbstractFunction1<SparkSession, Function1<LogicalPlan, BoxedUnit>>() {
          @Override
          public Function1<LogicalPlan, BoxedUnit> apply(SparkSession session) {
            return new RefuseRootDatabaseDrops(session);
          }
        });
    ext.injectCheckRule(
        new AbstractFunction1<SparkSession, Function1<LogicalPlan, BoxedUnit>>() {
          @Override
          public Function1<LogicalPlan, BoxedUnit> apply(SparkSession session) {
            return new AbstractFunction1<LogicalPlan, BoxedUnit>() {
              @Override
              public BoxedUnit apply(LogicalPlan plan) {
                Cmroot.Settings s = Cmroot.settings(null);
                ForeignRoots.refuse(session, plan, s);
                RemoteMetastore.refuseUnprotected(session, plan, s);
                return BoxedUnit.UNIT;
              }
            };
          }
        });
    return BoxedUnit.UNIT;
  }

  /** Wraps a destructive command in the statement that commits or aborts its recycles. */
  static final class WrapStatements extends Rule<LogicalPlan> {
    private final SparkSession session;

    WrapStatements(SparkSession session) {
      this.session = session;
    }

    @Override
    public LogicalPlan apply(LogicalPlan plan) {
      if (plan instanceof CmrootStatementCommand || CmrootStatement.current() != null) {
        return plan;
      }
      Cmroot.Settings s = Cmroot.settings(null);
      if (!s.enabled) {
        return plan;
      }
      if (plan instanceof Union) {
        return multiInsert((Union) plan);
      }
      Ctx ctx = CmrootCommands.contextOf(plan, session);
      if (s.debug) {
        Cmroot.LOG.warn("cmroot debug: statement {} -> {}", plan.getClass().getName(), ctx);
      }
      return ctx == null ? plan : new CmrootStatementCommand(plan, ctx);
    }

    /**
     * A multi-insert ({@code FROM s INSERT ... INSERT ...}) is a Union of writes: one
     * statement around the whole (its recycles commit together), each write in a statement
     * nested in it for its own context (table, op).
     */
    private LogicalPlan multiInsert(Union union) {
      boolean[] any = {false};
      LogicalPlan wrapped = union.mapChildren(new AbstractFunction1<LogicalPlan, LogicalPlan>() {
        @Override
        public LogicalPlan apply(LogicalPlan child) {
          Ctx ctx = CmrootCommands.contextOf(child, session);
          any[0] |= ctx != null;
          return ctx == null ? child : new CmrootStatementCommand(child, ctx);
        }
      });
      return any[0] ? new CmrootStatementCommand(wrapped, Ctx.MULTI_INSERT) : union;
    }
  }

  /**
   * DROP DATABASE of a database located at a warehouse root or at a directory containing
   * one: refused before anything runs. (The metastore client drops a CASCADE's tables before
   * the database's own pre-event fires, and deletes the database directory recursively.)
   */
  static final class RefuseRootDatabaseDrops extends AbstractFunction1<LogicalPlan, BoxedUnit> {
    private final SparkSession session;

    RefuseRootDatabaseDrops(SparkSession session) {
      this.session = session;
    }

    @Override
    public BoxedUnit apply(LogicalPlan plan) {
      String db = null;
      if (plan instanceof DropDatabaseCommand) {
        db = ((DropDatabaseCommand) plan).databaseName();
      } else if (plan instanceof DropNamespace
          && ((DropNamespace) plan).namespace() instanceof ResolvedNamespace) {
        ResolvedNamespace ns = (ResolvedNamespace) ((DropNamespace) plan).namespace();
        if (CatalogManager.SESSION_CATALOG_NAME().equals(ns.catalog().name())
            && ns.namespace().size() == 1) {
          db = ns.namespace().head();
        }
      }
      Cmroot.Settings s = db == null ? null : Cmroot.settings(null);
      if (s == null || !s.enabled) {
        return BoxedUnit.UNIT;
      }
      String location;
      try {
        location = Cmroot.where(
            session.sessionState().catalog().getDatabaseMetadata(db).locationUri());
      } catch (Exception e) {
        return BoxedUnit.UNIT; // no such database: the command says so
      }
      try {
        Cmroot.refuseRootRemoval(location, s, "DROP DATABASE " + db + " located at");
      } catch (Cmroot.RecycleException e) {
        throw new UncheckedIOException(e);
      }
      return BoxedUnit.UNIT;
    }
  }

  /**
   * SET from SQL of a key that decides whether deletes are kept: refused, saying where it
   * belongs. That is every spark.cmroot.* key, the SQL commit protocol, and the Hadoop keys that choose or configure
   * the file system of the `file` scheme (fs.file.*, fs.<scheme>.impl*,
   * fs.AbstractFileSystem.*.impl) or send deletes to the trash (fs.trash.*): the session's
   * SQL conf is copied into the Hadoop conf of its queries, so `SET fs.file.impl=...` with
   * `SET fs.file.impl.disable.cache=true` would give the next statement an unhooked file
   * system. Also spelled with the spark.hadoop. prefix.
   */
  static final class RefuseSettingChanges extends AbstractFunction1<LogicalPlan, BoxedUnit> {
    private static final java.util.regex.Pattern HADOOP_KEYS = java.util.regex.Pattern.compile(
        "fs\\.(file\\..*|trash\\..*|.*\\.impl(\\..*)?)");

    static boolean fixed(String key) {
      String k = key.trim();
      // The commit protocol is the shim's: overwrite snapshots and INSERT events.
      if (k.startsWith("spark.cmroot.") || k.equals("spark.sql.sources.commitProtocolClass")) {
        return true;
      }
      if (k.startsWith("spark.hadoop.")) {
        k = k.substring("spark.hadoop.".length());
      }
      return HADOOP_KEYS.matcher(k).matches();
    }

    @Override
    public BoxedUnit apply(LogicalPlan plan) {
      if (plan instanceof SetCommand) {
        Option<Tuple2<String, Option<String>>> kv = ((SetCommand) plan).kv();
        if (kv.isDefined() && kv.get()._2().isDefined() && fixed(kv.get()._1())) {
          String key = kv.get()._1().trim();
          throw new IllegalArgumentException("cmroot: " + key + " is a setting of the Spark "
              + "application and cannot be changed by SET: it decides whether every session's "
              + "deletes are kept in the cmroot. Set it when the application starts "
              + "(spark-submit --conf " + (key.startsWith("fs.") ? "spark.hadoop." : "") + key
              + "=..., spark-defaults.conf, or cmroot.spark.configure()).");
        }
      }
      return BoxedUnit.UNIT;
    }
  }
}
