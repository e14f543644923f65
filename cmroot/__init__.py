"""cmroot: a checksum-keyed change store that keeps deleted warehouse files for replication."""

__version__ = "0.1.0"
