"""The SQLite decision store and its keys."""
