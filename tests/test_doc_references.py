"""Every reference to a project file, module, class or function in the docs, docstrings and
comments still resolves.

A renamed module, moved function or renamed class leaves text behind that still names the
old thing; this test finds that text. It reads every ``.md`` file of the project
(``README.md``, ``docs/``) and the module, class and function docstrings and the whole-line
``#`` comments of every ``.py`` file of ``mindspeed_rl/``, ``tests/``, ``benchmarks/``,
``tools/`` and the launchers at the repository root. Everything is parsed with ``ast`` and
the file system: nothing is imported (torch neither), and it runs in a few seconds.

1. **File paths.** A token that looks like the path of a source, doc, config, script or
   image (``mindspeed_rl/trainer/phases.py``, ``trainer/phases.py``,
   ``tests/test_columns.py``, ``configs/grpo_smollm2_demo.yaml``, ``docs/trainer.md``, a
   bare ``packing.py``), in prose, inline code and fenced code alike (commands included),
   and every markdown link or image target (``[x](partial_rollout.md)``; URLs and
   ``#anchors`` aside).

   - Checked: names ending in ``.py .md .sh .yaml .yml .toml .png .jpg .svg`` (without a
     folder only ``.py .md .sh .yaml .yml``), ``.txt`` files under a top-level folder of
     the project or named ``requirements*``, and folders (``tests/``,
     ``mindspeed_rl/algorithms/``) that start at a top-level folder of the project.
     Run-time files (``metrics.jsonl``, ``config.json``, ``*.pt``, paths that start at a
     ``<placeholder>`` or ``/``) and metric names (``timing/rollout``) are not checked; nor
     is a file name without a folder of ours (see below) that is a whole string constant of
     the code: a file it reads or writes at run time (``job.yaml``, a MindSpeed-RL config
     its tests load from MindSpeed-RL's repository).
   - A path resolves if it exists relative to the directory of the text that names it, or
     if it is the tail of the path of a file or folder of the project: relative to the
     repository root, to ``mindspeed_rl/`` (the docs write ``trainer/phases.py``), to
     ``configs/`` (``model/qwen25_7b.yaml``), or a bare name anywhere. ``<placeholder>``
     and ``*`` are wildcards and ``{a,b}`` alternatives: each alternative must match.

2. **Dotted module paths**: ``mindspeed_rl.x.y`` anywhere (also ``python -m
   mindspeed_rl.fault.torchrun``), ``mindspeed_rl.x.y.Name``, ``mindspeed_rl.x.y:Name``,
   ``:mod:`` targets, and ``from mindspeed_rl.x import a, b``. The longest prefix that is a
   module or package of ``mindspeed_rl/`` must exist; the next name must be bound at the
   top level of it (``def``, ``class``, assignment, import) or be a submodule; a name
   after a class must be a member of the class. A dotted path that is a whole string
   constant of the code is a value it accepts (MindSpeed-RL's tool class path
   ``"mindspeed_rl.tools.retool.ReTool"``), not a reference.

3. **Names of classes and functions**, in inline code (a markdown or RST code span of
   ``Name``, ``Name()``, ``Name.member``, ``Name(args).call()``) and in Sphinx roles
   (``:class:``, ``:func:``, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:``).

   - Checked: a CamelCase name (a capital first, two capitals or more, a lower-case
     letter: ``SampleFlow``, ``_TorchProxy``); a capitalised name that is called or dotted
     (``Platform.process_group_backend``, ``LLM.generate``); ``module.name`` where
     ``module`` is the stem of a module of ``mindspeed_rl/`` that the code never uses as a
     variable or argument name (``exchange.exchange_blocks``; ``config.x`` or
     ``engine.x`` may be variables, and are not checked); any name in a Sphinx role; and
     a code span ``file.py`` followed by 's and a code span ``name``. Snake_case names
     alone in inline code are config keys, metric names and values, and are not checked;
     neither is inline code that is a whole string constant of the code (``"TimeLimitExceeded"``, a status SandboxFusion returns;
     ``"DeepseekV3ForCausalLM"``, an architecture name the code matches).
   - A name resolves if the project defines it: a ``class``, ``def`` or assignment at any
     depth of the Python files above. ``Class.member``: in the class body, as
     ``self.member =`` in a method, or in a base class of the project. ``module.name`` and
     ``file.py``'s ``name``: anywhere in that module. A name the project does not
     define must be a Python builtin or in ``EXTERNAL_NAMES``: a name of a library the
     project uses (megatron-core, vLLM, transformers, PEFT, torch, the standard library)
     mapped to the module that defines it; that module is parsed from the installed
     library (``.venv``) to check it does, member included where the class has no base
     classes (a library that is not installed is not checked).

**Other projects' files and names are not references to this one.** The docs compare with
MindSpeed-RL (whose package is also called ``mindspeed_rl``), MindSpeed-LLM, verl, TRL and
others, and cite their files, configs and classes. A reference that does not resolve is
theirs, and not reported, when

- its path starts at a folder only they have (``EXTERNAL_ROOTS``: ``verl/``,
  ``megatron/``, ``vllm/``, ``docs/zh/``, ...), or carries a ``repo@commit`` marker;
- the same sentence attributes it to one of them (``_OTHERS``: projects whose code is not
  installed here) just before it, within three words: ``MindSpeed-RL's [own]``, ``TRL's``,
  ``their [own]``, ``its own``, ``in verl`` (``EXTERNAL_OWNER``), or just after it: ``in
  their repository``, ``of MindSpeed-RL`` (``EXTERNAL_AFTER``). The installed libraries
  are not in that list: their paths start at their own folders and their names are
  checked through ``EXTERNAL_NAMES``;
- it is a file name that carries no folder of ours (a bare name, or ``model/x.yaml``: not
  starting at a top-level folder of the project nor at a folder of ``mindspeed_rl/``), in
  a text about one of them: the markdown section's heading, the paragraph, or the
  paragraph before it (for a table or code block; for a docstring, also the module
  docstring's first paragraph) names one of them. MindSpeed-RL's configs are cited by bare
  name (``grpo_qwen25_7b_A3.yaml``) under "MindSpeed-RL's own configs", this project's
  with their folder (``configs/...``), which is always checked.

The few references that need a decision of their own are in ``ALLOWED``, each with its
reason (an entry no text needs any more fails ``test_every_allowed_reference_is_still_needed``).
A failure lists every unresolved reference at once, as ``file:line: reference (why)``.
``test_known_bad_references_are_reported_and_good_ones_are_not`` runs the same functions on
made-up text, so the test cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import functools
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mindspeed_rl"
PY_DIRS = ("mindspeed_rl", "tests", "benchmarks", "tools")
SKIP_DIRS = {".git", ".venv", ".venv-trl", ".pytest_cache", "__pycache__", "logs", "outputs", "cache",
             "node_modules", "build", "dist"}
TOP_DIRS = {"mindspeed_rl", "tests", "benchmarks", "tools", "shell", "configs", "docs", ".ci"}
THIS = "tests/test_doc_references.py"

PATH_EXTS = ("py", "md", "sh", "yaml", "yml", "toml", "txt", "png", "jpg", "svg")
BARE_EXTS = ("py", "md", "sh", "yaml", "yml")
# A dotted inline-code token ending in one of these is a file name, not ``module.name``.
FILE_EXTS = set(PATH_EXTS) | {"json", "jsonl", "csv", "log", "bak", "pt", "bin", "idx",
                              "safetensors", "gguf", "cfg", "ini", "lock", "cpp", "h", "cu"}

# Folders that exist only in other projects' trees: a path starting here is theirs.
EXTERNAL_ROOTS = (
    "verl/", "megatron/", "vllm/", "vllm_ascend/", "trl/", "transformers/", "torch/",
    "csrc/", "docs/zh/", "examples/", "recipe/", "mindspeed/", "mindspeed_llm/",
)

# Projects the text compares with or cites, whose code is not installed here (names and paths
# of the installed libraries, torch, megatron-core, vLLM, transformers, are checked instead:
# EXTERNAL_ROOTS, EXTERNAL_NAMES).
_OTHERS = (r"MindSpeed-RL|MindSpeed-LLM|MindSpeed|verl|veRL|TRL|OpenRLHF|AReaL|NeMo-RL|slime|"
           r"SandboxFusion|CANN|Slurm|SLURM|Kubernetes")
NAMES_ANOTHER_PROJECT = re.compile(rf"\b(?:{_OTHERS})\b")
# "MindSpeed-RL's [own] [up to three words] `x`", "their x", "its own x", "in verl x" ...
EXTERNAL_OWNER = re.compile(
    rf"(?:(?:{_OTHERS})(?:\s+[\d.]+)?(?:'s|’s)(?:\s+own)?|(?i:\btheir)(?:\s+own)?|"
    rf"(?i:\bits)\s+own|\b(?:of|in|from|by)\s+(?:{_OTHERS}))"
    r"(?:\s+[\w.-]+){0,3}\s*[(`\[\"']*$"
)
# "`x` in their repository", "`x` of MindSpeed-RL" ...
EXTERNAL_AFTER = re.compile(
    rf"^[`)\]\"']*\s*\(?(?:(?:in|of|from)\s+(?:their|its)\s+(?:repository|repo|tree)|"
    rf"(?:in|of|from)\s+(?:{_OTHERS})\b)"
)

# Names of the libraries the project uses, by the module that defines them. Each is checked
# in the installed library with ``ast`` (test_the_externals_table_names_what_the_libraries_
# define): a name the library drops or moves fails here, as a renamed project name does.
EXTERNAL_NAMES: dict[str, str] = {
    # megatron-core
    "DistributedOptimizer": "megatron.core.optimizer.distrib_optimizer",
    "IndexedDataset": "megatron.core.datasets.indexed_dataset",
    "IndexedDatasetBuilder": "megatron.core.datasets.indexed_dataset",
    "MLASelfAttention": "megatron.core.transformer.multi_latent_attention",
    "MLATransformerConfig": "megatron.core.transformer.transformer_config",
    "MLP": "megatron.core.transformer.mlp",
    "PackedSeqParams": "megatron.core.packed_seq_params",
    "RankGenerator": "megatron.core.parallel_state",
    "RouterReplay": "megatron.core.transformer.moe.router_replay",
    "SharedExpertMLP": "megatron.core.transformer.moe.shared_experts",
    "TEDotProductAttention": "megatron.core.extensions.transformer_engine",
    "TopKRouter": "megatron.core.transformer.moe.router",
    "TransformerConfig": "megatron.core.transformer.transformer_config",
    "YarnRotaryEmbedding": "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    # vLLM
    "BaseRouter": "vllm.model_executor.layers.fused_moe.router.base_router",
    "LLM": "vllm.entrypoints.llm",
    "LLMEngine": "vllm.v1.engine.llm_engine",
    "MLAAttention": "vllm.model_executor.layers.attention.mla_attention",
    "RequestOutputKind": "vllm.sampling_params",
    # transformers, PEFT
    "AutoModelForSequenceClassification": "transformers.models.auto.modeling_auto",
    "DeepseekV3Config": "transformers.models.deepseek_v3.configuration_deepseek_v3",
    "DeepseekV3TopkRouter": "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "LlamaForSequenceClassification": "transformers.models.llama.modeling_llama",
    "Qwen3ForSequenceClassification": "transformers.models.qwen3.modeling_qwen3",
    "MistralForCausalLM": "transformers.models.mistral.modeling_mistral",
    "LoraParallelLinear": "peft.tuners.lora.tp_layer",
    # torch
    "ChildFailedError": "torch.distributed.elastic.multiprocessing.errors",
    "RendezvousConnectionError": "torch.distributed.elastic.rendezvous.api",
    "FileSystemReader": "torch.distributed.checkpoint.filesystem",
    "Tensor": "torch._tensor",
    # the standard library
    "BytesIO": "io",
    "Connection": "multiprocessing.connection",
    "PosixPath": "pathlib",
}

# References that need a decision of their own: (file, reference without its backticks) ->
# why it is not a stale reference to the project.
ALLOWED: dict[tuple[str, str], str] = {
    ("docs/algorithms.md", "mindspeed_rl/algorithms/dr_grpo.py"):
        "the file the worked example asks the reader to create "
        "(tests/test_add_an_estimator.py builds it as a module)",
    ("docs/algorithms.md", "from mindspeed_rl.algorithms import dr_grpo"):
        "the worked example's import line, with the module the reader creates",
    ("docs/architecture.md", "mindspeed_rl/models/mistral.py"):
        "the model module the worked example asks the reader to create "
        "(tests/test_architecture_examples.py runs it)",
    ("docs/tools.md", "configs/tools/x.yaml"):
        "a hypothetical bad tool YAML in an example error message",
    ("docs/testing.md", "coverage.py"): "the name of the coverage tool, not a file",
    ("mindspeed_rl/agent_tools/code_interpreter.py", "main.py"):
        "the file the interpreter's runner writes into its sandbox's working directory",
    ("mindspeed_rl/parallel/groups.py", "tool.py"):
        "any script run with plain python (``python tool.py``), an example",
    ("docs/reliability.md", "KillWait"): "Slurm's slurm.conf parameter",
    ("mindspeed_rl/fault/save_time.py", "KillWait"): "Slurm's slurm.conf parameter",
    ("tests/legacy_megatron_ckpt.py", "LinearNoTP"):
        "MindSpeed-LLM's class (the docstring describes its checkpoint layout; not installed)",
}


# ---------------------------------------------------------------------------------------
# The project: its files and what its Python files define


def _walk_files() -> tuple[set[str], set[str]]:
    files, dirs = set(), set()
    for top, subdirs, names in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        rel = Path(top).relative_to(ROOT).as_posix()
        rel = "" if rel == "." else rel + "/"
        dirs.update(rel + d for d in subdirs)
        files.update(rel + n for n in names)
    return files, dirs


def _assigned_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _assigned_names(elt)]
    if isinstance(target, ast.Starred):
        return _assigned_names(target.value)
    return []


def _statement_names(node: ast.AST) -> list[str]:
    """The names a statement binds in its scope."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n for t in node.targets for n in _assigned_names(t)]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return _assigned_names(node.target)
    if isinstance(node, ast.Import):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [a.asname or a.name for a in node.names]
    return []


