"""The plan: the ``Plan`` type and its one canonical dict form, tuned files, and search spaces."""
