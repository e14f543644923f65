package io.cmroot.spark;

import java.io.File;
import java.io.IOException;
import java.util.List;
import java.util.Map;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;

/**
 * The `file` scheme with cmroot: a delete of a path under a warehouse root (and not a Spark or
 * Hive temporary path) asks the daemon to move it into the cmroot instead, with the op, table
 * and partition of the statement running on this thread. Inside a statement the delete joins
 * the statement's prepared recycle, committed when the statement succeeds (so a TRUNCATE of
 * many partitions or a Hive overwrite deleting file by file is one unit); outside one it is
 * prepared and committed on its own. If the daemon refuses or cannot be reached, the delete
 * fails and nothing is deleted (unless spark.cmroot.failOpen=true). A delete of a warehouse
 * root, or of a directory containing one, is refused.
 *
 * <p>Set with {@code spark.hadoop.fs.file.impl=io.cmroot.spark.CmrootLocalFileSystem}. It
 * extends LocalFileSystem (not the raw one) because Hadoop and Hive cast
 * {@code FileSystem.getLocal(conf)} to LocalFileSystem.
 */
public class CmrootLocalFileSystem extends LocalFileSystem {
  // Files that keep appearing under a directory being deleted: staged again this many times.
  private static final int RESTAGE_ROUNDS = 3;

  @Override
  public boolean delete(Path f, boolean recursive) throws IOException {
    Cmroot.Settings s = Cmroot.settings(getConf());
    String local = s.enabled ? Cmroot.localPath(pathToFile(f).getPath()) : null;
    if (s.debug) {
      Cmroot.debugDelete(s, "delete", String.valueOf(local));
    }
    if (local == null) {
      return super.delete(f, recursive);
    }
    Cmroot.refuseRootRemoval(local, s, "the delete of");
    if (!Cmroot.protectedPath(local, s)) {
      return super.delete(f, recursive);
    }
    File file = new File(local);
    if (!Cmroot.holdsFiles(file.toPath())) {
      return super.delete(f, recursive); // missing, or directories only: no data to keep
    }
    if (file.isDirectory() && !recursive) {
      return super.delete(f, false); // a non-empty directory: Hadoop refuses, as it should
    }
    CmrootStatement st = CmrootStatement.current();
    Cmroot.Ctx ctx = CmrootStatement.contextFor(local);
    String op = ctx == null ? "DELETE" : ctx.deleteOp();
    Map<String, String> part = Cmroot.partitionOf(local, ctx == null ? null : ctx.location,
        file.isDirectory());
    String db = ctx == null ? null : ctx.db;
    String table = ctx == null ? null : ctx.table;
    String location = ctx == null ? null : ctx.location;
    boolean purge = ctx != null && ctx.purge;
    String what = "the delete of " + local;
    CmrootTransaction own = st != null ? null
        : new CmrootTransaction(s, op, db, table, purge, location, what);
    List<String> paths = Cmroot.withChecksumSibling(local);
    for (int round = 0; round < RESTAGE_ROUNDS && !paths.isEmpty(); round++) {
      List<Map<String, String>> parts = part.isEmpty() ? List.of() : List.of(part);
      boolean staged = st != null
          ? st.prepare(paths, op, db, table, purge, parts, location, what)
          : own.prepare(paths, parts, what);
      if (!staged) {
        return super.delete(f, recursive); // failed open (logged and counted)
      }
      // A writer may have added files meanwhile: they are part of what this delete removes.
      paths = file.exists() ? Cmroot.filesUnder(local) : List.of();
    }
    try {
      if (!paths.isEmpty()) {
        throw new Cmroot.RecycleException("cmroot: files keep appearing under " + local
            + " while it is deleted (" + paths.get(0) + "); stop the writer and run the "
            + "statement again", null);
      }
      if (file.exists()) {
        super.delete(f, true); // what the daemon left is empty directories only
      }
      CmrootFaults.afterPrepare(what);
      if (own != null) {
        own.commit();
      }
    } catch (IOException | RuntimeException e) {
      if (own != null) {
        own.abort(e.toString());
      }
      throw e;
    }
    return true;
  }
}
