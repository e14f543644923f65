package io.cmroot.spark;

import io.cmroot.metastore.Statement;
import io.cmroot.core.Cmroot;
import io.cmroot.core.CmrootTransaction;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

/**
 * One destructive statement while it runs: what it does ({@link Ctx}: op, table,
 * purge, location) and the prepared recycles of every delete it makes, one
 * {@link CmrootTransaction} per (op, db, table, purge), committed together once the
 * statement succeeded and aborted together when it failed (invariant 2: a statement is one
 * unit). {@link CmrootStatementCommand} opens one around each destructive command, with
 * try/finally, so a statement's context never outlives it.
 *
 * <p>A statement opened while another runs on the thread (each insert of a multi-insert,
 * wrapped inside the statement of the whole) has its own context but is part of the outer
 * one: its recycles join the outer statement's transactions and are committed or aborted
 * with them.
 *
 * <p>The current statement is inherited by threads started while it runs (Hive deletes a
 * table's old files from a pool it starts for the call); a thread that outlives it finds it
 * closed and ignores it.
 */
public final class CmrootStatement implements Statement {
  private static final InheritableThreadLocal<CmrootStatement> CURRENT =
      new InheritableThreadLocal<>();

  static {
    // The embedded metastore's listeners stage and record as parts of the running statement.
    Statement.Registry.register(CmrootStatement::current);
    Cmroot.addAuditPart(CmrootStatement::audit);
  }

  final Ctx ctx;
  private final Cmroot.Settings s;
  private final CmrootStatement outer;
  // The outermost statement: the unit that holds, commits and aborts every recycle.
  private final CmrootStatement unit;
  private final Map<String, CmrootTransaction> txs = new LinkedHashMap<>();
  // Drops (table or partition keys) whose data this statement staged: the metastore's
  // post-event then has no metadata-only drop to record.
  private final Set<String> staged = ConcurrentHashMap.newKeySet();
  // A CTAS writes its files before it creates its table: its INSERT event waits here, keyed
  // db.table, until the metastore listener has recorded the CREATE_TABLE.
  private final Map<String, Map<String, Object>> deferredInserts = new ConcurrentHashMap<>();
  // What runs once every recycle of the statement is committed (a write's INSERT event, the
  // removal of the directories an overwrite emptied), in the order it was added.
  private final List<Pending> afterCommit = new ArrayList<>();
  // What undoes a write whose recycle is rolled back (keyed like txs): an overwrite's job
  // committed its new files next to the old ones, which the rollback puts back.
  private final Map<String, List<Action>> undo = new LinkedHashMap<>();
  // Partitions (drop keys) the statement renamed, with their latest locations: Spark may
  // move a renamed partition's directory once more after the metastore did (a partition
  // column spelled in upper case), which is part of the rename, not a new location.
  private final Map<String, String> renamed = new ConcurrentHashMap<>();
  // Data files the statement renamed into its table from elsewhere (see movedIn).
  private final List<String> movedIn = new ArrayList<>();
  // Their renames ({from, to}), latest first: undone if the statement fails.
  private final List<String[]> moves = new ArrayList<>();
  // Files staged ahead of their own delete (CmrootLocalFileSystem: a directory Hive replaces
  // file by file): their deletes find them gone and succeed.
  private final Set<String> stagedFiles = ConcurrentHashMap.newKeySet();
  // Files of another table a LOAD kept before anything moved (CmrootStatementCommand): their
  // renames find them kept.
  private final Set<String> kept = ConcurrentHashMap.newKeySet();
  // Tables (db.table) whose catalog partitions a write listed for the rollback (firstTouch).
  private final Set<String> touched = ConcurrentHashMap.newKeySet();
  private final long startedMillis = System.currentTimeMillis();
  // The SQL text of the statement, when Spark kept it (for the audit); set on the unit.
  private volatile String sql;
  private volatile boolean open = true;
  private volatile String failure;

  private CmrootStatement(Ctx ctx, Cmroot.Settings s, CmrootStatement outer) {
    this.ctx = ctx;
    this.s = s;
    this.outer = outer;
    this.unit = outer == null ? this : outer.unit;
  }

