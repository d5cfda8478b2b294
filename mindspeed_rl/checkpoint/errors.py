"""The one exception class for unusable checkpoints."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or written; the message names the file and the tensor."""
