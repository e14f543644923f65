package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.apache.spark.sql.SaveMode;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.catalyst.TableIdentifier;
import org.apache.spark.sql.catalyst.analysis.ResolvedIdentifier;
import org.apache.spark.sql.catalyst.catalog.CatalogStorageFormat;
import org.apache.spark.sql.catalyst.catalog.CatalogTable;
import org.apache.spark.sql.catalyst.catalog.CatalogTablePartition;
import org.apache.spark.sql.catalyst.catalog.SessionCatalog;
import org.apache.spark.sql.catalyst.plans.logical.DropTable;
import org.apache.spark.sql.catalyst.plans.logical.LogicalPlan;
import org.apache.spark.sql.connector.catalog.Identifier;
import org.apache.spark.sql.execution.command.AlterTableAddColumnsCommand;
import org.apache.spark.sql.execution.command.AlterTableAddPartitionCommand;
import org.apache.spark.sql.execution.command.AlterTableChangeColumnCommand;
import org.apache.spark.sql.execution.command.AlterTableDropPartitionCommand;
import org.apache.spark.sql.execution.command.AlterTableRenameCommand;
import org.apache.spark.sql.execution.command.AlterTableRenamePartitionCommand;
import org.apache.spark.sql.execution.command.AlterTableSerDePropertiesCommand;
import org.apache.spark.sql.execution.command.AlterTableSetLocationCommand;
import org.apache.spark.sql.execution.command.AlterTableSetPropertiesCommand;
import org.apache.spark.sql.execution.command.AlterTableUnsetPropertiesCommand;
import org.apache.spark.sql.execution.command.CreateDataSourceTableCommand;
import org.apache.spark.sql.execution.command.CreateTableCommand;
import org.apache.spark.sql.execution.command.CreateTableLikeCommand;
import org.apache.spark.sql.execution.command.CreateDataSourceTableAsSelectCommand;
import org.apache.spark.sql.execution.command.DropTableCommand;
import org.apache.spark.sql.execution.command.InsertIntoDataSourceDirCommand;
import org.apache.spark.sql.execution.command.LoadDataCommand;
import org.apache.spark.sql.execution.command.RepairTableCommand;
import org.apache.spark.sql.execution.command.TruncateTableCommand;
import org.apache.spark.sql.execution.datasources.InsertIntoHadoopFsRelationCommand;
import org.apache.spark.sql.hive.execution.InsertIntoHiveDirCommand;
import org.apache.spark.sql.hive.execution.InsertIntoHiveTable;
import scala.Option;
import scala.jdk.javaapi.CollectionConverters;

/**
 * Which analyzed commands are destructive statements or writes, and what they do (op, db,
 * table, purge, location). Matched by type and read through typed accessors, so a Spark
 * release that changes them fails this shim's compilation instead of silently leaving a
 * statement unprotected.
 */
final class CmrootCommands {
  // The partition value Spark and Hive write a NULL as (ExternalCatalogUtils).
  private static final String DEFAULT_PARTITION = "__HIVE_DEFAULT_PARTITION__";

  private CmrootCommands() {}

