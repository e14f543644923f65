package io.cmroot.core;

import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;

/**
 * One two-phase recycle at the daemon (DESIGN, the two-phase rows of the API table): the
 * files one statement removes for one (op, db, table, purge), moved into the daemon's staging
 * by {@code POST /v1/recycle} with {@code "prepare": true}, seen by nobody, then published
 * with their one event by {@code commit} or put back by {@code abort}. Later parts of the same
 * statement join it with its txid; a refused part makes the daemon put every part back.
 *
 * <p>While it is open a background thread renews its lease, so a long job commit or metastore
 * transaction keeps it; if this JVM dies the renewals stop and the daemon puts the files back
 * when the lease passes. That is also what happens to an abort that cannot reach the daemon.
 */
public final class CmrootTransaction {
  // A commit that meets no daemon is retried for about half a minute (a daemon restarting);
  // the lease (spark.cmroot.lease, default 10 minutes) outlasts that many times over.
  private static final int COMMIT_ATTEMPTS = 7;
  private static final long FIRST_BACKOFF_MS = 500;
  private static final int CALL_TIMEOUT = 600; // seconds
  // Paths per prepare request: far below the daemon's 100,000 items and 64 MiB body, so a
  // large overwrite is a few joined parts, not one refused request (nor one per file).
  private static final int PATHS_PER_REQUEST = 10_000;

  private static final ScheduledExecutorService RENEWER =
      Executors.newSingleThreadScheduledExecutor(r -> {
        Thread t = new Thread(r, "cmroot-lease-renewer");
        t.setDaemon(true);
        return t;
      });

  private final Cmroot.Settings s;
  public final String op;
  public final String db;
  public final String table;
  public final boolean purge;
  private final String location;
  private final String what;
  // "copy" for a file the statement moves elsewhere (a rename that leaves its path): its
  // bytes are kept under that path while the file itself goes on to its new place.
  private final String mode;
  // The table's partitions' own locations outside its directory: its files there are the
  // table's too (the daemon otherwise takes one table directory per labelled recycle).
  private List<String> partitionLocations = Collections.emptyList();

  private volatile String txid; // null until the daemon answered the first prepare
  private List<Object> files = Collections.emptyList(); // every file staged so far
  private boolean finished;
  private boolean committed;
  private ScheduledFuture<?> renewal;

  /** `what` names the statement's change in messages ("table db.t", "the overwrite of P"). */
  public CmrootTransaction(Cmroot.Settings s, String op, String db, String table, boolean purge,
      String location, String what) {
    this(s, "move", op, db, table, purge, location, what);
  }

  public CmrootTransaction(Cmroot.Settings s, String mode, String op, String db, String table,
      boolean purge, String location, String what) {
    this.s = s;
    this.mode = mode;
    this.op = op == null ? "DELETE" : op;
    this.db = db;
    this.table = table;
    this.purge = purge;
    this.location = location;
    this.what = what;
  }

  /** Declare more of the table's partition locations outside its directory. */
  public synchronized CmrootTransaction withPartitionLocations(List<String> dirs) {
    List<String> all = new ArrayList<>(partitionLocations);
    for (String d : dirs) {
      if (!all.contains(d)) {
        all.add(d);
      }
    }
    partitionLocations = Collections.unmodifiableList(all);
    return this;
  }

  /** The key of the transaction a statement keeps for one kind of recycle. */
  public static String key(String op, String db, String table, boolean purge) {
    return op + "\u0000" + db + "\u0000" + table + "\u0000" + purge;
  }

  /**
   * Stage `paths` (all or nothing; `part` names them in messages) as one more part of this
   * transaction. Returns true when
   * staged; false when the daemon could not take the first part and spark.cmroot.failOpen is
   * true (logged and counted: the caller then deletes as Spark would). Throws when the daemon
   * refused or could not be reached: nothing of this part was moved and, for a later part,
   * every earlier part is back where it was too (the statement is one unit).
   */
  public synchronized boolean prepare(List<String> paths, List<Map<String, String>> partitions,
      String part) throws Cmroot.RecycleException {
    for (int from = 0; from < paths.size(); from += PATHS_PER_REQUEST) {
      List<String> chunk = paths.subList(from, Math.min(paths.size(), from + PATHS_PER_REQUEST));
      if (!prepareRequest(chunk, partitions, part)) {
        return false; // only ever the first request: a later one joins, and throws
      }
    }
    return true;
  }

