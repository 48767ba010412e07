"""Models that read and write the pools (see ``registry`` for what ``generate`` can run)."""
