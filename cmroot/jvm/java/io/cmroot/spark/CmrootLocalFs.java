package io.cmroot.spark;

import java.io.IOException;
import java.net.URI;
import java.net.URISyntaxException;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.DelegateToFileSystem;
import org.apache.hadoop.fs.FsConstants;

/**
 * The `file` scheme of Hadoop's other file API, FileContext
 * ({@code spark.hadoop.fs.AbstractFileSystem.file.impl=io.cmroot.spark.CmrootLocalFs}):
 * Hadoop's own LocalFs goes straight to the raw local file system, so a
 * {@code FileContext.delete} of a warehouse file would bypass {@link CmrootLocalFileSystem}.
 * This one delegates every call to it instead, deletes and replacing writes included.
 */
public class CmrootLocalFs extends DelegateToFileSystem {
  public CmrootLocalFs(URI uri, Configuration conf) throws IOException, URISyntaxException {
    super(uri, new CmrootLocalFileSystem(), conf, FsConstants.LOCAL_FS_URI.getScheme(), false);
  }

  @Override
  public int getUriDefaultPort() {
    return -1; // no port: a local path
  }
}
