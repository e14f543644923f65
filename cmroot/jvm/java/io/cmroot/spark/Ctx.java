package io.cmroot.spark;

import io.cmroot.core.Cmroot;
import java.io.IOException;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;

/**
 * What the statement running on this thread is doing: op, table, purge, location, and
 * whether it creates the table it writes (a CTAS). op "INSERT" is an append.
 */
public final class Ctx {
  /** The statement of a multi-insert as a whole: each insert in it has its own context. */
  static final Ctx MULTI_INSERT = new Ctx("MULTI_INSERT", null, null, false, null);

  public final String op;
  public final String db;
  public final String table;
  public final boolean purge;
  public final String location;
  public final boolean creating;
  // The table's partitions at custom locations (anywhere but the k=v/... path below
  // `location`): directory -> spec, for the partitions and new files a write records.
  final Map<String, Map<String, String>> partitionDirs;
  // The static partition values of an INSERT into a Hive table (PARTITION (p=1, q)): a
  // dynamic one's staging output names only the dynamic columns.
  final Map<String, String> staticSpec;
  // A LOAD DATA: every data file the statement writes into its table is recorded as its
  // INSERT (LOAD DATA LOCAL copies with plain creates, which no commit protocol sees).
  final boolean loading;

  public Ctx(String op, String db, String table, boolean purge, String location) {
    this(op, db, table, purge, location, false, Map.of(), false, Map.of());
  }

  public Ctx(String op, String db, String table, boolean purge, String location,
      boolean creating) {
    this(op, db, table, purge, location, creating, Map.of(), false, Map.of());
  }

  private Ctx(String op, String db, String table, boolean purge, String location,
      boolean creating, Map<String, Map<String, String>> partitionDirs, boolean loading,
      Map<String, String> staticSpec) {
    this.loading = loading;
    this.staticSpec = staticSpec;
    this.op = op;
    this.db = db;
    this.table = table;
    this.purge = purge;
    this.location = location;
    this.creating = creating;
    this.partitionDirs = partitionDirs;
  }

  /** This context, with the table's partitions at custom locations (directory -> spec). */
  Ctx withPartitionDirs(Map<String, Map<String, String>> dirs) {
    return new Ctx(op, db, table, purge, location, creating, Map.copyOf(dirs), loading,
        staticSpec);
  }

  /** This context, for a LOAD DATA. */
  Ctx loading() {
    return new Ctx(op, db, table, purge, location, creating, partitionDirs, true,
        staticSpec);
  }

  /** This context, for an INSERT with these static partition values. */
  Ctx withStaticSpec(Map<String, String> spec) {
    return new Ctx(op, db, table, purge, location, creating, partitionDirs, loading,
        Map.copyOf(spec));
  }

  /** The directories of the table: its location, then its custom partition locations. */
  List<String> dirs() {
    List<String> out = new ArrayList<>();
    if (location != null) {
      out.add(location);
    }
    out.addAll(new java.util.TreeSet<>(partitionDirs.keySet()));
    return out;
  }

  /**
   * Is `path` a job's temporary or staging output? In the table's location or one of its
   * partitions' own, only the names below that directory count: a table or partition
   * registered at a place named like a committer's attempt directory ({@code _temporary/7})
   * holds data all the same; a job's staging output inside the table does not.
   */
  boolean temporary(String path) {
    String deepest = deepestDir(path);
    if (deepest == null) {
      return Cmroot.isTemporary(path);
    }
    // Temporary if a temporary name, read from any of the directories holding the path,
    // ends below the deepest of them: a partition registered at <t>/_temporary/7 is the
    // attempt directory itself (data), one at <t>/_temporary holds the job's <t>/_temporary
    // /0 output (not data).
    for (String d : dirs()) {
      if (Cmroot.under(path, d) && Cmroot.temporaryEnd(d, path) > deepest.length()) {
        return true;
      }
    }
    return false;
  }

  /** The deepest of the table's directories (`dirs()`) holding `path`, or null. */
  private String deepestDir(String path) {
    String deepest = null;
    for (String d : dirs()) {
      if (Cmroot.under(path, d) && (deepest == null || d.length() > deepest.length())) {
        deepest = d;
      }
    }
    return deepest;
  }

  /**
   * The table's directories strictly below `path`: what a delete of a temporary `path`
   * (a job's clean-up of <t>/_temporary) must leave in place.
   */
  List<String> dirsBelow(String path) {
    List<String> out = new ArrayList<>();
    for (String d : dirs()) {
      if (!d.equals(path) && Cmroot.under(d, path)) {
        out.add(d);
      }
    }
    return out;
  }

