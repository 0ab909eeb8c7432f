"""Errors that reach the learner as one clear line (the CLI prints them and exits with code 2)."""


class LabkitError(Exception):
    """Base class of every error labkit reports to the user instead of a traceback."""


class ConfigError(LabkitError, ValueError):
    """Bad user input: the message names the bad value and how to fix it."""


class DeviceError(ConfigError):
    """A device or backend was asked for that this machine does not have (e.g. ``--device cuda``)."""


class OutputError(ConfigError):
    """A folder or file labkit must write cannot be created (read-only or missing parent, no permission)."""


class DatasetMissing(LabkitError, FileNotFoundError):
    """The dataset is not on disk and downloading was not requested."""


class DatasetCorrupt(LabkitError):
    """A dataset file is on disk but truncated or fails its checksum."""


class CheckpointError(LabkitError):
    """A checkpoint file is unreadable, corrupt or belongs to a different model."""
