package io.cmroot.spark;

import java.io.IOException;
import java.util.Iterator;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hive.metastore.MetaStoreEventListener;
import org.apache.hadoop.hive.metastore.api.MetaException;
import org.apache.hadoop.hive.metastore.api.Partition;
import org.apache.hadoop.hive.metastore.events.DropPartitionEvent;
import org.apache.hadoop.hive.metastore.events.DropTableEvent;

/**
 * A Hive metastore transactional listener
 * ({@code spark.hadoop.hive.metastore.transactional.event.listeners=
 * io.cmroot.spark.CmrootMetastoreRestage}): the last look at a dropped table's (or
 * partition's) directory inside the metastore transaction, before it commits.
 *
 * <p>The pre-event ({@link CmrootMetastoreListener}) staged the data when the drop began; a
 * file written there since would reach the daemon only from the metastore's delete, after the
 * metadata change was committed, and a refusal then (the daemon rolls the whole recycle back)
 * would leave the table gone from the catalog with its files back in place. Staged here,
 * joining the same recycle, a refusal throws, and the metastore rolls the drop back: the
 * table and every file stay as they were.
 */
public class CmrootMetastoreRestage extends MetaStoreEventListener {
  private final CmrootMetastoreListener stager;

  public CmrootMetastoreRestage(Configuration conf) {
    super(conf);
    stager = new CmrootMetastoreListener(conf);
  }

  @Override
  public void onDropTable(DropTableEvent e) throws MetaException {
    if (e.getDeleteData()) {
      try {
        stager.dropTable(e.getTable());
      } catch (IOException ex) {
        throw metaException(ex);
      }
    }
  }

  @Override
  public void onDropPartition(DropPartitionEvent e) throws MetaException {
    if (e.getDeleteData()) {
      try {
        Iterator<Partition> it = e.getPartitionIterator();
        while (it.hasNext()) {
          stager.dropPartition(e.getTable(), it.next());
        }
      } catch (IOException ex) {
        throw metaException(ex);
      }
    }
  }

  private static MetaException metaException(IOException ex) {
    MetaException me = new MetaException(ex instanceof Cmroot.RecycleException ? ex.getMessage()
        : "cmroot: " + ex);
    me.initCause(ex);
    return me;
  }
}
