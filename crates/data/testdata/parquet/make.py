"""Writes the hostile Parquet files the loader's tests read (pyarrow 26):

- nulls_bomb.parquet: one row whose `junk` column is a list of 100,000,000 nulls (1.2 KB);
- dictionary_bomb.parquet: 100 rows, each a reference to one 1 MiB dictionary string
  (about 100 MiB of JSON from a few KB);
- odd_types.parquet: two rows; `prompt` is text stored as plain bytes (no string annotation),
  `blob` bytes that are not UTF-8, `ts` and `day` the largest timestamp and date, `t` a time.

    python3 make.py   # in this directory
"""
import datetime

import pyarrow as pa
import pyarrow.parquet as pq

n = 100_000_000
nulls = pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), pa.nulls(n, pa.int32()))
pq.write_table(
    pa.table({"prompt": ["q"], "reward_model": [{"ground_truth": "7"}], "junk": nulls}),
    "nulls_bomb.parquet",
    compression="gzip",
)

rows = 100
dictionary = pa.DictionaryArray.from_arrays(
    pa.array([0] * rows, pa.int32()), pa.array(["x" * (1 << 20)])
)
pq.write_table(
    pa.table({"prompt": [f"q{i}" for i in range(rows)], "context": dictionary}),
    "dictionary_bomb.parquet",
    compression="gzip",
)

pq.write_table(
    pa.table(
        {
            "prompt": pa.array([b"What is 3+4?", b"What is 2+2?"], pa.binary()),
            "answer": pa.array([b"7", b"4"], pa.binary()),
            "blob": pa.array([b"\xff\xfe", b"\x00\x01"], pa.binary()),
            "ts": pa.array([2**63 - 1, 0], pa.timestamp("us")),
            "day": pa.array([2**31 - 1, 0], pa.date32()),
            "t": pa.array([datetime.time(1, 2, 3), datetime.time(0, 0)], pa.time64("us")),
        }
    ),
    "odd_types.parquet",
)
