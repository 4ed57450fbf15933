"""idem: exactly-once sinks on at-least-once delivery."""
