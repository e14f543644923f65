package io.cmroot.metastore;

import io.cmroot.core.Cmroot;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hive.metastore.MetaStoreEndFunctionContext;
import org.apache.hadoop.hive.metastore.MetaStoreEndFunctionListener;

/**
 * The metastore's end-function listener
 * ({@code hive.metastore.end.function.listeners=io.cmroot.metastore.CmrootEndFunctionListener}):
 * the end of every metastore call, success or not; cmroot acts on the drops. A drop's recycle is normally settled by
 * the post-event listener; one the call left unsettled (a listener after cmroot's failed the
 * call, so no post-event came) is settled here: aborted, every file back, when the call
 * failed. Either way the call's state is cleared, so the next call on this handler thread
 * starts afresh.
 */
public class CmrootEndFunctionListener extends MetaStoreEndFunctionListener {

  public CmrootEndFunctionListener(Configuration conf) {
    super(conf);
    Drops.configure(conf);
  }

  @Override
  public void onEndFunction(String functionName, MetaStoreEndFunctionContext context) {
    if (functionName == null || !functionName.startsWith("drop_")) {
      return; // a read the drop made on its way (get_table ...) ends inside the drop's call
    }
    try {
      Call.end(context.isSuccess(), "the metastore call " + functionName + " failed");
    } catch (Cmroot.RecycleException e) {
      // The call succeeded but its recycle could not be committed: the files are back in
      // place (or will be when the lease passes). The call's result is already sent.
      Cmroot.LOG.error("cmroot: the metastore completed {} but its recycle was rolled back: {}",
          functionName, e.getMessage());
    }
  }
}
