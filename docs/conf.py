"""Sphinx configuration of jaxsoft's documentation site (``make docs``).

The stack optax and flax use: Sphinx, MyST-NB (Markdown pages and the notebooks) and the
sphinx-book-theme. ``make docs`` builds with ``-W --keep-going -n`` (warnings are errors,
nitpicky cross-references) into ``docs/_build/html``; ``make docs-test`` then opens the site
in headless Chromium (tests/docs/test_browser.py).

Three things are generated at build time, under ignored paths:

* ``docs/notebooks/*.ipynb``: copies of ``notebooks/*.ipynb`` (Sphinx reads only files under
  ``docs/``). They are rendered with their committed outputs and never executed
  (``nb_execution_mode = "off"``): the notebooks are run by ``make test-notebooks``.
* ``docs/_generated/features_table.md``: the feature table, from the normalizer registry
  (``jaxsoft._features.feature_table``, the same table as the README's), included by
  ``features.md``.
* ``docs/api/_autosummary/``: one page per public name, from the ``autosummary`` lists of
  ``docs/api/*.rst`` (tests/docs/test_api_pages.py checks those lists cover every name of
  every public ``__all__``).

Links in the Markdown pages that leave ``docs/`` (``../notebooks/X.ipynb``,
``../kernels_pallas/README.md``) are written for GitHub; ``_rewrite_outside_links`` turns
the notebook links into links to the rendered pages and the others into GitHub URLs.

Outside references: CI has no network (only package registries), so intersphinx cannot
fetch the inventories of Python, NumPy, JAX, Flax or optax. Instead ``nitpick_ignore_regex``
lists the outside namespaces whose names appear in signatures and docstrings (``jax.Array``,
``flax.nnx.Module``, ``optax.GradientTransformation``, builtins such as ``int``); every
reference to a jaxsoft, kernels_pallas or train name must resolve: to its page, to the one
documented object of that short name, or, for a name of the code without a page (a
private helper), to plain text (``_resolve_own_names``); a name the code does not have is
an error. To link the outside
names instead, set ``JAXSOFT_DOCS_INTERSPHINX=1`` where the inventories are reachable
(Read the Docs): intersphinx is then enabled for them.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import inspect
import os
import pathlib
import re
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
# jaxsoft and kernels_pallas are installed (pip install -e); train/ is a directory of the
# repository, imported from its root.
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxsoft  # noqa: E402
from jaxsoft import _features  # noqa: E402

project = "jaxsoft"
author = "the jaxsoft authors"
copyright = f"{datetime.date.today().year}, {author}"  # noqa: A001
release = version = jaxsoft.__version__
REPOSITORY = "https://github.com/jaxsoft/jaxsoft"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "_generated", "**.ipynb_checkpoints", "README.md"]
root_doc = "index"

# --- MyST and the notebooks -----------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3          # [text](page.md#a-heading) links, as GitHub renders them
nb_execution_mode = "off"         # render the committed outputs; never run a notebook here
nb_merge_streams = True

# --- autodoc / autosummary / napoleon --------------------------------------------------------
autosummary_generate = True
autosummary_ignore_module_all = False
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
add_module_names = False
python_use_unqualified_type_names = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_custom_sections = [("Properties", "notes_style")]
templates_path = ["_templates"]

# --- outside references (see the module docstring) ------------------------------------------
nitpicky = True
_OUTSIDE = r"(jax|jaxlib|jnp|np|numpy|flax|nnx|optax|chex|orbax|etils|ml_dtypes|tqdm|matplotlib|torch|typing|typing_extensions|collections|dataclasses|enum|functools|pathlib|os|types|abc|argparse|concurrent|numbers|builtins|threading)"
nitpick_ignore_regex = [
    (r"py:.*", _OUTSIDE + r"(\..*)?"),
    # builtins and the typing names autodoc writes unqualified
    (r"py:.*", r"(int|float|bool|str|bytes|complex|object|tuple|list|dict|set|frozenset|type|slice|"
               r"callable|Callable|Any|Sequence|Mapping|Iterable|Iterator|Literal|Optional|Union|"
               r"None|NoneType|Ellipsis|ellipsis|ArrayLike|Array|DTypeLike|PRNGKeyArray|Shape|"
               r"PyTree|KeyArray|Self|TypeVar|ClassVar|Protocol|NamedTuple|Exception|ValueError|"
               r"TypeError|NotImplementedError|RuntimeError|Path|Generator|Hashable|PartialState)"),
]
# ``|x|`` in running text means an absolute value or a size, not a reST substitution.
rst_prolog = "\n".join(
    f".. |{name}| replace:: \\|{name}\\|" for name in ("x", "V", "V_i", "gamma", "error")) + "\n"

intersphinx_mapping: dict[str, tuple[str, None]] = {}
if os.environ.get("JAXSOFT_DOCS_INTERSPHINX") == "1":
  extensions.append("sphinx.ext.intersphinx")
  intersphinx_mapping = {
      "python": ("https://docs.python.org/3", None),
      "numpy": ("https://numpy.org/doc/stable", None),
      "jax": ("https://docs.jax.dev/en/latest", None),
      "flax": ("https://flax.readthedocs.io/en/latest", None),
      "optax": ("https://optax.readthedocs.io/en/latest", None),
  }

# --- HTML ------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"jaxsoft {release}"
html_theme_options = {
    "repository_url": REPOSITORY,
    "use_repository_button": True,
    "show_toc_level": 2,
    # the sidebar shows the open branch only: with ~400 API pages, the whole tree on every
    # page would make each page (and the build) several times larger
    "collapse_navbar": True,
    "navigation_with_keys": False,
}
# MathJax 3 from the sphinx-mathjax-offline package, copied into the site as
# _static/mathjax/: the formulas render without a CDN (CI and the browser test are offline).
# (The package's own Sphinx extension does the same but disables parallel reading.)
_MATHJAX = importlib.util.find_spec("sphinx-mathjax-offline")
if _MATHJAX is None or _MATHJAX.origin is None:
  raise RuntimeError("the docs need the sphinx-mathjax-offline package: pip install -e '.[docs]'")
html_static_path = [str(pathlib.Path(_MATHJAX.origin).parent / "static")]
mathjax_path = "mathjax/tex-chtml.js"
html_last_updated_fmt = None


# --- generated sources -----------------------------------------------------------------------
def _copy_notebooks() -> None:
  """Copies ``notebooks/*.ipynb`` to ``docs/notebooks/`` (only the changed ones)."""
  target = DOCS / "notebooks"
  target.mkdir(exist_ok=True)
  sources = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
  for stale in set(p.name for p in target.glob("*.ipynb")) - {p.name for p in sources}:
    (target / stale).unlink()
  for source in sources:
    copy = target / source.name
    if not copy.exists() or copy.read_bytes() != source.read_bytes():
      shutil.copy2(source, copy)


def _write_generated(name: str, text: str) -> None:
  """Writes ``docs/_generated/NAME`` when its text changed (keeps incremental builds quick)."""
  out = DOCS / "_generated" / name
  out.parent.mkdir(exist_ok=True)
  if not out.exists() or out.read_text() != text:
    out.write_text(text)


def _write_feature_table() -> None:
  _write_generated("features_table.md", _features.feature_table() + "\n")


def _write_properties_table() -> None:
  """The declared properties of every registered normalizer (``choosing.md`` includes it)."""
  from jaxsoft import normalizers  # noqa: PLC0415

  def mark(flag: bool) -> str:
    return "yes" if flag else ""

  rows = ["| normalizer | id | class | sums to 1 | sparse | shift invariant | length dependent "
          "| hyperparameters | what it computes |",
          "|---|---|---|---|---|---|---|---|---|"]
  for name in normalizers.names():
    spec = normalizers.get(name)
    link = (f"{{py:obj}}`{name} <jaxsoft.normalizers.{name}>`" if hasattr(normalizers, name)
            else f"`{name}`")
    sums = "yes" if spec.sums_to_one else ("≤ 1" if spec.at_most_one else "")
    params = ", ".join(f"`{p.name}`" for p in spec.params)
    what = spec.description.replace("|", "\\|")
    rows.append(f"| {link} | {spec.catalogue_id} | {spec.kernel_class} | {sums} "
                f"| {mark(spec.can_be_sparse)} | {mark(spec.shift_invariant)} "
                f"| {mark(spec.length_dependent)} | {params} | `{what}` |")
  _write_generated("properties_table.md", "\n".join(rows) + "\n")


_copy_notebooks()
_write_feature_table()
_write_properties_table()

_OUTSIDE_LINK = re.compile(r"\]\(\.\./([^)#\s]+)(#[^)\s]*)?\)")


def _rewrite_outside_links(app, docname, source) -> None:
  """``](../notebooks/X.ipynb)`` -> the rendered page; ``](../other)`` -> its GitHub URL."""
  del app
  if docname.startswith(("api/", "notebooks/")):
    return

  def rewrite(match: re.Match) -> str:
    path, anchor = match.group(1), match.group(2) or ""
    if path.startswith("notebooks/") and path.endswith(".ipynb"):
      return f"]({path}{anchor})"
    kind = "tree" if path.endswith("/") else "blob"
    return f"]({REPOSITORY}/{kind}/main/{path}{anchor})"

  source[0] = _OUTSIDE_LINK.sub(rewrite, source[0])


_SECTION = re.compile(r"^(\s*)(Args|Arguments|Attributes|Parameters|Keyword Args|Other Parameters):\s*$")
_NAME_LIST_CONTINUED = re.compile(r"^\s+[\w*]+(,\s*[\w*]+)*,\s*$")
_NAMES = re.compile(r"^(\s+)([\w*]+(?:,\s*[\w*]+)+)(\s*(?:\([^)]*\))?:)")


def _join_name_lists(app, what, name, obj, options, lines) -> None:
  """Reads the docstrings' ``a, b, c: description`` entries as napoleon expects them.

  jaxsoft's Google-style Args sections describe several parameters at once, and a long list
  of names continues on the next line (``q, k, v,\\n    bias: as for ...``). napoleon reads
  one entry per line, so the continued names are joined onto one line here, and the stars of
  ``**kwargs`` inside such a list are escaped (napoleon escapes them only in a lone name).
  Runs before napoleon (priority 400 < 500); the docstrings themselves stay as they are.
  """
  del app, what, name, obj, options
  out: list[str] = []
  in_args = False
  for line in lines:
    section = _SECTION.match(line)
    if section:
      in_args = True
    elif line.strip() and not line.startswith((" ", "\t")):
      in_args = False
    if in_args and out and _NAME_LIST_CONTINUED.match(out[-1]):
      out[-1] = out[-1].rstrip() + " " + line.strip()
    else:
      out.append(line)
  for i, line in enumerate(out):
    match = _NAMES.match(line)
    if match and "*" in match.group(2):
      out[i] = match.group(1) + match.group(2).replace("*", "\\*") + line[match.end(2):]
  lines[:] = out


_EXCEPTION_ENTRY = re.compile(r"^\s+[A-Za-z_][\w.]*(\s*\([^)]*\))?\s*:")


def _free_text_raises(app, what, name, obj, options, lines) -> None:
  """A ``Raises:`` section written as a sentence becomes a plain "Raises" paragraph.

  napoleon reads ``Raises:`` entries as ``ExceptionType: description``; a section that
  starts with prose (``ValueError naming the argument ...; KeyError for ...``) is kept as
  prose under a "Raises" heading instead of being read as one long exception name.
  """
  del app, what, name, obj, options
  for i, line in enumerate(lines):
    if line.strip() == "Raises:" and i + 1 < len(lines) and lines[i + 1].strip():
      if not _EXCEPTION_ENTRY.match(lines[i + 1]):
        indent = line[:len(line) - len(line.lstrip())]
        lines[i] = f"{indent}.. rubric:: Raises"
        lines.insert(i + 1, "")
        j = i + 2
        while j < len(lines) and (not lines[j].strip() or lines[j].startswith(indent + " ")):
          if lines[j].strip():
            lines[j] = indent + lines[j].strip()
          j += 1
      return


def _drop_inherited_data_docstrings(app, what, name, obj, options, lines) -> None:
  """A constant or field without a docstring of its own gets no text.

  Not ``dict``'s or ``tuple``'s docstring, nor that of the function a field holds
  (``LinearKind.output_gate = jax.nn.silu`` would show ``jax.nn.silu``'s).
  """
  del app, name, options
  if what in ("data", "attribute") and lines:
    text = "\n".join(lines).strip()
    for inherited in (type(obj).__doc__, getattr(obj, "__doc__", None)):
      # (a __slots__ class's __doc__ seen on an instance field can be a member descriptor)
      if isinstance(inherited, str) and text == inspect.cleandoc(inherited).strip():
        lines[:] = []
        return


_OURS = ("jaxsoft", "kernels_pallas", "train")


@functools.cache
def _names_in_the_code() -> frozenset[str]:
  """Every module-level and class-level name of the imported jaxsoft / kernels_pallas / train
  modules, short (``single_pass_update``) and qualified (``kernels_pallas.polykv.PolyKVCache``,
  ``Checkpointer.restore_newest``)."""
  names: set[str] = set()
  for modname, module in list(sys.modules.items()):
    if module is None or modname.split(".")[0] not in _OURS:
      continue
    for attr, value in list(vars(module).items()):
      names.update((attr, f"{modname}.{attr}"))
      if inspect.isclass(value):
        for member in vars(value):
          names.update((member, f"{attr}.{member}", f"{modname}.{attr}.{member}"))
  return frozenset(names)


def _resolve_own_names(app, env, node, contnode):
  """References to jaxsoft's own names that are not written in full.

  * A docstring refers to its neighbours by their short name (``:func:`fourier_head_logits```
    in ``jaxsoft.losses.fourier_head_cross_entropy``, whose neighbour is documented as
    ``jaxsoft.normalizers.fourier_head_logits``), or through the private module that defines
    them. When exactly one documented object has that last name component, the reference
    links to it.
  * A reference to a name of the code that has no page (a private helper, a method of a
    private class) is shown as written, without a link.
  * Anything else (a typo, a name that no longer exists) stays unresolved, and nitpicky
    mode makes it an error.
  """
  if node.get("refdomain") != "py":
    return None
  target = node["reftarget"].lstrip(".~")
  short = target.rsplit(".", 1)[-1]
  domain = env.get_domain("py")
  # (an object documented under its public name is also listed, aliased, under the
  # private module that defines it: only the public name counts)
  matches = [name for name, entry in domain.objects.items()
             if name.rsplit(".", 1)[-1] == short and not entry.aliased
             and name.split(".", 1)[0] in _OURS]
  if len(matches) == 1:
    return domain.resolve_xref(env, node.get("refdoc", ""), app.builder, node["reftype"],
                               matches[0], node, contnode)
  if target in _names_in_the_code():
    return contnode
  return None


def _alias_spellings() -> list[tuple[str, str]]:
  import jax  # noqa: PLC0415
  from sphinx.util.typing import stringify_annotation  # noqa: PLC0415

  pairs = []
  for alias, name in ((jax.typing.ArrayLike, "jax.typing.ArrayLike"),
                      (jax.typing.DTypeLike, "jax.typing.DTypeLike")):
    pairs.append((stringify_annotation(alias, "smart"), "~" + name))
    pairs.append((stringify_annotation(alias, "fully-qualified-except-typing"), name))
  return pairs


_ALIASES = _alias_spellings()


def _shorten_aliases(app, what, name, obj, options, signature, return_annotation):
  """Writes ``ArrayLike`` where autodoc would expand it into its eight-member union.

  (``autodoc_type_aliases`` would do it, but Sphinx 9 then prints ``ArrayLike | None`` as
  ``TypeAliasForwardRef('ArrayLike') | None``.)
  """
  del app, what, name, obj, options
  for expanded, short in _ALIASES:
    if signature:
      signature = signature.replace(expanded, short)
    if return_annotation:
      return_annotation = return_annotation.replace(expanded, short)
  return signature, return_annotation


def _skip_held_functions(app, what, name, obj, skip, options):
  """A class's field whose default is an outside function (``output_gate = jax.nn.silu``) is
  not one of its methods: the class's Attributes section documents it."""
  del app, name, options
  if (what == "class" and inspect.isroutine(obj)
      and (getattr(obj, "__module__", None) or "").split(".")[0]
      not in ("jaxsoft", "kernels_pallas", "train")):
    return True
  return skip


def setup(app):
  app.connect("autodoc-skip-member", _skip_held_functions)
  app.connect("autodoc-process-signature", _shorten_aliases)
  app.connect("missing-reference", _resolve_own_names)
  app.connect("source-read", _rewrite_outside_links)
  app.connect("autodoc-process-docstring", _drop_inherited_data_docstrings, priority=400)
  app.connect("autodoc-process-docstring", _join_name_lists, priority=400)
  app.connect("autodoc-process-docstring", _free_text_raises, priority=400)
