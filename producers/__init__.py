"""Producers: everything that runs on a node and turns what it sees into batches."""
