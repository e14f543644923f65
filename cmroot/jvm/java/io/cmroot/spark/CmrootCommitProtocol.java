package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import io.cmroot.core.CmrootTransaction;
import io.cmroot.core.CmrootFaults;
import java.io.File;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.file.Files;
import java.nio.file.LinkOption;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeSet;
import scala.jdk.javaapi.CollectionConverters;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.mapreduce.JobContext;
import org.apache.hadoop.mapreduce.TaskAttemptContext;
import org.apache.spark.internal.io.FileCommitProtocol;
import org.apache.spark.internal.io.FileNameSpec;
import org.apache.spark.sql.execution.datasources.SQLHadoopMapReduceCommitProtocol;

/**
 * Spark's SQL commit protocol, with the deletions of an overwrite kept until the job commits.
 *
 * <p>For {@code INSERT OVERWRITE} (and {@code mode("overwrite")}) Spark deletes the old
 * partition directories before it writes the new data. Here that delete only takes a snapshot:
 * the files under the path at that moment. At job commit exactly those files are prepared for
 * recycling in one all-or-nothing request, then the job commits. The recycle joins the
 * running statement's transaction ({@link CmrootStatement}) and is committed when the whole
 * statement succeeded, so a failure after the job commit (the metastore refusing the new
 * partitions, another insert of a multi-insert, a commit the daemon rolled back) puts the old
 * files back and removes the ones this job committed; outside a statement it is committed
 * right after the job commit. If the job commit fails the old files are back. So an
 * overwrite never recycles its own output (with FileOutputCommitter v2 the tasks commit
 * straight into the table directory, long before the job commits) nor a file another writer
 * added after the delete was asked. A job that fails before its commit never touched the old
 * files. With dynamic partition overwrite the partitions the job replaces are recycled the
 * same way, listed at job commit, while the new files still wait in Spark's staging directory.
 *
 * <p>After the recycle committed, the new data files of a table under the warehouse roots are
 * recorded as one INSERT event (after the overwrite's recycle, the order replication replays).
 * A Hive SerDe table Spark does not convert (e.g. STORED AS TEXTFILE) is written to a Hive
 * staging directory and moved in afterwards by Hive's loadTable or loadPartition, which keep
 * the file names (they carry this job's id): its INSERT is recorded once the statement is
 * done, from where the files landed.
 *
 * <p>Set with {@code spark.sql.sources.commitProtocolClass=io.cmroot.spark.CmrootCommitProtocol}.
 */
public class CmrootCommitProtocol extends SQLHadoopMapReduceCommitProtocol {
  private static final long serialVersionUID = 1L;

  private final String jobId;
  private final String outputPath;
  private final boolean dynamic;
  private final transient Ctx ctx; // the driver's statement; tasks never need it
  // What the deletes Spark asked for would have removed, when it asked (sorted, no duplicates).
  private final transient Set<String> snapshot = new TreeSet<>();
  private final transient List<String> deletedDirs = new ArrayList<>();
  // Outside a statement: the recycle of a file the overwrite replaced by a directory,
  // prepared when Spark deleted it (see replaceFile).
  private transient CmrootTransaction early;
  // A task's file at a partition's custom location (see commitTask): no relative name
  // starts so.
  private static final String ABSOLUTE = "\0";
  // In a task: the files each attempt is writing, by attempt id (see commitTask).
  private transient Map<String, List<String>> writing;

  public CmrootCommitProtocol(String jobId, String path, boolean dynamicPartitionOverwrite) {
    super(jobId, path, dynamicPartitionOverwrite);
    this.jobId = jobId;
    this.outputPath = path;
    this.dynamic = dynamicPartitionOverwrite;
    CmrootStatement st = CmrootStatement.current();
    this.ctx = st == null ? null : st.ctx;
  }

  @Override
  public String newTaskTempFile(TaskAttemptContext task, scala.Option<String> dir,
      FileNameSpec spec) {
    String temp = super.newTaskTempFile(task, dir, spec);
    String name = getFilename(task, spec); // what the file is called once committed
    writing(task).add(dir.isDefined() ? dir.get() + "/" + name : name);
    return temp;
  }