def _block_names(body: list[ast.stmt]) -> set[str]:
    """Names a block binds, also inside its if/try/with/for blocks (not inside defs)."""
    names: set[str] = set()
    for node in body:
        names.update(_statement_names(node))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for attr in ("body", "orelse", "finalbody"):
            names |= _block_names(getattr(node, attr, None) or [])
        for handler in getattr(node, "handlers", None) or []:
            names |= _block_names(handler.body)
        for case in getattr(node, "cases", None) or []:
            names |= _block_names(case.body)
    return names


def _is_self_attribute(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))


@dataclass
class ClassInfo:
    members: set[str]
    bases: list[str]


def _class_info(node: ast.ClassDef) -> ClassInfo:
    members = _block_names(node.body)
    members.update(sub.attr for sub in ast.walk(node) if _is_self_attribute(sub))
    bases = []
    for b in node.bases:
        b = b.value if isinstance(b, ast.Subscript) else b
        if isinstance(b, (ast.Name, ast.Attribute)):
            bases.append(b.id if isinstance(b, ast.Name) else b.attr)
    return ClassInfo(members, bases)


@dataclass
class ModuleInfo:
    path: str
    top: set[str]  # names bound at the top level (def, class, assignment, import)
    everywhere: set[str]  # every def, class and assigned name at any depth, self.x too


