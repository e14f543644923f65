package io.cmroot.testfs;

import java.io.File;
import java.io.FileNotFoundException;
import java.io.IOException;
import java.net.URI;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;

/**
 * A second Hadoop scheme, `disk://`, over the local disk: what the tests use for a warehouse
 * on a file system other than `file` (an object store or HDFS in production), since neither
 * can run here. Paths are local paths under another scheme. Statuses are plain ones: the
 * raw local file system's read permissions from a `file:` URI of the path.
 */
public class DiskFileSystem extends RawLocalFileSystem {
  private static final URI NAME = URI.create("disk:///");
  // The scheme it was configured under (fs.<scheme>.impl): `disk`, or a second name of the
  // same disk for tests of aliases.
  private URI name;

  @Override
  public void initialize(URI uri, Configuration conf) throws IOException {
    super.initialize(uri, conf);
    name = URI.create(uri.getScheme() + ":///");
  }

  @Override
  public URI getUri() {
    return name == null ? NAME : name;
  }

  @Override
  public String getScheme() {
    return getUri().getScheme();
  }

  @Override
  public FileStatus getFileStatus(Path f) throws IOException {
    File file = pathToFile(f);
    if (!file.exists()) {
      throw new FileNotFoundException(f + " does not exist");
    }
    return status(file, makeQualified(f));
  }

  @Override
  public FileStatus[] listStatus(Path f) throws IOException {
    File file = pathToFile(f);
    if (!file.exists()) {
      throw new FileNotFoundException(f + " does not exist");
    }
    Path at = makeQualified(f);
    String[] names = file.isDirectory() ? file.list() : null;
    if (names == null) {
      return new FileStatus[] {status(file, at)};
    }
    FileStatus[] out = new FileStatus[names.length];
    for (int i = 0; i < names.length; i++) {
      out[i] = status(new File(file, names[i]), new Path(at, names[i]));
    }
    return out;
  }

  private static FileStatus status(File file, Path at) {
    return new FileStatus(file.length(), file.isDirectory(), 1, 32 << 20, file.lastModified(),
        at);
  }
}
