"""The request and result CSV files of account updater jobs (second document, section 4 "Account
updater jobs"; section 8 limits).

A request file is read once as a stream and checked (size, UTF-8 text, CSV, header, one field per
column on every row) while it is cut into chunks recorded as byte ranges (:func:`scan_request`); a
chunk's rows are read again from its byte range alone (:func:`read_rows`).
"""

from __future__ import annotations

import codecs
import csv
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from typing import NamedTuple

from domain.account_updater.errors import RequestFileError

REQUEST_COLUMNS = ("token", "expiration_year", "expiration_month", "merchant_id")
REQUEST_HEADER = ",".join(REQUEST_COLUMNS)
RESULT_COLUMNS = (
    "token",
    "expiration_year",
    "expiration_month",
    "new_token",
    "new_expiration_year",
    "new_expiration_month",
    "result_code",
)
RESULT_HEADER = ",".join(RESULT_COLUMNS)
MAX_FILE_ERRORS = 10
"""Reading a bad file stops after this many messages."""

#: Content types that some S3-compatible servers (moto's, in ``tessera dev``) read as an HTML form,
#: storing an empty object: ``curl --data-binary`` sends the first unless told otherwise.
FORM_CONTENT_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def empty_upload_error(content_type: str | None) -> str:
    """The job error of a request file that arrived empty: when it was uploaded as a form, say so and
    how to upload it instead."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in FORM_CONTENT_TYPES:
        return (
            f"The file arrived empty: it was uploaded with Content-Type {kind}, which the S3 server read as a "
            "form (curl --data-binary sends that type). Upload the file itself, e.g. "
            "curl -T request.csv '<upload_url>' or add -H 'Content-Type: text/csv'."
        )
    return f"The file is empty; its first line must be the header {REQUEST_HEADER}."


class _Lines:
    """Lines of a byte stream (line endings kept, decoded as UTF-8) and the byte offset reached.

    ``position`` is the offset just after the last line handed out, so after ``csv.reader`` returns a
    record it is the offset where the next record starts. Raises :class:`RequestFileError` for bytes that are
    not UTF-8 text or that contain NUL.
    """

    def __init__(self, blocks: Iterable[bytes], *, start: int = 0, max_bytes: int | None = None, strip_bom=False):
        self._blocks = blocks
        self.position = start
        self.read = 0
        self._max = max_bytes
        self._strip_bom = strip_bom
        self.line_number = 0

    def __iter__(self) -> Iterator[str]:
        pending = b""
        first = True
        for block in self._blocks:
            self.read += len(block)
            if self._max is not None and self.read > self._max:
                raise RequestFileError(f"The file is over the limit of {self._max:,} bytes (30 MB).")
            buffer = pending + block if pending else block
            begin = 0
            while True:
                end = buffer.find(b"\n", begin)
                if end < 0:
                    break
                line = buffer[begin : end + 1]
                begin = end + 1
                if first:
                    first = False
                    if self._strip_bom and line.startswith(codecs.BOM_UTF8):
                        self.position += len(codecs.BOM_UTF8)
                        line = line[len(codecs.BOM_UTF8) :]
                yield self._text(line)
            pending = buffer[begin:]
        if pending:
            if first and self._strip_bom and pending.startswith(codecs.BOM_UTF8):
                self.position += len(codecs.BOM_UTF8)
                pending = pending[len(codecs.BOM_UTF8) :]
            yield self._text(pending)

    def _text(self, line: bytes) -> str:
        self.line_number += 1
        if b"\x00" in line:
            raise RequestFileError(f"The file is not a CSV text file: line {self.line_number} contains NUL bytes.")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestFileError(
                f"The file is not a CSV text file: line {self.line_number} is not UTF-8 text."
            ) from None
        self.position += len(line)
        return text


@dataclass
class ChunkPlan:
    """One chunk of a request file: bytes ``[start_byte, end_byte)``, data rows from ``first_row``."""

    start_byte: int
    end_byte: int
    first_row: int
    row_count: int


@dataclass
class Scan:
    """What reading a request file found: its columns, rows, chunks, ETag and size, or ``errors``."""

    columns: list[str] = field(default_factory=list)
    rows: int = 0
    chunks: list[ChunkPlan] = field(default_factory=list)
    etag: str | None = None
    size: int = 0
    errors: list[str] = field(default_factory=list)


def parse_header(record: list[str]) -> tuple[list[str], list[str]]:
    """``(columns, errors)`` of a header record: names trimmed and lower-cased; ``token`` required;
    the other known columns (``expiration_year``, ``expiration_month``, ``merchant_id``) optional, in any
    order; unknown or repeated names are errors."""
    columns = [name.strip().lower() for name in record]
    errors = []
    unknown = [name for name in columns if name not in REQUEST_COLUMNS]
    repeated = sorted({name for name in columns if columns.count(name) > 1})
    if "token" not in columns:
        errors.append(f"The header must name the column token; expected {REQUEST_HEADER}.")
    if unknown:
        errors.append(
            f"The header names unknown columns ({', '.join(repr(u) for u in unknown[:5])}); expected {REQUEST_HEADER}."
        )
    if repeated:
        errors.append(f"The header names a column more than once ({', '.join(repeated)}).")
    return columns, errors


def scan_request(blocks: Iterable[bytes], *, max_bytes: int, chunk_rows: int) -> Scan:
    """Read a request file once, as a stream: check it and cut it into chunks of ``chunk_rows`` rows.

    Checks: at most ``max_bytes``; UTF-8 text without NUL; parseable CSV; a header (see
    :func:`parse_header`); every row with as many fields as the header. Blank lines are skipped and not
    counted. Stops after :data:`MAX_FILE_ERRORS` messages. Memory use is one block and one record.
    """
    scan = Scan()
    lines = _Lines(blocks, max_bytes=max_bytes, strip_bom=True)
    reader = csv.reader(lines, strict=True)
    try:
        header = next(reader, None)
        while header == []:
            header = next(reader, None)
        if header is None:
            scan.errors.append(f"The file is empty; its first line must be the header {REQUEST_HEADER}.")
            return scan
        scan.columns, scan.errors = parse_header(header)
        if scan.errors:
            return scan
        width = len(scan.columns)
        chunk_start, chunk_first, in_chunk = lines.position, 1, 0
        for record in reader:
            if not record:
                continue
            scan.rows += 1
            if len(record) != width:
                scan.errors.append(
                    f"Row {scan.rows} (line {reader.line_num}) has {len(record)} fields; the header has {width}."
                )
                if len(scan.errors) >= MAX_FILE_ERRORS:
                    scan.errors.append(f"Reading stopped after {MAX_FILE_ERRORS} errors.")
                    return scan
                continue
            in_chunk += 1
            if in_chunk == chunk_rows:
                scan.chunks.append(ChunkPlan(chunk_start, lines.position, chunk_first, in_chunk))
                chunk_start, chunk_first, in_chunk = lines.position, scan.rows + 1, 0
        if in_chunk:
            scan.chunks.append(ChunkPlan(chunk_start, lines.position, chunk_first, in_chunk))
    except RequestFileError as exc:
        scan.errors.append(str(exc))
    except csv.Error as exc:
        scan.errors.append(f"The file is not valid CSV: {exc} (line {reader.line_num}).")
    scan.size = lines.read
    return scan


class Row(NamedTuple):
    """One data row of a request file (cells as written, trimmed)."""

    number: int
    token: str
    expiration_year: str
    expiration_month: str
    merchant_id: str


def read_rows(blocks: Iterable[bytes], columns: list[str], *, start: int, first_row: int) -> Iterator[Row]:
    """The data rows of one chunk's bytes, numbered from ``first_row`` (blank lines skipped, as in
    :func:`scan_request`).

    The chunk (a slice that :func:`scan_request` checked) is decoded in one piece and split into lines
    as :func:`scan_request` reads them; bytes that are not UTF-8 text, or hold NUL, raise
    :class:`RequestFileError` with the line that holds them, as there.
    """
    data = b"".join(blocks)
    try:
        if b"\x00" in data:
            raise UnicodeError
        text = data.decode("utf-8")
    except UnicodeError:
        lines: Iterable[str] = _Lines([data], start=start)  # raises, naming the line
    else:
        lines = io.StringIO(text, newline="")  # lines end at \n, \r\n or \r: the csv reader's record ends
    width = len(columns)
    index = {name: position for position, name in enumerate(columns)}
    # a column the header lacks reads the blank cell appended after the record's own cells
    cells = itemgetter(*(index.get(name, width) for name in REQUEST_COLUMNS))
    number = first_row
    for record in csv.reader(lines, strict=True):
        if not record:
            continue
        if len(record) < width:
            record += [""] * (width - len(record))
        record.append("")
        token, year, month, merchant = cells(record)
        yield Row(number, token.strip(), year.strip(), month.strip(), merchant.strip())
        number += 1
