"""`pipe preprocess`: turn JSONL, parquet and similar inputs into token shards."""
