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
 * and partition of the statement running on this thread. If the daemon refuses or cannot be
 * reached, the delete fails and nothing is deleted (unless spark.cmroot.failOpen=true).
 *
 * <p>Set with {@code spark.hadoop.fs.file.impl=io.cmroot.spark.CmrootLocalFileSystem}. It
 * extends LocalFileSystem (not the raw one) because Hadoop and Hive cast
 * {@code FileSystem.getLocal(conf)} to LocalFileSystem.
 */
public class CmrootLocalFileSystem extends LocalFileSystem {

  @Override
  public boolean delete(Path f, boolean recursive) throws IOException {
    Cmroot.Settings s = Cmroot.settings(getConf());
    String local = s.enabled ? Cmroot.localPath(pathToFile(f).getPath()) : null;
    if (s.debug) {
      Cmroot.debugDelete(s, "delete", String.valueOf(local));
    }
    if (local == null || !Cmroot.protectedPath(local, s)) {
      return super.delete(f, recursive);
    }
    File file = new File(local);
    if (!Cmroot.holdsFiles(file.toPath())) {
      return super.delete(f, recursive); // missing, or directories only: no data to keep
    }
    if (file.isDirectory() && !recursive) {
      return super.delete(f, false); // a non-empty directory: Hadoop refuses, as it should
    }
    List<String> paths = Cmroot.withChecksumSibling(local);
    Cmroot.Ctx ctx = Cmroot.contextFor(local);
    String op = ctx == null ? "DELETE" : ctx.deleteOp();
    Map<String, String> part = Cmroot.partitionOf(local, ctx == null ? null : ctx.location,
        file.isDirectory());
    boolean recycled = Cmroot.recycle(paths, op, ctx == null ? null : ctx.db,
        ctx == null ? null : ctx.table, ctx != null && ctx.purge,
        part.isEmpty() ? List.of() : List.of(part), ctx == null ? null : ctx.location, s,
        "the delete of " + local);
    if (!recycled) {
      return super.delete(f, recursive); // disabled, or failed open (logged and counted)
    }
    if (file.exists()) {
      super.delete(f, true); // what the daemon left is empty directories only
    }
    return true;
  }
}
