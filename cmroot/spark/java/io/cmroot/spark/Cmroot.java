package io.cmroot.spark;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.File;
import java.io.IOException;
import java.net.URI;
import java.net.URLDecoder;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.concurrent.atomic.AtomicLong;
import java.util.stream.Stream;
import org.apache.hadoop.conf.Configuration;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * The shared core of the cmroot Spark shim: settings, the path rules (which paths are
 * recycled, which are refused), the statement context type, the table definition replication
 * recreates tables from, and the daemon's HTTP calls ({@link CmrootTransaction} makes the
 * two-phase recycles, {@link #addEvent} records events). All store logic lives in the daemon;
 * this only tells it what to recycle and what changed.
 */
public final class Cmroot {
  static final Logger LOG = LoggerFactory.getLogger("io.cmroot.spark");

  /** Deletions that went ahead without a recycle because spark.cmroot.failOpen=true. */
  public static final AtomicLong FAIL_OPEN_DELETES = new AtomicLong();
  /** Events (changes already made) not recorded because spark.cmroot.failOpen=true. */
  public static final AtomicLong FAIL_OPEN_EVENTS = new AtomicLong();

  private static final ObjectMapper JSON = new ObjectMapper();
  private static volatile HttpClient http;

  private Cmroot() {}

  public static long failOpenDeletes() {
    return FAIL_OPEN_DELETES.get();
  }

  public static long failOpenEvents() {
    return FAIL_OPEN_EVENTS.get();
  }

  // -- settings ---------------------------------------------------------------------------

  /** The spark.cmroot.* settings of the application (see {@link #conf}). */
  public static final class Settings {
    public final String url;
    public final String token;
    public final boolean enabled;
    public final boolean failOpen;
    public final boolean debug;
    public final List<String> roots;
    /** Seconds a prepared recycle is held for its statement between renewals. */
    public final long leaseSeconds;

    Settings(String url, String token, boolean enabled, boolean failOpen, boolean debug,
        List<String> roots, long leaseSeconds) {
      this.url = url;
      this.token = token;
      this.enabled = enabled;
      this.failOpen = failOpen;
      this.debug = debug;
      this.roots = roots;
      this.leaseSeconds = leaseSeconds;
    }
  }

  /** The keys a session may not change: they decide whether and where files are kept. */
  public static final List<String> FIXED_KEYS = List.of("url", "token", "enabled", "failOpen",
      "warehouseRoots", "lease");

  /**
   * spark.cmroot.KEY from the application's static conf (the SparkConf every SparkEnv of the
   * application shares: driver and executors), else $CMROOT_KEY. Never the session's runtime
   * conf nor the per-query Hadoop conf, which a SQL user can change with SET: the protection
   * is the application's, not a session switch. Without Spark in this JVM (a bare Hadoop
   * client or a standalone metastore) it is the Hadoop conf's spark.cmroot.KEY or cmroot.KEY.
   */
  static String conf(Configuration hconf, String key, String dflt) {
    String v = null;
    org.apache.spark.SparkConf spark = sparkConf();
    if (spark != null) {
      v = spark.get("spark.cmroot." + key, null);
    } else if (hconf != null) {
      v = hconf.get("spark.cmroot." + key, hconf.get("cmroot." + key));
    }
    if (v == null) {
      v = System.getenv("CMROOT_" + key.toUpperCase(Locale.ROOT));
    }
    return v == null || v.isEmpty() ? dflt : v;
  }

  /** The application's SparkConf, or null without a running Spark application here. */
  static org.apache.spark.SparkConf sparkConf() {
    try {
      org.apache.spark.SparkEnv env = org.apache.spark.SparkEnv.get();
      return env == null ? null : env.conf();
    } catch (Throwable e) {
      return null; // no Spark classes in this JVM
    }
  }

  public static Settings settings(Configuration hconf) {
    String roots = conf(hconf, "warehouseRoots", null);
    org.apache.spark.SparkConf spark = sparkConf();
    if (roots == null && spark != null) {
      roots = spark.get("spark.sql.warehouse.dir", null);
    }
    if (roots == null && spark == null && hconf != null) {
      roots = hconf.get("spark.sql.warehouse.dir", hconf.get("hive.metastore.warehouse.dir"));
    }
    List<String> list = new ArrayList<>();
    if (roots != null) {
      for (String r : roots.split(",")) {
        String p = localPath(r.trim());
        if (p != null && !p.isEmpty()) {
          list.add(p);
        }
      }
    }
    // No spark.cmroot.url anywhere: this application did not ask for cmroot (the file system
    // may be a cached instance from an earlier application in this JVM): stay inert.
    String url = conf(hconf, "url", null);
    return new Settings(
        url == null ? "" : url.replaceAll("/+$", ""),
        conf(hconf, "token", null),
        url != null && Boolean.parseBoolean(conf(hconf, "enabled", "true")),
        Boolean.parseBoolean(conf(hconf, "failOpen", "false")),
        Boolean.parseBoolean(conf(hconf, "debug", "false")),
        list,
        seconds(conf(hconf, "lease", "10m"), "spark.cmroot.lease"));
  }

  /** "90s", "10m", "1h" or plain seconds, as seconds (the daemon takes 1 s to 1 day). */
  static long seconds(String value, String key) {
    String v = value.trim().toLowerCase(Locale.ROOT);
    long unit = 1;
    if (v.endsWith("s")) {
      v = v.substring(0, v.length() - 1);
    } else if (v.endsWith("m")) {
      unit = 60;
      v = v.substring(0, v.length() - 1);
    } else if (v.endsWith("h")) {
      unit = 3600;
      v = v.substring(0, v.length() - 1);
    }
    try {
      long n = Long.parseLong(v.trim()) * unit;
      if (n >= 1 && n <= 86400) {
        return n;
      }
    } catch (NumberFormatException e) {
      // reported below
    }
    throw new IllegalArgumentException("cmroot: " + key + "=" + value + " is not a duration "
        + "between 1s and 24h: write it like 90s, 10m or 1h");
  }

  // -- paths ------------------------------------------------------------------------------

  /**
   * An absolute, normalized local path, its parent directories' symlinks resolved (see
   * {@link #real}), for file:/..., file:///... or /...; null otherwise.
   */
  public static String localPath(String pathOrUri) {
    if (pathOrUri == null || pathOrUri.isEmpty()) {
      return null;
    }
    String p = pathOrUri;
    if (p.startsWith("file:")) {
      try {
        p = new URI(p).getPath();
      } catch (Exception e) {
        p = p.substring("file:".length());
      }
    } else if (p.matches("^[a-zA-Z][a-zA-Z0-9+.-]*:.*")) {
      return null; // another scheme
    }
    if (p == null || p.isEmpty()) {
      return null;
    }
    return real(Paths.get(p).toAbsolutePath().normalize(), false);
  }

  /**
   * The local path of a partition's metastore location, which reaches the metastore spelt
   * two ways: as a URI (a value's escaped directory name `s=x%3Dy` written `s=x%253Dy`) or
   * as a Hadoop path string (`s=x%3Dy` as is). The URI reading, unless only the other names
   * a directory that exists.
   */
  static String existingLocalPath(String loc) {
    String p = localPath(loc);
    if (p == null || new File(p).exists() || !loc.startsWith("file:")) {
      return p;
    }
    String raw = localPath(loc.substring("file:".length()));
    return raw != null && new File(raw).exists() ? raw : p;
  }

  /**
   * `p` with its symlinks resolved: the real path of its longest existing prefix, then the
   * rest as named. Without `followLast` its last component stays as named (a delete of a
   * symlink removes the link, not its target). Paths are compared, and sent to the daemon,
   * this way: a root or a table reached through a symlinked directory is still that root or
   * table, never "outside the roots".
   */
  static String real(Path p, boolean followLast) {
    Path name = p.getFileName();
    if (!followLast && name != null && p.getParent() != null) {
      return Paths.get(real(p.getParent(), true)).resolve(name).toString();
    }
    Path existing = p;
    Path rest = null;
    while (existing != null) {
      try {
        Path r = existing.toRealPath();
        return (rest == null ? r : r.resolve(rest)).normalize().toString();
      } catch (IOException e) {
        Path last = existing.getFileName();
        if (last == null) {
          break;
        }
        rest = rest == null ? last : last.resolve(rest);
        existing = existing.getParent();
      }
    }
    return p.toString();
  }

  static boolean under(String path, String root) {
    return path.equals(root) || path.startsWith(root.endsWith("/") ? root : root + "/");
  }

  // The staging directories Spark and Hive create inside a job's output, by their exact
  // shapes: a user's table or partition directory is never taken for one (a table named
  // `_temporary_orders` or `.hive-staging-x` is data). Spark's dynamic overwrite stages in
  // .spark-staging-<job UUID>; Hive (and Spark's HiveTempPath) in
  // <hive.exec.stagingdir>_hive_<yyyy-MM-dd_HH-mm-ss_SSS>_<random>-<task runner id>, where
  // hive.exec.stagingdir is .hive-staging unless the application or a session (SET) names
  // another: the shape after the name is Hive's own and unlike any table's directory.
  private static final java.util.regex.Pattern SPARK_STAGING = java.util.regex.Pattern.compile(
      "\\.spark-staging-\\p{XDigit}{8}-\\p{XDigit}{4}-\\p{XDigit}{4}-\\p{XDigit}{4}-"
          + "\\p{XDigit}{12}");
  private static final java.util.regex.Pattern HIVE_STAGING = java.util.regex.Pattern.compile(
      "[^/]+_hive_\\d{4}-\\d{2}-\\d{2}_\\d{2}-\\d{2}-\\d{2}_\\d{3}_-?\\d+-\\d+");
  // Hadoop's FileOutputCommitter writes under <output>/_temporary/<application attempt>/.
  private static final java.util.regex.Pattern ATTEMPT = java.util.regex.Pattern.compile(
      "\\d+");

  /** Spark's and Hive's own temporary and staging paths, never recycled. */
  public static boolean isTemporary(String path) {
    return temporaryBelow("", path);
  }

  /**
   * Is `path` (under `base`) in a job's temporary or staging output below `base`? Only the
   * names below `base` count: a table located at a place named like a committer's attempt
   * directory ({@code _temporary/7}) holds data all the same, and so does what is below it.
   */
  static boolean temporaryBelow(String base, String path) {
    return temporaryEnd(base, path) >= 0;
  }

  /**
   * Where the first temporary or staging name below `base` in `path` ends (the length of
   * the prefix of `path` through it: {@code <base>/_temporary/0}, {@code <base>/.spark-
   * staging-<uuid>}), or -1 if there is none.
   */
  static int temporaryEnd(String base, String path) {
    String[] segs = path.substring(base.length()).split("/");
    int end = base.length();
    for (int i = 0; i < segs.length; i++) {
      end += (i == 0 ? 0 : 1) + segs[i].length();
      if (isStagingName(segs[i])) {
        return end;
      }
      if (segs[i].equals("_temporary")) {
        if (i + 1 < segs.length && ATTEMPT.matcher(segs[i + 1]).matches()) {
          return end + 1 + segs[i + 1].length();
        }
        if (i + 1 == segs.length && isCommitterTemporary(new File(path))) {
          return end;
        }
      }
    }
    return -1;
  }

  static boolean isStagingName(String seg) {
    return SPARK_STAGING.matcher(seg).matches() || HIVE_STAGING.matcher(seg).matches();
  }

  /**
   * A `_temporary` directory as FileOutputCommitter lays it out: only application-attempt
   * directories (0, 1, ...) in it. A table called `_temporary` holds data files or k=v
   * directories, so it is not one.
   */
  static boolean isCommitterTemporary(File dir) {
    File[] children = dir.listFiles();
    if (children == null || children.length == 0) {
      return false;
    }
    for (File c : children) {
      if (!c.isDirectory() || !ATTEMPT.matcher(c.getName()).matches()) {
        return false;
      }
    }
    return true;
  }

  /** Hadoop's and Hive's hidden names (".x.crc", "_SUCCESS"): never data of a table. */
  static boolean isHiddenName(String name) {
    return name.startsWith(".") || name.startsWith("_");
  }

  /**
   * The data files in `dir` (and below it when `recursive`), sorted: no temporary or hidden
   * names, and only names containing `mark` when it is not null.
   */
  static List<String> dataFiles(File dir, boolean recursive, String mark) {
    List<String> out = new ArrayList<>();
    File[] children = dir.listFiles();
    if (children == null) {
      return out;
    }
    for (File f : children) {
      String n = f.getName();
      boolean isDir = f.isDirectory();
      // Spark's and Hive's staging names are all hidden ones, none with a '='. As Spark's
      // file index has it, a directory `_src=1` or `.p=1` is a partition all the same.
      if (isHiddenName(n) && !(isDir && n.indexOf('=') > 1)) {
        continue;
      }
      if (isDir) {
        if (recursive) {
          out.addAll(dataFiles(f, true, mark));
        }
      } else if (f.isFile() && (mark == null || n.contains(mark))) {
        out.add(f.getPath()); // under `dir`, already a real path
      }
    }
    java.util.Collections.sort(out);
    return out;
  }

  /** The distinct non-empty partitions `of` gives `files`, in the order first met. */
  static List<Map<String, String>> partitionsOf(List<String> files,
      java.util.function.Function<String, Map<String, String>> of) {
    List<Map<String, String>> parts = new ArrayList<>();
    for (String f : files) {
      Map<String, String> kv = of.apply(f);
      if (!kv.isEmpty() && !parts.contains(kv)) {
        parts.add(kv);
      }
    }
    return parts;
  }

  /** `paths` as the files of an event: [{"path"}], hashed by the daemon. */
  static List<Map<String, Object>> fileRefs(List<String> paths) {
    List<Map<String, Object>> out = new ArrayList<>();
    for (String p : paths) {
      out.add(Map.of("path", p));
    }
    return out;
  }

  /** Is `path` under a warehouse root, and not a temporary path? */
  public static boolean protectedPath(String path, Settings s) {
    return path != null && !isTemporary(path) && protectedLocation(path, s);
  }

  /**
   * {@link #protectedPath}, judged for the table `ctx` (a statement's) writes: a path in its
   * location or one of its partitions' own, by the catalog's word, is data whatever those
   * are named (see {@link Ctx#temporary}).
   */
  static boolean protectedPath(String path, Settings s, Ctx ctx) {
    return path != null && protectedLocation(path, s)
        && !(ctx == null ? isTemporary(path) : ctx.temporary(path));
  }

  /**
   * Is this location of a table or partition, as the catalog records it, under a root? Its
   * name does not matter: a directory named like a job's temporary output
   * ({@code _temporary/7}) that someone registered as a partition holds that partition's data.
   */
  static boolean protectedLocation(String location, Settings s) {
    if (location == null || !s.enabled) {
      return false;
    }
    for (String root : s.roots) {
      if (under(location, root)) {
        return true;
      }
    }
    return false;
  }

  /**
   * The warehouse root that `path` is, or contains, null if none; also when `path` is a
   * symlink to one of them (removing an alias of the warehouse is refused all the same).
   */
  static String rootWithin(String path, Settings s) {
    if (path == null || !s.enabled) {
      return null;
    }
    String target = real(Paths.get(path), true);
    for (String root : s.roots) {
      if (under(root, path) || under(root, target)) {
        return root;
      }
    }
    return null;
  }

  /**
   * Refuse (throw) a delete of `path` when it is a warehouse root or contains one: removing it
   * would take the whole warehouse with it, and nothing of it would be kept (invariant 5).
   */
  static void refuseRootRemoval(String path, Settings s, String what) throws RecycleException {
    String root = rootWithin(path, s);
    if (root != null && Files.exists(Paths.get(path), java.nio.file.LinkOption.NOFOLLOW_LINKS)) {
      String msg = "cmroot refuses " + what + " " + path + ": "
          + (root.equals(path) ? "it is" : "it contains") + " the warehouse root " + root
          + ", which is never removed. Nothing was deleted. Delete the tables or files under "
          + root + " instead, or write to a directory that holds no warehouse root";
      LOG.error(msg);
      throw new RecycleException(msg, null);
    }
  }

  /**
   * Every file (and symlink) under `dir`, or `dir` itself when it is one, skipping Spark's and
   * Hive's temporary directories below it: what a delete of `dir` asked now would remove.
   */
  static List<String> filesUnder(String dir) throws IOException {
    return filesUnder(dir, true);
  }

  /**
   * {@link #filesUnder(String)}, or with `skipTemporary` false every file below `dir`
   * whatever its directories are called: what a LOAD DATA moves is data all of it.
   */
  static List<String> filesUnder(String dir, boolean skipTemporary) throws IOException {
    Path root = Paths.get(dir);
    List<String> out = new ArrayList<>();
    if (!Files.isDirectory(root, java.nio.file.LinkOption.NOFOLLOW_LINKS)) {
      if (Files.exists(root, java.nio.file.LinkOption.NOFOLLOW_LINKS)) {
        out.add(dir);
      }
      return out;
    }
    Files.walkFileTree(root, new java.nio.file.SimpleFileVisitor<Path>() {
      @Override
      public java.nio.file.FileVisitResult preVisitDirectory(Path d,
          java.nio.file.attribute.BasicFileAttributes a) {
        return skipTemporary && !d.equals(root) && temporaryBelow(root.toString(), d.toString())
            ? java.nio.file.FileVisitResult.SKIP_SUBTREE
            : java.nio.file.FileVisitResult.CONTINUE;
      }

      @Override
      public java.nio.file.FileVisitResult visitFile(Path f,
          java.nio.file.attribute.BasicFileAttributes a) {
        out.add(f.toString());
        return java.nio.file.FileVisitResult.CONTINUE;
      }

      @Override
      public java.nio.file.FileVisitResult visitFileFailed(Path f, IOException e)
          throws IOException {
        if (e instanceof java.nio.file.NoSuchFileException) {
          return java.nio.file.FileVisitResult.CONTINUE; // removed meanwhile: not ours to keep
        }
        throw e;
      }
    });
    java.util.Collections.sort(out);
    return out;
  }

  /**
   * What a directory holds (the entries with files in them), so that the directory itself
   * stays for the metastore to delete (it logs an error when the directory it drops is
   * already gone); the directory itself when it cannot be listed.
   */
  static List<String> contents(String dir) throws IOException {
    String[] names = new File(dir).list();
    List<String> out = new ArrayList<>();
    if (names == null) {
      out.add(dir);
      return out;
    }
    Arrays.sort(names);
    for (String n : names) {
      File f = new File(dir, n);
      if (holdsFiles(f.toPath())) {
        out.add(f.getPath());
      }
    }
    return out;
  }

  /** Remove the directories under and including `dir` that hold nothing, deepest first. */
  static void removeEmptyDirectories(File dir) {
    File[] children = dir.listFiles();
    if (children == null) {
      return;
    }
    for (File c : children) {
      if (c.isDirectory() && !Files.isSymbolicLink(c.toPath())) {
        removeEmptyDirectories(c);
      }
    }
    dir.delete(); // fails, as it should, when something is left
  }

  /** Does the tree at `p` hold at least one file (or symlink)? */
  /**
   * `p` if it is a symlink, else the first symlink under it (not followed, hidden names and
   * what they hold skipped, as Hive's listings skip them); else null.
   */
  static String firstSymlink(Path p) throws IOException {
    if (Files.isSymbolicLink(p)) {
      return p.toString();
    }
    if (!Files.isDirectory(p, java.nio.file.LinkOption.NOFOLLOW_LINKS)) {
      return null;
    }
    try (Stream<Path> s = Files.walk(p)) {
      return s.filter(x -> Files.isSymbolicLink(x) && !hiddenBelow(p, x))
          .map(Path::toString).findFirst().orElse(null);
    }
  }

  private static boolean hiddenBelow(Path top, Path x) {
    for (Path seg : top.relativize(x)) {
      if (isHiddenName(seg.toString())) {
        return true;
      }
    }
    return false;
  }

  static boolean holdsFiles(Path p) throws IOException {
    if (!Files.isDirectory(p, java.nio.file.LinkOption.NOFOLLOW_LINKS)) {
      return Files.exists(p, java.nio.file.LinkOption.NOFOLLOW_LINKS);
    }
    try (Stream<Path> s = Files.walk(p)) {
      return s.anyMatch(x -> !Files.isDirectory(x, java.nio.file.LinkOption.NOFOLLOW_LINKS));
    }
  }

  /** The k=v directory segments of `path` below `base` (all of them when base is null). */
  public static Map<String, String> partitionOf(String path, String base, boolean isDir) {
    Map<String, String> out = new LinkedHashMap<>();
    String rel = path;
    if (base != null && under(path, base)) {
      rel = path.substring(base.length());
    }
    List<String> segs = new ArrayList<>(Arrays.asList(rel.split("/")));
    if (!isDir && !segs.isEmpty()) {
      segs.remove(segs.size() - 1); // a file name is not a partition
    }
    for (String seg : segs) {
      int eq = seg.indexOf('=');
      if (eq > 0) {
        out.put(unescape(seg.substring(0, eq)), unescape(seg.substring(eq + 1)));
      } else if (base == null) {
        out.clear(); // only the trailing k=v run counts
      }
    }
    return out;
  }

  /**
   * Is `dir` the place Spark and Hive give the partition `spec` by default: the k=v/...
   * path of exactly its values, in order, right below `location`?
   */
  static boolean isDefaultPartitionDir(String dir, String location, Map<String, String> spec) {
    if (location == null || dir.equals(location) || !under(dir, location)) {
      return false;
    }
    String[] segs = dir.substring(location.replaceAll("/+$", "").length() + 1).split("/");
    for (String seg : segs) {
      if (seg.indexOf('=') <= 0) {
        return false; // partitionOf skips such a segment; here it makes the place custom
      }
    }
    return segs.length == spec.size() && partitionOf(dir, location, true).equals(spec);
  }

  static String unescape(String s) {
    if (s.indexOf('%') < 0) {
      return s;
    }
    try {
      return URLDecoder.decode(s.replace("+", "%2B"), StandardCharsets.UTF_8);
    } catch (IllegalArgumentException e) {
      return s;
    }
  }

  // -- statement context ------------------------------------------------------------------

  /**
   * What the statement running on this thread is doing: op, table, purge, location, and
   * whether it creates the table it writes (a CTAS). op "INSERT" is an append.
   */
  public static final class Ctx {
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
        return isTemporary(path);
      }
      // Temporary if a temporary name, read from any of the directories holding the path,
      // ends below the deepest of them: a partition registered at <t>/_temporary/7 is the
      // attempt directory itself (data), one at <t>/_temporary holds the job's <t>/_temporary
      // /0 output (not data).
      for (String d : dirs()) {
        if (under(path, d) && temporaryEnd(d, path) > deepest.length()) {
          return true;
        }
      }
      return false;
    }

    /** The deepest of the table's directories (`dirs()`) holding `path`, or null. */
    private String deepestDir(String path) {
      String deepest = null;
      for (String d : dirs()) {
        if (under(path, d) && (deepest == null || d.length() > deepest.length())) {
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
        if (!d.equals(path) && under(d, path)) {
          out.add(d);
        }
      }
      return out;
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
        if (under(path, d) && (deepest == null || d.length() > deepest.length())) {
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
      if (location == null || !under(path, location) || path.equals(location)) {
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
      if (location != null && under(path, location)) {
        return this;
      }
      for (String d : partitionDirs.keySet()) {
        if (under(path, d)) {
          return this;
        }
      }
      return null;
    }

    /** The table's partitions' own locations outside its directory. */
    List<String> partitionLocations() {
      List<String> out = new ArrayList<>();
      for (String d : new java.util.TreeSet<>(partitionDirs.keySet())) {
        if (location == null || !under(d, location)) {
          out.add(d);
        }
      }
      return out;
    }

    @Override
    public String toString() {
      return op + " " + db + "." + table + (purge ? " PURGE" : "") + (creating ? " CREATE" : "")
          + " @" + location;
    }
  }

  // -- the daemon -------------------------------------------------------------------------

  static String tableKey(String db, String table) {
    return (db + "." + table).toLowerCase(Locale.ROOT);
  }

  /** Thrown when cmroot refuses or cannot be reached: the deletion must not happen. */
  public static final class RecycleException extends IOException {
    public RecycleException(String message, Throwable cause) {
      super(message, cause);
    }
  }

  private static HttpClient http() {
    HttpClient c = http;
    if (c == null) {
      synchronized (Cmroot.class) {
        if (http == null) {
          http = HttpClient.newBuilder()
              .connectTimeout(Duration.ofSeconds(10))
              .version(HttpClient.Version.HTTP_1_1)
              .build();
        }
        c = http;
      }
    }
    return c;
  }

  /** `e` as an unchecked exception, for overrides of Scala methods that declare none. */
  static RuntimeException unchecked(Throwable e) {
    if (e instanceof Error) {
      throw (Error) e;
    }
    if (e instanceof RuntimeException) {
      return (RuntimeException) e;
    }
    if (e instanceof IOException) {
      return new java.io.UncheckedIOException((IOException) e);
    }
    return new RuntimeException(e.getMessage(), e);
  }

  /** Thrown when an event of a change already made could not be recorded. */
  public static final class EventException extends IOException {
    public EventException(String message, Throwable cause) {
      super(message, cause);
    }
  }

  /**
   * Record a non-destructive event ({@code POST /v1/events}): `body` holds eventType, db,
   * table, partitions, location, tableObj and files as [{"path"}] (the daemon hashes them).
   * Returns true when recorded, false when cmroot is disabled or failed open. The change is
   * already made when this runs, so a failure cannot undo it: it throws EventException (the
   * statement fails, saying so) unless spark.cmroot.failOpen=true, which logs and counts it.
   */
  public static boolean addEvent(Map<String, Object> body, Settings s, String what)
      throws EventException {
    if (!s.enabled) {
      return false;
    }
    long t0 = System.nanoTime();
    Answer a = post("/v1/events", body, s, Duration.ofMinutes(10));
    if (a.ok) {
      if (LOG.isDebugEnabled()) {
        LOG.debug("cmroot: recorded {} ({}) in {} ms: {}", body.get("eventType"), what,
            (System.nanoTime() - t0) / 1_000_000, abbreviate(a.body));
      }
      return true;
    }
    String table = body.get("table") == null ? String.valueOf(body.get("db"))
        : body.get("db") + "." + body.get("table");
    String msg = "cmroot could not record the " + body.get("eventType") + " event of " + what
        + ": " + a.problem;
    if (s.failOpen) {
      FAIL_OPEN_EVENTS.incrementAndGet();
      LOG.warn("{}; the change stands but is missing from cmroot's event log "
          + "(spark.cmroot.failOpen=true; fail-open events so far: {}): replicas of {} need a "
          + "fresh bootstrap", msg, FAIL_OPEN_EVENTS.get(), table);
      return false;
    }
    LOG.error("{}; the change was applied but not recorded (spark.cmroot.failOpen=false)", msg);
    throw new EventException(msg + ". The change WAS applied but is not in cmroot's event log, "
        + "so replication of " + table + " needs a fresh bootstrap (`cmroot repl dump` without "
        + "--from).", a.cause);
  }

  /** What the daemon answered to one POST, or why it could not. */
  static final class Answer {
    final boolean ok;
    /** The HTTP status, 0 when the daemon could not be reached or did not answer. */
    final int status;
    final String body;
    final String problem;
    final Throwable cause;

    Answer(int status, String body, String problem, Throwable cause) {
      this.ok = status == 200;
      this.status = status;
      this.body = body;
      this.problem = problem;
      this.cause = cause;
    }

    JsonNode json() throws IOException {
      return JSON.readTree(body);
    }
  }

  static Answer post(String route, Map<String, Object> body, Settings s, Duration timeout) {
    try {
      HttpRequest.Builder rb = HttpRequest.newBuilder(URI.create(s.url + route))
          .timeout(timeout)
          .header("Content-Type", "application/json")
          .header("Accept", "application/json")
          .POST(HttpRequest.BodyPublishers.ofByteArray(JSON.writeValueAsBytes(body)));
      if (s.token != null) {
        rb.header("Authorization", "Bearer " + s.token);
      }
      HttpResponse<String> resp = sendThroughInterrupts(rb.build());
      if (resp.statusCode() == 200) {
        return new Answer(200, resp.body(), null, null);
      }
      return new Answer(resp.statusCode(), resp.body(), "the daemon at " + s.url
          + " answered HTTP " + resp.statusCode() + ": " + errorText(resp.body()), null);
    } catch (IOException e) {
      return new Answer(0, null, "the daemon at " + s.url + " is unreachable (" + e
          + "); is `cmroot serve` running?", e);
    }
  }

  /**
   * Send and wait for the answer even if this thread is interrupted (Hive cancels the other
   * loads of a failed statement with interrupts): a commit or abort cut short would leave a
   * statement's files staged until the lease passes. The request has its own timeout; the
   * interrupt is kept for the caller.
   */
  private static HttpResponse<String> sendThroughInterrupts(HttpRequest request)
      throws IOException {
    boolean interrupted = Thread.interrupted();
    try {
      java.util.concurrent.CompletableFuture<HttpResponse<String>> answer =
          http().sendAsync(request, HttpResponse.BodyHandlers.ofString());
      while (true) {
        try {
          return answer.get();
        } catch (InterruptedException e) {
          interrupted = true;
        } catch (java.util.concurrent.ExecutionException e) {
          Throwable cause = e.getCause();
          throw cause instanceof IOException ? (IOException) cause : new IOException(cause);
        }
      }
    } finally {
      if (interrupted) {
        Thread.currentThread().interrupt();
      }
    }
  }

  private static String errorText(String body) {
    try {
      JsonNode n = JSON.readTree(body);
      String e = n.path("error").asText("");
      String d = n.path("detail").asText("");
      return d.isEmpty() ? e : e + ": " + d;
    } catch (Exception ex) {
      return abbreviate(body);
    }
  }

  static String abbreviate(String s) {
    return s == null ? "" : s.length() > 300 ? s.substring(0, 300) + "..." : s;
  }

  /** The paths to send for a delete of `p`: itself, and its .crc sibling for a file. */
  static List<String> withChecksumSibling(String p) {
    List<String> out = new ArrayList<>();
    out.add(p);
    File f = new File(p);
    if (f.isFile() && !f.getName().endsWith(".crc")) {
      File crc = new File(f.getParentFile(), "." + f.getName() + ".crc");
      if (crc.isFile()) {
        out.add(crc.getPath());
      }
    }
    return out;
  }

  static void debugDelete(Settings s, String what, String path) {
    if (s.debug) {
      LOG.warn("cmroot debug: " + what + " " + path + " statement=" + CmrootStatement.current(),
          new Exception("stack of " + what));
    }
  }

  // -- table definitions ------------------------------------------------------------------

  /**
   * The table definition replication recreates a table from, as JSON: a thrift metastore
   * Table, or a Hive ql.metadata.Table (whose getTTable() is used). Called by the metastore
   * listener for tableObj, and through py4j by `cmroot repl dump` on a bootstrap.
   */
  public static String tableJson(Object table) throws IOException {
    return JSON.writeValueAsString(tableMap(thriftTable(table)));
  }

  /**
   * Does this application's hook record the events of a table or partition at `location`
   * (under a warehouse root, the hook enabled)? Through py4j by `cmroot repl dump`: a table
   * it does not record would stand still on a replica.
   */
  public static boolean recordsAt(String location, Configuration hconf) {
    return protectedLocation(localPath(location), settings(hconf));
  }

  static org.apache.hadoop.hive.metastore.api.Table thriftTable(Object table) {
    if (table instanceof org.apache.hadoop.hive.metastore.api.Table) {
      return (org.apache.hadoop.hive.metastore.api.Table) table;
    }
    try {
      // ql.metadata.Table by reflection: hive-exec need not be on the class path otherwise
      return (org.apache.hadoop.hive.metastore.api.Table)
          table.getClass().getMethod("getTTable").invoke(table);
    } catch (ReflectiveOperationException | NullPointerException e) {
      throw new IllegalArgumentException("cmroot: not a Hive table: "
          + (table == null ? "null" : table.getClass().getName()), e);
    }
  }

  static Map<String, Object> tableMap(org.apache.hadoop.hive.metastore.api.Table t) {
    org.apache.hadoop.hive.metastore.api.StorageDescriptor sd = t.getSd();
    org.apache.hadoop.hive.metastore.api.SerDeInfo serde = sd == null ? null : sd.getSerdeInfo();
    String location = sd == null ? null : sd.getLocation();
    Map<String, Object> m = new LinkedHashMap<>();
    m.put("db", t.getDbName());
    m.put("table", t.getTableName());
    m.put("tableType", t.getTableType());
    m.put("location", localPath(location) != null ? localPath(location) : location);
    m.put("columns", fields(sd == null ? null : sd.getCols()));
    m.put("partitionKeys", fields(t.getPartitionKeys()));
    m.put("parameters", sorted(t.getParameters()));
    m.put("inputFormat", sd == null ? null : sd.getInputFormat());
    m.put("outputFormat", sd == null ? null : sd.getOutputFormat());
    m.put("serde", serde == null ? null : serde.getSerializationLib());
    m.put("serdeParameters", sorted(serde == null ? null : serde.getParameters()));
    return m;
  }

  private static List<Map<String, Object>> fields(
      List<org.apache.hadoop.hive.metastore.api.FieldSchema> cols) {
    List<Map<String, Object>> out = new ArrayList<>();
    if (cols != null) {
      for (org.apache.hadoop.hive.metastore.api.FieldSchema c : cols) {
        Map<String, Object> f = new LinkedHashMap<>();
        f.put("name", c.getName());
        f.put("type", c.getType());
        f.put("comment", c.getComment());
        out.add(f);
      }
    }
    return out;
  }

  private static Map<String, String> sorted(Map<String, String> m) {
    return m == null ? new java.util.TreeMap<>() : new java.util.TreeMap<>(m);
  }
}
