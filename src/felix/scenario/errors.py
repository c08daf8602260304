"""The errors a run's inputs raise when a file cannot be read as what the config names.

They live apart from the readers so that ``locations`` (where files are looked up) can raise them
without importing the readers that import it.
"""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset folder, archive or file that cannot be read as the named dataset."""


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the device and the event."""