  @Override
  public String newTaskTempFileAbsPath(TaskAttemptContext task, String absoluteDir,
      FileNameSpec spec) {
    String temp = super.newTaskTempFileAbsPath(task, absoluteDir, spec);
    // The directory as a URI, the form a partition's catalog location has (a directory
    // named `s%2Ft` stays so), then the name: placed as the statement's partition is.
    writing(task).add(ABSOLUTE + new Path(absoluteDir).toUri() + "\0" + getFilename(task, spec));
    return temp;
  }

  /**
   * Spark's commit message, paired with the files the task wrote: relative to the output
   * path ("k=v/part-..."), or ABSOLUTE + directory + NUL + name where Spark writes a
   * partition at a custom location. The INSERT event lists them, so the table need not be
   * walked for them. A Tuple2 and a String[], as Spark's own message is a Tuple2: types
   * every serializer Spark configures knows (Kryo with registrationRequired included).
   */
  @Override
  public FileCommitProtocol.TaskCommitMessage commitTask(TaskAttemptContext task) {
    FileCommitProtocol.TaskCommitMessage m = super.commitTask(task);
    return new FileCommitProtocol.TaskCommitMessage(
        new scala.Tuple2<>(m.obj(), done(task).toArray(new String[0])));
  }

  @Override
  public void abortTask(TaskAttemptContext task) {
    done(task);
    super.abortTask(task);
  }

  private synchronized List<String> writing(TaskAttemptContext task) {
    if (writing == null) {
      writing = new HashMap<>();
    }
    return writing.computeIfAbsent(task.getTaskAttemptID().toString(), k -> new ArrayList<>());
  }

  private synchronized List<String> done(TaskAttemptContext task) {
    List<String> files = writing == null ? null
        : writing.remove(task.getTaskAttemptID().toString());
    return files == null ? List.of() : files;
  }

  /** The files a task reports, when `obj` is one of this protocol's commit messages. */
  private static String[] wrote(Object obj) {
    return obj instanceof scala.Tuple2 && ((scala.Tuple2<?, ?>) obj)._2() instanceof String[]
        ? (String[]) ((scala.Tuple2<?, ?>) obj)._2() : null;
  }

