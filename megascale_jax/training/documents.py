"""Documents from a corpus's shards: JSONL (plain, gzip or zstd) and Parquet, the forms pre-training
corpora ship in (FineWeb, Dolma, The Pile, a company's own dump), each document the string in one
field (`text` by default).

    for text in read_documents(path, "text", bad): ...

Read as a stream (a JSONL line, a Parquet record batch at a time), so memory does not grow with a
shard. Bad input, each one line naming the file (and line):

* a glob that matches nothing, a Parquet file without the field's column, text that is not UTF-8
  where the whole file is not (a binary, a Parquet file named .jsonl): an error (`DocumentError`);
* a JSONL line that is not JSON or not UTF-8, or lacks the field, or whose field is not a string
  (a Parquet row whose field is null): counted in
  `BadLines` and skipped (the count and the first such file:line are reported once), or an error at
  the first one with `stop_at_bad_line`;
* an empty shard: skipped with a warning; nothing at all to read: an error.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import os
from typing import Iterator

JSONL = (".jsonl", ".json", ".ndjson")
COMPRESSED = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
PARQUET_BATCH_ROWS = 1024


class DocumentError(ValueError):
    """A corpus the reader cannot use: one line naming the file and the fix."""


@dataclasses.dataclass
class BadLines:
    """JSONL lines skipped: how many, and the first one's file:line and reason."""

    stop_at_bad_line: bool = False
    count: int = 0
    first: str = ""

    def add(self, where: str, reason: str) -> None:
        if self.stop_at_bad_line:
            raise DocumentError(f"{where}: {reason}; fix the line, or leave it out (bad lines are skipped and "
                                "counted without --stop-at-bad-line)")
        self.count += 1
        self.first = self.first or f"{where}: {reason}"


def matching_files(pattern: str) -> list[str]:
    """The files a glob names, sorted, each once however many symlinks lead to it (real paths)."""
    return sorted(dict.fromkeys(os.path.realpath(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)))


def shard_paths(pattern: str) -> list[str]:
    """The shards a glob names, in the corpus's order (`matching_files`)."""
    paths = matching_files(pattern)
    if not paths:
        raise DocumentError(f"{pattern!r} matches no files; pass a glob of .jsonl(.gz|.zst) or .parquet shards")
    unknown = [p for p in paths if shard_format(p) is None]
    if unknown:
        raise DocumentError(f"{unknown[0]} is neither JSONL (.jsonl, .json, .ndjson, optionally .gz or .zst) nor "
                            ".parquet; narrow the glob to the corpus's shards")
    return paths


def shard_format(path: str) -> str | None:
    """"jsonl" or "parquet" by the file's name, None for anything else."""
    name = path.lower()
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    if name.endswith(JSONL):
        return "jsonl"
    if path.lower().endswith(".parquet"):
        return "parquet"
    return None


def read_documents(path: str, field: str, bad: BadLines) -> Iterator[str]:
    """The shard's documents in order: `field` of each JSONL object or Parquet row."""
    if os.path.getsize(path) == 0:
        return
    if shard_format(path) == "parquet":
        yield from _parquet_documents(path, field, bad)
    else:
        yield from _jsonl_documents(path, field, bad)


def _open_binary(path: str):
    compression = COMPRESSED.get(os.path.splitext(path)[1].lower())
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "zstd":
        import zstandard  # the `data` extra

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _jsonl_documents(path: str, field: str, bad: BadLines) -> Iterator[str]:
    try:
        with _open_binary(path) as raw:
            for number, line in enumerate(raw, start=1):
                if not line.strip():
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError:
                    if number == 1 and b"\0" in line:
                        raise DocumentError(f"{path} is not UTF-8 text (a binary, or a Parquet file named as JSONL?); "
                                            "pass JSONL shards or name Parquet files .parquet") from None
                    bad.add(f"{path}:{number}", "not UTF-8")
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError:
                    bad.add(f"{path}:{number}", "not JSON")
                    continue
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    bad.add(f"{path}:{number}", f"no string field {field!r} (--text-field)")
                    continue
                yield record[field]
    except (OSError, EOFError) as e:  # a truncated or corrupt gzip/zstd stream
        raise DocumentError(f"{path}: cannot be read to its end ({e}); re-download or leave out the shard") from None


def _parquet_documents(path: str, field: str, bad: BadLines) -> Iterator[str]:
    import pyarrow.parquet as pq  # the `data` extra

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors for a file that is not Parquet
        raise DocumentError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0]}); "
                            "pass Parquet shards") from None
    columns = parquet.schema_arrow.names
    if field not in columns:
        raise DocumentError(f"{path} has no column {field!r} (its columns: {', '.join(columns)}); "
                            "set --text-field to the text's column")
    row = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if isinstance(text, str):
                yield text
            else:
                bad.add(f"{path}: row {row}", f"field {field!r} is {type(text).__name__}, not a string")
