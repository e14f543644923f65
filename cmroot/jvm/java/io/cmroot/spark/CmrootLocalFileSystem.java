package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import io.cmroot.core.CmrootTransaction;
import io.cmroot.core.CmrootFaults;
import java.io.File;
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.LinkOption;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.EnumSet;
import java.util.List;
import java.util.Map;
import org.apache.hadoop.fs.CreateFlag;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Options;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.util.Progressable;

/**
 * The `file` scheme with cmroot: a delete of a path under a warehouse root (and not a Spark or
 * Hive temporary path), and a create (overwrite) or rename onto an existing data file there,
 * asks the daemon to move it into the cmroot instead, with the op, table
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
  // Hadoop's trash directory name (TrashPolicyDefault: <home>/.Trash/Current/<path>).
  private static final String TRASH = ".Trash";

  // -- writes that replace a file: the old file is recycled first, as a delete of it --------

  @Override
  public FSDataOutputStream create(Path f, FsPermission permission, boolean overwrite,
      int bufferSize, short replication, long blockSize, Progressable progress)
      throws IOException {
    if (overwrite) {
      recycleReplaced(f);
    }
    FSDataOutputStream out = super.create(f, permission, overwrite, bufferSize, replication,
        blockSize, progress);
    loaded(f);
    return out;
  }

  /** A data file a LOAD DATA writes into its table (LOCAL: a copy): part of its INSERT. */
  private void loaded(Path f) {
    CmrootStatement st = CmrootStatement.current();
    if (st == null || !st.ctx.loading) {
      return;
    }
    String local = Cmroot.localPath(pathToFile(f).getPath());
    Ctx into = local == null ? null : st.ctx.appliesTo(local);
    if (into != null && into.table != null && !into.temporary(local)
        && !Cmroot.isHiddenName(new File(local).getName())) {
      st.movedIn(null, local, List.of(local));
    }
  }

  @Override
  public FSDataOutputStream createNonRecursive(Path f, FsPermission permission,
      boolean overwrite, int bufferSize, short replication, long blockSize,
      Progressable progress) throws IOException {
    if (overwrite) {
      recycleReplaced(f);
    }
    return super.createNonRecursive(f, permission, overwrite, bufferSize, replication,
        blockSize, progress);
  }

  @Override
  public FSDataOutputStream create(Path f, FsPermission permission, EnumSet<CreateFlag> flags,
      int bufferSize, short replication, long blockSize, Progressable progress,
      Options.ChecksumOpt checksumOpt) throws IOException {
    if (flags.contains(CreateFlag.OVERWRITE)) {
      recycleReplaced(f);
    }
    return super.create(f, permission, flags, bufferSize, replication, blockSize, progress,
        checksumOpt);
  }

  @Override
  public FSDataOutputStream createNonRecursive(Path f, FsPermission permission,
      EnumSet<CreateFlag> flags, int bufferSize, short replication, long blockSize,
      Progressable progress) throws IOException {
    if (flags.contains(CreateFlag.OVERWRITE)) {
      recycleReplaced(f);
    }
    return super.createNonRecursive(f, permission, flags, bufferSize, replication, blockSize,
        progress);
  }

  /**
   * A rename onto an existing file replaces it (the raw local rename does): recycle it. A
   * statement that renames a data file of another table into its own (LOAD DATA INPATH)
   * takes it away from its path: its bytes are kept there first (a copy-mode part of the
   * statement), and the file is recorded as the statement's table's new data.
   */
  @Override
  public boolean rename(Path src, Path dst) throws IOException {
    if (intoTrash(src, dst)) {
      return delete(src, true, false);
    }
    if (pathToFile(src).getAbsoluteFile().toPath().normalize()
        .equals(pathToFile(dst).getAbsoluteFile().toPath().normalize())) {
      return super.rename(src, dst); // onto itself (a LOAD of a table's own file): a no-op
    }
    Cmroot.Settings s = Cmroot.settings(getConf());
    refuseRootMove(src, s);
    String target = s.enabled ? Cmroot.localPath(pathToFile(dst).getPath()) : null;
    if (Ctx.protectedPath(target, s, statementCtx())) {
      refuseLate("move into", target);
    }
    recycleReplaced(dst);
    CmrootStatement st = CmrootStatement.current();
    String from = st == null || !s.enabled ? null : Cmroot.localPath(pathToFile(src).getPath());
    String to = from == null ? null : Cmroot.localPath(pathToFile(dst).getPath());
    Ctx into = to == null ? null : st.ctx.appliesTo(to);
    java.nio.file.Path source = from == null ? null : new File(from).toPath();
    boolean link = source != null && Files.isSymbolicLink(source);
    // LOAD DATA moves what its path holds one entry at a time: files, and directories whole.
    boolean dir = source != null && st.ctx.loading && !link
        && Files.isDirectory(source, LinkOption.NOFOLLOW_LINKS);
    // What a LOAD DATA moves is the data its path names, whatever that is called.
    if (into == null || into.table == null || (!st.ctx.loading && into.temporary(from))
        || !(link || dir || Files.isRegularFile(source, LinkOption.NOFOLLOW_LINKS))) {
      return super.rename(src, dst); // a job's or Hive's staging output, or a directory
    }
    if (link) {
      throw new Cmroot.RecycleException("cmroot refuses to move " + from + " into "
          + into.db + "." + into.table + ": it is a symlink, which cmroot never follows, so"
          + " the table's new data could not be recorded for replication. Nothing was moved."
          + " Load the file itself.", null);
    }
    List<String> files = Cmroot.filesUnder(from, !st.ctx.loading);
    // Data files leaving their place under the roots (another table's, or another partition
    // of this one): their bytes are kept there first, unless the statement did at its start.
    List<String> keep = st.notKept(files);
    boolean data = st.ctx.loading ? Cmroot.protectedLocation(from, s)
        : Ctx.protectedPath(from, s, into);
    if (data && !keep.isEmpty() && !st.prepareCopy(keep,
        "the move of " + from + " into " + into.table, into.appliesTo(from))) {
      return super.rename(src, dst); // failed open
    }
    String landed = Files.isDirectory(new File(to).toPath(), LinkOption.NOFOLLOW_LINKS)
        ? new File(to, new File(from).getName()).getPath() : to;
    boolean moved = super.rename(src, dst);
    if (moved) {
      List<String> now = new ArrayList<>();
      for (String f : files) {
        if (!Cmroot.isHiddenName(new File(f).getName())) {
          now.add(landed + f.substring(from.length()));
        }
      }
      st.movedIn(from, landed, now);
    }
    return moved;
  }

  /** The context of the statement running on this thread, or null. */
  private static Ctx statementCtx() {
    CmrootStatement st = CmrootStatement.current();
    return st == null ? null : st.ctx;
  }

  /** Refuse a write of a failed statement that reaches here after it ended (see failedHere). */
  private static void refuseLate(String what, String path) throws Cmroot.RecycleException {
    String failed = CmrootStatement.failedHere();
    if (failed != null) {
      throw new Cmroot.RecycleException("cmroot refused the " + what + " " + path + ": the"
          + " statement it belongs to failed and was rolled back (" + failed + ")", null);
    }
  }

  /** The rename Hadoop's Trash uses (Rename.TO_TRASH), and FileContext's with OVERWRITE. */
  @Override
  protected void rename(Path src, Path dst, Options.Rename... options) throws IOException {
    if (intoTrash(src, dst)) {
      if (!delete(src, true, false)) {
        throw new IOException("cmroot: could not recycle " + src + " instead of moving it to "
            + "the trash");
      }
      return;
    }
    refuseRootMove(src, Cmroot.settings(getConf()));
    if (Arrays.asList(options).contains(Options.Rename.OVERWRITE)) {
      recycleReplaced(dst);
    }
    super.rename(src, dst, options);
  }

  /** A rename of a root, or of a directory holding one, takes the warehouse away: refused. */
  private void refuseRootMove(Path src, Cmroot.Settings s) throws IOException {
    String from = s.enabled ? Cmroot.localPath(pathToFile(src).getPath()) : null;
    if (from != null) {
      Cmroot.refuseRootRemoval(from, s, "the move of");
    }
  }

  /**
   * Is this a rename of a warehouse path into a trash directory (Hadoop's Trash, which Hive
   * uses for the old files of an overwrite or a drop when fs.trash.interval > 0)? That is a
   * delete: the cmroot is the trash, so the path is recycled instead of moved behind its back.
   */
  private boolean intoTrash(Path src, Path dst) {
    Cmroot.Settings s = Cmroot.settings(getConf());
    String to = s.enabled ? Cmroot.localPath(pathToFile(dst).getPath()) : null;
    if (to == null || !to.contains("/" + TRASH + "/")) {
      return false;
    }
    String from = Cmroot.localPath(pathToFile(src).getPath());
    return Cmroot.protectedPath(from, s) || Cmroot.rootWithin(from, s) != null;
  }

  /**
   * Recycle the data file at `f` (a delete through this hook, with the statement's context)
   * before a write replaces it. Directories are not replaced by a create or rename onto them;
   * Hadoop's hidden names (_SUCCESS, .crc) are not data and are rewritten by every job.
   */
  private void recycleReplaced(Path f) throws IOException {
    Cmroot.Settings s = Cmroot.settings(getConf());
    String local = s.enabled ? Cmroot.localPath(pathToFile(f).getPath()) : null;
    if (local == null || Cmroot.isHiddenName(new File(local).getName())
        || !Ctx.protectedPath(local, s, statementCtx())) {
      return;
    }
    java.nio.file.Path p = new File(local).toPath();
    if (Files.isRegularFile(p, LinkOption.NOFOLLOW_LINKS) || Files.isSymbolicLink(p)) {
      delete(f, false);
    }
  }

  // -- deletes --------------------------------------------------------------------------------

  @Override
  public boolean delete(Path f, boolean recursive) throws IOException {
    return delete(f, recursive, true);
  }

  /** Delete `file` (at `f`) whole, but for the directories `keep` and the way to them. */
  private boolean deleteAround(Path f, File file, List<String> keep) throws IOException {
    String here = file.getPath();
    if (keep.contains(here)) {
      return true;
    }
    boolean onTheWay = keep.stream().anyMatch(k -> Cmroot.under(k, here));
    if (!onTheWay || !Files.isDirectory(file.toPath(), LinkOption.NOFOLLOW_LINKS)) {
      return super.delete(f, true);
    }
    File[] children = file.listFiles();
    for (File c : children == null ? new File[0] : children) {
      deleteAround(new Path(f, c.getName()), c, keep);
    }
    return true;
  }

  /**
   * `ahead`: a data file of an overwrite may be staged with its directory's others (see
   * replacedByHive). Not for a move into the trash: Hadoop's Trash first checks that the file
   * is still there, which one staged ahead no longer is.
   */
  private boolean delete(Path f, boolean recursive, boolean ahead) throws IOException {
    Cmroot.Settings s = Cmroot.settings(getConf());
    String local = s.enabled ? Cmroot.localPath(pathToFile(f).getPath()) : null;
    if (s.debug) {
      Cmroot.debugDelete(s, "delete", String.valueOf(local));
    }
    if (local == null) {
      return super.delete(f, recursive);
    }
    Cmroot.refuseRootRemoval(local, s, "the delete of");
    Ctx sctx = statementCtx();
    if (!Ctx.protectedPath(local, s, sctx)) {
      // A job's clean-up of <t>/_temporary where the catalog placed a partition, or another
      // table, below it (<t>/_temporary/7): the job's leftovers go, the data stays.
      List<String> keep = Ctx.keptBelow(local, recursive, sctx);
      return keep.isEmpty() ? super.delete(f, recursive) : deleteAround(f, new File(local), keep);
    }
    refuseLate("delete", local);
    File file = new File(local);
    CmrootStatement st = CmrootStatement.current();
    if (!Cmroot.holdsFiles(file.toPath())) {
      if (st == null) {
        return super.delete(f, recursive); // missing, or directories only: no data to keep
      }
      // Staged with the rest of its directory by an earlier delete (replacedByHive), maybe
      // on another of Hive's threads right now: its lock is held until they are marked. The
      // lock also keeps a rollback of the statement (which puts staged files back) from
      // running between this look and the delete.
      synchronized (st.replaceLock()) {
        if (st.stagedFile(local)) {
          return true;
        }
        if (!Cmroot.holdsFiles(file.toPath())) {
          return super.delete(f, recursive);
        }
      }
      // Files came back meanwhile (the statement was rolled back): they are data to keep.
    }
    if (file.isDirectory() && !recursive) {
      return super.delete(f, false); // a non-empty directory: Hadoop refuses, as it should
    }
    Deletes.Labels l = new Deletes.Labels(local, file.isDirectory());
    if (ahead && st != null && recursive && "INSERT_OVERWRITE".equals(l.op)
        && Files.isRegularFile(file.toPath(), LinkOption.NOFOLLOW_LINKS)) {
      return replacedByHive(f, file, st, l);
    }
    return Deletes.recycle(local, l, s, st, r -> super.delete(f, r));
  }

  /**
   * A data file of an overwrite deleted by itself: Hive replaces a directory's contents file
   * by file (one delete each, from a pool of threads, then its new files). The first of those
   * deletes stages every data file the directory held before the statement began, in one
   * request, not one round trip per file; the others find theirs staged. Files newer than
   * the statement (a concurrent writer's, or its own) are not Hive's to replace from here.
   */
  private boolean replacedByHive(Path f, File file, CmrootStatement st, Deletes.Labels l)
      throws IOException {
    synchronized (st.replaceLock()) {
      if (st.stagedFile(file.getPath())) {
        return true;
      }
      if (!Files.isRegularFile(file.toPath(), LinkOption.NOFOLLOW_LINKS)) {
        return super.delete(f, true);
      }
      List<String> paths = st.olderSiblings(file);
      if (!st.prepare(paths, l.op, l.db, l.table, l.purge, l.parts(), l.location, l.what)) {
        return super.delete(f, true); // failed open (logged and counted)
      }
      st.markFilesStaged(paths);
    }
    CmrootFaults.afterPrepare(null, l.what);
    return true;
  }
}