  /** The context of `plan` when it is one of the statements cmroot wraps; else null. */
  static Ctx contextOf(LogicalPlan plan, SparkSession session) {
    if (plan instanceof DropTableCommand) {
      DropTableCommand c = (DropTableCommand) plan;
      return c.isView() ? null : forTable(session, "DROP_TABLE", c.tableName(), c.purge());
    }
    if (plan instanceof DropTable) { // the v2 plan Spark keeps for DROP TABLE (no useV1Command)
      DropTable c = (DropTable) plan;
      if (!(c.child() instanceof ResolvedIdentifier)) {
        return null;
      }
      Identifier ident = ((ResolvedIdentifier) c.child()).identifier();
      String[] ns = ident.namespace();
      Option<String> db = ns.length > 0 ? Option.apply(ns[ns.length - 1]) : Option.empty();
      return forTable(session, "DROP_TABLE", new TableIdentifier(ident.name(), db), c.purge());
    }
    if (plan instanceof AlterTableDropPartitionCommand) {
      AlterTableDropPartitionCommand c = (AlterTableDropPartitionCommand) plan;
      return c.retainData() ? null
          : forTable(session, "DROP_PARTITION", c.tableName(), c.purge());
    }
    if (plan instanceof TruncateTableCommand) {
      return forTable(session, "TRUNCATE", ((TruncateTableCommand) plan).tableName(), false);
    }
    if (plan instanceof LoadDataCommand) {
      LoadDataCommand c = (LoadDataCommand) plan;
      return forTable(session, c.isOverwrite() ? "INSERT_OVERWRITE" : "INSERT", c.table(), false)
          .loading();
    }
    if (plan instanceof InsertIntoHadoopFsRelationCommand) {
      InsertIntoHadoopFsRelationCommand c = (InsertIntoHadoopFsRelationCommand) plan;
      String op = c.mode() == SaveMode.Overwrite ? "INSERT_OVERWRITE" : "INSERT";
      String location = Cmroot.where(String.valueOf(c.outputPath()));
      if (c.catalogTable().isDefined()) {
        CatalogTable table = c.catalogTable().get();
        TableIdentifier id = table.identifier();
        return new Ctx(op, db(session, id), id.table(), false, location)
            .withPartitionDirs(customPartitions(session, table, location));
      }
      return new Ctx(op, null, null, false, location);
    }
    if (plan instanceof InsertIntoHiveTable) {
      InsertIntoHiveTable c = (InsertIntoHiveTable) plan;
      TableIdentifier id = c.table().identifier();
      String location = Cmroot.where(c.table().location());
      Map<String, String> fixed = new LinkedHashMap<>();
      for (Map.Entry<String, Option<String>> e
          : CollectionConverters.asJava(c.partition()).entrySet()) {
        if (e.getValue().isDefined()) {
          // PARTITION (p=NULL): Hive's default partition, as Spark names it on disk.
          String v = e.getValue().get();
          fixed.put(e.getKey(), v == null ? DEFAULT_PARTITION : v);
        }
      }
      return new Ctx(c.overwrite() ? "INSERT_OVERWRITE" : "INSERT", db(session, id),
          id.table(), false, location)
          .withPartitionDirs(customPartitions(session, c.table(), location))
          .withStaticSpec(fixed);
    }
    if (plan instanceof InsertIntoHiveDirCommand) { // deletes the old entries one by one
      InsertIntoHiveDirCommand c = (InsertIntoHiveDirCommand) plan;
      return c.overwrite() ? directory(c.storage()) : null;
    }
    if (plan instanceof InsertIntoDataSourceDirCommand) {
      InsertIntoDataSourceDirCommand c = (InsertIntoDataSourceDirCommand) plan;
      return c.overwrite() ? directory(c.storage()) : null;
    }
    TableIdentifier changed = metadataChange(plan);
    if (changed != null) {
      // Deletes nothing; a statement so that its events are recorded once the command
      // returned: an event that cannot be recorded then fails the statement with cmroot's
      // error, where from inside the metastore Spark would retry the change and report
      // "already exists" instead. A partition rename's files are listed where they end up.
      return new Ctx("DELETE", db(session, changed), changed.table(), false, null);
    }
    if (plan instanceof CreateDataSourceTableAsSelectCommand) {
      CatalogTable table = ((CreateDataSourceTableAsSelectCommand) plan).table();
      TableIdentifier id = table.identifier();
      TableIdentifier qualified = new TableIdentifier(id.table(), Option.apply(db(session, id)));
      Option<java.net.URI> uri = table.storage().locationUri();
      java.net.URI location = uri.isDefined() ? uri.get()
          : session.sessionState().catalog().defaultTablePath(qualified);
      return new Ctx("INSERT", db(session, id), id.table(), false, Cmroot.where(location),
          true);
    }
    return null;
  }