def _docstring(node: ast.AST) -> ast.Constant | None:
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        if (node.body and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
                and isinstance(node.body[0].value.value, str)):
            return node.body[0].value
    return None


@dataclass
class Project:
    files: set[str]
    dirs: set[str]
    paths: set[str] = field(default_factory=set)  # files | dirs
    tails: set[str] = field(default_factory=set)  # every tail of every file and folder path
    dir_tails: set[str] = field(default_factory=set)
    modules: dict[str, ModuleInfo] = field(default_factory=dict)  # mindspeed_rl.x.y -> info
    by_path: dict[str, ModuleInfo] = field(default_factory=dict)  # every parsed .py file
    stems: dict[str, list[str]] = field(default_factory=dict)  # "y" -> ["mindspeed_rl.x.y"]
    classes: dict[str, list[ClassInfo]] = field(default_factory=dict)
    defined: set[str] = field(default_factory=set)  # every name defined anywhere
    variables: set[str] = field(default_factory=set)  # names of variables, arguments
    constants: set[str] = field(default_factory=set)  # string constants (docstrings aside)
    trees: dict[str, ast.Module] = field(default_factory=dict)  # every parsed .py file
    sources: dict[str, str] = field(default_factory=dict)
    docstrings: dict[str, list[ast.Constant]] = field(default_factory=dict)

    def class_has(self, cls: str, member: str, seen: frozenset = frozenset()) -> bool | None:
        """Whether project class ``cls`` (or a base of the project) defines ``member``;
        None where ``cls`` is no project class or a base outside the project may."""
        infos = self.classes.get(cls)
        if not infos:
            return None
        unknown = False
        for info in infos:
            if member in info.members:
                return True
            for base in info.bases:
                if base in seen or base in ("object", "Generic", "Protocol"):
                    continue
                found = self.class_has(base, member, seen | {cls})
                if found:
                    return True
                unknown = unknown or found is None
        return None if unknown else False


