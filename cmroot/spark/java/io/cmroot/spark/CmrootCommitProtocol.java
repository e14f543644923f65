package io.cmroot.spark;

import java.io.File;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.mapreduce.JobContext;
import org.apache.spark.internal.io.FileCommitProtocol;
import org.apache.spark.sql.execution.datasources.SQLHadoopMapReduceCommitProtocol;

/**
 * Spark's SQL commit protocol, with the deletions of an overwrite deferred to job commit.
 *
 * <p>For {@code INSERT OVERWRITE} (and {@code mode("overwrite")}) Spark deletes the old
 * partition directories before it writes the new data. Here that delete only records the
 * path; at job commit, after every task has written its files, the old files are recycled in
 * one all-or-nothing request and only then are the new files moved into place. A job that
 * fails never reaches commit: the old files stay where they were. If cmroot refuses, the
 * commit throws, Spark aborts the job and the table is unchanged. With dynamic partition
 * overwrite the partitions the job replaces are recycled the same way, in one request.
 *
 * <p>After the job committed, the new data files of a table under the warehouse roots are
 * recorded as one INSERT event (after the overwrite's recycle, the order replication replays).
 * Known gap: a Hive SerDe table Spark does not convert (e.g. STORED AS TEXTFILE) is written
 * to a Hive staging directory and moved in by Hive's loadTable; that INSERT is not recorded.
 *
 * <p>Set with {@code spark.sql.sources.commitProtocolClass=io.cmroot.spark.CmrootCommitProtocol}.
 */
public class CmrootCommitProtocol extends SQLHadoopMapReduceCommitProtocol {
  private static final long serialVersionUID = 1L;

  private final String jobId;
  private final String outputPath;
  private final boolean dynamic;
  private final transient Cmroot.Ctx ctx; // the driver's statement; tasks never need it
  private final transient List<String> deferred = new ArrayList<>();

  public CmrootCommitProtocol(String jobId, String path, boolean dynamicPartitionOverwrite) {
    super(jobId, path, dynamicPartitionOverwrite);
    this.jobId = jobId;
    this.outputPath = path;
    this.dynamic = dynamicPartitionOverwrite;
    this.ctx = Cmroot.context();
  }

  @Override
  public boolean deleteWithJob(FileSystem fs, Path path, boolean recursive) {
    Cmroot.Settings s = Cmroot.settings(fs.getConf());
    String local = fs instanceof CmrootLocalFileSystem ? Cmroot.localPath(path.toUri().getPath())
        : null;
    if (local == null || !recursive || !Cmroot.protectedPath(local, s)) {
      return superDelete(fs, path, recursive);
    }
    deferred.add(local); // recycled at commit, once the new data is written
    return true;
  }