  /**
   * Open a statement on this thread; {@link #close} it in a finally block. `sql`: its text,
   * if known (null for a statement nested in another: the outer one's text stands).
   */
  static CmrootStatement open(Ctx ctx, Cmroot.Settings s, String sql) {
    CmrootStatement st = new CmrootStatement(ctx, s, current());
    if (st.unit.sql == null && sql != null) {
      st.unit.sql = sql;
    }
    CURRENT.set(st);
    return st;
  }

  /** Spark's part of the audit: its user and application, and the statement's text. */
  private static Map<String, String> audit() {
    Map<String, String> m = new LinkedHashMap<>();
    scala.Option<org.apache.spark.SparkContext> sc =
        org.apache.spark.SparkContext$.MODULE$.getActive();
    if (sc.isDefined()) {
      m.put("user", sc.get().sparkUser());
      m.put("app", sc.get().appName() + " " + sc.get().applicationId());
    }
    CmrootStatement st = current();
    if (st != null) {
      m.put("statement", st.unit.sql);
    }
    return m;
  }

  /** The statement running on this thread, or null. */
  public static CmrootStatement current() {
    CmrootStatement st = CURRENT.get();
    return st != null && st.open ? st : null;
  }

  /**
   * Why the statement this thread worked for failed, if it did and has ended; else null.
   * Hive cancels a failed load's other threads by interrupting them, and they may still be
   * deleting or moving files after the statement ended: those writes belong to a statement
   * that was rolled back, and must not run outside it, as if on their own.
   */
  static String failedHere() {
    CmrootStatement st = CURRENT.get();
    return st == null || st.open ? null : st.unit.failure;
  }

  /** The context of the current statement, if `path` belongs to its table; else null. */
  static Ctx contextFor(String path) {
    CmrootStatement st = current();
    return st == null ? null : st.ctx.appliesTo(path);
  }

  /**
   * Stage `paths` as a part of this statement: they join its transaction for (op, db, table,
   * purge). Returns false when failed open (the caller deletes as Spark would).
   */
  @Override
  public boolean prepare(List<String> paths, String op, String db, String table,
      boolean purge, List<Map<String, String>> partitions, String location, String part)
      throws Cmroot.RecycleException {
    CmrootStatement u = unit;
    if (u.failure != null) {
      throw new Cmroot.RecycleException("cmroot: " + u.failure, null);
    }
    CmrootTransaction tx;
    synchronized (u.txs) {
      tx = u.txs.computeIfAbsent(CmrootTransaction.key(op, db, table, purge),
          k -> new CmrootTransaction(s, op, db, table, purge, location, "the statement " + ctx)
              .withPartitionLocations(table != null && table.equalsIgnoreCase(ctx.table)
                  && String.valueOf(db).equalsIgnoreCase(String.valueOf(ctx.db))
                  ? ctx.partitionLocations() : List.of()));
    }
    return u.prepareIn(tx, paths, partitions, part);
  }

  /**
   * One part of the statement, under the replace lock: a part the daemon refuses rolls the
   * whole transaction back there and then, and a delete on another of Hive's threads that
   * looks at a directory (see CmrootLocalFileSystem) must see it before or after that, never
   * in between. After a refusal every later part is refused at once.
   */
  private boolean prepareIn(CmrootTransaction tx, List<String> paths,
      List<Map<String, String>> partitions, String part) throws Cmroot.RecycleException {
    synchronized (stagedFiles) {
      if (failure != null) {
        throw new Cmroot.RecycleException("cmroot: " + failure, null);
      }
      try {
        return tx.prepare(paths, partitions, part);
      } catch (Cmroot.RecycleException e) {
        failure = e.getMessage();
        throw e;
      }
    }
  }