  private boolean prepareRequest(List<String> paths, List<Map<String, String>> partitions,
      String part) throws Cmroot.RecycleException {
    if (finished) {
      throw new Cmroot.RecycleException("cmroot: the recycle of " + what + " (transaction "
          + txid + ") was already committed or aborted; run the statement again", null);
    }
    Map<String, Object> body = new LinkedHashMap<>();
    body.put("paths", paths);
    body.put("mode", mode);
    body.put("purge", purge);
    body.put("op", op);
    if (db != null) {
      body.put("db", db);
    }
    if (table != null) {
      body.put("table", table);
    }
    body.put("partitions", partitions == null ? Collections.emptyList() : partitions);
    if (location != null) {
      body.put("location", location);
    }
    // Only the partition locations this part reaches: one the daemon would refuse as a
    // table's directory by the layout (<db>.db/<name>) then refuses only what recycles there.
    List<String> reached = new ArrayList<>();
    for (String d : partitionLocations) {
      if (paths.stream().anyMatch(p -> Cmroot.under(p, d) || Cmroot.under(d, p))) {
        reached.add(d);
      }
    }
    if (!reached.isEmpty()) {
      body.put("partitionLocations", reached);
    }
    body.put("prepare", true);
    body.put("lease", s.leaseSeconds);
    if (txid != null) {
      body.put("txid", txid);
    }
    long t0 = System.nanoTime();
    Cmroot.Answer a = Cmroot.post("/v1/recycle", body, s, CALL_TIMEOUT);
    if (a.ok) {
      try {
        Map<String, Object> answer = a.json();
        files = Json.list(answer, "files");
        if (txid == null) {
          txid = Json.text(answer, "txid");
          if (txid.isEmpty()) {
            throw new java.io.IOException("no txid in " + Cmroot.abbreviate(a.body));
          }
          long every = Math.max(1, s.leaseSeconds / 3);
          renewal = RENEWER.scheduleAtFixedRate(this::renew, every, every, TimeUnit.SECONDS);
        }
      } catch (java.io.IOException e) {
        throw new Cmroot.RecycleException("cmroot: the daemon at " + s.url + " answered the "
            + "prepare of " + part + " with something that is not its JSON: " + e, e);
      }
      if (Cmroot.LOG.isDebugEnabled()) {
        Cmroot.LOG.debug("cmroot: prepared {} ({} paths, op {}, transaction {}) in {} ms",
            part, paths.size(), op, txid, (System.nanoTime() - t0) / 1_000_000);
      }
      return true;
    }
    String msg = "cmroot could not recycle " + part + " (op " + op + ", " + paths.size()
        + " path(s), first " + paths.get(0) + "): " + a.problem;
    if (txid != null && a.status == 409) { // committed already: this part is too late
      finish();
      throw new Cmroot.RecycleException(msg + ". The statement's recycle was already "
          + "committed; this part was not deleted. Run the statement again.", a.cause);
    }
    if (txid != null) {
      // A part of a transaction already holding files: the daemon rolled it all back when it
      // refused; if it did not answer, take no chances and abort.
      if (a.status == 0) {
        abort("its part " + paths.get(0) + " got no answer");
      }
      finish();
      Cmroot.LOG.error("{}; every part of the statement stays where it was", msg);
      throw new Cmroot.RecycleException(msg + ". Nothing was deleted: the files of every "
          + "earlier part of this statement are back where they were. Fix the request (or "
          + "start the daemon), then run the statement again.", a.cause);
    }
    if (a.status == 0) {
      msg += " (if the daemon staged anything before the answer was lost, it puts it back "
          + "when the lease of " + s.leaseSeconds + " s passes)";
    }
    // Fail open only when cmroot is down (unreachable, 5xx): a 4xx is the daemon refusing
    // this request, and deleting anyway would lose exactly what it refused to take.
    if (s.failOpen && (a.status == 0 || a.status >= 500)) {
      Cmroot.FAIL_OPEN_DELETES.incrementAndGet();
      Cmroot.LOG.warn("{}; deleting WITHOUT a copy in cmroot because failOpen=true "
          + "(fail-open deletions so far: {})", msg, Cmroot.FAIL_OPEN_DELETES.get());
      return false;
    }
    Cmroot.LOG.error("{}; nothing deleted: the statement fails (failOpen=false)",
        msg);
    throw new Cmroot.RecycleException(msg + ". Nothing was deleted (failOpen="
        + "false). Start the daemon or fix the request, then run the statement again.", a.cause);
  }

  /** Whether a part was staged and neither committed nor aborted yet. */
  public synchronized boolean pending() {
    return txid != null && !finished;
  }