def _tails(paths) -> set[str]:
    out = set()
    for p in paths:
        parts = p.split("/")
        out.update("/".join(parts[i:]) for i in range(len(parts)))
    return out


@functools.lru_cache(maxsize=None)
def project() -> Project:
    files, dirs = _walk_files()
    proj = Project(files, dirs, paths=files | dirs, tails=_tails(files | dirs),
                   dir_tails=_tails(dirs))
    for f in sorted(files):
        if (not f.endswith(".py") or ("/" in f and f.split("/", 1)[0] not in PY_DIRS)
                or f == THIS):  # its examples would resolve names and paths of their own
            continue
        try:
            source = (ROOT / f).read_text(encoding="utf-8")
            tree = ast.parse(source, filename=f)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue  # a file being written, or one that does not parse: other tests see it
        proj.trees[f], proj.sources[f] = tree, source
        docstrings = proj.docstrings[f] = []
        seen_docstrings: set[int] = set()
        everywhere: set[str] = set()
        for node in ast.walk(tree):  # parents before children: a docstring is known first
            doc = _docstring(node)
            if doc is not None:
                docstrings.append(doc)
                seen_docstrings.add(id(doc))
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                everywhere.update(_statement_names(node))
            if isinstance(node, ast.ClassDef):
                proj.classes.setdefault(node.name, []).append(_class_info(node))
            elif _is_self_attribute(node):
                everywhere.add(node.attr)
            elif isinstance(node, ast.arg):
                proj.variables.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                proj.variables.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                proj.variables.add(node.attr)
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in seen_docstrings and len(node.value) < 200):
                proj.constants.add(node.value)
        info = ModuleInfo(f, _block_names(tree.body), everywhere)
        proj.defined |= everywhere
        proj.by_path[f] = info
        if f.startswith(PACKAGE + "/"):
            dotted = f[:-3].replace("/", ".").removesuffix(".__init__")
            proj.modules[dotted] = info
            proj.stems.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    return proj


# ---------------------------------------------------------------------------------------
# The libraries the project uses


def _source_of(module: str) -> Path | None:
    """The source file of ``module``, found without importing anything; None if its top
    package is not installed."""
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not spec.submodule_search_locations:
        return Path(spec.origin) if spec.origin and not rest else None
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest.split(".") if rest else [])
    return path / "__init__.py" if (path / "__init__.py").is_file() else path.with_suffix(".py")


@functools.lru_cache(maxsize=None)
def _external_module(module: str) -> ast.Module | str | None:
    path = _source_of(module)
    if path is None:
        return None
    if not path.is_file():
        return f"{module} is not installed at {path}"
    return ast.parse(path.read_text(encoding="utf-8"))


def external_resolves(chain: list[str]) -> str | None:
    """None if ``chain`` (``Name`` or ``Name.member``) is a builtin or an EXTERNAL_NAMES
    entry that its module defines; else why not."""
    head = chain[0]
    if head not in EXTERNAL_NAMES:
        if hasattr(builtins, head):
            return None
        return "defined nowhere in the project, not a builtin, not in EXTERNAL_NAMES"
    module = EXTERNAL_NAMES[head]
    if module.partition(".")[0] in sys.stdlib_module_names:  # cheap to import, maybe frozen
        try:
            obj = importlib.import_module(module)
        except ImportError as e:
            return f"{module}: {e}"
        for name in chain:
            if not hasattr(obj, name):
                return f"{obj.__name__} has no {name} (EXTERNAL_NAMES)"
            obj = getattr(obj, name)
        return None
    tree = _external_module(module)
    if tree is None:
        return None  # the library is not installed here: nothing to check against
    if isinstance(tree, str):
        return tree
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == head:
            if len(chain) > 1 and not node.bases and chain[1] not in _class_info(node).members:
                return f"{module}.{head} has no member {chain[1]}"
            return None  # (a member a base class may define is taken as defined)
        if head in _statement_names(node):
            return None
    return f"{module} does not define {head} (EXTERNAL_NAMES)"


