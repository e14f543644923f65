package io.cmroot.metastore;

import java.io.IOException;
import java.util.List;
import java.util.Map;
import java.util.function.Supplier;

/**
 * The statement of an engine that embeds the metastore in its own process (Spark with its
 * embedded Hive metastore), running on this thread: the listeners stage a drop's data as a
 * part of it, and record their events when it ends, so that the whole statement is one
 * unit. A standalone metastore has none: each of its calls is its own unit ({@link Call}).
 */
public interface Statement {
  /** Something to run later (an event to record once the statement's recycles settled). */
  interface Action {
    void run() throws IOException;
  }

  /**
   * Stage `paths` as a part of the statement, in its recycle for (op, db, table, purge).
   * False when failed open (the metastore then deletes as usual).
   */
  boolean prepare(List<String> paths, String op, String db, String table, boolean purge,
      List<Map<String, String>> partitions, String location, String what) throws IOException;

  /** The drop (table or partition key) whose data the statement staged. */
  void markStaged(String dropKey);

  /** Did the statement stage that drop's data (so it has no metadata-only event)? */
  boolean staged(String dropKey);

  /** A part failed where the engine may not see it: put everything back now. */
  void fail(String why);

  /** Run `action` once the statement ended, its recycles settled. */
  void afterEnd(Action action);

  /** A CTAS's INSERT event, held until its table's CREATE_TABLE was recorded; or null. */
  Map<String, Object> takeDeferredInsert(String db, String table);

  /** Whether the statement drops table db.table with PURGE; null if it drops another. */
  Boolean purgeOf(String db, String table);

  /** The partition (drop key) was renamed to `dir` by the statement. */
  void renamedTo(String key, String dir);

  /** Where the statement renamed that partition to, or null. */
  String renamedLocation(String key);

  /** The statements of the engine embedding this metastore, if one registered them. */
  final class Registry {
    private static volatile Supplier<Statement> source;

    private Registry() {}

    /** Called by the engine's hook when it loads. */
    public static void register(Supplier<Statement> current) {
      source = current;
    }

    /** The statement running on this thread, or null. */
    public static Statement current() {
      Supplier<Statement> s = source;
      return s == null ? null : s.get();
    }
  }
}