  /**
   * Keep the bytes of `paths` (files of another table, or of no table, that the statement
   * moves into its own: LOAD DATA INPATH) under their paths, as one more part of this
   * statement: a copy-mode recycle, op DELETE, committed with the rest. The rename then moves
   * the files themselves. Returns false when failed open.
   */
  boolean prepareCopy(List<String> paths, String part, Ctx from)
      throws Cmroot.RecycleException {
    CmrootStatement u = unit;
    if (u.failure != null) {
      throw new Cmroot.RecycleException("cmroot: " + u.failure, null);
    }
    // Labelled with the table when the file leaves a partition of the statement's own table
    // (a replica of it must drop it there); a file of another table has no known label.
    String db = from == null ? null : from.db;
    String table = from == null ? null : from.table;
    CmrootTransaction tx;
    synchronized (u.txs) {
      tx = u.txs.computeIfAbsent("copy\u0000" + CmrootTransaction.key("DELETE", db, table,
          false), k -> new CmrootTransaction(s, "copy", "DELETE", db, table, false,
          from == null ? null : from.location,
          "the files the statement " + ctx + " moves out of their place")
          .withPartitionLocations(from == null ? List.of() : from.partitionLocations()));
    }
    return u.prepareIn(tx, paths, from == null ? List.of() : from.partitionsOf(paths), part);
  }

  /**
   * Data files this statement moved into its table by renaming `from` to `to` (LOAD DATA
   * INPATH: a file, or a directory of them): all of them are recorded as one INSERT once the
   * statement committed. If it fails, `to` goes back to `from` (Hive moves a load's files one
   * at a time: a later one refused must not leave the earlier ones in the table); one the
   * statement wrote itself (`from` null: LOAD DATA LOCAL's copy) is removed.
   */
  void movedIn(String from, String to, List<String> files) {
    CmrootStatement u = unit;
    synchronized (u.movedIn) {
      if (u.movedIn.isEmpty()) {
        afterCommit(() -> u.recordMovedIn(ctx));
      }
      u.movedIn.addAll(files);
      u.moves.add(0, new String[] {from, to}); // undone latest first
    }
  }

  /** Put what the statement moved in back where it came from (its failure; logged). */
  private void moveBack() {
    List<String[]> all;
    synchronized (movedIn) {
      all = new ArrayList<>(moves);
      moves.clear();
      movedIn.clear();
    }
    for (String[] m : all) {
      java.nio.file.Path to = java.nio.file.Paths.get(m[1]);
      try {
        if (m[0] == null) { // a copy of a file left where it was
          for (String f : Cmroot.withChecksumSibling(m[1])) {
            java.nio.file.Files.deleteIfExists(java.nio.file.Paths.get(f));
          }
          continue;
        }
        java.nio.file.Path from = java.nio.file.Paths.get(m[0]);
        if (java.nio.file.Files.exists(to, java.nio.file.LinkOption.NOFOLLOW_LINKS)
            && !java.nio.file.Files.exists(from, java.nio.file.LinkOption.NOFOLLOW_LINKS)) {
          java.nio.file.Files.createDirectories(from.getParent());
          java.nio.file.Files.move(to, from, java.nio.file.StandardCopyOption.ATOMIC_MOVE);
        }
      } catch (java.io.IOException | RuntimeException e) {
        Cmroot.LOG.error("cmroot: the statement failed, and {} it moved from {} could not go "
            + "back: {}", m[1], m[0], e.toString());
      }
    }
  }

  private void recordMovedIn(Ctx c) throws java.io.IOException {
    List<String> files;
    synchronized (movedIn) {
      files = new ArrayList<>(movedIn);
      movedIn.clear();
    }
    List<Map<String, String>> parts = c.partitionsOf(files);
    Map<String, Object> body = new LinkedHashMap<>();
    body.put("eventType", "INSERT");
    body.put("db", c.db);
    body.put("table", c.table);
    body.put("partitions", parts);
    body.put("partitionLocations", c.partitionDirsOf(files, parts));
    body.put("location", c.location);
    body.put("files", Cmroot.fileRefs(files));
    Cmroot.addEvent(body, s, "the files moved into " + c.db + "." + c.table);
  }

  /** The partition `key` was renamed (or renamed and moved again) to `dir` by this statement. */
  @Override
  public Boolean purgeOf(String db, String table) {
    return table.equalsIgnoreCase(ctx.table) && db.equalsIgnoreCase(String.valueOf(ctx.db))
        ? ctx.purge : null;
  }

  @Override
  public void renamedTo(String key, String dir) {
    unit.renamed.put(key, String.valueOf(dir));
  }

