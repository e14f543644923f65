package io.cmroot.metastore;

import io.cmroot.core.Cmroot;
import io.cmroot.core.CmrootFaults;
import io.cmroot.core.CmrootTransaction;
import java.io.IOException;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hive.metastore.api.Table;

/** Staging a drop's data: into the running engine statement, or into the metastore call. */
final class Stage {
  private Stage() {}

  /**
   * Stage what `dirs` hold (their entries: the directories stay for the metastore to
   * delete, which it logs as an error when they are gone) as one part of the call's (or the
   * statement's) recycle. `outside` are those of `dirs` outside the table's directory.
   */
  static void stage(Configuration conf, Cmroot.Settings s, Table t, List<String> keys,
      List<Map<String, String>> parts, List<String> dirs, List<String> outside, String what,
      String op, boolean purge) throws IOException {
    List<String> paths = new ArrayList<>();
    List<String> reached = new ArrayList<>();
    for (String dir : dirs) {
      Cmroot.refuseRootRemoval(dir, s, "the drop of " + what + " located at");
      if (Cmroot.protectedLocation(dir, s) && Cmroot.holdsFiles(dir, conf)) {
        paths.addAll(Cmroot.contents(dir, conf));
        if (outside.contains(dir)) {
          reached.add(dir);
        }
      }
    }
    if (paths.isEmpty()) {
      return; // nothing to keep, or already staged by the statement (Spark: DROP PARTITION)
    }
    if (s.debug) {
      Cmroot.debugDelete(s, "metastore drop of " + what, dirs.toString());
    }
    String tableLoc = Drops.location(t);
    String location = Cmroot.protectedLocation(tableLoc, s) ? tableLoc : null;
    Statement st = Statement.Registry.current();
    if (st != null) {
      if (!st.prepare(paths, op, t.getDbName(), t.getTableName(), purge, parts, location,
          what)) {
        return; // failed open: the metastore deletes as usual
      }
      for (String key : keys) {
        st.markStaged(key);
      }
    } else {
      Call call = Call.get();
      CmrootTransaction tx = call.tx(s, op, t.getDbName(), t.getTableName(), purge, location,
          "the drop of " + what).withPartitionLocations(reached);
      if (!tx.prepare(paths, parts, what)) {
        return;
      }
      for (String key : keys) {
        call.markStaged(key);
      }
    }
    CmrootFaults.afterPrepare(conf, "the drop of " + what);
  }
}
