"""The tracker file of a Megatron checkpoint directory: which iteration to load.

Its own module so that every reader (the weight source, the checkpoint formats, the
trainer state, the launcher's fault report) imports it one way, without torch.
"""

from __future__ import annotations

from pathlib import Path

from mindspeed_rl.errors import CheckpointError

TRACKER_FILE = "latest_checkpointed_iteration.txt"


def read_tracker(folder: str | Path) -> int | None:
    """The iteration ``folder/latest_checkpointed_iteration.txt`` names (None: ``release``).

    CheckpointError naming the file when it is missing, cannot be read, or holds anything
    but ``release`` or an iteration number (a damaged or foreign file, binary included)."""
    tracker = Path(folder) / TRACKER_FILE
    try:
        raw = tracker.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{tracker}: missing; no checkpoint has been saved in "
                              f"{folder}") from None
    except OSError as exc:
        raise CheckpointError(f"{tracker}: cannot be read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        text = None
    if text == "release":
        return None
    if text is None or not text.isdigit():
        raise CheckpointError(
            f"{tracker}: holds {raw[:40]!r}{'...' if len(raw) > 40 else ''}, neither "
            "'release' nor an iteration number (a damaged or foreign file); write the number "
            f"of the iteration to load (an iter_XXXXXXX folder in {folder}) into it")
    return int(text)