  /** Where the partition `key` renamed by this statement is now; null if it was not. */
  @Override
  public String renamedLocation(String key) {
    return unit.renamed.get(key);
  }

  /**
   * `file` and the data files next to it whose inode last changed before the statement began
   * (ctime: a file written, renamed or linked there since is newer), each with its checksum
   * sibling. What Hive listed to replace, without what arrived after the statement started.
   */
  List<String> olderSiblings(java.io.File file) throws java.io.IOException {
    List<String> out = new ArrayList<>(Cmroot.withChecksumSibling(file.getPath()));
    for (String f : olderEntries(file.getParent())) {
      if (!f.equals(file.getPath()) && Cmroot.isFile(f)) {
        out.addAll(Cmroot.withChecksumSibling(f));
      }
    }
    return out;
  }

  /**
   * The entries of the directory `dir` Hive replaces (not hidden, not directories) last
   * changed before the statement began; none if `dir` is missing.
   */
  List<String> olderEntries(String dir) throws java.io.IOException {
    return dir == null ? List.of() : Cmroot.olderEntries(dir, unit.startedMillis);
  }

  void markKept(List<String> paths) {
    unit.kept.addAll(paths);
  }

  /** Those of `paths` whose bytes the statement has not kept yet. */
  List<String> notKept(List<String> paths) {
    List<String> out = new ArrayList<>();
    for (String p : paths) {
      if (!unit.kept.contains(p)) {
        out.add(p);
      }
    }
    return out;
  }

  /** Serialises the deletes of files staged ahead (see CmrootLocalFileSystem). */
  Object replaceLock() {
    return unit.stagedFiles;
  }

  void markFilesStaged(List<String> paths) {
    unit.stagedFiles.addAll(paths);
  }

  boolean stagedFile(String path) {
    return unit.stagedFiles.contains(path);
  }

  @Override
  public void markStaged(String dropKey) {
    unit.staged.add(dropKey);
  }

  @Override
  public boolean staged(String dropKey) {
    return unit.staged.contains(dropKey);
  }

  void deferInsert(String db, String table, Map<String, Object> body) {
    unit.deferredInserts.put(Cmroot.tableKey(db, table), body);
  }

  @Override
  public Map<String, Object> takeDeferredInsert(String db, String table) {
    return unit.deferredInserts.remove(Cmroot.tableKey(db, table));
  }

  /**
   * A part of the statement failed where Spark may not see it (the metastore reports a failed
   * drop to its post-event listeners): put everything back now; the commit then fails.
   */
  @Override
  public void fail(String why) {
    unit.failure = why;
    unit.abort(why);
  }

  /** An action waiting for the statement's end; `always`: also when the statement fails. */
  private static final class Pending {
    final Action action;
    final boolean always;

    Pending(Action action, boolean always) {
      this.action = action;
      this.always = always;
    }
  }

  /** Run `action` once the statement's recycles are committed; never if it fails. */
  void afterCommit(Action action) {
    synchronized (unit.afterCommit) {
      unit.afterCommit.add(new Pending(action, false));
    }
  }

  /**
   * Run `action` (recording a change already made) when the statement ends: after its
   * recycles were committed, in the order of {@link #afterCommit}; after they were put back
   * when it fails.
   */
  @Override
  public void afterEnd(Action action) {
    synchronized (unit.afterCommit) {
      unit.afterCommit.add(new Pending(action, true));
    }
  }

  /** Take the pending actions (only those run on failure too, unless `committed`). */
  private List<Action> takePending(boolean committed) {
    List<Action> out = new ArrayList<>();
    synchronized (afterCommit) {
      for (Pending p : afterCommit) {
        if (committed || p.always) {
          out.add(p.action);
        }
      }
      afterCommit.clear();
    }
    return out;
  }

  /** Is this statement one write of a larger one (a multi-insert's)? */
  boolean nested() {
    return outer != null;
  }

  /**
   * True the first time a write of the statement asks for db.table: the catalog as that
   * first write found it is what a rollback restores, not as a later write of the same
   * table (after the first one's changes) found it.
   */
  boolean firstTouch(String db, String table) {
    return unit.touched.add(db + "." + table);
  }

