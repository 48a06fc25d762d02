"""Stream workers: decode, window, featurize, store."""
