"""`disk://`, a second Hadoop file system scheme over the local disk, standing for the
object stores and HDFS that cannot run here: its Hadoop class (for the metastore and
Spark) and, in `fsspec_disk/`, its fsspec twin (for the daemon)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from cmroot.jvm import cache_dir, pyspark_home

SOURCE = Path(__file__).with_name("DiskFileSystem.java")
DISK_FS = "io.cmroot.testfs.DiskFileSystem"
# On a Python process's path, this directory registers `disk` with fsspec (an entry point).
FSSPEC_DISK = Path(__file__).with_name("fsspec_disk")


def disk_fs_jar() -> str:
    """The jar of the `disk` scheme (Java 8 bytecode, for the metastore as for Spark),
    built once into the cmroot JVM cache."""
    key = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out = cache_dir() / f"cmroot-testfs-{key}.jar"
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        classes = Path(tmp) / "classes"
        javac = shutil.which("javac") or "javac"
        subprocess.run([javac, "-nowarn", "--release", "8", "-cp",
                        str(pyspark_home() / "jars" / "*"), "-d", str(classes), str(SOURCE)],
                       check=True, capture_output=True)
        part = Path(tmp) / "part.jar"
        subprocess.run([shutil.which("jar") or "jar", "--create", "--file", str(part),
                        "-C", str(classes), "."], check=True, capture_output=True)
        part.replace(out)
    return str(out)