  /** Run `action` if the recycle (op, db, table, purge) of the statement is rolled back. */
  void onRollback(String op, String db, String table, boolean purge, Action action) {
    synchronized (unit.txs) {
      unit.undo.computeIfAbsent(CmrootTransaction.key(op, db, table, purge),
          k -> new ArrayList<>()).add(action);
    }
  }

  /**
   * Publish every prepared recycle of the statement, in the order they were opened, then run
   * what waits for that ({@link #afterCommit}). A statement nested in another leaves that to
   * the outer one.
   */
  void commit() throws Cmroot.RecycleException {
    if (unit != this) {
      return;
    }
    if (failure != null) {
      abort(failure);
      throw new Cmroot.RecycleException("cmroot: " + failure + "; nothing was recycled", null);
    }
    List<Map.Entry<String, CmrootTransaction>> all;
    synchronized (txs) {
      all = new ArrayList<>(txs.entrySet());
    }
    for (int i = 0; i < all.size(); i++) {
      try {
        all.get(i).getValue().commit();
      } catch (Cmroot.RecycleException e) {
        for (Map.Entry<String, CmrootTransaction> later : all.subList(i + 1, all.size())) {
          later.getValue().abort("an earlier recycle of the statement could not be committed");
        }
        undo(all.subList(i, all.size()), e);
        recordAfterFailure();
        throw e;
      }
    }
    for (Action a : takePending(true)) {
      try {
        a.run();
      } catch (java.io.IOException e) {
        throw Cmroot.unchecked(e);
      }
    }
    recordDeferredInserts();
  }

  /**
   * A CTAS's INSERT that no metastore listener in this JVM took: the metastore is remote,
   * and its cmroot plugin recorded the CREATE_TABLE while the statement ran. Recorded now,
   * after it, as the embedded listener would have.
   */
  private void recordDeferredInserts() {
    List<Map<String, Object>> left = new ArrayList<>(deferredInserts.values());
    deferredInserts.clear();
    for (Map<String, Object> body : left) {
      try {
        Cmroot.addEvent(body, s, "the data written by CREATE TABLE " + body.get("db") + "."
            + body.get("table") + " AS SELECT");
      } catch (java.io.IOException e) {
        throw Cmroot.unchecked(e);
      }
    }
  }

  /** Put back every file the statement staged (never throws; see CmrootTransaction.abort). */
  void abort(String why) {
    CmrootStatement u = unit;
    List<Map.Entry<String, CmrootTransaction>> all;
    synchronized (u.txs) {
      all = new ArrayList<>(u.txs.entrySet());
    }
    synchronized (u.stagedFiles) { // see prepareIn
      if (u.failure == null) {
        u.failure = why;
      }
      for (Map.Entry<String, CmrootTransaction> tx : all) {
        tx.getValue().abort(why);
      }
    }
    u.undo(all, null);
    u.moveBack();
    u.recordAfterFailure();
  }

  /** A failed statement still records the changes it made (logged when it cannot). */
  private void recordAfterFailure() {
    for (Action a : takePending(false)) {
      try {
        a.run();
      } catch (java.io.IOException | RuntimeException e) {
        Cmroot.LOG.error("cmroot: {}", e.getMessage());
      }
    }
  }

  /** Undo the writes of the rolled-back transactions `rolledBack` (once each; logged). */
  private void undo(List<Map.Entry<String, CmrootTransaction>> rolledBack, Exception cause) {
    for (Map.Entry<String, CmrootTransaction> tx : rolledBack) {
      List<Action> actions;
      synchronized (txs) {
        actions = undo.remove(tx.getKey());
      }
      for (Action a : actions == null ? List.<Action>of() : actions) {
        try {
          a.run();
        } catch (java.io.IOException | RuntimeException e) {
          Cmroot.LOG.error("cmroot: could not undo a write of {} after its recycle was rolled "
              + "back ({}): {}", tx.getValue(), cause, e.toString());
        }
      }
    }
  }

  /** End the statement on this thread; the statement it was nested in (if any) is current. */
  void close() {
    open = false;
    if (outer != null) {
      CURRENT.set(outer);
    } else {
      CURRENT.remove();
    }
  }

  @Override
  public String toString() {
    return String.valueOf(ctx);
  }
}
