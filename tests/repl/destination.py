"""A destination warehouse for the replication tests, in its own process (one JVM holds
one Hive metastore, and the source's lives in the test process).

    python -m tests.repl.destination PLAN.json
    python -m tests.repl.destination --serve BASE   (a JSON list of steps per stdin line)

PLAN: {"base": DIR, "steps": [STEP, ...], "decoys": {PATH: SIZE}}; a STEP may hold
"sql": [SQL] (run first), "load": {"dump": URL, "target": NAME|null, "daemon_url": URL,
"token_file": PATH}, "queries": {NAME: SQL}, "status": [SCOPE], "partitions": [TABLE],
"files": [DB.TABLE]. "decoys" (optional) are files of SIZE zero bytes written at PATH
before anything else: what another cluster may hold at the source's paths. Steps run in
order in one Spark session; a failed load is reported and the later steps still run.
The answer is one JSON line on stdout: a list with, per step, {"load": result |
{"error", "detail", "kind"}, "rows": {NAME: rows}, "status": {SCOPE: id|null},
"partitions": {TABLE: [...]}, "files": {TABLE: [paths]}}."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def _session(base: Path, short_lived: bool) -> Any:
    from cmroot.repl.session import session
    from tests.spark.sparklib import spark_settings

    conf = spark_settings(base, base / "warehouse", short_lived, archived=True)
    spark = session("cmroot-test-destination", conf)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_steps(spark: Any, base: Path, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from cmroot.exceptions import CmrootError
    from cmroot.repl import load, status

    answers = []
    for step in steps:
        out: dict[str, Any] = {"rows": {}, "status": {}, "partitions": {}, "files": {}}
        for statement in step.get("sql", []):  # the destination's own statements
            spark.sql(statement)
        if "load" in step:
            try:
                how = step["load"]
                token_file = how.get("token_file")
                token = Path(token_file).read_text().strip() if token_file else None
                out["load"] = load(spark, how["dump"], how.get("target"),
                                   daemon_url=how.get("daemon_url"), token=token)
                out["load"] = out["load"].to_json()
            except CmrootError as e:
                out["load"] = {"error": e.message, "detail": e.detail, "kind": type(e).__name__}
        for name, sql in step.get("queries", {}).items():
            try:
                out["rows"][name] = sorted(list(r) for r in spark.sql(sql).collect())
            except Exception as e:  # e.g. a table the load did not create
                out["rows"][name] = {"error": str(e).splitlines()[0]}
        for scope in step.get("status", []):
            db, _, table = scope.partition(".")
            out["status"][scope] = status(spark, db, table or None)
        for table in step.get("partitions", []):
            try:
                out["partitions"][table] = sorted(
                    r[0] for r in spark.sql(f"SHOW PARTITIONS {table}").collect()
                )
            except Exception as e:
                out["partitions"][table] = {"error": str(e).splitlines()[0]}
        for table in step.get("files", []):
            db, _, t = table.partition(".")
            root = base / "warehouse" / f"{db}.db" / t
            out["files"][table] = sorted(
                os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
            )
        answers.append(out)
    return answers


def main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    base = Path(plan["base"])
    for path, size in plan.get("decoys", {}).items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(bytes(size))
    spark = _session(base, short_lived=True)  # one plan, then gone
    answers = run_steps(spark, base, plan["steps"])
    spark.stop()
    print(json.dumps(answers, default=str))
    return 0


def serve(base: Path) -> int:
    """One Spark session for many plans: a JSON list of steps per line on stdin, a JSON
    answer per line on stdout ({"answers": [...]} or {"crash": traceback})."""
    import traceback

    spark = _session(base, short_lived=False)  # the many plans of a package
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever else prints must not mix with the answers
    for line in sys.stdin:
        try:
            reply: dict[str, Any] = {"answers": run_steps(spark, base, json.loads(line))}
        except Exception:
            reply = {"crash": traceback.format_exc()}
        out.write(json.dumps(reply, default=str) + "\n")
        out.flush()
    spark.stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        sys.exit(serve(Path(sys.argv[2])))
    sys.exit(main(sys.argv[1]))