  /** The table a catalog command that records events changes; null for other plans. */
  private static TableIdentifier metadataChange(LogicalPlan plan) {
    if (plan instanceof CreateTableCommand) {
      return ((CreateTableCommand) plan).table().identifier();
    }
    if (plan instanceof CreateDataSourceTableCommand) {
      return ((CreateDataSourceTableCommand) plan).table().identifier();
    }
    if (plan instanceof CreateTableLikeCommand) {
      return ((CreateTableLikeCommand) plan).targetTable();
    }
    if (plan instanceof AlterTableRenameCommand) {
      return ((AlterTableRenameCommand) plan).oldName();
    }
    if (plan instanceof AlterTableAddColumnsCommand) {
      return ((AlterTableAddColumnsCommand) plan).table();
    }
    if (plan instanceof AlterTableChangeColumnCommand) {
      return ((AlterTableChangeColumnCommand) plan).tableName();
    }
    if (plan instanceof AlterTableSetPropertiesCommand) {
      return ((AlterTableSetPropertiesCommand) plan).tableName();
    }
    if (plan instanceof AlterTableUnsetPropertiesCommand) {
      return ((AlterTableUnsetPropertiesCommand) plan).tableName();
    }
    if (plan instanceof AlterTableSerDePropertiesCommand) {
      return ((AlterTableSerDePropertiesCommand) plan).tableName();
    }
    if (plan instanceof AlterTableSetLocationCommand) {
      return ((AlterTableSetLocationCommand) plan).tableName();
    }
    if (plan instanceof AlterTableAddPartitionCommand) {
      return ((AlterTableAddPartitionCommand) plan).tableName();
    }
    if (plan instanceof AlterTableRenamePartitionCommand) {
      return ((AlterTableRenamePartitionCommand) plan).tableName();
    }
    if (plan instanceof RepairTableCommand) {
      return ((RepairTableCommand) plan).tableName();
    }
    return null;
  }

  /**
   * The location of the partition `spec` of the statement's table, by the catalog of the
   * session running it; null if there is no such partition (or no session here).
   */
  static String partitionLocation(Ctx ctx, Map<String, String> spec) {
    Option<SparkSession> active = SparkSession.getActiveSession();
    if (!active.isDefined() || ctx.table == null) {
      return null;
    }
    try {
      CatalogTablePartition p = active.get().sessionState().catalog().getPartition(
          new TableIdentifier(ctx.table, Option.apply(ctx.db)),
          scala.collection.immutable.Map$.MODULE$.from(CollectionConverters.asScala(spec)));
      return Cmroot.where(p.location());
    } catch (Exception e) {
      return null; // no such partition, or a spec the catalog does not take
    }
  }

