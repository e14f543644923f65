package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import java.io.IOException;
import java.util.List;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;

/**
 * cmroot on a Hadoop file system other than the local one (hdfs, s3a, abfs, gs...): what the
 * per-scheme subclasses `cmroot spark-conf --scheme` generates call (see
 * cmroot/jvm/SchemeFileSystem.java.in). A subclass keeps the class Hive and Spark cast to
 * (DistributedFileSystem stays a DistributedFileSystem) and routes its deletes, replacing
 * creates and renames, and bulk deletes here.
 *
 * <p>A delete of a path under a warehouse root is a recycle: the daemon copies each file into
 * the store and removes it (a take), as a part of the running statement or on its own; a
 * create or rename that replaces a data file recycles the old file first. A delete of a root
 * or of a directory holding one is refused. LOAD DATA into or out of such a root is refused
 * before it runs ({@link ForeignRoots}); a rename here belonging to one is refused too.
 */
public final class SchemeHook {
  // Hadoop's trash directory name (TrashPolicyDefault: <home>/.Trash/Current/<path>).
  private static final String TRASH = "/.Trash/";

  private SchemeHook() {}

  /** The place of `f` on `fs`, as cmroot compares it; null when cmroot is off here. */
  private static String place(FileSystem fs, Path f, Cmroot.Settings s) {
    if (!s.enabled) {
      return null;
    }
    Cmroot.useHadoop(fs.getConf());
    return Cmroot.place(fs.makeQualified(f).toString(), fs.getConf());
  }

  private static Cmroot.RawDeletes raw(FileSystem fs) {
    return (Cmroot.RawDeletes) fs;
  }

  /** A delete through the scheme's hook. */
  public static boolean delete(FileSystem fs, Path f, boolean recursive) throws IOException {
    Cmroot.Settings s = Cmroot.settings(fs.getConf());
    String key = place(fs, f, s);
    if (s.debug) {
      Cmroot.debugDelete(s, "delete", String.valueOf(key));
    }
    if (key == null) {
      return raw(fs).rawDelete(f, recursive);
    }
    Cmroot.refuseRootRemoval(key, s, "the delete of");
    CmrootStatement st = CmrootStatement.current();
    Ctx sctx = st == null ? null : st.ctx;
    if (!Ctx.protectedPath(key, s, sctx)) {
      // A job's clean-up of <t>/_temporary where the catalog placed a partition, or another
      // table, below it (<t>/_temporary/7): the job's leftovers go, the data stays.
      List<String> keep = Ctx.keptBelow(key, recursive, sctx);
      if (keep.isEmpty()) {
        return raw(fs).rawDelete(f, recursive);
      }
      deleteAround(key, keep);
      return true;
    }
    refuseLate("delete", key);
    if (!Cmroot.holdsFiles(key, fs.getConf())) {
      if (st == null) {
        return raw(fs).rawDelete(f, recursive); // missing, or directories only
      }
      // Staged ahead by the overwrite it belongs to (CmrootCommitProtocol.stageReplaced):
      // the lock keeps a rollback (which puts staged files back) from running in between.
      synchronized (st.replaceLock()) {
        if (st.stagedFile(key)) {
          return true;
        }
        if (!Cmroot.holdsFiles(key, fs.getConf())) {
          return raw(fs).rawDelete(f, recursive);
        }
      }
    }
    boolean dir = Cmroot.isDirectory(key);
    if (dir && !recursive) {
      return raw(fs).rawDelete(f, false); // a non-empty directory: refused, as it should be
    }
    return Deletes.recycle(key, new Deletes.Labels(key, dir), s, st,
        r -> raw(fs).rawDelete(f, r));
  }

  /** `key` deleted whole, but for the directories `keep` and the way to them. */
  private static void deleteAround(String key, List<String> keep) throws IOException {
    if (keep.contains(key)) {
      return;
    }
    boolean onTheWay = keep.stream().anyMatch(k -> Cmroot.under(k, key));
    if (!onTheWay || !Cmroot.isDirectory(key)) {
      Cmroot.rawDelete(key, true);
      return;
    }
    for (String c : Cmroot.children(key)) {
      deleteAround(c, keep);
    }
  }

  /** Before a create that overwrites `f`: the data file there is recycled first. */
  public static void replacing(FileSystem fs, Path f) throws IOException {
    Cmroot.Settings s = Cmroot.settings(fs.getConf());
    String key = place(fs, f, s);
    CmrootStatement st = CmrootStatement.current();
    if (key == null || Cmroot.isHiddenName(Cmroot.name(key))
        || !Ctx.protectedPath(key, s, st == null ? null : st.ctx) || !Cmroot.isFile(key)) {
      return;
    }
    delete(fs, f, false);
  }

  /**
   * Before a rename of `src` to `dst` (`overwrite`: with Rename.OVERWRITE): null to go on
   * with it, else its result. A rename into a trash directory of warehouse data is its
   * delete (the cmroot is the trash). A rename of a root, or of a directory holding one, is
   * refused: it takes the warehouse away as a delete would. Onto an existing data file, an
   * overwriting rename recycles that file first; a plain one is refused, because whether it
   * replaces the file is the file system's to say (HDFS and S3A refuse, a local disk
   * replaces) and recycling ahead would make either a replacement. A LOAD DATA's move is
   * refused too.
   */
  public static Boolean renaming(FileSystem fs, Path src, Path dst, boolean overwrite)
      throws IOException {
    Cmroot.Settings s = Cmroot.settings(fs.getConf());
    String from = place(fs, src, s);
    String to = place(fs, dst, s);
    if (from == null || to == null || from.equals(to)) {
      return null; // onto itself: the file system's own no-op (or refusal)
    }
    if (to.contains(TRASH)
        && (Cmroot.protectedPath(from, s) || Cmroot.rootWithin(from, s) != null)) {
      return delete(fs, src, true);
    }
    Cmroot.refuseRootRemoval(from, s, "the move of");
    CmrootStatement st = CmrootStatement.current();
    Ctx ctx = st == null ? null : st.ctx;
    if (Ctx.protectedPath(to, s, ctx)) {
      refuseLate("move into", to);
    }
    if (ctx != null && ctx.loading
        && (Cmroot.protectedLocation(from, s) || Cmroot.protectedLocation(to, s))) {
      throw new Cmroot.RecycleException("cmroot refuses to move " + from + " to " + to
          + ": LOAD DATA is not protected on " + Cmroot.scheme(to) + ":// yet. Nothing was"
          + " moved. Write the data with INSERT instead.", null);
    }
    if (overwrite) {
      replacing(fs, dst);
    } else if (!Cmroot.isHiddenName(Cmroot.name(to)) && Ctx.protectedPath(to, s, ctx)
        && Cmroot.isFile(to)) {
      throw new Cmroot.RecycleException("cmroot refuses to rename " + from + " onto the data"
          + " file " + to + ": nothing was moved. Rename with Options.Rename.OVERWRITE (the"
          + " old file is then kept by cmroot), or delete it first.", null);
    }
    return null;
  }

  /** Refuse a write of a failed statement that reaches here after it ended. */
  private static void refuseLate(String what, String path) throws Cmroot.RecycleException {
    String failed = CmrootStatement.failedHere();
    if (failed != null) {
      throw new Cmroot.RecycleException("cmroot refused the " + what + " " + path + ": the"
          + " statement it belongs to failed and was rolled back (" + failed + ")", null);
    }
  }
}