# ---------------------------------------------------------------------------------------
# Texts: markdown files and docstrings, in blocks (paragraphs, tables, code blocks)


@dataclass
class Block:
    file: str  # relative to ROOT
    lineno: int  # the line of text[0]
    text: str
    code: bool  # a fenced code block
    heading: str  # the markdown heading the block is under
    context: str  # the paragraph before it (and, in a docstring, the module's summary)

    def line_at(self, offset: int) -> int:
        return self.lineno + self.text.count("\n", 0, offset)


_FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_blocks(rel: str, text: str) -> list[Block]:
    blocks: list[Block] = []
    heading, previous = "", ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        start = i
        if _FENCE.match(line):
            fence = _FENCE.match(line).group(1)
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                i += 1
            i += 1
            code = True
        elif re.match(r"#{1,6}\s", line):
            heading = line
            i += 1
            code = False
        else:
            while i < len(lines) and lines[i].strip() and not _FENCE.match(lines[i]) \
                    and not re.match(r"#{1,6}\s", lines[i]):
                i += 1
            code = False
        body = "\n".join(lines[start:i])
        blocks.append(Block(rel, start + 1, body, code, heading, previous))
        previous = body
    return blocks


def docstring_blocks(rel: str, tree: ast.Module, docstrings: list[ast.Constant]) -> list[Block]:
    """The paragraphs of ``docstrings``, the docstrings of module ``tree``."""
    blocks = []
    summary = (ast.get_docstring(tree, clean=False) or "").split("\n\n", 1)[0]
    for doc in docstrings:
        previous = ""
        offset = 0
        for para in re.split(r"(\n[ \t]*\n)", doc.value):
            if para.strip() and not re.fullmatch(r"\n[ \t]*\n", para):
                lineno = doc.lineno + doc.value.count("\n", 0, offset)
                blocks.append(Block(rel, lineno, para, False, "", summary + "\n" + previous))
                previous = para
            offset += len(para)
    return blocks


def comment_blocks(rel: str, tree: ast.Module, source: str) -> list[Block]:
    """Runs of whole-line ``#`` comments, one block each."""
    blocks = []
    summary = (ast.get_docstring(tree, clean=False) or "").split("\n\n", 1)[0]
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("#"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].lstrip().startswith("#"):
            i += 1
        text = "\n".join(line.lstrip()[1:] for line in lines[start:i])
        blocks.append(Block(rel, start + 1, text, False, "", summary))
    return blocks


@functools.lru_cache(maxsize=None)
def all_blocks() -> list[Block]:
    proj = project()
    blocks = []
    for rel in sorted(proj.files):
        if rel.endswith(".md"):
            blocks += markdown_blocks(rel, (ROOT / rel).read_text(encoding="utf-8"))
    for rel, docstrings in sorted(proj.docstrings.items()):
        blocks += docstring_blocks(rel, proj.trees[rel], docstrings)
        blocks += comment_blocks(rel, proj.trees[rel], proj.sources[rel])
    return blocks


# ---------------------------------------------------------------------------------------
# Finding the references of a block, and resolving them

