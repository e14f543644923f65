package io.cmroot.spark;

import java.lang.reflect.Method;
import org.apache.spark.sql.SaveMode;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.SparkSessionExtensions;
import org.apache.spark.sql.catalyst.TableIdentifier;
import org.apache.spark.sql.catalyst.plans.logical.Command;
import org.apache.spark.sql.catalyst.plans.logical.LogicalPlan;
import org.apache.spark.sql.connector.catalog.Identifier;
import scala.Function1;
import scala.Option;
import scala.runtime.AbstractFunction1;
import scala.runtime.BoxedUnit;

/**
 * {@code spark.sql.extensions=io.cmroot.spark.CmrootExtensions}: a check rule that looks at
 * every analyzed statement and, for a destructive one or a write, tells the hooks what is
 * running on this thread (op, db, table, purge flag, table location), so the files it deletes
 * are recycled, and the files it writes recorded, with that context. Any other command
 * clears the context. Plans are matched by class name and read through their accessors, so
 * the shim does not depend on the exact constructor shapes of one Spark release.
 */
public class CmrootExtensions extends AbstractFunction1<SparkSessionExtensions, BoxedUnit> {

  @Override
  public BoxedUnit apply(SparkSessionExtensions ext) {
    ext.injectCheckRule(
        new AbstractFunction1<SparkSession, Function1<LogicalPlan, BoxedUnit>>() {
          @Override
          public Function1<LogicalPlan, BoxedUnit> apply(SparkSession session) {
            return new Inspector(session);
          }
        });
    return BoxedUnit.UNIT;
  }

  static final class Inspector extends AbstractFunction1<LogicalPlan, BoxedUnit> {
    private final SparkSession session;

    Inspector(SparkSession session) {
      this.session = session;
    }

    @Override
    public BoxedUnit apply(LogicalPlan plan) {
      try {
        Cmroot.Ctx ctx = contextOf(plan);
        if (plan instanceof Command && Cmroot.settings(null).debug) {
          Cmroot.LOG.warn("cmroot debug: statement {} -> {}", plan.getClass().getName(), ctx);
        }
        if (ctx != null) {
          Cmroot.setContext(ctx);
        } else if (plan instanceof Command) {
          Cmroot.setContext(null);
        }
      } catch (Throwable e) {
        Cmroot.LOG.warn("cmroot: could not read the statement context of {}",
            plan.getClass().getName(), e);
      }
      return BoxedUnit.UNIT;
    }

    private Cmroot.Ctx contextOf(LogicalPlan plan) throws Exception {
      switch (plan.getClass().getSimpleName()) {
        case "DropTableCommand":
          if ((Boolean) call(plan, "isView")) {
            return null;
          }
          return forTable("DROP_TABLE", (TableIdentifier) call(plan, "tableName"),
              (Boolean) call(plan, "purge"));
        case "DropTable": { // the v2 plan Spark 4 keeps for DROP TABLE (no useV1Command)
          Object child = call(plan, "child");
          if (!child.getClass().getSimpleName().equals("ResolvedIdentifier")) {
            return null;
          }
          Identifier ident = (Identifier) call(child, "identifier");
          String[] ns = ident.namespace();
          String name = ident.name();
          Option<String> db = ns.length > 0 ? Option.apply(ns[ns.length - 1]) : Option.empty();
          return forTable("DROP_TABLE", new TableIdentifier(name, db),
              (Boolean) call(plan, "purge"));
        }
        case "AlterTableDropPartitionCommand":
          if ((Boolean) call(plan, "retainData")) {
            return null;
          }
          return forTable("DROP_PARTITION", (TableIdentifier) call(plan, "tableName"),
              (Boolean) call(plan, "purge"));
        case "TruncateTableCommand":
          return forTable("TRUNCATE", (TableIdentifier) call(plan, "tableName"), false);
        case "InsertIntoHadoopFsRelationCommand": {
          String op = call(plan, "mode") == SaveMode.Overwrite ? "INSERT_OVERWRITE" : "INSERT";
          Option<?> table = (Option<?>) call(plan, "catalogTable");
          String location = Cmroot.localPath(String.valueOf(call(plan, "outputPath")));
          if (table.isDefined()) {
            TableIdentifier id = (TableIdentifier) call(table.get(), "identifier");
            return new Cmroot.Ctx(op, db(id), id.table(), false, location);
          }
          // The inner write of a CTAS names no table: it writes the outer statement's.
          Cmroot.Ctx outer = Cmroot.context();
          if (outer != null && outer.table != null && location != null
              && outer.appliesTo(location) != null) {
            return new Cmroot.Ctx(op, outer.db, outer.table, false, outer.location,
                outer.creating);
          }
          return new Cmroot.Ctx(op, null, null, false, location);
        }
        case "InsertIntoHiveTable": {
          String op = (Boolean) call(plan, "overwrite") ? "INSERT_OVERWRITE" : "INSERT";
          Object table = call(plan, "table");
          TableIdentifier id = (TableIdentifier) call(table, "identifier");
          return new Cmroot.Ctx(op, db(id), id.table(), false,
              Cmroot.localPath(String.valueOf(call(table, "location"))));
        }
        case "CreateDataSourceTableAsSelectCommand": {
          Object table = call(plan, "table");
          TableIdentifier id = (TableIdentifier) call(table, "identifier");
          TableIdentifier qualified = new TableIdentifier(id.table(), Option.apply(db(id)));
          Option<?> uri = (Option<?>) call(call(table, "storage"), "locationUri");
          Object location = uri.isDefined() ? uri.get()
              : session.sessionState().catalog().defaultTablePath(qualified);
          return new Cmroot.Ctx("INSERT", db(id), id.table(), false,
              Cmroot.localPath(String.valueOf(location)), true);
        }
        default:
          return null;
      }
    }

    private Cmroot.Ctx forTable(String op, TableIdentifier id, boolean purge) {
      String db = db(id);
      String location = null;
      try {
        location = Cmroot.localPath(String.valueOf(session.sessionState().catalog()
            .getTableMetadata(new TableIdentifier(id.table(), Option.apply(db))).location()));
      } catch (Throwable e) {
        // no such table (IF EXISTS) or a temporary view: no location to match
      }
      return new Cmroot.Ctx(op, db, id.table(), purge, location);
    }

    private String db(TableIdentifier id) {
      if (id.database().isDefined()) {
        return id.database().get();
      }
      return session.sessionState().catalog().getCurrentDatabase();
    }
  }

  static Object call(Object target, String accessor) throws Exception {
    Method m = target.getClass().getMethod(accessor);
    return m.invoke(target);
  }
}
