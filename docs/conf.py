"""Sphinx configuration of the documentation site.

Build it strictly (warnings, broken links and unresolved references fail), as CI does::

    uv run --group docs sphinx-build -W --keep-going -n -b html docs docs/_build/html

or serve it with live reload while editing::

    uv run --group docs sphinx-autobuild docs docs/_build/html
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _version
from typing import Any

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

import decent_optim_wrapper

project = "decent-optim-wrapper"
author = "The decent-optim-wrapper developers"
copyright = "2026, The decent-optim-wrapper developers"
release = _version("decent-optim-wrapper")
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

html_theme = "furo"
html_title = f"decent-optim-wrapper {release}"

# -- Markdown ------------------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links to headings up to ###

# -- API reference from the docstrings ------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": True, "ignore-module-all": True}
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False  # torch's docstrings (nn.Module.train, ...) refer to torch's own pages
python_maximum_signature_line_length = 100  # long signatures one parameter per line
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Strict build (-n): every cross-reference must resolve. Our own objects are documented in the API
# reference; objects of other projects cannot be looked up offline (no intersphinx), so references
# to them are accepted unresolved, rendered as code.
_EXTERNAL = (
    r"(torch|datetime|typing|typing_extensions|collections|contextlib|dataclasses|argparse|enum|"
    r"functools|loguru|os|pathlib|numbers|abc|types|threading|lightning|transformers|accelerate)(\..*)?"
)
nitpick_ignore_regex = [
    (r"py:.*", _EXTERNAL),
    # builtins and the short names torch's and Python's annotations use
    (r"py:.*", r"(int|float|bool|str|bytes|object|tuple|list|dict|set|frozenset|type|None|callable)"),
    # a builtin generic that autodoc splits at its comma in a dataclass signature (``dict[int, float]``)
    (r"py:class", r"(dict|list|tuple|set)\[.*"),
    (r"py:.*", r"(Tensor|DTensor|DeviceMesh|Optimizer|LRScheduler|Module|ProcessGroup|Work|GradScaler)"),
    (r"py:.*", r"(timedelta|Path)"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Protocol|TypeVar|Generator|ClassVar)"),
    (r"py:.*", r"(RuntimeError|ValueError|TypeError|KeyError|Exception|BaseException)"),
    (r"py:.*", r"(NoneType|Ellipsis|EllipsisType|ModuleType)"),
    # private helpers (base classes, type variables) are not part of the reference
    (r"py:(class|obj)", r"decent_optim_wrapper(\.\w+)*\.(_\w+|T)"),
]


def _public_objects() -> set[int]:
    return {id(getattr(decent_optim_wrapper, name)) for name in decent_optim_wrapper.__all__}


_PUBLIC = _public_objects()


def _skip_public_in_modules(
    app: Sphinx, what: str, name: str, obj: Any, skip: bool, options: dict[str, Any]
) -> bool | None:
    """Document each public object once, under ``decent_optim_wrapper`` (the path users import)."""
    if what == "module" and id(obj) in _PUBLIC and not isinstance(obj, int | str):
        return True
    return None


def _lookup(path: str) -> Any:
    """The object a dotted path names, importing the longest module prefix; raises if there is none."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise LookupError(path)


def _resolve_alias(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.Element | None:
    """Resolve a reference to one of our objects by another path it is importable under.

    Docstrings name an object where the reader meets it (``decent_optim_wrapper.GossipCompression``,
    ``decent_optim_wrapper.engine.GossipCompression``, or ``Topology`` inside a module that imports
    it); the reference documents it once. A path that names no object of ours stays unresolved, so
    the strict build still fails on a wrong path.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if module:
        candidates += [f"{module}.{target}"]
        if cls:
            # the names the class's own module sees, wherever the class is documented
            candidates += [f"{module}.{cls}.{target}"]
            try:
                defined_in = _lookup(f"{module}.{cls}").__module__
            except (LookupError, AttributeError):
                defined_in = None
            if defined_in:
                candidates += [f"{defined_in}.{target}", f"{defined_in}.{cls}.{target}"]
    domain = env.get_domain("py")
    documented = _documented_by_object(env)
    for candidate in candidates:
        if not candidate.startswith("decent_optim_wrapper"):
            continue
        try:
            obj = _lookup(candidate)
        except (LookupError, AttributeError):
            continue
        name = documented.get((id(obj), candidate.rsplit(".", 1)[-1]))
        if name is not None and name != node["reftarget"]:
            return domain.resolve_xref(
                env, node["refdoc"], app.builder, node["reftype"], name, node, contnode
            )
    return None


def _documented_by_object(env: BuildEnvironment) -> dict[tuple[int, str], str]:
    """Every documented object of ours, keyed by the object and its last name component."""
    # Built once per build process, when the first reference is resolved: every page has been read.
    if not _DOCUMENTED:
        for name in env.get_domain("py").objects:
            if not name.startswith("decent_optim_wrapper"):
                continue
            try:
                obj = _lookup(name)
            except (LookupError, AttributeError):
                continue
            _DOCUMENTED.setdefault((id(obj), name.rsplit(".", 1)[-1]), name)
    return _DOCUMENTED


_DOCUMENTED: dict[tuple[int, str], str] = {}


def setup(app: Sphinx) -> None:
    app.connect("autodoc-skip-member", _skip_public_in_modules)
    app.connect("missing-reference", _resolve_alias)