_URL = re.compile(r"\b(?:https?|ftp|file)://\S+|\bwww\.\S+")
_PATH = re.compile(
    r"(?<![\w./@:~$-])((?:\.{1,2}/)?(?:[\w.*<>{},-]+/)+(?:[\w.*<>{},-]*[\w*>}])?"
    r"|[\w*<>{},-][\w.*<>{},-]*\.(?:" + "|".join(PATH_EXTS) + r"))(?![\w/-])"
)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_DOTTED = re.compile(r"(?<![\w./-])~?(mindspeed_rl(?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_]\w*))?")
_FROM_IMPORT = re.compile(r"\bfrom\s+(mindspeed_rl(?:\.\w+)*)\s+import\s+\(?([\w\s,]+)")
_CODE = re.compile(r"(?<!`)(`+)(?!`)([^`\n]+?)(?<!`)\1(?!`)")
_ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|data|exc|obj|mod):`~?([^`]+)`")
_CHAIN = re.compile(r"^~?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(.*)$", re.S)
_POSSESSIVE = re.compile(r"`+([\w/.-]+\.py)`+(?:'s|’s) `+(\w+)`+")


@dataclass(frozen=True)
class Finding:
    file: str
    lineno: int
    ref: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.lineno}: {self.ref} ({self.why})"


def _theirs_nearby(block: Block, start: int, end: int) -> bool:
    """The sentence attributes the reference at text[start:end] to another project."""
    before = block.text[max(0, start - 100):start]
    before = re.split(r"[.!?;:]\s|\||\n\s*[-*]\s", before)[-1]
    after = block.text[end:end + 60]
    return bool(EXTERNAL_OWNER.search(before) or EXTERNAL_AFTER.search(after))


def _expand(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",")
            for x in _expand(pattern[: m.start()] + alt + pattern[m.end():])]


def path_resolves(ref: str, from_file: str) -> bool:
    proj = project()
    is_dir = ref.endswith("/")
    for alt in _expand(ref.rstrip("/")):
        glob = re.sub(r"<[^<>]*>", "*", alt)
        if "*" in glob:
            pool = proj.dirs if is_dir else proj.paths
            if not any(fnmatch.fnmatchcase(p, glob) or fnmatch.fnmatchcase(p, "*/" + glob)
                       for p in pool):
                return False
            continue
        try:
            local = ((ROOT / from_file).parent / alt).resolve().relative_to(ROOT).as_posix()
        except ValueError:
            local = None
        if local in (proj.dirs if is_dir else proj.paths):
            continue
        alt = alt.removeprefix("./")
        if alt not in (proj.dir_tails if is_dir else proj.tails):
            return False
    return True


def _is_checked_path(ref: str, is_link: bool) -> bool:
    if "@" in ref or ref.startswith(EXTERNAL_ROOTS) or ref.startswith(("/", "~", "<")):
        return False
    if is_link:
        return True
    first, _, _ = ref.partition("/")
    if ref.endswith("/"):
        return first in TOP_DIRS
    name = ref.rsplit("/", 1)[-1]
    ext = name.rsplit(".", 1)[-1] if "." in name else ""
    if ext == "txt":
        return first in TOP_DIRS or name.startswith("requirements")
    return ext in (PATH_EXTS if "/" in ref else BARE_EXTS)


def _located_here(ref: str) -> bool:
    """``ref`` starts at a folder of ours: a top-level folder of the project or a folder of
    the package (the docs write ``trainer/phases.py``), not a bare name or ``model/x.yaml``."""
    ref = ref.removeprefix("./")
    first, slash, _ = ref.partition("/")
    return bool(slash) and (first in TOP_DIRS or f"{PACKAGE}/{first}" in project().dirs)


def check_paths(block: Block) -> list[Finding]:
    out = []
    text = _URL.sub(lambda m: " " * len(m.group(0)), block.text)
    candidates = []
    for m in _LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if target and not re.match(r"^[a-z]+:", target):
            candidates.append((target, m.start(1), m.end(1), True))
    links = {c[1] for c in candidates}
    candidates += [(m.group(1), m.start(1), m.end(1), False) for m in _PATH.finditer(text)
                   if m.start(1) not in links]
    for ref, start, end, is_link in candidates:
        if not _is_checked_path(ref, is_link) or path_resolves(ref, block.file):
            continue
        if ref in project().constants and not _located_here(ref):
            continue  # a file the code reads or writes at run time (``job.yaml``)
        if _theirs_nearby(block, start, end):
            continue
        if not _located_here(ref) and NAMES_ANOTHER_PROJECT.search(
                "\n".join((block.heading, block.context, block.text))):
            continue  # a file name without our folders, in a text about another project
        out.append(Finding(block.file, block.line_at(start), ref, "no such file in the project"))
    return out


def resolve_dotted(dotted: str) -> str | None:
    """None if ``mindspeed_rl.x.y[.Name[.member]]`` resolves, else why not."""
    proj = project()
    parts = dotted.split(".")
    n = next((n for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in proj.modules), 0)
    if n == 0:
        return "no such module"
    module, rest = ".".join(parts[:n]), parts[n:]
    if not rest:
        return None
    if rest[0] not in proj.modules[module].top:
        return f"{module} has no submodule or top-level name {rest[0]}"
    if len(rest) > 1 and proj.class_has(rest[0], rest[1]) is False:
        return f"class {rest[0]} has no member {rest[1]}"
    return None


def check_dotted(block: Block) -> list[Finding]:
    out = []
    constants = project().constants
    for m in _DOTTED.finditer(block.text):
        dotted = m.group(1) + (f".{m.group(2)}" if m.group(2) else "")
        why = resolve_dotted(dotted)
        if why and not _theirs_nearby(block, m.start(), m.end()) and not (
                m.group(0).lstrip("~") in constants or dotted in constants):
            out.append(Finding(block.file, block.line_at(m.start()), m.group(0).lstrip("~"), why))
    for m in _FROM_IMPORT.finditer(block.text):
        if resolve_dotted(m.group(1)):
            continue  # the module itself is reported above
        for item in m.group(2).split(","):
            name = item.split()[0] if item.split() else ""
            why = resolve_dotted(f"{m.group(1)}.{name}") if name else None
            if why:
                out.append(Finding(block.file, block.line_at(m.start()),
                                   f"from {m.group(1)} import {name}", why))
    return out


def _camel(name: str) -> bool:
    return bool(re.match(r"^_?[A-Z]", name) and re.search(r"[a-z]", name)
                and sum(c.isupper() for c in name) >= 2)


def _module_stem(head: str) -> bool:
    """``head`` names a module of the package and nothing in the code is a variable of
    that name (``exchange``, not ``config``)."""
    proj = project()
    return head in proj.stems and head not in proj.variables


def resolve_name(chain: list[str], role: str | None = None) -> str | None:
    """None if the name chain (``Name``, ``Class.member``, ``module.name``) resolves."""
    proj = project()
    head = chain[0]
    if head == PACKAGE:
        return resolve_dotted(".".join(chain))
    if role == "mod":
        return None if f"{PACKAGE}.{'.'.join(chain)}" in proj.modules or any(
            m.endswith("." + ".".join(chain)) for m in proj.modules) else "no such module"
    if len(chain) > 1 and head in proj.classes:
        found = proj.class_has(head, chain[1])
        return f"class {head} has no member {chain[1]}" if found is False else None
    if len(chain) > 1 and head in proj.stems:
        for module in proj.stems[head]:
            if (resolve_dotted(".".join([module] + chain[1:])) is None
                    or chain[1] in proj.modules[module].everywhere):
                return None
        if _module_stem(head):
            return f"module {head} defines no {chain[1]}"
        return None  # ``head`` is (also) a variable of the code: not decidable
    if head in proj.defined:
        return None
    if len(chain) > 1 and head in proj.variables and head[0].islower():
        return None  # an attribute of some variable
    return external_resolves(chain)


def check_names(block: Block) -> list[Finding]:
    out = []
    proj = project()
    for m in _ROLE.finditer(block.text):
        target = m.group(2).strip()
        chain = _CHAIN.match(target)
        if not chain or target in proj.constants:
            continue
        why = resolve_name(chain.group(1).split("."), m.group(1))
        if why and not _theirs_nearby(block, m.start(), m.end()):
            out.append(Finding(block.file, block.line_at(m.start()), m.group(0), why))
    if block.code:
        return out
    text = _ROLE.sub(lambda mm: " " * len(mm.group(0)), block.text)
    for m in _CODE.finditer(text):
        content = m.group(2).strip()
        chain = _CHAIN.match(content)
        if not chain:
            continue
        names, rest = chain.group(1).split("."), chain.group(2)
        head = names[0]
        if head == PACKAGE or names[-1] in FILE_EXTS or content in proj.constants:
            continue  # the dotted rule checks it; a file name; a value of the code
        if rest and not rest.startswith(("(", "[", " ->")):
            continue  # prose, a formula, a message
        called = rest.startswith("(")
        if not (_camel(head) or (re.match(r"^_?[A-Z][a-z]", head) and (len(names) > 1 or called))
                or (re.match(r"^[A-Z][A-Z0-9]+$", head) and len(names) > 1
                    and re.match(r"^[a-z_]", names[1]))
                or (len(names) > 1 and _module_stem(head))):
            continue
        why = resolve_name(names)
        if why and not _theirs_nearby(block, m.start(), m.end()):
            out.append(Finding(block.file, block.line_at(m.start()), m.group(0), why))
    for m in _POSSESSIVE.finditer(block.text):
        path, name = m.group(1), m.group(2)
        infos = [i for p, i in proj.by_path.items() if p == path or p.endswith("/" + path)]
        if infos and not any(name in i.everywhere or name in i.top for i in infos):
            out.append(Finding(block.file, block.line_at(m.start()), m.group(0),
                               f"{path} defines no {name}"))
    return out


def unresolved(block: Block) -> list[Finding]:
    """Every reference of ``block`` that does not resolve, ALLOWED ones included."""
    return list(dict.fromkeys(check_paths(block) + check_dotted(block) + check_names(block)))


def check_block(block: Block) -> list[Finding]:
    return [f for f in unresolved(block) if (f.file, f.ref.strip("`")) not in ALLOWED]


