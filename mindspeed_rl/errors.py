"""The exceptions that cross layers, at the bottom of the package so any layer may raise
or catch them without importing the package that usually raises them.

- :class:`CheckpointError`: raised by ``checkpoint/`` and by the weight readers of
  ``models/``; the launchers report it as bad input.
- :class:`TransferDockError` / :class:`TransferDockTimeoutError`: raised by
  ``transfer_dock/``; ``fault/collective.py`` and the launch guard recognise them.

The layers are listed in pyproject.toml ([tool.importlinter]).
"""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or written; the message names the file and the tensor."""


class TransferDockError(RuntimeError):
    """A put or get that is inconsistent or can never be satisfied."""


class TransferDockTimeoutError(TransferDockError):
    """A dock collective did not complete within the configured timeout."""
