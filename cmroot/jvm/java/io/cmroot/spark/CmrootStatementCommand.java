package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import java.util.List;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.catalyst.plans.logical.Command;
import org.apache.spark.sql.catalyst.plans.logical.LogicalPlan;
import org.apache.spark.sql.catalyst.trees.LeafLike;
import org.apache.spark.sql.execution.command.AlterTableDropPartitionCommand;
import org.apache.spark.sql.execution.command.LeafRunnableCommand;
import org.apache.spark.sql.execution.command.LoadDataCommand;
import org.apache.spark.sql.execution.command.RunnableCommand;
import org.apache.spark.sql.execution.command.TruncateTableCommand;
import scala.Enumeration;
import scala.collection.immutable.Seq;
import scala.jdk.javaapi.CollectionConverters;

/**
 * A destructive command, wrapped (as delta-spark replaces commands) so that it runs as one
 * {@link CmrootStatement}: the statement's context is set for exactly the time the command
 * runs (try/finally, on its thread and the threads it starts), every recycle its deletes
 * make is prepared in the statement's transaction, and that transaction is committed once
 * the command returned, or aborted when it threw. {@link CmrootExtensions} puts it around the
 * analyzed command; the command itself runs unchanged, through its own query execution.
 *
 * <p>A DROP PARTITION stages the data of every partition it names first, in one request:
 * the metastore drops partitions one call at a time, so without that a refused partition
 * would be found only after the earlier ones were gone from the catalog. A TRUNCATE stages
 * every file it empties first, in one request, for the same reason and for one round trip.
 */
public final class CmrootStatementCommand extends LogicalPlan implements LeafRunnableCommand {
  private static final long serialVersionUID = 1L;

  private final LogicalPlan inner;
  private final Ctx ctx;
  private Seq<Enumeration.Value> nodePatterns;

  public CmrootStatementCommand(LogicalPlan inner, Ctx ctx) {
    this.inner = inner;
    this.ctx = ctx;
    // What scalac emits for a class mixing these traits in: it sets the trait's vals.
    Command.$init$(this);
    RunnableCommand.$init$(this);
    LeafLike.$init$(this);
  }

  LogicalPlan inner() {
    return inner;
  }

  /**
   * The statement's SQL text, for the audit: what the parser kept on the command (its
   * origin), else the job description the SQL shell and the Thrift server set; else null.
   */
  private String sqlText(SparkSession session) {
    scala.Option<String> text = inner.origin().sqlText();
    if (text.isDefined()) {
      return text.get();
    }
    return session.sparkContext().getLocalProperty("spark.job.description");
  }

  @Override
  public Seq<Row> run(SparkSession session) {
    Cmroot.Settings s = Cmroot.settings(null);
    CmrootStatement st = CmrootStatement.open(ctx, s, sqlText(session));
    try {
      List<Row> rows;
      try {
        if (inner instanceof AlterTableDropPartitionCommand) {
          // Staged here for the whole statement, with a remote metastore too: Spark drops
          // partitions one metastore call each, and a refusal must leave them all.
          CmrootDropPartitions.stage(session, (AlterTableDropPartitionCommand) inner, st, s);
        } else if (inner instanceof TruncateTableCommand) {
          CmrootTruncate.stage(session, (TruncateTableCommand) inner, st, s);
        } else if (inner instanceof LoadDataCommand && s.enabled) {
          prepareLoad((LoadDataCommand) inner, session, st, s);
        }
        rows = org.apache.spark.sql.classic.Dataset$.MODULE$
            .ofRows((org.apache.spark.sql.classic.SparkSession) session, inner)
            .collectAsList();
      } catch (Throwable e) {
        st.abort("the statement failed: " + e);
        throw Cmroot.unchecked(e);
      }
      try {
        st.commit();
      } catch (Cmroot.RecycleException e) {
        throw Cmroot.unchecked(e);
      }
      return CollectionConverters.asScala(rows).toList();
    } finally {
      st.close();
    }
  }

