"""What the data pipeline costs: streaming (`stream_memory`)."""