  private boolean superDelete(FileSystem fs, Path path, boolean recursive) {
    try {
      return fs.delete(path, recursive);
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
  }

  @Override
  public void commitJob(JobContext jobContext,
      scala.collection.immutable.Seq<FileCommitProtocol.TaskCommitMessage> taskCommits) {
    Cmroot.Settings s = Cmroot.settings(jobContext.getConfiguration());
    String base = Cmroot.localPath(outputPath);
    Set<String> paths = new LinkedHashSet<>();
    for (String d : deferred) {
      // Everything that was in the directory when Spark asked to delete it, except Spark's
      // own staging (the new data waits there).
      File dir = new File(d);
      String[] names = dir.isDirectory() ? dir.list() : null;
      if (names == null) {
        if (dir.exists()) {
          paths.add(d);
        }
        continue;
      }
      for (String n : names) {
        if (!Cmroot.isTemporaryName(n)) {
          paths.add(new File(dir, n).getPath());
        }
      }
    }
    if (dynamic && base != null && Cmroot.protectedPath(base, s)) {
      for (String part : partitionPaths(taskCommits)) {
        File p = new File(base, part);
        if (p.exists()) {
          paths.add(Cmroot.localPath(p.getPath()));
        }
      }
    }
    List<String> list = new ArrayList<>();
    for (String p : paths) {
      try {
        if (Cmroot.holdsFiles(new File(p).toPath())) {
          list.add(p);
        }
      } catch (IOException e) {
        throw new UncheckedIOException(e);
      }
    }
    if (!list.isEmpty() && s.enabled) {
      Cmroot.Ctx c = ctx != null ? ctx.appliesTo(base == null ? list.get(0) : base) : null;
      List<Map<String, String>> parts = new ArrayList<>();
      for (String p : list) {
        Map<String, String> kv = Cmroot.partitionOf(p, base, new File(p).isDirectory());
        if (!kv.isEmpty() && !parts.contains(kv)) {
          parts.add(kv);
        }
      }
      boolean recycled;
      try {
        recycled = Cmroot.recycle(list, "INSERT_OVERWRITE", c == null ? null : c.db,
            c == null ? null : c.table, false, parts, c == null ? null : c.location, s,
            "the overwrite of " + outputPath);
      } catch (Cmroot.RecycleException e) {
        throw new UncheckedIOException(e); // Spark aborts the job: the old data stays
      }
      if (!recycled) {
        for (String p : list) { // failed open: delete as Spark would have
          Path hp = new Path(new File(p).toURI());
          try {
            FileSystem.getLocal(jobContext.getConfiguration()).getRaw().delete(hp, true);
          } catch (IOException e) {
            throw new UncheckedIOException(e);
          }
        }
      }
    }
    deferred.clear();
    super.commitJob(jobContext, taskCommits);
    recordInsert(s, base);
  }

  /**
   * One INSERT event for the files this job wrote (their names carry its job id) into the
   * table of the statement. A CTAS's waits for the metastore listener to record the table.
   */
  private void recordInsert(Cmroot.Settings s, String base) {
    Cmroot.Ctx c = ctx == null || base == null ? null : ctx.appliesTo(base);
    if (c == null || c.table == null || !Cmroot.protectedPath(base, s)) {
      return;
    }
    // A walk of the table: Spark reports the partitions a job wrote only for a dynamic
    // overwrite. Listing directories is cheap next to the write itself.
    List<String> files = Cmroot.dataFiles(new File(base), true, jobId);
    if (files.isEmpty()) {
      return;
    }
    List<Map<String, String>> parts = new ArrayList<>();
    for (String f : files) {
      Map<String, String> kv = Cmroot.partitionOf(f, base, false);
      if (!kv.isEmpty() && !parts.contains(kv)) {
        parts.add(kv);
      }
    }
    Map<String, Object> body = new LinkedHashMap<>();
    body.put("eventType", "INSERT");
    body.put("db", c.db);
    body.put("table", c.table);
    body.put("partitions", parts);
    body.put("location", c.location);
    body.put("files", Cmroot.fileRefs(files));
    if (c.creating) {
      Cmroot.deferInsert(c.db, c.table, body);
      return;
    }
    try {
      Cmroot.addEvent(body, s, "the insert into " + c.db + "." + c.table);
    } catch (Cmroot.EventException e) {
      throw new UncheckedIOException(e);
    }
  }

  @Override
  public void abortJob(JobContext jobContext) {
    deferred.clear(); // the old data was never touched
    super.abortJob(jobContext);
  }

  /** The partition directories (relative, "k=v/...") the tasks of this job wrote. */
  private static Set<String> partitionPaths(
      scala.collection.immutable.Seq<FileCommitProtocol.TaskCommitMessage> taskCommits) {
    Set<String> out = new LinkedHashSet<>();
    scala.collection.Iterator<FileCommitProtocol.TaskCommitMessage> it = taskCommits.iterator();
    while (it.hasNext()) {
      Object obj = it.next().obj();
      if (obj instanceof scala.Tuple2) {
        Object second = ((scala.Tuple2<?, ?>) obj)._2();
        if (second instanceof scala.collection.Iterable) {
          scala.collection.Iterator<?> ps = ((scala.collection.Iterable<?>) second).iterator();
          while (ps.hasNext()) {
            out.add(String.valueOf(ps.next()));
          }
        }
      }
    }
    return out;
  }
}