  /**
   * Before anything of a LOAD DATA INPATH moves: refuse a path that is, or holds, a symlink,
   * and keep the bytes of every file of another table (or of no table) under the roots that
   * it will move, in one part of the statement. Hive deletes the table's old files first and
   * then moves the new ones in one entry at a time; a keep refused midway (a FIFO, say)
   * would otherwise be found after a new file had taken an old one's name, where the old
   * one can no longer be put back. Files of the statement's own table are kept as they move.
   */
  private static void prepareLoad(LoadDataCommand c, SparkSession session, CmrootStatement st,
      Cmroot.Settings s) throws java.io.IOException {
    if (c.isLocal()) {
      return; // LOCAL copies the bytes in: a symlink's target is read, nothing leaves
    }
    org.apache.hadoop.fs.Path p = new org.apache.hadoop.fs.Path(c.path());
    org.apache.hadoop.fs.FileSystem fs = p.getFileSystem(session.sessionState().newHadoopConf());
    if (!(fs instanceof CmrootLocalFileSystem)) {
      return;
    }
    org.apache.hadoop.fs.FileStatus[] matched = fs.globStatus(fs.makeQualified(p));
    List<String> keep = new java.util.ArrayList<>();
    for (org.apache.hadoop.fs.FileStatus m : matched == null
        ? new org.apache.hadoop.fs.FileStatus[0] : matched) {
      String local = Cmroot.localPath(m.getPath().toUri().getPath());
      // A symlink to a directory named by the path is listed like the directory (Hive moves
      // its entries, not the link); hidden entries Hive skips. What the path names is data
      // whatever it is called (a table may be located at `x/_temporary/7`).
      java.nio.file.Path top = local == null ? null : java.nio.file.Paths.get(local);
      boolean linkedDir = top != null && java.nio.file.Files.isSymbolicLink(top)
          && java.nio.file.Files.isDirectory(top);
      String link = top == null ? null
          : linkedDir ? Cmroot.firstSymlink(top.toRealPath()) : Cmroot.firstSymlink(top);
      if (link != null) {
        throw new Cmroot.RecycleException("cmroot refuses to move " + link + " into "
            + c.table().unquotedString() + " (LOAD DATA INPATH '" + c.path() + "'): it is a"
            + " symlink, which cmroot never follows, so the table's new data could not be"
            + " recorded for replication. Nothing was moved. Load the files themselves.", null);
      }
      if (top == null || linkedDir || Cmroot.isHiddenName(top.getFileName().toString())
          || !Cmroot.protectedLocation(local, s) || st.ctx.appliesTo(local) != null) {
        continue;
      }
      java.io.File[] entries = java.nio.file.Files.isDirectory(top,
          java.nio.file.LinkOption.NOFOLLOW_LINKS) ? top.toFile().listFiles()
          : new java.io.File[] {top.toFile()};
      for (java.io.File e : entries == null ? new java.io.File[0] : entries) {
        if (!Cmroot.isHiddenName(e.getName())) {
          keep.addAll(Cmroot.filesUnder(e.getPath(), false));
        }
      }
    }
    if (!keep.isEmpty() && st.prepareCopy(keep, "the files LOAD DATA INPATH '" + c.path()
        + "' moves into " + c.table().unquotedString(), null)) {
      st.markKept(keep);
    }
  }

  // -- what a Scala case class gets from the compiler -------------------------------------

  @Override
  public Seq<org.apache.spark.sql.catalyst.expressions.Attribute> output() {
    return inner.output();
  }

  @Override
  public Seq<LogicalPlan> children() {
    return scala.collection.immutable.List$.MODULE$.empty();
  }

  @Override
  public LogicalPlan withNewChildrenInternal(
      scala.collection.immutable.IndexedSeq<LogicalPlan> newChildren) {
    return this;
  }

  @Override
  public LogicalPlan mapChildren(scala.Function1<LogicalPlan, LogicalPlan> f) {
    return this;
  }

  /** What EXPLAIN shows: the statement, and the command it runs. */
  @Override
  public String simpleString(int maxFields) {
    return "CmrootStatement " + ctx + ": " + inner.simpleString(maxFields);
  }

  @Override
  public Seq<Enumeration.Value> nodePatterns() {
    return nodePatterns;
  }

  @Override
  public void org$apache$spark$sql$catalyst$plans$logical$Command$_setter_$nodePatterns_$eq(
      Seq<Enumeration.Value> patterns) {
    this.nodePatterns = patterns;
  }

  // Command's and RunnableCommand's: Java takes LogicalPlan's over a trait's default.
  @Override
  public org.apache.spark.sql.catalyst.expressions.AttributeSet producedAttributes() {
    return outputSet();
  }

  @Override
  public org.apache.spark.sql.catalyst.plans.logical.Statistics stats() {
    return org.apache.spark.sql.catalyst.plans.logical.Statistics$.MODULE$.DUMMY();
  }

  @Override
  public scala.collection.immutable.Map<String,
      org.apache.spark.sql.execution.metric.SQLMetric> metrics() {
    return scala.collection.immutable.Map$.MODULE$.empty();
  }

  @Override
  public int productArity() {
    return 2;
  }

  @Override
  public Object productElement(int n) {
    switch (n) {
      case 0:
        return inner;
      case 1:
        return ctx;
      default:
        throw new IndexOutOfBoundsException(String.valueOf(n));
    }
  }

  @Override
  public boolean canEqual(Object other) {
    return other instanceof CmrootStatementCommand;
  }
}
