"""Hooks that route deletions through the cmroot daemon from outside Spark (the Spark
hook lives in `cmroot.spark`)."""