def check_markdown(file: str, text: str) -> list[Finding]:
    """Every unresolved reference of markdown ``text``, as if it were the file ``file``."""
    return [f for block in markdown_blocks(file, text) for f in check_block(block)]


def check_python(file: str, source: str) -> list[Finding]:
    """Every unresolved reference of the docstrings and comments of ``source``, as if it were
    the file ``file``."""
    tree = ast.parse(source)
    docstrings = [d for d in map(_docstring, ast.walk(tree)) if d is not None]
    blocks = docstring_blocks(file, tree, docstrings) + comment_blocks(file, tree, source)
    return [f for block in blocks for f in check_block(block)]


# ---------------------------------------------------------------------------------------
# The tests


def test_every_reference_in_docs_and_docstrings_resolves():
    findings = sorted({f for block in all_blocks() for f in check_block(block)},
                      key=lambda f: (f.file, f.lineno, f.ref))
    if findings:
        pytest.fail(
            f"{len(findings)} references in the docs, docstrings or comments name nothing in "
            "the project (renamed or moved? fix the text; the rules are in "
            f"{THIS}):\n" + "\n".join(str(f) for f in findings), pytrace=False)


def test_the_texts_hold_references_to_check():
    """Guards the extraction itself: the project's texts name many files, modules and
    classes (a broken pattern would make the test above pass on nothing)."""
    blocks = all_blocks()
    paths = sum(1 for b in blocks for m in _PATH.finditer(b.text)
                if _is_checked_path(m.group(1), False))
    dotted = sum(len(_DOTTED.findall(b.text)) for b in blocks)
    roles = sum(len(_ROLE.findall(b.text)) for b in blocks)
    camel = sum(1 for b in blocks if not b.code for m in _CODE.finditer(b.text)
                if _camel(m.group(2).strip().split(".")[0].split("(")[0]))
    assert paths > 300 and dotted > 50 and roles > 50 and camel > 100, (paths, dotted, roles, camel)


