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
 * The shared core of the cmroot Spark shim: settings, the statement context, the path rules
 * (which paths are recycled), the table definition replication recreates tables from, and
 * the two HTTP calls the shim makes, {@code POST /v1/recycle} and {@code POST /v1/events}.
 * All store logic lives in the daemon; this only tells it what to recycle and what changed.
 */
public final class Cmroot {
  static final Logger LOG = LoggerFactory.getLogger("io.cmroot.spark");

  /** Deletions that went ahead without a recycle because spark.cmroot.failOpen=true. */
  public static final AtomicLong FAIL_OPEN_DELETES = new AtomicLong();
  /** Recycle requests the daemon accepted. */
  public static final AtomicLong RECYCLE_REQUESTS = new AtomicLong();
  /** Events (changes already made) not recorded because spark.cmroot.failOpen=true. */
  public static final AtomicLong FAIL_OPEN_EVENTS = new AtomicLong();

  private static final ObjectMapper JSON = new ObjectMapper();
  private static volatile HttpClient http;

  private Cmroot() {}

  public static long failOpenDeletes() {
    return FAIL_OPEN_DELETES.get();
  }

  public static long recycleRequests() {
    return RECYCLE_REQUESTS.get();
  }

  public static long failOpenEvents() {
    return FAIL_OPEN_EVENTS.get();
  }

  // -- settings ---------------------------------------------------------------------------

  /** The spark.cmroot.* settings, read from the SparkConf (or a Hadoop conf, or the env). */
  public static final class Settings {
    public final String url;
    public final String token;
    public final boolean enabled;
    public final boolean failOpen;
    public final boolean debug;
    public final List<String> roots;

    Settings(String url, String token, boolean enabled, boolean failOpen, boolean debug,
        List<String> roots) {
      this.url = url;
      this.token = token;
      this.enabled = enabled;
      this.failOpen = failOpen;
      this.debug = debug;
      this.roots = roots;
    }
  }

  /**
   * spark.cmroot.KEY: from the active session's runtime conf (so `SET spark.cmroot.failOpen`
   * works per session), else the SparkConf, else the Hadoop conf (spark.cmroot.KEY or
   * cmroot.KEY), else $CMROOT_KEY.
   */
  static String conf(Configuration hconf, String key, String dflt) {
    String v = null;
    try {
      scala.Option<org.apache.spark.sql.SparkSession> active =
          org.apache.spark.sql.SparkSession.getActiveSession();
      if (active.isDefined()) {
        scala.Option<String> o = active.get().conf().getOption("spark.cmroot." + key);
        if (o.isDefined()) {
          v = o.get();
        }
      }
    } catch (Throwable e) {
      // no session on this thread
    }
    try {
      org.apache.spark.SparkEnv env = org.apache.spark.SparkEnv.get();
      if (v == null && env != null && env.conf().contains("spark.cmroot." + key)) {
        v = env.conf().get("spark.cmroot." + key);
      }
    } catch (Throwable e) {
      // no Spark in this JVM (a bare Hadoop client): fall through to the Hadoop conf
    }
    if (v == null && hconf != null) {
      v = hconf.get("spark.cmroot." + key, hconf.get("cmroot." + key));
    }
    if (v == null) {
      v = System.getenv("CMROOT_" + key.toUpperCase(Locale.ROOT));
    }
    return v == null || v.isEmpty() ? dflt : v;
  }

  private static String sparkConf(String key) {
    try {
      org.apache.spark.SparkEnv env = org.apache.spark.SparkEnv.get();
      if (env != null && env.conf().contains(key)) {
        return env.conf().get(key);
      }
    } catch (Throwable e) {
      // no Spark
    }
    return null;
  }

  public static Settings settings(Configuration hconf) {
    String roots = conf(hconf, "warehouseRoots", null);
    if (roots == null) {
      roots = sparkConf("spark.sql.warehouse.dir");
    }
    if (roots == null && hconf != null) {
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
        list);
  }

  // -- paths ------------------------------------------------------------------------------

