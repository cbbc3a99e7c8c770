"""Reading inputs (Parquet) and writing exports (Parquet, JSONL)."""
