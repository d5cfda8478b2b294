"""Reading YAML the way config authors expect: ``1e-6`` is a float, duplicate keys are errors."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import yaml

from mindspeed_rl.config.config_error import ConfigError


class _ConfigYamlLoader(yaml.SafeLoader):
    """SafeLoader with two fixes for hand-written configs.

    PyYAML follows YAML 1.1, where ``1e-6`` (no dot) is a *string*; every
    MindSpeed-RL / Megatron config writes learning rates that way, so the YAML
    1.2 float pattern is added. And a key written twice in one mapping would
    silently keep the last value; here it is an error.
    """


# YAML 1.2 core-schema floats (adds exponent-without-dot forms such as 1e-6, 5E+3).
_ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int):
        super().__init__(key, line)
        self.key, self.line = key, line


def _construct_mapping_no_duplicates(loader: _ConfigYamlLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    mapping: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in mapping:
            raise _DuplicateKey(key, key_node.start_mark.line + 1)
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_ConfigYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                  _construct_mapping_no_duplicates)


def read_yaml_file(path: Path, key: str) -> Any:
    """Parse a YAML file; ``key`` names the setting that pointed at it, for the error."""
    if not path.is_file():
        raise ConfigError(key, f"file not found: {path}", "check the path (relative paths are "
                          "resolved against the current working directory)", value=str(path))
    data = path.read_bytes()
    try:
        # Decoded here, not by the YAML reader: its error offsets count from a chunk.
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(None, f"{path}: not UTF-8 text: byte 0x{data[e.start]:02x} at byte "
                          f"offset {e.start} (line {line}, byte {column} of the line) is not "
                          "valid UTF-8", "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                          ) from None
    stream = io.StringIO(text)
    stream.name = str(path)  # the file YAML's error marks name
    try:
        return yaml.load(stream, Loader=_ConfigYamlLoader)
    except _DuplicateKey as e:
        raise ConfigError(None, f"{path}:{e.line}: key {e.key!r} is written twice in one mapping",
                          "keep one of them") from None
    except yaml.YAMLError as e:
        raise ConfigError(key, f"{path} is not valid YAML: {' '.join(str(e).split())}",
                          "fix the syntax at the line shown") from None


def parse_yaml_scalar(text: str) -> Any:
    """A command-line override value, parsed as YAML: ``8``, ``1e-6``, ``true``, ``[a, b]``."""
    try:
        return yaml.load(text, Loader=_ConfigYamlLoader)
    except _DuplicateKey as e:
        raise ConfigError(None, f"override value {text!r} writes key {e.key!r} twice") from None
