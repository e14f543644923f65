package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import io.cmroot.core.CmrootFaults;
import io.cmroot.core.CmrootTransaction;
import java.io.IOException;
import java.util.List;
import java.util.Map;

/**
 * The recycle of what one delete through a file system hook removes, on any scheme: the
 * path (a file, or a directory whole) is prepared in the running statement or in its own
 * transaction, files that appear meanwhile are prepared with it, and what the daemon left
 * (empty directories) is deleted. Shared by the `file` hook and the other schemes' hooks.
 */
final class Deletes {
  // Files that keep appearing under a directory being deleted: staged again this many times.
  private static final int RESTAGE_ROUNDS = 3;

  private Deletes() {}

  /** The file system's own delete of the path, without cmroot. */
  interface Rest {
    boolean delete(boolean recursive) throws IOException;
  }

  /** What a delete of a path is recorded as: the running statement's op, table, partition. */
  static final class Labels {
    final String op;
    final String db;
    final String table;
    final boolean purge;
    final String location;
    final Map<String, String> part;
    final String what;

    Labels(String key, boolean isDir) {
      Ctx ctx = CmrootStatement.contextFor(key);
      op = ctx == null ? "DELETE" : ctx.deleteOp();
      part = ctx == null ? Cmroot.partitionOf(key, null, isDir) : ctx.partitionOf(key, isDir);
      db = ctx == null ? null : ctx.db;
      table = ctx == null ? null : ctx.table;
      location = ctx == null ? null : ctx.location;
      purge = ctx != null && ctx.purge;
      what = "the delete of " + key;
    }

    List<Map<String, String>> parts() {
      return part.isEmpty() ? List.of() : List.of(part);
    }
  }

  /**
   * Recycle `key` (see the class comment) in `st`, or on its own when `st` is null; `rest`
   * deletes what is left. Returns what the delete returns.
   */
  static boolean recycle(String key, Labels l, Cmroot.Settings s, CmrootStatement st,
      Rest rest) throws IOException {
    CmrootTransaction own = st != null ? null
        : new CmrootTransaction(s, l.op, l.db, l.table, l.purge, l.location, l.what);
    List<String> paths = Cmroot.withChecksumSibling(key);
    for (int round = 0; round < RESTAGE_ROUNDS && !paths.isEmpty(); round++) {
      boolean staged = st != null
          ? st.prepare(paths, l.op, l.db, l.table, l.purge, l.parts(), l.location, l.what)
          : own.prepare(paths, l.parts(), l.what);
      if (!staged) {
        return rest.delete(true); // failed open (logged and counted)
      }
      // A writer may have added files meanwhile: they are part of what this delete removes.
      paths = present(key) ? Cmroot.filesUnder(key) : List.of();
    }
    try {
      if (!paths.isEmpty()) {
        throw new Cmroot.RecycleException("cmroot: files keep appearing under " + key
            + " while it is deleted (" + paths.get(0) + "); stop the writer and run the "
            + "statement again", null);
      }
      if (present(key)) {
        rest.delete(true); // what the daemon left is empty directories only
      }
      CmrootFaults.afterPrepare(null, l.what);
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

  /** Is something at `key`? Locally as java.io sees it (a symlink is followed). */
  private static boolean present(String key) throws IOException {
    return Cmroot.isLocal(key) ? new java.io.File(key).exists() : Cmroot.exists(key);
  }
}
