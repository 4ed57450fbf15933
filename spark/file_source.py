"""``idem run``'s source: the JSON-lines files of a directory as a Spark stream.

The rows' schema is ``--schema``, else the one kept in the checkpoint, else
inferred from the files (and kept, so every restart reads them the same way). A
line Spark cannot parse with it (not JSON, cut short, a value of the wrong type)
keeps its text in ``_idem_raw_body`` and says why in ``_idem_malformed``:
``@exactly_once`` dead-letters it with the line as its body.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from pyspark.sql.types import (
    ArrayType,
    DataType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from idem.errors import ConfigError, SerializationError
from idem.spark.messages import MALFORMED_COLUMN, RAW_BODY_COLUMN
from idem.spark.rows import schema_from_ddl, schema_from_json

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SCHEMA_FILE: Final = "idem-schema.json"
"""Where the checkpoint keeps the schema of the source files (so restarts agree)."""

NO_FILE_GLOB: Final = "idem-takes-no-file/"
"""A file-name filter no file matches (a name has no ``/``): the file source of a query
that only waits for retries."""


def source_schema(
    spark: SparkSession,
    *,
    source: str,
    ddl: str | None,
    checkpoint: str,
    fields: Mapping[str, str | None] | None = None,
) -> StructType:
    """The rows' schema: ``ddl`` (``--schema``), else the one kept in the checkpoint, else
    inferred from the files in ``source``. ``fields`` (``{flag: field name}``) must be
    in it: a schema is kept only once they are, so a restart never inherits one
    inferred from files that lacked them (e.g. files with no rows yet)."""
    kept = Path(checkpoint) / SCHEMA_FILE
    if ddl:
        try:
            schema = schema_from_ddl(ddl)
        except SerializationError as exc:
            raise ConfigError(f"--schema: {str(exc).removeprefix('schema: ')}") from None
        for field in schema.fields:
            _check_json_readable(field.name, field.dataType)
        _require(schema, fields, where="the schema given with --schema")
    elif kept.is_file():
        schema = schema_from_json(kept.read_text(encoding="utf-8"))
        _require(schema, fields, where=f"the schema kept in {kept}")
        return schema
    else:
        files = [p for p in Path(source).iterdir() if not p.name.startswith((".", "_"))]
        if not any(p.is_file() for p in files):
            raise ConfigError(
                f"--source: {source} holds no files to infer the schema from; pass --schema"
            )
        schema = spark.read.json(source).schema
        corrupt = "_corrupt_record"
        if corrupt in schema.fieldNames():
            schema = StructType([f for f in schema.fields if f.name != corrupt])
        if not schema.fields:
            raise ConfigError(
                f"--source: the files in {source} hold no JSON object to infer the schema "
                "from (empty, or not JSON); pass --schema, or add rows first"
            )
        _require(schema, fields, where=f"the rows of the files in {source}")
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(schema.json(), encoding="utf-8")
    return schema


def _check_json_readable(name: str, kind: DataType) -> None:
    """Refuse a type Spark's JSON reader cannot read (it failed the query as it started)."""
    if isinstance(kind, MapType):
        if not isinstance(kind.keyType, StringType):
            raise ConfigError(
                f"--schema: column {name!r}: a map keyed by {kind.keyType.simpleString()} "
                "cannot be read from JSON (JSON object keys are text); use map<string, ...>"
            )
        _check_json_readable(name, kind.valueType)
    elif isinstance(kind, ArrayType):
        _check_json_readable(name, kind.elementType)
    elif isinstance(kind, StructType):
        for field in kind.fields:
            _check_json_readable(f"{name}.{field.name}", field.dataType)


def _require(schema: StructType, fields: Mapping[str, str | None] | None, *, where: str) -> None:
    """Every named field is in ``schema``, else a :class:`ConfigError` naming its flag."""
    names = schema.fieldNames()
    for flag, name in (fields or {}).items():
        if name is not None and name not in names:
            raise ConfigError(
                f"{flag}: no field {name!r} in {where} (fields: {', '.join(names) or 'none'})"
            )


def file_rows(
    spark: SparkSession,
    schema: StructType,
    *,
    source: str,
    max_files_per_trigger: int | None = None,
    new_files: bool = True,
) -> DataFrame:
    """The rows of the files in ``source`` as a stream, with ``_idem_raw_body`` and
    ``_idem_malformed`` (see module doc). ``new_files=False``: a stream that takes no file
    (one that only waits for retries); the files it leaves out are not marked seen, so the
    next query on the checkpoint takes them."""
    raw = StructField(RAW_BODY_COLUMN, StringType(), True)
    reader = (
        spark.readStream.schema(StructType([*schema.fields, raw]))
        .option("mode", "PERMISSIVE")
        .option("columnNameOfCorruptRecord", RAW_BODY_COLUMN)
    )
    if not new_files:
        reader = reader.option("pathGlobFilter", NO_FILE_GLOB)
    if max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
    rows = reader.json(source)
    why = F.concat(
        F.lit("line of "),
        F.col("_metadata.file_name"),
        F.lit(" is not valid JSON for the schema"),
    )
    return rows.withColumn(MALFORMED_COLUMN, F.when(F.col(RAW_BODY_COLUMN).isNotNull(), why))
