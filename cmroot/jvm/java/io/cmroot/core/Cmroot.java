package io.cmroot.core;

import java.io.ByteArrayOutputStream;
import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.HttpURLConnection;
import java.net.URI;
import java.net.URL;
import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.atomic.AtomicLong;
import java.util.function.Supplier;
import java.util.stream.Stream;
import org.apache.hadoop.conf.Configuration;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * The core the metastore plugin and the Spark hook share: settings, the path rules (which
 * paths are recycled, which are refused), the table definition replication recreates tables
 * from, and the daemon's HTTP calls ({@link CmrootTransaction} makes the two-phase recycles,
 * {@link #addEvent} records events). All store logic lives in the daemon; this only tells it
 * what to recycle and what changed. Java 8, no Spark classes and no library beyond Hadoop's
 * and slf4j: a Hive 2.3 or 3.x metastore on Java 8 loads it.
 */
public final class Cmroot {
  public static final Logger LOG = LoggerFactory.getLogger("io.cmroot");

  /** Deletions that went ahead without a recycle because spark.cmroot.failOpen=true. */
  public static final AtomicLong FAIL_OPEN_DELETES = new AtomicLong();
  /** Events (changes already made) not recorded because spark.cmroot.failOpen=true. */
  public static final AtomicLong FAIL_OPEN_EVENTS = new AtomicLong();

  // Seconds to wait for the daemon to accept a connection (it answers at once when up).
  private static final int CONNECT_TIMEOUT_MS = 10_000;

  private Cmroot() {}

  public static long failOpenDeletes() {
    return FAIL_OPEN_DELETES.get();
  }

  public static long failOpenEvents() {
    return FAIL_OPEN_EVENTS.get();
  }

  // -- settings ---------------------------------------------------------------------------

  /** The cmroot settings of the application or metastore (see {@link #conf}). */
  public static final class Settings {
    public final String url;
    private final String token;
    private final String tokenFile;
    public final boolean enabled;
    public final boolean failOpen;
    public final boolean debug;
    public final List<String> roots;
    /**
     * The roots on another file system than the local one (s3a://, hdfs://...), as
     * {@link #uriKey} spells them (they are among `roots` too). The metastore plugin keeps
     * drops there (the daemon moves the files); Spark's hook cannot yet, and refuses.
     */
    public final List<String> foreignRoots;
    /** Seconds a prepared recycle is held for its statement between renewals. */
    public final long leaseSeconds;

    public Settings(String url, String token, String tokenFile, boolean enabled,
        boolean failOpen, boolean debug, List<String> roots, List<String> foreignRoots,
        long leaseSeconds) {
      this.url = url;
      this.token = token;
      this.tokenFile = tokenFile;
      this.enabled = enabled;
      this.failOpen = failOpen;
      this.debug = debug;
      this.roots = roots;
      this.foreignRoots = foreignRoots;
      this.leaseSeconds = leaseSeconds;
    }

    /**
     * The token: inline (cmroot.token), or the first line of cmroot.tokenFile, read at each
     * request so that a rotated token takes effect without a restart; only requests need
     * it, so a file being rotated never stops a query that deletes nothing. An unreadable
     * file is an error naming it: the request is not sent (a recycle then fails closed).
     */
    public String token() throws IOException {
      if (tokenFile == null) {
        return token;
      }
      try {
        byte[] raw = Files.readAllBytes(Paths.get(tokenFile));
        String t = new String(raw, StandardCharsets.UTF_8).trim();
        int nl = t.indexOf('\n');
        return nl < 0 ? t : t.substring(0, nl).trim();
      } catch (IOException | RuntimeException e) {
        throw new IOException("cannot read the token file " + tokenFile + " (cmroot.tokenFile: "
            + e + "); make it readable by this process, or set cmroot.token", e);
      }
    }
  }

  /** The keys a session may not change: they decide whether and where files are kept. */
  public static final List<String> FIXED_KEYS = Collections.unmodifiableList(Arrays.asList(
      "url", "token", "tokenFile", "enabled", "failOpen", "warehouseRoots", "lease",
      "metastorePlugin"));

  /**
   * spark.cmroot.KEY from the application's static conf (the SparkConf every SparkEnv of the
   * application shares: driver and executors), else $CMROOT_KEY. Never the session's runtime
   * conf nor the per-query Hadoop conf, which a SQL user can change with SET: the protection
   * is the application's, not a session switch. Without Spark in this JVM (a standalone
   * metastore, a bare Hadoop client) it is the Hadoop conf's cmroot.KEY (hive-site.xml) or
   * spark.cmroot.KEY.
   */
  public static String conf(Configuration hconf, String key, String dflt) {
    String v = null;
    if (AppConf.Registry.running()) {
      v = AppConf.Registry.get("spark.cmroot." + key);
    } else if (hconf != null) {
      v = hconf.get("cmroot." + key, hconf.get("spark.cmroot." + key));
    }
    if (v == null) {
      v = System.getenv("CMROOT_" + key.toUpperCase(Locale.ROOT));
    }
    return v == null || v.isEmpty() ? dflt : v;
  }

  // Roots on other file systems as Hadoop resolves them: asked until they exist, then kept.
  private static final Map<String, String> ROOTS =
      new java.util.concurrent.ConcurrentHashMap<>();

  /** A root on another file system as Hadoop resolves it; kept once resolved whole. */
  private static String root(String spelt, Configuration hconf) {
    String known = ROOTS.get(spelt);
    if (known != null) {
      return known;
    }
    String[] placed = resolved(spelt, hconf);
    if (placed == null) {
      return null;
    }
    if (placed[1] != null) {
      ROOTS.put(spelt, placed[0]); // a root made later is asked again until it exists
    }
    return placed[0];
  }

  public static Settings settings(Configuration hconf) {
    String roots = conf(hconf, "warehouseRoots", null);
    boolean spark = AppConf.Registry.running();
    if (roots == null && spark) {
      roots = AppConf.Registry.get("spark.sql.warehouse.dir");
    }
    if (roots == null && !spark && hconf != null) {
      roots = hconf.get("spark.sql.warehouse.dir", hconf.get("hive.metastore.warehouse.dir"));
    }
    // A root without a scheme is on the default file system, as Hadoop resolves it: on an
    // HDFS cluster hive.metastore.warehouse.dir=/user/hive/warehouse is hdfs://nn/user/...,
    // and taken for a local directory it would leave every table "outside the roots".
    String dfs = hconf != null ? hconf.get("fs.defaultFS")
        : spark ? AppConf.Registry.get("spark.hadoop.fs.defaultFS") : null;
    boolean localDefault = dfs == null || dfs.trim().isEmpty() || dfs.trim().startsWith("file:");
    List<String> list = new ArrayList<>();
    List<String> foreign = new ArrayList<>();
    if (roots != null) {
      for (String raw : roots.split(",")) {
        String r = raw.trim();
        if (r.isEmpty()) {
          continue;
        }
        if (!localDefault && r.startsWith("/")) {
          r = dfs.trim().replaceAll("/+$", "") + r;
        }
        String p = localPath(r);
        if (p != null && !p.isEmpty()) {
          list.add(p);
          continue;
        }
        String key;
        try {
          key = hconf == null ? uriKey(r) : root(r, hconf);
        } catch (RuntimeException e) {
          key = null;
        }
        if (key == null) {
          throw new IllegalArgumentException("cmroot: the warehouse root " + r + " (cmroot."
              + "warehouseRoots, else the warehouse directory) is neither a local path nor a"
              + " URI of a file system: correct it and restart");
        }
        foreign.add(key);
        list.add(key);
      }
    }
    // No cmroot url anywhere: this application did not ask for cmroot (the file system may
    // be a cached instance from an earlier application in this JVM): stay inert.
    String url = conf(hconf, "url", null);
    return new Settings(
        url == null ? "" : url.replaceAll("/+$", ""),
        conf(hconf, "token", null),
        conf(hconf, "tokenFile", null),
        url != null && Boolean.parseBoolean(conf(hconf, "enabled", "true")),
        Boolean.parseBoolean(conf(hconf, "failOpen", "false")),
        Boolean.parseBoolean(conf(hconf, "debug", "false")),
        list,
        foreign,
        seconds(conf(hconf, "lease", "10m"), "cmroot.lease"));
  }

  /** "90s", "10m", "1h" or plain seconds, as seconds (the daemon takes 1 s to 1 day). */
  public static long seconds(String value, String key) {
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
  public static String existingLocalPath(String loc) {
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
  public static String real(Path p, boolean followLast) {
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

  /**
   * A location on another file system, spelt for comparison with {@link #under}: scheme and
   * authority lower-cased, the path normalized (no `.`, `..`, doubled or trailing slashes).
   */
  public static String uriKey(String location) {
    URI u = new org.apache.hadoop.fs.Path(location).toUri();
    String path = u.getPath() == null ? "" : Paths.get("/" + u.getPath()).normalize().toString();
    String scheme = u.getScheme() == null ? "" : u.getScheme().toLowerCase(Locale.ROOT) + "://";
    String auth = u.getAuthority() == null ? "" : u.getAuthority().toLowerCase(Locale.ROOT);
    return scheme + auth + ("/".equals(path) ? "" : path);
  }

  private static final String SCHEME = "^[a-zA-Z][a-zA-Z0-9+.-]*:.*";

  /**
   * A location as cmroot compares it and sends it to the daemon: a local path
   * ({@link #localPath}), or on another file system its {@link #uriKey}; null if none.
   */
  public static String place(String location) {
    String local = localPath(location);
    if (local != null || location == null || !location.matches(SCHEME)) {
      return local;
    }
    try {
      return uriKey(location);
    } catch (RuntimeException e) {
      return null; // not a URI: no place of ours
    }
  }

  /**
   * {@link #place}, with a location on another file system resolved through Hadoop first
   * (`conf`'s file systems): a viewfs mount, or a name the file system qualifies (a default
   * port), is placed where its files are, so that it is compared with the roots by what it
   * is, not by how it was spelt.
   */
  public static String place(String location, Configuration conf) {
    String[] placed = resolved(location, conf);
    return placed == null ? null : placed[0];
  }

  /**
   * {placed, whether it was resolved whole}, or null (no place): a path that does not exist
   * (a root not made yet, a directory the metastore just deleted) is resolved through its
   * nearest existing parent, its missing names appended; only an existing one is resolved
   * whole (a viewfs mount whose target is missing stays as spelt).
   */
  private static String[] resolved(String location, Configuration conf) {
    String placed = place(location);
    if (placed == null || isLocal(placed) || conf == null) {
      return placed == null ? null : new String[] {placed, "whole"};
    }
    try {
      org.apache.hadoop.fs.Path p = new org.apache.hadoop.fs.Path(location);
      org.apache.hadoop.fs.FileSystem fs = p.getFileSystem(conf);
      List<String> missing = new ArrayList<>();
      for (org.apache.hadoop.fs.Path q = fs.makeQualified(p); q != null; q = q.getParent()) {
        org.apache.hadoop.fs.Path r;
        try {
          r = fs.resolvePath(q);
        } catch (java.io.FileNotFoundException e) {
          missing.add(0, q.getName());
          continue;
        }
        for (String name : missing) {
          r = new org.apache.hadoop.fs.Path(r, name);
        }
        return new String[] {uriKey(r.toString()), missing.isEmpty() ? "whole" : null};
      }
      return new String[] {uriKey(fs.makeQualified(p).toString()), null};
    } catch (IOException | RuntimeException e) {
      return new String[] {placed, null}; // no file system for it here: compared as spelt
    }
  }

  /**
   * Refuse (throw) `what` at `place` when it is outside every root, yet under one by path
   * with another scheme (s3:// and s3a://, say): the same files by another name, which the
   * roots would not cover, so a drop there would go unkept.
   */
  public static void refuseAlias(String place, Settings s, String what)
      throws RecycleException {
    if (place == null || isLocal(place) || !s.enabled || protectedLocation(place, s)) {
      return;
    }
    String rest = place.substring(place.indexOf("://") + 3);
    for (String root : s.foreignRoots) {
      String rootRest = root.substring(root.indexOf("://") + 3);
      if (under(rest, rootRest) || under(rootRest, rest)) {
        String msg = "cmroot refuses " + what + " " + place + ": it names the files of the "
            + "warehouse root " + root + " by another file system scheme, so cmroot would "
            + "not keep them. Nothing was dropped. Give tables locations spelt as the root "
            + "is, or add this spelling to cmroot.warehouseRoots (and the daemon's roots).";
        LOG.error(msg);
        throw new RecycleException(msg, null);
      }
    }
  }

  // The Hadoop configuration of this process (the metastore's, or the Spark application's):
  // the file systems places on other schemes are resolved and listed through. Static because
  // catalog locations are read in many places that have no file system at hand.
  private static volatile Configuration hadoop;

  /** Remember the process's Hadoop configuration (each listener, and Spark's extensions). */
  public static void useHadoop(Configuration conf) {
    if (conf != null) {
      hadoop = conf;
    }
  }

  /** The process's Hadoop configuration (see {@link #useHadoop}), or a default one. */
  public static Configuration hadoop() {
    Configuration c = hadoop;
    return c != null ? c : new Configuration();
  }

  /** {@link #place(String, Configuration)} through the process's Hadoop configuration. */
  public static String where(String location) {
    return place(location, hadoop);
  }

  /**
   * {@link #where(String)} of a location the catalog hands over as a URI (Spark's
   * CatalogTable and partitions: a directory `sp ace` spelt `sp%20ace`, one named `s%2Ft`
   * spelt `s%252Ft`). A local one is read as the URI it is; one on another file system
   * as the Hadoop path it names, the spelling {@link #uriKey} reads.
   */
  public static String where(URI location) {
    if (location == null) {
      return null;
    }
    String scheme = location.getScheme();
    return scheme == null ? where(location.getPath())
        : "file".equalsIgnoreCase(scheme) ? where(location.toString())
        : where(new org.apache.hadoop.fs.Path(location).toString());
  }

  /**
   * A file system that deletes without cmroot when asked (a scheme's hook): what cmroot's
   * own clean-ups use, so that they are not taken for deletes of data.
   */
  public interface RawDeletes {
    boolean rawDelete(org.apache.hadoop.fs.Path p, boolean recursive) throws IOException;
  }

  /** Is this place (see {@link #place}) on the local file system? */
  public static boolean isLocal(String place) {
    return place.startsWith("/");
  }

  /** The Hadoop file system of a place on another file system, and its path there. */
  private static org.apache.hadoop.fs.FileSystem fsOf(String place, Configuration conf)
      throws IOException {
    return new org.apache.hadoop.fs.Path(place).getFileSystem(
        conf == null ? new Configuration() : conf);
  }

  /** {@link #holdsFiles(Path)} for a place on any file system. */
  public static boolean holdsFiles(String place, Configuration conf) throws IOException {
    if (isLocal(place)) {
      return holdsFiles(Paths.get(place));
    }
    org.apache.hadoop.fs.Path p = new org.apache.hadoop.fs.Path(place);
    try {
      return fsOf(place, conf).listFiles(p, true).hasNext();
    } catch (java.io.FileNotFoundException e) {
      return false;
    }
  }

  /** {@link #contents(String)} for a place on any file system. */
  public static List<String> contents(String place, Configuration conf) throws IOException {
    if (isLocal(place)) {
      return contents(place);
    }
    List<String> out = new ArrayList<>();
    org.apache.hadoop.fs.FileSystem fs = fsOf(place, conf);
    try {
      for (org.apache.hadoop.fs.FileStatus st : fs.listStatus(new org.apache.hadoop.fs.Path(place))) {
        String child = uriKey(st.getPath().toString());
        if (!st.isDirectory() || holdsFiles(child, conf)) {
          out.add(child);
        }
      }
    } catch (java.io.FileNotFoundException e) {
      return out;
    }
    Collections.sort(out);
    return out;
  }

  /** {@link #dataFiles(File, boolean, String)} for a place on any file system. */
  public static List<String> dataFiles(String place, boolean recursive, String mark,
      Configuration conf) throws IOException {
    if (isLocal(place)) {
      return dataFiles(new File(place), recursive, mark);
    }
    List<String> out = new ArrayList<>();
    org.apache.hadoop.fs.FileStatus[] children;
    try {
      children = fsOf(place, conf).listStatus(new org.apache.hadoop.fs.Path(place));
    } catch (java.io.FileNotFoundException e) {
      return out;
    }
    for (org.apache.hadoop.fs.FileStatus st : children) {
      String n = st.getPath().getName();
      boolean isDir = st.isDirectory();
      if (notData(n, isDir)) {
        continue;
      }
      String child = uriKey(st.getPath().toString());
      if (isDir) {
        if (recursive) {
          out.addAll(dataFiles(child, true, mark, conf));
        }
      } else if (st.isFile() && (mark == null || n.contains(mark))) {
        out.add(child);
      }
    }
    Collections.sort(out);
    return out;
  }

  /** The status of a place on another file system, or null if nothing is there. */
  private static org.apache.hadoop.fs.FileStatus status(String place) throws IOException {
    try {
      return fsOf(place, hadoop()).getFileStatus(new org.apache.hadoop.fs.Path(place));
    } catch (java.io.FileNotFoundException e) {
      return null;
    }
  }

  /** Is anything (a symlink included, not followed) at this place on any file system? */
  public static boolean exists(String place) throws IOException {
    return isLocal(place) ? Files.exists(Paths.get(place), java.nio.file.LinkOption.NOFOLLOW_LINKS)
        : status(place) != null;
  }

  /** Is a plain file (not a symlink, not a directory) at this place on any file system? */
  public static boolean isFile(String place) throws IOException {
    if (isLocal(place)) {
      return Files.isRegularFile(Paths.get(place), java.nio.file.LinkOption.NOFOLLOW_LINKS);
    }
    org.apache.hadoop.fs.FileStatus st = status(place);
    return st != null && st.isFile();
  }

  /** Is a directory (not a symlink to one) at this place on any file system? */
  public static boolean isDirectory(String place) throws IOException {
    if (isLocal(place)) {
      return Files.isDirectory(Paths.get(place), java.nio.file.LinkOption.NOFOLLOW_LINKS);
    }
    org.apache.hadoop.fs.FileStatus st = status(place);
    return st != null && st.isDirectory();
  }

  /** The entries of the directory `place` on any file system; none if it is missing. */
  public static List<String> children(String place) throws IOException {
    List<String> out = new ArrayList<>();
    if (isLocal(place)) {
      String[] names = new File(place).list();
      for (String n : names == null ? new String[0] : names) {
        out.add(child(place, n));
      }
    } else {
      try {
        for (org.apache.hadoop.fs.FileStatus c
            : fsOf(place, hadoop()).listStatus(new org.apache.hadoop.fs.Path(place))) {
          out.add(uriKey(c.getPath().toString()));
        }
      } catch (java.io.FileNotFoundException e) {
        return out;
      }
    }
    Collections.sort(out);
    return out;
  }

  /** The scheme of a place on another file system ("file" for a local one). */
  public static String scheme(String place) {
    return isLocal(place) ? "file" : place.substring(0, place.indexOf(':'));
  }

  /** `name` (one or more segments, "k=v/j=w") inside the directory `place`. */
  public static String child(String place, String name) {
    return place.replaceAll("/+$", "") + "/" + name.replaceAll("^/+", "");
  }

  /** The directory holding `place`. */
  public static String parent(String place) {
    return place.substring(0, Math.max(place.lastIndexOf('/'), isLocal(place) ? 1 : 0));
  }

  /** The last name of `place`. */
  public static String name(String place) {
    return place.substring(place.lastIndexOf('/') + 1);
  }

  /** Remove what is at `place` (a file, or a tree when `recursive`) without cmroot. */
  public static boolean rawDelete(String place, boolean recursive) throws IOException {
    if (isLocal(place)) {
      File f = new File(place);
      if (recursive && f.isDirectory() && !Files.isSymbolicLink(f.toPath())) {
        File[] children = f.listFiles();
        for (File c : children == null ? new File[0] : children) {
          rawDelete(c.getPath(), true);
        }
      }
      return f.delete();
    }
    org.apache.hadoop.fs.Path p = new org.apache.hadoop.fs.Path(place);
    org.apache.hadoop.fs.FileSystem fs = fsOf(place, hadoop());
    return fs instanceof RawDeletes ? ((RawDeletes) fs).rawDelete(p, recursive)
        : fs.delete(p, recursive);
  }

  /** Remove the directories under and including `place` that hold nothing, deepest first. */
  public static void removeEmptyDirectories(String place) throws IOException {
    if (isLocal(place)) {
      removeEmptyDirectories(new File(place));
      return;
    }
    org.apache.hadoop.fs.FileStatus[] children;
    try {
      children = fsOf(place, hadoop()).listStatus(new org.apache.hadoop.fs.Path(place));
    } catch (java.io.FileNotFoundException e) {
      return;
    }
    for (org.apache.hadoop.fs.FileStatus c : children) {
      if (c.isDirectory()) {
        removeEmptyDirectories(uriKey(c.getPath().toString()));
      }
    }
    if (!holdsFiles(place, hadoop())) {
      rawDelete(place, true); // directories only below it: what the loop left is empty
    }
  }

  /**
   * The entries of the directory `place` (not hidden, not directories) last modified before
   * `millis`, on any file system (locally by ctime: a file renamed or linked there since is
   * newer; elsewhere by modification time, which a rename keeps).
   */
  public static List<String> olderEntries(String place, long millis) throws IOException {
    List<String> out = new ArrayList<>();
    if (isLocal(place)) {
      File[] entries = new File(place).listFiles();
      for (File f : entries == null ? new File[0] : entries) {
        Path p = f.toPath();
        if (isHiddenName(f.getName())
            || Files.isDirectory(p, java.nio.file.LinkOption.NOFOLLOW_LINKS)) {
          continue;
        }
        try {
          if (((java.nio.file.attribute.FileTime) Files.getAttribute(p, "unix:ctime",
              java.nio.file.LinkOption.NOFOLLOW_LINKS)).toMillis() < millis) {
            out.add(f.getPath());
          }
        } catch (IOException | UnsupportedOperationException e) {
          // gone meanwhile, or no ctime here: left to its own delete
        }
      }
      return out;
    }
    org.apache.hadoop.fs.FileStatus[] children;
    try {
      children = fsOf(place, hadoop()).listStatus(new org.apache.hadoop.fs.Path(place));
    } catch (java.io.FileNotFoundException e) {
      return out;
    }
    for (org.apache.hadoop.fs.FileStatus c : children) {
      if (!c.isDirectory() && !isHiddenName(c.getPath().getName())
          && c.getModificationTime() < millis) {
        out.add(uriKey(c.getPath().toString()));
      }
    }
    Collections.sort(out);
    return out;
  }

  public static boolean under(String path, String root) {
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
  public static boolean temporaryBelow(String base, String path) {
    return temporaryEnd(base, path) >= 0;
  }

  /**
   * Where the first temporary or staging name below `base` in `path` ends (the length of
   * the prefix of `path` through it: {@code <base>/_temporary/0}, {@code <base>/.spark-
   * staging-<uuid>}), or -1 if there is none.
   */
  public static int temporaryEnd(String base, String path) {
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
        if (i + 1 == segs.length && isCommitterTemporary(path)) {
          return end;
        }
      }
    }
    return -1;
  }

  /**
   * What the numbered directories in the committer `_temporary` directory `dir` (see
   * {@link #isCommitterTemporary}) hold that no committer writes there: what a job's clean-up
   * of `dir` must leave where it is. A committer's attempt directory holds only its task
   * attempts' `_temporary` and its committed `task_<job>_<m|r>_<n>` directories; a table
   * located at {@code <t>/_temporary/7} holds data files or k=v directories, which stay,
   * while the committer's own entries beside them go. (Judged by the entries, not by the
   * number: the job's attempt number is in its own configuration, which the file system's
   * hook does not see.) None when `dir` is not called `_temporary`.
   */
  public static List<String> dataInAttempts(String dir) throws IOException {
    List<String> out = new ArrayList<>();
    if (!name(dir).equals("_temporary")) {
      return out;
    }
    for (String c : children(dir)) {
      if (ATTEMPT.matcher(name(c)).matches() && isDirectory(c)) {
        for (String e : children(c)) {
          if (!committerEntry(e)) {
            out.add(e);
          }
        }
      }
    }
    return out;
  }

  // Hadoop's TaskID: task_<job tracker id>_<job number>_<type>_<task number>; a partition
  // directory (task_id=1) has a '='.
  private static final java.util.regex.Pattern TASK = java.util.regex.Pattern.compile(
      "task_[^=/]+_\\d+_[mrjct]_\\d+");

  /** Is `entry` of an attempt directory one a committer writes (see dataInAttempts)? */
  private static boolean committerEntry(String entry) throws IOException {
    String n = name(entry);
    return (n.equals("_temporary") || TASK.matcher(n).matches()) && isDirectory(entry);
  }

  public static boolean isStagingName(String seg) {
    return SPARK_STAGING.matcher(seg).matches() || HIVE_STAGING.matcher(seg).matches();
  }

  /**
   * A `_temporary` directory as FileOutputCommitter lays it out: only application-attempt
   * directories (0, 1, ...) in it. A table called `_temporary` holds data files or k=v
   * directories, so it is not one.
   */
  public static boolean isCommitterTemporary(String dir) {
    if (!isLocal(dir)) {
      try {
        org.apache.hadoop.fs.FileStatus[] children =
            fsOf(dir, hadoop()).listStatus(new org.apache.hadoop.fs.Path(dir));
        for (org.apache.hadoop.fs.FileStatus c : children) {
          if (!c.isDirectory() || !ATTEMPT.matcher(c.getPath().getName()).matches()) {
            return false;
          }
        }
        return children.length > 0;
      } catch (IOException e) {
        return false;
      }
    }
    File[] children = new File(dir).listFiles();
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
  public static boolean isHiddenName(String name) {
    return name.startsWith(".") || name.startsWith("_");
  }

  /**
   * Is this entry of a data directory none of its data? Spark's and Hive's staging names
   * are all hidden ones, none with a '='. As Spark's file index has it, a directory
   * `_src=1` or `.p=1` is a partition all the same.
   */
  public static boolean notData(String name, boolean isDir) {
    return isHiddenName(name) && !(isDir && name.indexOf('=') > 0);
  }

  /**
   * The data files in `dir` (and below it when `recursive`), sorted: no temporary or hidden
   * names, and only names containing `mark` when it is not null.
   */
  public static List<String> dataFiles(File dir, boolean recursive, String mark) {
    List<String> out = new ArrayList<>();
    File[] children = dir.listFiles();
    if (children == null) {
      return out;
    }
    for (File f : children) {
      String n = f.getName();
      boolean isDir = f.isDirectory();
      if (notData(n, isDir)) {
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
  public static List<Map<String, String>> partitionsOf(List<String> files,
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
  public static List<Map<String, Object>> fileRefs(List<String> paths) {
    List<Map<String, Object>> out = new ArrayList<>();
    for (String p : paths) {
      out.add(Collections.<String, Object>singletonMap("path", p));
    }
    return out;
  }

  /** Is `path` under a warehouse root, and not a temporary path? */
  public static boolean protectedPath(String path, Settings s) {
    return path != null && !isTemporary(path) && protectedLocation(path, s);
  }

  /**
   * Is this location of a table or partition, as the catalog records it, under a root? Its
   * name does not matter: a directory named like a job's temporary output
   * ({@code _temporary/7}) that someone registered as a partition holds that partition's data.
   */
  public static boolean protectedLocation(String location, Settings s) {
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
  public static String rootWithin(String path, Settings s) {
    if (path == null || !s.enabled) {
      return null;
    }
    String target = isLocal(path) ? real(Paths.get(path), true) : path;
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
  public static void refuseRootRemoval(String path, Settings s, String what)
      throws RecycleException {
    String root = rootWithin(path, s);
    if (root != null && (!isLocal(path)
        || Files.exists(Paths.get(path), java.nio.file.LinkOption.NOFOLLOW_LINKS))) {
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
  public static List<String> filesUnder(String dir) throws IOException {
    return filesUnder(dir, true);
  }

  /**
   * {@link #filesUnder(String)}, or with `skipTemporary` false every file below `dir`
   * whatever its directories are called: what a LOAD DATA moves is data all of it.
   */
  public static List<String> filesUnder(String dir, boolean skipTemporary) throws IOException {
    if (!isLocal(dir)) {
      return filesUnderElsewhere(dir, dir, skipTemporary);
    }
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

  /** {@link #filesUnder(String, boolean)} on another file system: `top` is the delete's. */
  private static List<String> filesUnderElsewhere(String top, String dir, boolean skipTemporary)
      throws IOException {
    List<String> out = new ArrayList<>();
    org.apache.hadoop.fs.FileStatus[] children;
    try {
      children = fsOf(dir, hadoop()).listStatus(new org.apache.hadoop.fs.Path(dir));
    } catch (java.io.FileNotFoundException e) {
      return out; // removed meanwhile: not ours to keep
    }
    for (org.apache.hadoop.fs.FileStatus c : children) {
      String child = uriKey(c.getPath().toString());
      if (child.equals(dir)) {
        out.add(dir); // `dir` is a file: listed as itself
      } else if (!c.isDirectory()) {
        out.add(child);
      } else if (!skipTemporary || !temporaryBelow(top, child)) {
        out.addAll(filesUnderElsewhere(top, child, skipTemporary));
      }
    }
    Collections.sort(out);
    return out;
  }

  /**
   * What a directory holds (the entries with files in them), so that the directory itself
   * stays for the metastore to delete (it logs an error when the directory it drops is
   * already gone); the directory itself when it cannot be listed.
   */
  public static List<String> contents(String dir) throws IOException {
    if (!isLocal(dir)) {
      return contents(dir, hadoop());
    }
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
  public static void removeEmptyDirectories(File dir) {
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
  public static String firstSymlink(Path p) throws IOException {
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

  public static boolean holdsFiles(Path p) throws IOException {
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
  public static boolean isDefaultPartitionDir(String dir, String location,
      Map<String, String> spec) {
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

  public static String unescape(String s) {
    if (s.indexOf('%') < 0) {
      return s;
    }
    try {
      return URLDecoder.decode(s.replace("+", "%2B"), "UTF-8");
    } catch (IllegalArgumentException | java.io.UnsupportedEncodingException e) {
      return s;
    }
  }

  // -- the daemon -------------------------------------------------------------------------

  public static String tableKey(String db, String table) {
    return (db + "." + table).toLowerCase(Locale.ROOT);
  }

  /** Thrown when cmroot refuses or cannot be reached: the deletion must not happen. */
  public static final class RecycleException extends IOException {
    public RecycleException(String message, Throwable cause) {
      super(message, cause);
    }
  }

  /** `e` as an unchecked exception, for overrides of Scala methods that declare none. */
  public static RuntimeException unchecked(Throwable e) {
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
    Answer a = post("/v1/events", body, s, 600);
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
          + "(failOpen=true; fail-open events so far: {}): replicas of {} need a "
          + "fresh bootstrap", msg, FAIL_OPEN_EVENTS.get(), table);
      return false;
    }
    LOG.error("{}; the change was applied but not recorded (failOpen=false)", msg);
    throw new EventException(msg + ". The change WAS applied but is not in cmroot's event log, "
        + "so replication of " + table + " needs a fresh bootstrap (`cmroot repl dump` without "
        + "--from).", a.cause);
  }

  /** What the daemon answered to one POST, or why it could not. */
  public static final class Answer {
    public final boolean ok;
    /** The HTTP status, 0 when the daemon could not be reached or did not answer. */
    public final int status;
    public final String body;
    public final String problem;
    public final Throwable cause;

    public Answer(int status, String body, String problem, Throwable cause) {
      this.ok = status == 200;
      this.status = status;
      this.body = body;
      this.problem = problem;
      this.cause = cause;
    }

    /** The answer's JSON object; IOException when it is not one. */
    public Map<String, Object> json() throws IOException {
      try {
        return Json.object(body);
      } catch (IllegalArgumentException e) {
        throw new IOException(e.getMessage(), e);
      }
    }
  }

  /**
   * POST `body` as JSON to the daemon's `route`, waiting at most `timeoutSeconds` for the
   * answer. Blocking socket I/O goes on through interrupts (Hive cancels the other loads of
   * a failed statement with them): a commit or abort cut short would leave a statement's
   * files staged until the lease passes. Connections are kept alive and reused.
   */
  public static Answer post(String route, Map<String, Object> body, Settings s,
      int timeoutSeconds) {
    if ((route.equals("/v1/recycle") || route.equals("/v1/events"))
        && !body.containsKey("audit")) {
      body = new LinkedHashMap<>(body);
      body.put("audit", audit());
    }
    String token;
    try {
      token = s.token();
    } catch (IOException e) {
      return new Answer(0, null, "cmroot " + e.getMessage(), e);
    }
    HttpURLConnection c = null;
    try {
      byte[] out = Json.write(body).getBytes(StandardCharsets.UTF_8);
      c = (HttpURLConnection) new URL(s.url + route).openConnection();
      c.setConnectTimeout(CONNECT_TIMEOUT_MS);
      c.setReadTimeout(timeoutSeconds * 1000);
      c.setRequestMethod("POST");
      c.setDoOutput(true);
      c.setUseCaches(false);
      c.setFixedLengthStreamingMode(out.length);
      c.setRequestProperty("Content-Type", "application/json");
      c.setRequestProperty("Accept", "application/json");
      if (token != null) {
        c.setRequestProperty("Authorization", "Bearer " + token);
      }
      try (OutputStream o = c.getOutputStream()) {
        o.write(out);
      }
      int status = c.getResponseCode();
      InputStream in = status >= 400 ? c.getErrorStream() : c.getInputStream();
      String text = in == null ? "" : read(in);
      if (status == 200) {
        return new Answer(200, text, null, null);
      }
      return new Answer(status, text, "the daemon at " + s.url + " answered HTTP " + status
          + ": " + errorText(text), null);
    } catch (IOException | RuntimeException e) {
      if (c != null) {
        c.disconnect(); // a half-read connection must not go back to the pool
      }
      return new Answer(0, null, "the daemon at " + s.url + " is unreachable (" + e
          + "); is `cmroot serve` running?", e);
    }
  }

  // -- audit: who and what asks (recorded on each event; cmroot/audit.py) -----------------

  private static final List<Supplier<Map<String, String>>> AUDIT_PARTS =
      new CopyOnWriteArrayList<>();
  private static final int STATEMENT_CHARS = 1000; // the daemon keeps no more
  private static volatile String host;

  /**
   * Add what a module knows of who asks (Spark: its user, application and statement; the
   * metastore: the calling user and client address), merged over the process's user and host
   * in the order added. A part that fails is skipped: an audit never fails a recycle.
   */
  public static void addAuditPart(Supplier<Map<String, String>> part) {
    AUDIT_PARTS.add(part);
  }

  /** The audit sent with every recycle and event. */
  public static Map<String, String> audit() {
    Map<String, String> m = new LinkedHashMap<>();
    m.put("user", System.getProperty("user.name"));
    m.put("host", hostName());
    for (Supplier<Map<String, String>> part : AUDIT_PARTS) {
      try {
        Map<String, String> more = part.get();
        if (more != null) {
          more.forEach((k, v) -> {
            if (v != null && !v.isEmpty()) {
              m.put(k, v);
            }
          });
        }
      } catch (RuntimeException | LinkageError e) {
        LOG.debug("cmroot: an audit part failed", e);
      }
    }
    m.values().removeIf(v -> v == null || v.isEmpty());
    String sql = m.get("statement");
    if (sql != null && sql.length() > STATEMENT_CHARS) {
      m.put("statement", sql.substring(0, STATEMENT_CHARS - 1) + "\u2026");
    }
    return m;
  }

  private static String hostName() {
    String h = host;
    if (h == null) {
      try {
        h = java.net.InetAddress.getLocalHost().getHostName();
      } catch (IOException | RuntimeException e) {
        h = "";
      }
      host = h;
    }
    return h;
  }

  private static String read(InputStream in) throws IOException {
    try (InputStream i = in) {
      ByteArrayOutputStream buf = new ByteArrayOutputStream();
      byte[] chunk = new byte[8192];
      int n;
      while ((n = i.read(chunk)) > 0) {
        buf.write(chunk, 0, n);
      }
      return new String(buf.toByteArray(), StandardCharsets.UTF_8);
    }
  }

  private static String errorText(String body) {
    try {
      Map<String, Object> n = Json.object(body);
      String e = Json.text(n, "error");
      String d = Json.text(n, "detail");
      return d.isEmpty() ? e : e + ": " + d;
    } catch (Exception ex) {
      return abbreviate(body);
    }
  }

  public static String abbreviate(String s) {
    return s == null ? "" : s.length() > 300 ? s.substring(0, 300) + "..." : s;
  }

  /** The paths to send for a delete of `p`: itself, and its .crc sibling for a file. */
  public static List<String> withChecksumSibling(String p) {
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

  public static void debugDelete(Settings s, String what, String path) {
    if (s.debug) {
      LOG.warn("cmroot debug: " + what + " " + path + " thread=" + Thread.currentThread()
          .getName(), new Exception("stack of " + what));
    }
  }

  // -- table definitions ------------------------------------------------------------------

  /**
   * The table definition replication recreates a table from, as JSON: a thrift metastore
   * Table, or a Hive ql.metadata.Table (whose getTTable() is used). Called by the metastore
   * listener for tableObj, and through py4j by `cmroot repl dump` on a bootstrap.
   */
  public static String tableJson(Object table) throws IOException {
    return Json.write(tableMap(thriftTable(table)));
  }

  /**
   * Does this application's hook record the events of a table or partition at `location`
   * (under a warehouse root, the hook enabled)? Through py4j by `cmroot repl dump`: a table
   * it does not record would stand still on a replica.
   */
  public static boolean recordsAt(String location, Configuration hconf) {
    return protectedLocation(localPath(location), settings(hconf));
  }

  public static org.apache.hadoop.hive.metastore.api.Table thriftTable(Object table) {
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

  public static Map<String, Object> tableMap(org.apache.hadoop.hive.metastore.api.Table t) {
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
