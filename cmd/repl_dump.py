"""`cmroot repl dump` as a Spark application (a bootstrap lists and hashes on the cluster):

    spark-submit --master yarn cmd/repl_dump.py DB[.TABLE] --to-dir URI [--from N ...]

Spark settings come from spark-submit; everything else is `cmroot repl dump`."""

import sys

from cmroot.cli import main

if __name__ == "__main__":
    sys.exit(main(["repl", "dump", *sys.argv[1:]]))
