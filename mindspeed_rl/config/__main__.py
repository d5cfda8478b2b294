"""``python -m mindspeed_rl.config --config FILE [key=value ...] [--dry-run --world-size N]``."""

import sys

from mindspeed_rl.config.cli import main

sys.exit(main())
