"""`cmroot repl load` as a Spark application:

    spark-submit --master yarn cmd/repl_load.py [DB[.TABLE]] --from-dir URI [--with k=v ...]

Spark settings come from spark-submit; everything else is `cmroot repl load`."""

import sys

from cmroot.cli import main

if __name__ == "__main__":
    sys.exit(main(["repl", "load", *sys.argv[1:]]))
