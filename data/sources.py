"""The formats people have, read as one stream of documents, in constant memory. `--data_path` may be:
- a file: `.jsonl` (a JSON object per line, the text in `--text_field`, default "text": MiniMind's pretraining
  format), `.json` (the same, or one JSON array, read whole), `.txt` (blank-line-separated paragraphs),
  `.parquet` (the `--text_field` column);
- a directory: every such file under it (recursive, sorted, hidden skipped), or a `save_to_disk` folder
  (of a `DatasetDict`: its "train" split);
- a glob such as `shards/*.jsonl` (quoted, so the shell does not expand it);
- `hf:NAME` (or `hf:NAME:CONFIG`): `datasets.load_dataset(NAME, split="train", streaming=True)`, a hub name or a
  local folder of data files.
`DocumentSource.documents()` yields `(text, where)` (file and line or row), skipping blank documents; a
malformed record raises `DataError` naming file and line when the reader reaches it (no separate check pass).
"""
import glob
import hashlib
import json
import os
from dataclasses import dataclass

class DataError(ValueError):
    """Bad input data; the message names the file (and the line, where there is one)."""


@dataclass
class DocumentSource:
    """Where the documents come from: `files` (sorted paths), `dataset_dir` (a save_to_disk folder) or `hub` (a
    datasets.load_dataset name); `text_field`: the text column. `total_bytes`: input size on disk (0 = unknown)."""
    description: str
    text_field: str = "text"
    files: tuple = ()
    dataset_dir: str | None = None
    hub: str | None = None

    @property
    def total_bytes(self):
        return sum(os.path.getsize(f) for f in self._local_files())

    def _local_files(self):
        return self.files or (_all_files(self.dataset_dir) if self.dataset_dir else ())

    def documents(self):
        """Yield (text, where) for every non-empty document, in a fixed order. Raises DataError."""
        if self.hub is not None:
            yield from _hub_documents(self.hub, self.text_field)
        elif self.dataset_dir is not None:
            yield from _saved_dataset_documents(self.dataset_dir, self.text_field)
        else:
            for path in self.files:
                yield from FILE_KINDS[os.path.splitext(path)[1].lower()](path, self.text_field)

    def fingerprint(self, memo=None):
        """Content hash (16 hex) of the input and how it is read. A hub dataset is keyed by name, hf:DIR by its
        files. `memo`: a dict {path|size|mtime|inode|ctime: sha1} kept across calls, so a warm start re-reads
        nothing."""
        h = hashlib.sha1(f"text_field={self.text_field}".encode())
        files = self._local_files()
        if self.hub is not None:
            h.update(f"hub:{self.hub}".encode())
            local = self.hub.partition(":")[0]
            files = _all_files(local) if os.path.isdir(local) else ()  # a local dataset folder: by content
        for path in files:
            h.update(os.path.splitext(path)[1].lower().encode() + file_sha1(path, memo).encode())
        return h.hexdigest()[:16]


def open_source(data_path, text_field="text"):
    """Resolve `--data_path` to a DocumentSource. Raises DataError when nothing usable is there."""
    if data_path.startswith("hf:"):
        return DocumentSource(f"datasets.load_dataset({data_path[3:]!r})", text_field, hub=data_path[3:])
    if os.path.isdir(data_path):
        if _is_saved_dataset(data_path):
            return DocumentSource(f"{data_path} (datasets.save_to_disk folder)", text_field, dataset_dir=data_path)
        files = [f for f in _all_files(data_path) if os.path.splitext(f)[1].lower() in FILE_KINDS]
        nested = next((d for d in sorted({os.path.dirname(f) for f in files}) if _is_saved_dataset(d)), None)
        if nested is not None:
            raise DataError(f"{nested}: a datasets.save_to_disk folder inside the data folder {data_path}: pass it "
                            f"as --data_path on its own, or move it out")
        if not files:
            raise DataError(f"{data_path}: directory holds no {', '.join(FILE_KINDS)} file")
        return DocumentSource(f"{data_path} ({len(files)} files)", text_field, files=tuple(files))
    if os.path.exists(data_path):
        _check_kind(data_path)
        return DocumentSource(data_path, text_field, files=(data_path,))
    if glob.has_magic(data_path):
        files = sorted(f for f in glob.glob(data_path, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"{data_path}: the pattern matches no file")
        for f in files:
            _check_kind(f)
        return DocumentSource(f"{data_path} ({len(files)} files)", text_field, files=tuple(files))
    raise DataError(f"{data_path}: data file not found")


def _is_saved_dataset(folder):
    names = set(os.listdir(folder))
    return "dataset_dict.json" in names or {"state.json", "dataset_info.json"} <= names


def _check_kind(path):
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_KINDS:
        raise DataError(f"{path}: unsupported extension '{ext}', expected {', '.join(FILE_KINDS)}")


def _all_files(folder):
    """Every non-hidden file under folder (hidden folders skipped), sorted by path."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        out += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(out)


def file_sha1(path, memo=None):
    """sha1 of a file's bytes (hex); with `memo` (dict) keyed by path, size, mtime, inode and ctime (a file
    replaced or rewritten within one mtime tick changes its inode or ctime), computed once."""
    st, memo = os.stat(path), {} if memo is None else memo
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"
    if key not in memo:
        h = hashlib.sha1()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        memo[key] = h.hexdigest()
    return memo[key]


def _decoded_lines(path):
    """(line number, str) of a UTF-8 file (BOM dropped), "\\r\\n" and a bare "\\r" read as "\\n" (as text mode)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = (raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else raw).decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if "\r" not in line:
                yield lineno, line
                continue
            # only "\n" ends a line: str.splitlines would also split at U+2028, U+0085, \f... inside JSON strings
            *parts, last = line.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            for part in parts:
                yield lineno, part + "\n"
            if last:
                yield lineno, last


