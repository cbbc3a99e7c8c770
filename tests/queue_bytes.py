"""Bytes per request of a submitted SQLite queue, and where they go (SQLite's dbstat), for BENCHMARKS.md.

    python -m tests.queue_bytes OUT_DIR MODEL [NUM_ROWS] [submit flags...]   # e.g. --chat

Short random prompts (3-12 words), as a new user's 200,000-row file; the payload is the stored prompt text and
token ids (4 bytes each)."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = "the a river stone of to in what is how why name three list write short poem about".split()


def main(out: Path, model: str, num_rows: int, flags: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(num_rows)]
    data = out / "in.parquet"
    pq.write_table(pa.table({"prompt": prompts}), data)
    db = out / "q.db"
    for old in out.glob("q.db*"):
        old.unlink()
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "bulkgen", "submit", str(data), "--model", model,
                           "--db", f"sqlite:///{db}", "--json", *flags], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    print(f"submitted in {time.perf_counter() - start:.1f} s")
    con = sqlite3.connect(db)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    text = ids = 0
    for prompt, blob in con.execute("SELECT prompt, prompt_token_ids FROM requests"):
        text += len((prompt or "").encode())
        ids += len(blob or b"")
    size = db.stat().st_size
    print(f"input {data.stat().st_size / 1e6:.1f} MB Parquet; queue {size / 1e6:.1f} MB = {size / num_rows:.0f} "
          f"B/request; payload: text {text / num_rows:.0f} + ids {ids / num_rows:.0f} B/request; "
          f"queue / payload {size / (text + ids):.2f}x")
    query = "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name HAVING SUM(pgsize) > 65536 ORDER BY 2 DESC"
    for name, num_bytes in con.execute(query):
        print(f"  {name:32s} {num_bytes / 1e6:7.1f} MB {num_bytes / num_rows:6.0f} B/request")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 200_000, sys.argv[4:])
