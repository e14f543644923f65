package io.cmroot.testfs;

import java.net.URI;
import org.apache.hadoop.fs.RawLocalFileSystem;

/**
 * A second Hadoop scheme, `disk://`, over the local disk: what the tests use for a warehouse
 * on a file system other than `file` (an object store or HDFS in production), since neither
 * can run here. Paths are local paths under another scheme.
 */
public class DiskFileSystem extends RawLocalFileSystem {
  private static final URI NAME = URI.create("disk:///");

  @Override
  public URI getUri() {
    return NAME;
  }

  @Override
  public String getScheme() {
    return "disk";
  }
}