def test_the_externals_table_names_what_the_libraries_define():
    wrong = [f"{name} -> {EXTERNAL_NAMES[name]}: {why}" for name in sorted(EXTERNAL_NAMES)
             if (why := external_resolves([name]))]
    assert not wrong, "\n".join(wrong)


def test_every_allowed_reference_is_still_needed():
    """An entry whose text is gone (fixed, or the file removed), or that the rules resolve
    by themselves, is removed from ALLOWED."""
    files = {file for file, _ in ALLOWED}
    flagged = {(f.file, f.ref.strip("`")) for block in all_blocks() if block.file in files
               for f in unresolved(block)}
    unneeded = [f"{file}: {ref}" for file, ref in ALLOWED if (file, ref) not in flagged]
    assert not unneeded, "ALLOWED entries no text needs any more:\n" + "\n".join(unneeded)


def _real_names() -> dict[str, str]:
    """Names of things the project has today, for the made-up texts below (the package is
    being refactored: fixed names would make this test fail for the wrong reason)."""
    proj = project()
    for dotted, info in sorted(proj.modules.items()):
        if "." not in dotted.removeprefix(PACKAGE + "."):
            continue  # a module in a subpackage, so that it has a short relative path
        for node in proj.trees[info.path].body:
            methods = [n.name for n in getattr(node, "body", [])
                       if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
            if (isinstance(node, ast.ClassDef) and _camel(node.name) and methods
                    and len(proj.classes[node.name]) == 1):
                return {"module": dotted, "path": info.path,
                        "short": info.path.removeprefix(PACKAGE + "/"), "cls": node.name,
                        "method": methods[0],
                        "doc": sorted(p for p in proj.files if p.startswith("docs/")
                                      and p.endswith(".md"))[0].removeprefix("docs/"),
                        "config": sorted(p for p in proj.files if p.startswith("configs/")
                                         and p.endswith(".yaml"))[0]}
    raise AssertionError("no class with a public method in a module of a subpackage")


_BAD_MD = """\
# Notes

The phase lives in `mindspeed_rl/trainer/no_such_file.py` (module
`mindspeed_rl.trainer.no_such_module`), built by `NoSuchClassAnywhere`.
See [the guide](no_such_doc.md), :func:`no_such_function_anywhere`,
`{cls}.no_such_method` and `{module}.no_such_function`.

```bash
python -m mindspeed_rl.trainer.no_such_launcher --config configs/no_such_config.yaml
```
"""
_BAD_PY = '''\
"""A module whose docstring names `mindspeed_rl/trainer/no_such_file.py`,
:class:`NoSuchClassAnywhere` and ``trainer/no_such_part.py``."""


def f():
    """Calls :func:`{module}.no_such_function`."""
    # as ``no_such_module.py`` does
'''
_GOOD_MD = """\
# Notes

The class is in `{path}` (`{short}`): `{cls}` (`{cls}.{method}`, `{cls}()`),
`{module}.{cls}`, :class:`~{module}.{cls}`; see [the docs]({doc}), `{THIS}` and
`{config}`, and run `python -m {module}`.

MindSpeed-RL's `mindspeed_rl/workers/actor_hybrid_worker.py` and verl's
`verl/trainer/ppo/core_algos.py` are theirs, as is `docs/zh/features/partial_rollout.md`;
`rl_config.partial_rollout_max_split` is a key and `timing/rollout` a metric.
"""


def test_known_bad_references_are_reported_and_good_ones_are_not():
    names = _real_names()
    bad_md = _BAD_MD.format(**names)
    reported = {f.ref for f in check_markdown("docs/fake.md", bad_md)}
    for expected in ("mindspeed_rl/trainer/no_such_file.py",
                     "mindspeed_rl.trainer.no_such_module",
                     "`NoSuchClassAnywhere`",
                     "no_such_doc.md",
                     ":func:`no_such_function_anywhere`",
                     f"`{names['cls']}.no_such_method`",
                     f"{names['module']}.no_such_function",
                     "mindspeed_rl.trainer.no_such_launcher",
                     "configs/no_such_config.yaml"):
        assert expected in reported, (expected, reported)
    lines = {f.ref: f.lineno for f in check_markdown("docs/fake.md", bad_md)}
    assert lines["mindspeed_rl.trainer.no_such_module"] == 4
    assert lines["configs/no_such_config.yaml"] == 9

    found = {str(f) for f in check_python("mindspeed_rl/fake.py", _BAD_PY.format(**names))}
    assert found >= {
        "mindspeed_rl/fake.py:1: mindspeed_rl/trainer/no_such_file.py "
        "(no such file in the project)",
        "mindspeed_rl/fake.py:2: :class:`NoSuchClassAnywhere` (defined nowhere in the project, "
        "not a builtin, not in EXTERNAL_NAMES)",
        "mindspeed_rl/fake.py:2: trainer/no_such_part.py (no such file in the project)",
        f"mindspeed_rl/fake.py:6: :func:`{names['module']}.no_such_function` "
        f"({names['module']} has no submodule or top-level name no_such_function)",
        "mindspeed_rl/fake.py:7: no_such_module.py (no such file in the project)",
    }, found

    good_md = _GOOD_MD.format(THIS=THIS, **names)
    assert check_markdown("docs/fake.md", good_md) == [], good_md