  /**
   * What a recursive delete of the temporary `path` must leave in place (a job's clean-up of
   * <t>/_temporary): the directories of the statement's table below it (`ctx`, if any), and
   * what numbered directories in it hold that no committer writes (Cmroot.dataInAttempts).
   */
  static List<String> keptBelow(String path, boolean recursive, Ctx ctx) throws IOException {
    if (!recursive) {
      return List.of();
    }
    List<String> keep = new ArrayList<>(Cmroot.dataInAttempts(path));
    if (ctx != null) {
      keep.addAll(ctx.dirsBelow(path));
    }
    return keep;
  }

  /** The distinct partitions ({k: v}) `files` belong to, in the order first met. */
  List<Map<String, String>> partitionsOf(List<String> files) {
    return Cmroot.partitionsOf(files, f -> partitionOf(f, false));
  }

  /**
   * The directory of each of `parts` (this context's partitionsOf(files)), read off the
   * files in it: what an event's `partitionLocations` says. Null if one is unknown (an
   * event without it places its partitions by their paths).
   */
  List<String> partitionDirsOf(List<String> files, List<Map<String, String>> parts) {
    Map<Map<String, String>, String> dirs = new java.util.HashMap<>();
    for (String f : files) {
      dirs.putIfAbsent(partitionOf(f, false), partitionDir(f, false));
    }
    List<String> out = new ArrayList<>();
    for (Map<String, String> p : parts) {
      String d = dirs.get(p);
      if (d == null) {
        return null;
      }
      out.add(d);
    }
    return out;
  }

  /** The partition ({k: v}) `path` belongs to, in the table's directory or a custom one. */
  Map<String, String> partitionOf(String path, boolean isDir) {
    String dir = partitionDir(path, isDir);
    Map<String, String> custom = dir == null ? null : partitionDirs.get(dir);
    return custom != null ? custom : Cmroot.partitionOf(path, location, isDir);
  }

  /** The directory of the partition `path` belongs to (custom or default), or null. */
  private String partitionDir(String path, boolean isDir) {
    String deepest = null; // a partition's location may lie inside another's
    for (String d : partitionDirs.keySet()) {
      if (Cmroot.under(path, d) && (deepest == null || d.length() > deepest.length())) {
        deepest = d;
      }
    }
    // A partition at its default place (k=v/... below the table) inside a custom location
    // (the table's root, or another partition's k=v parent) is the deeper one.
    int byDefault = defaultPlaceEnd(path, isDir);
    if (deepest != null && deepest.length() >= byDefault) {
      return deepest;
    }
    return byDefault < 0 ? null : path.substring(0, byDefault);
  }

  /**
   * The length of the default partition directory holding `path` (the run of k=v
   * directories right below the table's location), or -1.
   */
  private int defaultPlaceEnd(String path, boolean isDir) {
    if (location == null || !Cmroot.under(path, location) || path.equals(location)) {
      return -1;
    }
    String base = location.replaceAll("/+$", "");
    String[] segs = path.substring(base.length() + 1).split("/");
    int n = isDir ? segs.length : segs.length - 1;
    int end = -1;
    int at = base.length();
    for (int i = 0; i < n && segs[i].indexOf('=') > 0; i++) {
      at += 1 + segs[i].length();
      end = at;
    }
    return end;
  }

  /**
   * The op of a delete seen while this statement runs: an append replaces nothing, so
   * anything it does delete is recycled as a plain DELETE.
   */
  String deleteOp() {
    return "INSERT".equals(op) ? "DELETE" : op;
  }

  /**
   * This context, if `path` is in its table's directory or in one of its partitions' own
   * locations (declared to the daemon as the recycle's `partitionLocations`).
   */
  Ctx appliesTo(String path) {
    if (location != null && Cmroot.under(path, location)) {
      return this;
    }
    for (String d : partitionDirs.keySet()) {
      if (Cmroot.under(path, d)) {
        return this;
      }
    }
    return null;
  }

  /** The table's partitions' own locations outside its directory. */
  List<String> partitionLocations() {
    List<String> out = new ArrayList<>();
    for (String d : new java.util.TreeSet<>(partitionDirs.keySet())) {
      if (location == null || !Cmroot.under(d, location)) {
        out.add(d);
      }
    }
    return out;
  }

  /**
   * {@link Cmroot#protectedPath}, judged for the table `ctx` (a statement's) writes: a path in its
   * location or one of its partitions' own, by the catalog's word, is data whatever those
   * are named (see {@link #temporary}).
   */
  static boolean protectedPath(String path, Cmroot.Settings s, Ctx ctx) {
    return path != null && Cmroot.protectedLocation(path, s)
        && !(ctx == null ? Cmroot.isTemporary(path) : ctx.temporary(path));
  }

  @Override
  public String toString() {
    return op + " " + db + "." + table + (purge ? " PURGE" : "") + (creating ? " CREATE" : "")
        + " @" + location;
  }
}
