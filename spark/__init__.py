"""idem.spark: PySpark glue (exactly-once foreachBatch, retry stream, Delta sinks)."""
