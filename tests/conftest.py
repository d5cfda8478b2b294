import os
import sys

# Spawned ranks unpickle test bodies by module name: keep tests/ importable in them too.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")
