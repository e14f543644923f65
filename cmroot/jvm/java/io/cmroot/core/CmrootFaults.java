package io.cmroot.core;

import java.io.File;
import java.io.IOException;
import java.util.concurrent.TimeUnit;
import org.apache.hadoop.conf.Configuration;

/**
 * Test fault points, for the tests of what happens between a prepared recycle and the
 * statement's (or metastore call's) own commit. Both are off unless set in the application's
 * static conf (or the metastore's hive-site.xml as cmroot.test.*); they are never needed in
 * production:
 *
 * <ul>
 *   <li>{@code spark.cmroot.test.failAfterPrepare=true}: every hook fails right after its
 *       recycle was prepared, as if the statement's own commit (the job commit, the metastore
 *       transaction, the command) had failed there.
 *   <li>{@code spark.cmroot.test.pauseAfterPrepare=DIR}: every hook, right after its recycle
 *       was prepared, creates DIR/reached and waits (at most 5 minutes) until DIR/go exists:
 *       a test can then stop or restart the daemon between prepare and commit.
 * </ul>
 */
public final class CmrootFaults {
  private CmrootFaults() {}

  /** The point between a prepared recycle and the commit of the statement that made it. */
  public static void afterPrepare(Configuration hconf, String where) throws IOException {
    String pause = Cmroot.conf(hconf, "test.pauseAfterPrepare", null);
    if (pause != null) {
      File dir = new File(pause);
      new File(dir, "reached").createNewFile(); // false when a part before this one made it
      long deadline = System.nanoTime() + TimeUnit.MINUTES.toNanos(5);
      while (!new File(dir, "go").exists() && System.nanoTime() < deadline) {
        try {
          Thread.sleep(50);
        } catch (InterruptedException e) {
          Thread.currentThread().interrupt();
          throw new IOException("cmroot test fault point interrupted", e);
        }
      }
    }
    if (Boolean.parseBoolean(Cmroot.conf(hconf, "test.failAfterPrepare", "false"))) {
      throw new IOException("cmroot test fault point spark.cmroot.test.failAfterPrepare: "
          + where + " fails after its recycle was prepared");
    }
  }
}