  /**
   * Publish every staged file with the transaction's one event. Retried while the daemon
   * cannot be reached or is overloaded: the daemon's commit is idempotent (a commit sent again
   * after its answer was lost gets the same event), so 200 always means committed and 404
   * always means rolled back. Throws when it was not published; the files are then back in
   * place (now, or by the daemon when the lease passes), never silently.
   */
  public synchronized void commit() throws Cmroot.RecycleException {
    if (txid == null || committed) {
      return;
    }
    if (finished) { // a later part was refused (the daemon rolled it all back) or aborted
      throw rolledBack("a part of it was refused or it was aborted", null);
    }
    Cmroot.Answer a = null;
    long backoff = FIRST_BACKOFF_MS;
    for (int attempt = 1; attempt <= COMMIT_ATTEMPTS; attempt++) {
      a = Cmroot.post("/v1/transactions/" + txid + "/commit", Collections.<String, Object>emptyMap(), s,
          CALL_TIMEOUT);
      if (a.ok) {
        committed();
        return;
      }
      if (a.status == 404) {
        finish();
        throw rolledBack(a.problem + " (its lease of " + s.leaseSeconds + " s passed, or it "
            + "was aborted)", a.cause);
      }
      if (a.status != 0 && a.status != 503) {
        break; // refused: retrying cannot help
      }
      Cmroot.LOG.warn("cmroot: commit of {} (transaction {}) attempt {} of {}: {}; retrying",
          what, txid, attempt, COMMIT_ATTEMPTS, a.problem);
      if (attempt < COMMIT_ATTEMPTS && !sleep(backoff)) {
        break;
      }
      backoff *= 2;
    }
    String msg = "cmroot could not commit the recycle of " + what + " (op " + op
        + ", transaction " + txid + ", " + files.size() + " file(s)): " + a.problem;
    if (abortAnswer("its commit failed") == 409) {
      committed(); // the commit did go through; only its answers were lost
      return;
    }
    Cmroot.LOG.error(msg);
    throw new Cmroot.RecycleException(msg + ". No event was recorded for it; its files are "
        + "back in place (or will be when its lease passes). Run the statement again.",
        a.cause);
  }

  private void committed() {
    committed = true;
    finish();
    if (Cmroot.LOG.isDebugEnabled()) {
      Cmroot.LOG.debug("cmroot: committed {} (transaction {}, {} files)", what, txid,
          files.size());
    }
  }

  /** The error of a transaction the daemon rolled back: the statement did not take effect. */
  private Cmroot.RecycleException rolledBack(String why, Throwable cause) {
    String msg = "cmroot: the recycle of " + what + " (op " + op + ", transaction " + txid
        + ", " + files.size() + " file(s)) was rolled back by the daemon: " + why
        + ". Its files are back in place and no event was recorded, so the statement did "
        + "not take effect as a unit: run it again";
    Cmroot.LOG.error(msg);
    return new Cmroot.RecycleException(msg, cause);
  }

  /**
   * Put every staged file back. Never throws: if the daemon cannot be reached, it puts them
   * back itself when the lease passes (no renewals come from here any more).
   */
  public synchronized void abort(String why) {
    abortAnswer(why);
  }

  /** abort(why), returning the daemon's status (409: it was committed; 0: no answer). */
  private int abortAnswer(String why) {
    if (txid == null || finished) {
      return 404;
    }
    finish();
    Cmroot.Answer a = Cmroot.post("/v1/transactions/" + txid + "/abort",
        Collections.<String, Object>emptyMap(), s, CALL_TIMEOUT);
    if (a.ok || a.status == 404) {
      Cmroot.LOG.info("cmroot: aborted the recycle of {} (transaction {}, {} file(s) put back): "
          + "{}", what, txid, files.size(), why);
    } else if (a.status == 409) {
      Cmroot.LOG.warn("cmroot: the recycle of {} (transaction {}) was already committed; not "
          + "aborted after {}", what, txid, why);
    } else {
      Cmroot.LOG.error("cmroot could not abort the recycle of {} (transaction {}, {} file(s)) "
          + "after {}: {}. The daemon puts the files back itself when the transaction's lease "
          + "passes, at most {} s from now (no more renewals are sent).", what, txid,
          files.size(), why, a.problem, s.leaseSeconds);
    }
    return a.status;
  }

  private void finish() {
    finished = true;
    if (renewal != null) {
      renewal.cancel(false);
    }
  }

  /** Keep the lease while the statement runs (from the renewer thread, never blocking it). */
  private void renew() {
    String id = txid;
    Cmroot.Answer a = Cmroot.post("/v1/transactions/" + id + "/renew",
        Collections.<String, Object>singletonMap("lease", s.leaseSeconds), s,
        (int) Math.max(1, s.leaseSeconds / 3));
    if (!a.ok && a.status != 0) {
      Cmroot.LOG.error("cmroot: the lease of the recycle of {} (transaction {}) could not be "
          + "renewed: {}", what, id, a.problem);
    } else if (!a.ok) {
      Cmroot.LOG.warn("cmroot: renewing the lease of transaction {}: {}; trying again", id,
          a.problem);
    }
  }

  private static boolean sleep(long ms) {
    try {
      Thread.sleep(ms);
      return true;
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      return false;
    }
  }

  @Override
  public String toString() {
    return "transaction " + txid + " (" + what + ", op " + op + ")";
  }
}