def _text_of(obj, field, where):
    if not isinstance(obj, dict) or field not in obj:
        raise DataError(f"{where}: expected an object with a \"{field}\" field"
                        + ("" if not isinstance(obj, dict)
                           else f" (it has: {', '.join(list(obj)[:8])}; see --text_field)"))
    text = obj[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: \"{field}\" must be a string, got {type(text).__name__}")
    return text


def _jsonl_documents(path, field):
    with open(path, "rb") as f:
        is_array = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == b"["
    if is_array:  # one JSON array: read whole
        try:
            with open(path, encoding="utf-8-sig") as f:
                records = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: malformed JSON array ({e})") from None
        records = ((obj, f"{path}[{i}]") for i, obj in enumerate(records))
    for obj, where in records if is_array else jsonl_records(path):
        text = _text_of(obj, field, where)
        if text.strip():
            yield text, where


def jsonl_records(path):
    """(parsed object, "file:line") per non-blank jsonl line. Raises DataError (file:line) for non-UTF-8 or non-JSON."""
    for lineno, line in _decoded_lines(path):
        if not line.strip():
            continue
        try:
            yield json.loads(line), f"{path}:{lineno}"
        except json.JSONDecodeError as e:  # (its msg sometimes ends in " at" already)
            raise DataError(f"{path}:{lineno}: malformed JSON "
                            f"({e.msg.removesuffix(' at')} at column {e.colno})") from None


def _txt_documents(path, _field):
    """Paragraphs: the text split on "\\n\\n" (datasets' text loader, sample_by="paragraph"), named by first line."""
    buf, start = "", 1
    for lineno, line in _decoded_lines(path):
        if not buf:
            start = lineno
        buf += line
        if line == "\n" and "\n\n" in buf:
            *done, buf = buf.split("\n\n")
            for para in done:
                if para.strip():
                    yield para, f"{path}:{start}"
            start = lineno + 1
    if buf.strip():
        yield buf, f"{path}:{start}"


def _parquet_documents(path, field):
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own types for a damaged file
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e)[:200]})") from None
    yield from _rows(_parquet_columns(pf, path, field), pf.schema_arrow.names, field, path)


def _parquet_columns(pf, path, field):
    row, batches = 0, pf.iter_batches(batch_size=1024, columns=[field])
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # a damaged data page: pyarrow's own error types
            raise DataError(f"{path}: row {row + 1} onwards cannot be read "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
        if batch is None:
            return
        row += batch.num_rows
        yield batch.column(0).to_pylist()


def _rows(columns, names, field, name):
    """(text, "name: row N") of the non-empty texts in `columns` (an iterable of lists of a column's values)."""
    if names is not None and field not in names:
        raise DataError(f"{name}: no column \"{field}\" (columns: {', '.join(names[:12])}); see --text_field")
    row = 0
    for column in columns:
        for text in column:
            row += 1
            if text is not None and not isinstance(text, str):
                raise DataError(f"{name}: row {row}: column \"{field}\" must hold strings, got {type(text).__name__}")
            if text and text.strip():
                yield text, f"{name}: row {row}"


def _saved_dataset_documents(folder, field):
    import datasets
    ds = datasets.load_from_disk(folder)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{folder}: a DatasetDict without a \"train\" split (splits: {', '.join(ds)})")
        ds = ds["train"]
    yield from _rows((b[field] for b in ds.iter(batch_size=1024)), ds.column_names, field, folder)


def _hub_documents(name, field):
    import datasets
    path, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(path, config or None, split="train", streaming=True)
    except Exception as e:  # no network, unknown name, no train split...
        raise DataError(f"hf:{name}: could not be loaded ({type(e).__name__}: {str(e)[:300]})") from None
    try:
        yield from _rows((b[field] for b in ds.iter(batch_size=1024)), ds.column_names, field, f"hf:{name}")
    except DataError:
        raise
    except Exception as e:  # a damaged file inside the dataset, a lost connection...
        raise DataError(f"hf:{name}: could not be read "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None


FILE_KINDS = {".jsonl": _jsonl_documents, ".json": _jsonl_documents, ".txt": _txt_documents,
              ".parquet": _parquet_documents}
