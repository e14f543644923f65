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
 * (which paths are recycled) and the one HTTP call the shim makes, {@code POST /v1/recycle}.
 * All store logic lives in the daemon; this only tells it what to recycle.
 */
public final class Cmroot {
  static final Logger LOG = LoggerFactory.getLogger("io.cmroot.spark");

  /** Deletions that went ahead without a recycle because spark.cmroot.failOpen=true. */
  public static final AtomicLong FAIL_OPEN_DELETES = new AtomicLong();
  /** Recycle requests the daemon accepted. */
  public static final AtomicLong RECYCLE_REQUESTS = new AtomicLong();

  private static final ObjectMapper JSON = new ObjectMapper();
  private static volatile HttpClient http;

  private Cmroot() {}

  public static long failOpenDeletes() {
    return FAIL_OPEN_DELETES.get();
  }

  public static long recycleRequests() {
    return RECYCLE_REQUESTS.get();
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

  /** What the statement running on this thread is doing: op, table, purge, location. */
  public static final class Ctx {
    public final String op;
    public final String db;
    public final String table;
    public final boolean purge;
    public final String location;

    public Ctx(String op, String db, String table, boolean purge, String location) {
      this.op = op;
      this.db = db;
      this.table = table;
      this.purge = purge;
      this.location = location;
    }

    /** This context, if `path` belongs to its table. */
    Ctx appliesTo(String path) {
      return location != null && under(path, location) ? this : null;
    }

    @Override
    public String toString() {
      return op + " " + db + "." + table + (purge ? " PURGE" : "") + " @" + location;
    }
  }

  // Inheritable: Hive deletes a table's old files from a pool it starts for the call.
  private static final InheritableThreadLocal<Ctx> CONTEXT = new InheritableThreadLocal<>();

  public static void setContext(Ctx ctx) {
    if (ctx == null) {
      CONTEXT.remove();
    } else {
      CONTEXT.set(ctx);
    }
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
   * nothing was moved and the caller must not delete.
   */
  public static boolean recycle(List<String> paths, String op, String db, String table,
      boolean purge, List<Map<String, String>> partitions, Settings s, String what)
      throws RecycleException {
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
    String problem;
    Throwable cause = null;
    long t0 = System.nanoTime();
    try {
      HttpRequest.Builder rb = HttpRequest.newBuilder(URI.create(s.url + "/v1/recycle"))
          .timeout(Duration.ofMinutes(10))
          .header("Content-Type", "application/json")
          .header("Accept", "application/json")
          .POST(HttpRequest.BodyPublishers.ofByteArray(JSON.writeValueAsBytes(body)));
      if (s.token != null) {
        rb.header("Authorization", "Bearer " + s.token);
      }
      HttpResponse<String> resp = http().send(rb.build(), HttpResponse.BodyHandlers.ofString());
      if (resp.statusCode() == 200) {
        RECYCLE_REQUESTS.incrementAndGet();
        if (s.debug) {
          System.err.printf("cmroot debug: recycled %s (%d paths, op %s) in %d ms%n", what,
              paths.size(), body.get("op"), (System.nanoTime() - t0) / 1_000_000);
        }
        if (LOG.isDebugEnabled()) {
          LOG.debug("cmroot: recycled {} ({} paths, op {}, {}.{}) in {} ms: {}", what,
              paths.size(), body.get("op"), db, table, (System.nanoTime() - t0) / 1_000_000,
              abbreviate(resp.body()));
        }
        return true;
      }
      problem = "the daemon at " + s.url + " answered HTTP " + resp.statusCode() + ": "
          + errorText(resp.body());
    } catch (IOException e) {
      cause = e;
      problem = "the daemon at " + s.url + " is unreachable (" + e + "); is `cmroot serve` running?";
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      cause = e;
      problem = "interrupted while waiting for the daemon at " + s.url;
    }
    String msg = "cmroot could not recycle " + what + " (op " + body.get("op") + ", "
        + paths.size() + " path(s), first " + paths.get(0) + "): " + problem;
    if (s.failOpen) {
      FAIL_OPEN_DELETES.incrementAndGet();
      LOG.warn("{}; deleting WITHOUT a copy in cmroot because spark.cmroot.failOpen=true "
          + "(fail-open deletions so far: {})", msg, FAIL_OPEN_DELETES.get());
      return false;
    }
    LOG.error("{}; nothing deleted: the statement fails (spark.cmroot.failOpen=false)", msg);
    throw new RecycleException(msg + ". Nothing was deleted (spark.cmroot.failOpen=false). "
        + "Start the daemon or fix the request, then run the statement again.", cause);
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
}
