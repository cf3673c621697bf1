"""Exception types: every user-facing failure is a KVRewriteError with a message that says what to do."""


class KVRewriteError(Exception):
    """Base class of all errors kvrewrite raises on purpose."""


class InvalidArgumentError(KVRewriteError, ValueError):
    """A user-supplied option is out of range or malformed (e.g. a rate outside [0, 1))."""


class UnsupportedModelError(KVRewriteError):
    """The model's architecture has no adapter, or lacks a part the adapter needs."""


class ModelSourceError(KVRewriteError):
    """A model id or path could not be resolved to a local checkpoint directory."""


class CalibrationError(KVRewriteError):
    """Calibration text is missing or too short for the requested number of tokens."""


class CorruptCheckpointError(KVRewriteError):
    """A checkpoint file is missing, truncated, corrupt, or does not match its spec."""


class VerificationError(KVRewriteError):
    """The rewritten model failed the full-rank equivalence check against the original."""


class HubError(KVRewriteError):
    """Talking to the Hugging Face Hub failed: not logged in, no write access, offline, or the network is down."""


class KVRewriteWarning(UserWarning):
    """Something the user should know that does not stop the run (the CLI prints it as one `warning:` line)."""


class OutputError(KVRewriteError):
    """The output could not be written (disk full, read-only, permissions); nothing at the output was changed."""


class MissingDependencyError(KVRewriteError, ImportError):
    """A compiler-only package (the `compile` extra: gensim, scikit-learn, matplotlib) is not installed."""