  @Override
  public boolean deleteWithJob(FileSystem fs, Path path, boolean recursive) {
    Cmroot.Settings s = Cmroot.settings(fs.getConf());
    // A path of a hooked file system (file://, or a scheme's hook), as cmroot places it.
    String local = fs instanceof CmrootLocalFileSystem ? Cmroot.localPath(path.toUri().getPath())
        : fs instanceof Cmroot.RawDeletes ? Cmroot.place(fs.makeQualified(path).toString(),
            fs.getConf()) : null;
    try {
      if (local != null) {
        Cmroot.refuseRootRemoval(local, s, "the overwrite of");
      }
      if (local == null || !recursive || !Ctx.protectedPath(local, s, ctx)) {
        return fs.delete(path, recursive);
      }
      if (s.enabled && Cmroot.isFile(local)) {
        return replaceFile(fs, path, local, s);
      }
      snapshot.addAll(Cmroot.filesUnder(local)); // recycled at commit, once the new data is in
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
    deletedDirs.add(local);
    return true;
  }

  /**
   * The overwrite of a path that is a file: the job writes a directory there, so the file
   * must leave now, not at job commit. It is staged (prepared) now and committed with the
   * rest; if the job or the statement fails, it comes back.
   */
  private boolean replaceFile(FileSystem fs, Path path, String local, Cmroot.Settings s)
      throws IOException {
    CmrootStatement st = CmrootStatement.current();
    String base = Cmroot.where(outputPath);
    if (st == null) {
      early = transaction(s, base);
      if (!early.prepare(List.of(local), partitions(List.of(local), base),
          "the overwrite of " + outputPath)) {
        early = null;
        return fs.delete(path, false); // failed open
      }
      return true;
    }
    return stage(st, null, List.of(local), base) || fs.delete(path, false);
  }

  @Override
  public void commitJob(JobContext jobContext,
      scala.collection.immutable.Seq<FileCommitProtocol.TaskCommitMessage> messages) {
    Cmroot.Settings s = Cmroot.settings(jobContext.getConfiguration());
    String base = Cmroot.where(outputPath);
    List<String> wrote = reported(messages, base); // for the INSERT event
    scala.collection.immutable.Seq<FileCommitProtocol.TaskCommitMessage> taskCommits =
        sparkOwn(messages);
    List<String> list = new ArrayList<>();
    try {
      for (String p : snapshot) {
        if (Cmroot.exists(p)) {
          list.add(p); // one another writer removed meanwhile is not ours to keep
        }
      }
      if (dynamic && base != null && Ctx.protectedPath(base, s, ctx)) {
        for (String part : partitionPaths(taskCommits)) {
          list.addAll(Cmroot.filesUnder(Cmroot.isLocal(base)
              ? Cmroot.localPath(new File(base, part).getPath()) : Cmroot.child(base, part)));
        }
      }
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
    // Inside a statement the recycle joins the statement's transaction, committed when the
    // whole statement succeeded (a failure after the job commit, such as the metastore
    // refusing the new partitions, puts the old files back); outside one it is its own.
    CmrootStatement st = CmrootStatement.current();
    CmrootTransaction own = early;
    early = null;
    boolean staging = !list.isEmpty() && s.enabled;
    // A Hive write: the statement moves the committed files from this staging output into
    // its table after the job; they are listed there when it is done.
    boolean moved = st != null && base != null && ctx != null && ctx.table != null
        && ctx.location != null && ctx.temporary(base);
    try {
      if (staging) {
        own = st == null ? (own != null ? own : transaction(s, base)) : null;
        if (!stage(st, own, list, base)) {
          deleteFailedOpen(jobContext, list);
          own = null;
        } else {
          CmrootFaults.afterPrepare(null, "the job commit of " + outputPath);
        }
      }
      super.commitJob(jobContext, taskCommits);
      if (moved && s.enabled && "INSERT_OVERWRITE".equals(ctx.op)) {
        stageReplaced(st, base);
      }
    } catch (Throwable e) {
      if (own != null) {
        own.abort("the job commit of " + outputPath + " failed: " + e);
      }
      throw Cmroot.unchecked(e);
    }
    List<String> emptied = new ArrayList<>(deletedDirs);
    deletedDirs.clear();
    snapshot.clear();
    String target = moved ? ctx.location : base;
    CmrootStatement.Action done = () -> {
      for (String d : emptied) {
        Cmroot.removeEmptyDirectories(d); // what Spark's delete would not have left
      }
      recordInsert(s, target, moved ? null : wrote);
    };
    if (moved && "INSERT_OVERWRITE".equals(ctx.op)) {
      // Hive deletes the old files (each a part of the statement's recycle) and moves these
      // in partition by partition: if a later part is refused, the old files come back and
      // the ones this job committed must go, or the table would hold both.
      st.onRollback("INSERT_OVERWRITE", ctx.db, ctx.table, false,
          () -> removeOutput(ctx.location));
    }
    try {
      if (st != null && (staging || moved)) { // (a CTAS's INSERT waits for its table)
        st.afterCommit(done);
      } else {
        if (own != null) {
          own.commit();
        }
        done.run();
      }
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
  }

  /**
   * A Hive overwrite of the partitions this job committed to its staging output `base`
   * (k=v/... directories holding its files): Hive's load then
   * replaces each from a pool of threads, deleting its old files there. They are staged
   * here, all in one part, before any of those threads starts, and their deletes find them
   * staged (CmrootLocalFileSystem.replacedByHive). One the daemon refuses (a symlink) fails
   * the job commit with nothing moved, not one of Hive's threads midway: Hive interrupts
   * the others then, and an interrupted metastore call of the embedded metastore leaves its
   * connection lost to the pool (with enough lost, every later statement waits forever).
   */
  private void stageReplaced(CmrootStatement st, String base) throws IOException {
    Set<String> parts = new LinkedHashSet<>();
    for (String f : Cmroot.dataFiles(base, true, null, Cmroot.hadoop())) {
      String rel = Cmroot.parent(f).substring(base.length()).replaceAll("^/+", "");
      // Hive's load skips a hidden directory (`_p=1`): it replaces no partition there.
      if (!rel.isEmpty() && java.util.Arrays.stream(rel.split("/"))
          .noneMatch(Cmroot::isHiddenName)) {
        parts.add(rel);
      }
    }
    List<String> paths = new ArrayList<>();
    for (String part : parts) {
      // The partition Hive replaces: the static values of the statement and the dynamic
      // ones its output directory names, where the catalog says it lies. A partition not
      // yet in the catalog has no old files of its own.
      Map<String, String> spec = new LinkedHashMap<>(ctx.staticSpec);
      spec.putAll(Cmroot.partitionOf(part, null, true));
      String dir = CmrootCommands.partitionLocation(ctx, spec);
      for (String e : st.olderEntries(dir)) {
        paths.addAll(Cmroot.withChecksumSibling(e));
      }
    }
    if (paths.isEmpty()) {
      return;
    }
    synchronized (st.replaceLock()) {
      if (st.prepare(paths, "INSERT_OVERWRITE", ctx.db, ctx.table, false,
          ctx.partitionsOf(paths), ctx.location, "the overwrite of " + ctx.db + "."
          + ctx.table)) {
        st.markFilesStaged(paths);
      }
    }
  }

  /** Prepare the overwrite's recycle in the statement, or in `own`; false if failed open. */
  private boolean stage(CmrootStatement st, CmrootTransaction own, List<String> list,
      String base) throws IOException {
    String what = "the overwrite of " + outputPath;
    if (st == null) {
      return own.prepare(list, partitions(list, base), what);
    }
    Ctx c = ctx == null || base == null ? null : ctx.appliesTo(base);
    String db = c == null ? null : c.db;
    String table = c == null ? null : c.table;
    if (!st.prepare(list, "INSERT_OVERWRITE", db, table, false, partitions(list, base),
        c == null ? null : c.location, what)) {
      return false;
    }
    // If the statement fails after the job commit, the old files come back: the files this
    // job committed must go, or the table would hold both.
    st.onRollback("INSERT_OVERWRITE", db, table, false, () -> removeOutput(base));
    if (!dynamic && table != null && st.nested() && st.firstTouch(db, table)) {
      // In a multi-insert a later write may fail after this one's command changed the
      // catalog: dropped the partitions the overwrite emptied (Spark does, once the job
      // committed), added new ones. The files come back, so must the partitions.
      CmrootStatement.Action restore = CmrootCommands.partitionsRestorer(db, table);
      if (restore != null) {
        st.onRollback("INSERT_OVERWRITE", db, table, false, restore);
      }
    }
    return true;
  }

  /** Remove the data files this job committed (their names carry its id). */
  private void removeOutput(String base) {
    for (String p : jobFiles(base)) {
      for (String f : Cmroot.withChecksumSibling(p)) {
        try {
          Cmroot.rawDelete(f, false); // the job's own output: nothing any event recorded
        } catch (IOException e) {
          Cmroot.LOG.error("cmroot: could not remove {} (the output of a rolled back job): {}",
              f, e.toString());
        }
      }
    }
  }

  private CmrootTransaction transaction(Cmroot.Settings s, String base) {
    Ctx c = ctx == null || base == null ? null : ctx.appliesTo(base);
    return new CmrootTransaction(s, "INSERT_OVERWRITE", c == null ? null : c.db,
        c == null ? null : c.table, false, c == null ? null : c.location,
        "the overwrite of " + outputPath);
  }

  /**
   * The data files this job wrote (their names carry its id): under the output path, and in
   * the custom locations of the statement's table's partitions.
   */
  private List<String> jobFiles(String base) {
    Ctx c = ctx == null ? null : ctx.appliesTo(base);
    // A partition's own location may lie below a hidden name of the table's (`_x/7`).
    Set<String> files = new TreeSet<>();
    try {
      files.addAll(Cmroot.dataFiles(base, true, jobId, Cmroot.hadoop()));
      for (String d : c == null ? List.<String>of() : c.dirs()) {
        files.addAll(Cmroot.dataFiles(d, true, jobId, Cmroot.hadoop()));
      }
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
    return new ArrayList<>(files);
  }

  /** The partitions ({k: v}) the files belong to (custom partition locations included). */
  private List<Map<String, String>> partitions(List<String> files, String base) {
    Ctx c = ctx == null || base == null ? null : ctx.appliesTo(base);
    return c != null ? c.partitionsOf(files)
        : Cmroot.partitionsOf(files, p -> Cmroot.partitionOf(p, base, false));
  }

  /** Failed open (logged and counted): delete as Spark would have. */
  private static void deleteFailedOpen(JobContext jobContext, List<String> files)
      throws IOException {
    for (String p : files) {
      Cmroot.rawDelete(p, false);
    }
  }

  /**
   * One INSERT event for the files this job wrote (their names carry its job id) into the
   * table of the statement: `wrote`, as the tasks reported them, or found by a walk of the
   * table when null (a Hive load moved them). A CTAS's waits for the metastore listener to
   * record the table.
   */
  private void recordInsert(Cmroot.Settings s, String base, List<String> wrote)
      throws Cmroot.EventException {
    Ctx c = ctx == null || base == null ? null : ctx.appliesTo(base);
    if (c == null || c.table == null || !Ctx.protectedPath(base, s, c)) {
      return;
    }
    List<String> files = wrote == null ? jobFiles(base) : landed(wrote);
    if (files.isEmpty()) {
      return;
    }
    List<Map<String, String>> parts = partitions(files, base);
    Map<String, Object> body = new LinkedHashMap<>();
    body.put("eventType", "INSERT");
    body.put("db", c.db);
    body.put("table", c.table);
    body.put("partitions", parts);
    body.put("partitionLocations", c.partitionDirsOf(files, parts));
    body.put("location", c.location);
    body.put("files", Cmroot.fileRefs(files));
    CmrootStatement st = CmrootStatement.current();
    if (c.creating && st != null) {
      st.deferInsert(c.db, c.table, body);
      return;
    }
    Cmroot.addEvent(body, s, "the insert into " + c.db + "." + c.table);
  }

  /**
   * Of the files the tasks reported (none below a hidden name), those the walk of
   * {@link #jobFiles} would find: plain files, sorted, without duplicates. One stat for each,
   * where the walk takes two for every entry of the table.
   */
  private static List<String> landed(List<String> wrote) {
    Set<String> out = new TreeSet<>();
    try {
      for (String f : wrote) {
        if (Cmroot.isFile(f)) {
          out.add(f);
        }
      }
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
    return new ArrayList<>(out);
  }

  /** Is the relative path ("k=v/part-...", or a bare name) hidden, or below a hidden name? */
  private static boolean hiddenBelow(String rel) {
    String[] names = rel.split("/");
    for (int i = 0; i < names.length; i++) {
      if (Cmroot.notData(names[i], i < names.length - 1)) {
        return true;
      }
    }
    return false;
  }

  @Override
  public void abortJob(JobContext jobContext) {
    snapshot.clear(); // the old data was never touched
    deletedDirs.clear();
    super.abortJob(jobContext);
    if (early != null) { // a file replaced by the output: back in its place
      early.abort("the job writing " + outputPath + " failed");
      early = null;
    }
  }

  /** The commit messages as Spark's protocol made them, without the files cmroot added. */
  private static scala.collection.immutable.Seq<FileCommitProtocol.TaskCommitMessage> sparkOwn(
      scala.collection.immutable.Seq<FileCommitProtocol.TaskCommitMessage> messages) {
    List<FileCommitProtocol.TaskCommitMessage> out = new ArrayList<>();
    scala.collection.Iterator<FileCommitProtocol.TaskCommitMessage> it = messages.iterator();
    while (it.hasNext()) {
      FileCommitProtocol.TaskCommitMessage m = it.next();
      out.add(wrote(m.obj()) != null
          ? new FileCommitProtocol.TaskCommitMessage(((scala.Tuple2<?, ?>) m.obj())._1()) : m);
    }
    return CollectionConverters.asScala(out).toList();
  }

  /**
   * The data files the tasks reported writing, as places below `base` or at a partition's
   * custom location, none below a hidden name; null when a task did not say (the table is
   * walked for them instead).
   */
  private static List<String> reported(
      scala.collection.immutable.Seq<FileCommitProtocol.TaskCommitMessage> messages,
      String base) {
    if (base == null) {
      return null;
    }
    List<String> out = new ArrayList<>();
    scala.collection.Iterator<FileCommitProtocol.TaskCommitMessage> it = messages.iterator();
    while (it.hasNext()) {
      String[] files = wrote(it.next().obj());
      if (files == null) {
        return null;
      }
      for (String f : files) {
        if (f.startsWith(ABSOLUTE)) {
          // The directory as the catalog's location is read, as the walk of it was.
          int nul = f.indexOf('\0', ABSOLUTE.length());
          String dir = Cmroot.where(java.net.URI.create(f.substring(ABSOLUTE.length(), nul)));
          String name = f.substring(nul + 1);
          if (dir != null && !Cmroot.isHiddenName(name)) {
            out.add(Cmroot.child(dir, name));
          }
        } else if (!hiddenBelow(f)) {
          out.add(Cmroot.isLocal(base) ? Cmroot.child(base, f)
              : Cmroot.uriKey(Cmroot.child(base, f)));
        }
      }
    }
    return out;
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