  /**
   * What puts the partitions of db.table back as they are listed now: one missing then is
   * created again, one moved to another location is moved back, and one not listed now
   * whose directory holds no data file then (a partition the rolled-back writes added; its
   * files are removed by then) is dropped, its directory kept. Null for an unpartitioned
   * table, or when there is no session here. The metastore records each change (after
   * those it undoes): a replica ends as this table does.
   */
  static CmrootStatement.Action partitionsRestorer(String db, String table) {
    Option<SparkSession> active = SparkSession.getActiveSession();
    if (!active.isDefined()) {
      return null;
    }
    SessionCatalog catalog = active.get().sessionState().catalog();
    TableIdentifier id = new TableIdentifier(table, Option.apply(db));
    List<CatalogTablePartition> before;
    try {
      if (catalog.getTableMetadata(id).partitionColumnNames().isEmpty()) {
        return null;
      }
      before = CollectionConverters.asJava(catalog.listPartitions(id, Option.empty()));
    } catch (Exception e) {
      return null; // no such table: the command itself says so
    }
    return () -> {
      Map<scala.collection.immutable.Map<String, String>, CatalogTablePartition> now =
          new LinkedHashMap<>();
      for (CatalogTablePartition p : CollectionConverters.asJava(
          catalog.listPartitions(id, Option.empty()))) {
        now.put(p.spec(), p);
      }
      List<CatalogTablePartition> missing = new ArrayList<>();
      List<CatalogTablePartition> moved = new ArrayList<>();
      for (CatalogTablePartition p : before) {
        CatalogTablePartition cur = now.remove(p.spec());
        if (cur == null) {
          missing.add(p);
        } else if (!String.valueOf(cur.location()).equals(String.valueOf(p.location()))) {
          moved.add(p);
        }
      }
      List<scala.collection.immutable.Map<String, String>> added = new ArrayList<>();
      for (CatalogTablePartition p : now.values()) {
        String dir = Cmroot.where(p.location());
        if (dir != null && Cmroot.dataFiles(dir, true, null, Cmroot.hadoop()).isEmpty()) {
          added.add(p.spec());
        }
      }
      if (!added.isEmpty()) {
        catalog.dropPartitions(id, CollectionConverters.asScala(added).toList(), true, false,
            true);
      }
      if (!moved.isEmpty()) {
        catalog.alterPartitions(id, CollectionConverters.asScala(moved).toList());
      }
      if (!missing.isEmpty()) {
        catalog.createPartitions(id, CollectionConverters.asScala(missing).toList(), true);
      }
    };
  }

  /**
   * The partitions of `table` (as the analysed plan or the catalog gave it) at custom
   * locations: anywhere but the k=v/... path below `location` that their spec gives
   * (directory -> spec). An unpartitioned table costs no metastore call.
   */
  private static Map<String, Map<String, String>> customPartitions(SparkSession session,
      CatalogTable table, String location) {
    Map<String, Map<String, String>> out = new LinkedHashMap<>();
    if (table == null || table.partitionColumnNames().isEmpty()) {
      return out;
    }
    try {
      TableIdentifier id = table.identifier();
      TableIdentifier qualified = new TableIdentifier(id.table(), Option.apply(db(session, id)));
      for (CatalogTablePartition p : CollectionConverters.asJava(
          session.sessionState().catalog().listPartitions(qualified, Option.empty()))) {
        String dir = Cmroot.where(p.location());
        Map<String, String> spec = CollectionConverters.asJava(p.spec());
        if (dir != null && !Cmroot.isDefaultPartitionDir(dir, location, spec)) {
          out.put(dir, spec);
        }
      }
    } catch (Exception e) {
      // no such table any more, or not partitioned by the catalog: the command itself says so
    }
    return out;
  }

  /** INSERT OVERWRITE DIRECTORY: no table, the directory's old entries are one recycle. */
  private static Ctx directory(CatalogStorageFormat storage) {
    Option<java.net.URI> uri = storage.locationUri();
    return uri.isDefined()
        ? new Ctx("INSERT_OVERWRITE", null, null, false,
            Cmroot.where(uri.get()))
        : null;
  }

  private static Ctx forTable(SparkSession session, String op, TableIdentifier id,
      boolean purge) {
    String db = db(session, id);
    CatalogTable table = null;
    String location = null;
    try {
      table = session.sessionState().catalog()
          .getTableMetadata(new TableIdentifier(id.table(), Option.apply(db)));
      location = Cmroot.where(table.location());
    } catch (Exception e) {
      // no such table (IF EXISTS) or a temporary view: no location to match
    }
    return new Ctx(op, db, id.table(), purge, location)
        .withPartitionDirs(customPartitions(session, table, location));
  }

  private static String db(SparkSession session, TableIdentifier id) {
    return id.database().isDefined() ? id.database().get()
        : session.sessionState().catalog().getCurrentDatabase();
  }
}