  /** An absolute, normalized local path for file:/..., file:///... or /...; null otherwise. */
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
    return Paths.get(p).toAbsolutePath().normalize().toString();
  }

  static boolean under(String path, String root) {
    return path.equals(root) || path.startsWith(root.endsWith("/") ? root : root + "/");
  }

  /** Spark's and Hive's own temporary and staging paths, never recycled. */
  public static boolean isTemporary(String path) {
    for (String seg : path.split("/")) {
      if (isTemporaryName(seg)) {
        return true;
      }
    }
    return false;
  }

  static boolean isTemporaryName(String seg) {
    return seg.equals("_temporary")
        || seg.startsWith(".spark-staging-")
        || seg.startsWith(".hive-staging")
        || seg.startsWith("_temporary_");
  }

  /** Hadoop's hidden names (".x.crc", "_SUCCESS"): never data of a table. */
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
      if (isHiddenName(n) || isTemporaryName(n)) {
        continue;
      }
      if (f.isDirectory()) {
        if (recursive) {
          out.addAll(dataFiles(f, true, mark));
        }
      } else if (f.isFile() && (mark == null || n.contains(mark))) {
        out.add(localPath(f.getPath()));
      }
    }
    java.util.Collections.sort(out);
    return out;
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
    if (path == null || !s.enabled || isTemporary(path)) {
      return false;
    }
    for (String root : s.roots) {
      if (under(path, root)) {
        return true;
      }
    }
    return false;
  }

  /** Does the tree at `p` hold at least one file (or symlink)? */
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
    public final String op;
    public final String db;
    public final String table;
    public final boolean purge;
    public final String location;
    public final boolean creating;

    public Ctx(String op, String db, String table, boolean purge, String location) {
      this(op, db, table, purge, location, false);
    }

    public Ctx(String op, String db, String table, boolean purge, String location,
        boolean creating) {
      this.op = op;
      this.db = db;
      this.table = table;
      this.purge = purge;
      this.location = location;
      this.creating = creating;
    }

    /**
     * The op of a delete seen while this statement runs: an append replaces nothing, so
     * anything it does delete is recycled as a plain DELETE.
     */
    String deleteOp() {
      return "INSERT".equals(op) ? "DELETE" : op;
    }

    /** This context, if `path` belongs to its table. */
    Ctx appliesTo(String path) {
      return location != null && under(path, location) ? this : null;
    }

    @Override
    public String toString() {
      return op + " " + db + "." + table + (purge ? " PURGE" : "") + (creating ? " CREATE" : "")
          + " @" + location;
    }
  }

  // Inheritable: Hive deletes a table's old files from a pool it starts for the call.
  private static final InheritableThreadLocal<Ctx> CONTEXT = new InheritableThreadLocal<>();

  public static void setContext(Ctx ctx) {
    DEFERRED_INSERTS.remove(); // a CTAS that failed before its table existed left it here
    if (ctx == null) {
      CONTEXT.remove();
    } else {
      CONTEXT.set(ctx);
    }
  }

  /*
   * A data source CTAS writes its files before it creates its table. Its INSERT event waits
   * here, keyed db.table, until the metastore listener has recorded the CREATE_TABLE, so that
   * replication replays the creation first.
   */
  private static final ThreadLocal<Map<String, Map<String, Object>>> DEFERRED_INSERTS =
      ThreadLocal.withInitial(LinkedHashMap::new);

  static String tableKey(String db, String table) {
    return (db + "." + table).toLowerCase(Locale.ROOT);
  }

  static void deferInsert(String db, String table, Map<String, Object> body) {
    DEFERRED_INSERTS.get().put(tableKey(db, table), body);
  }

  static Map<String, Object> takeDeferredInsert(String db, String table) {
    return DEFERRED_INSERTS.get().remove(tableKey(db, table));
  }

  public static Ctx context() {
    return CONTEXT.get();
  }

  static Ctx contextFor(String path) {
    Ctx c = CONTEXT.get();
    return c == null ? null : c.appliesTo(path);
  }

  // -- the daemon -------------------------------------------------------------------------

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

  /**
   * Ask the daemon to recycle (move into the cmroot) `paths`, all or nothing. Returns true when
   * recycled, false when cmroot is disabled or failed open (the caller then deletes as usual).
   * Throws RecycleException, naming cmroot, when the daemon refused or could not be reached:
   * nothing was moved and the caller must not delete. `location` (the table's, or null) is
   * recorded on the event for replication.
   */
  public static boolean recycle(List<String> paths, String op, String db, String table,
      boolean purge, List<Map<String, String>> partitions, String location, Settings s,
      String what) throws RecycleException {
    if (paths.isEmpty()) {
      return true;
    }
    Map<String, Object> body = new LinkedHashMap<>();
    body.put("paths", paths);
    body.put("mode", "move");
    body.put("purge", purge);
    body.put("op", op == null ? "DELETE" : op);
    if (db != null) {
      body.put("db", db);
    }
    if (table != null) {
      body.put("table", table);
    }
    body.put("partitions", partitions == null ? List.of() : partitions);
    if (location != null) {
      body.put("location", location);
    }
    long t0 = System.nanoTime();
    Answer a = post("/v1/recycle", body, s, Duration.ofMinutes(10));
    if (a.ok) {
      RECYCLE_REQUESTS.incrementAndGet();
      if (s.debug) {
        System.err.printf("cmroot debug: recycled %s (%d paths, op %s) in %d ms%n", what,
            paths.size(), body.get("op"), (System.nanoTime() - t0) / 1_000_000);
      }
      if (LOG.isDebugEnabled()) {
        LOG.debug("cmroot: recycled {} ({} paths, op {}, {}.{}) in {} ms: {}", what,
            paths.size(), body.get("op"), db, table, (System.nanoTime() - t0) / 1_000_000,
            abbreviate(a.body));
      }
      return true;
    }
    String msg = "cmroot could not recycle " + what + " (op " + body.get("op") + ", "
        + paths.size() + " path(s), first " + paths.get(0) + "): " + a.problem;
    if (s.failOpen) {
      FAIL_OPEN_DELETES.incrementAndGet();
      LOG.warn("{}; deleting WITHOUT a copy in cmroot because spark.cmroot.failOpen=true "
          + "(fail-open deletions so far: {})", msg, FAIL_OPEN_DELETES.get());
      return false;
    }
    LOG.error("{}; nothing deleted: the statement fails (spark.cmroot.failOpen=false)", msg);
    throw new RecycleException(msg + ". Nothing was deleted (spark.cmroot.failOpen=false). "
        + "Start the daemon or fix the request, then run the statement again.", a.cause);
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
  private static final class Answer {
    final boolean ok;
    final String body;
    final String problem;
    final Throwable cause;

    Answer(boolean ok, String body, String problem, Throwable cause) {
      this.ok = ok;
      this.body = body;
      this.problem = problem;
      this.cause = cause;
    }
  }

  private static Answer post(String route, Map<String, Object> body, Settings s,
      Duration timeout) {
    try {
      HttpRequest.Builder rb = HttpRequest.newBuilder(URI.create(s.url + route))
          .timeout(timeout)
          .header("Content-Type", "application/json")
          .header("Accept", "application/json")
          .POST(HttpRequest.BodyPublishers.ofByteArray(JSON.writeValueAsBytes(body)));
      if (s.token != null) {
        rb.header("Authorization", "Bearer " + s.token);
      }
      HttpResponse<String> resp = http().send(rb.build(), HttpResponse.BodyHandlers.ofString());
      if (resp.statusCode() == 200) {
        return new Answer(true, resp.body(), null, null);
      }
      return new Answer(false, resp.body(), "the daemon at " + s.url + " answered HTTP "
          + resp.statusCode() + ": " + errorText(resp.body()), null);
    } catch (IOException e) {
      return new Answer(false, null, "the daemon at " + s.url + " is unreachable (" + e
          + "); is `cmroot serve` running?", e);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      return new Answer(false, null, "interrupted while waiting for the daemon at " + s.url, e);
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

  private static String abbreviate(String s) {
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
      LOG.warn("cmroot debug: " + what + " " + path + " ctx=" + CONTEXT.get(),
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
