"""``python -m jaxsoft``: a command line that lists and explains what the library holds.

Subcommands (``python -m jaxsoft --help``):

* ``list normalizers|attention|linear|losses|kernels|pooling``: one line per public name
  (name, feature id, kernel class where it has one, a one-line description);
* ``info NAME``: the signature, hyperparameters with their declared ranges, the first
  paragraph (the formula) and the References section of the docstring, and which
  implementations run it;
* ``gallery`` (the default when no subcommand is given): every registered normalizer
  applied to one sample row.

Nothing here is maintained by hand: normalizers come from the registry
(:func:`jaxsoft.normalizers.names` / :func:`jaxsoft.normalizers.get`), everything else from
the packages' ``__all__`` and the docstrings (first line; the first feature id such as
``A11`` they name).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import os
import re
import sys
import types
from typing import Any

import kernels_pallas
from jaxsoft import attention, linear, losses, normalizers, pooling

__all__ = ["CATEGORIES", "gallery", "main"]

# category -> the module its public names come from
CATEGORIES = {
    "normalizers": "jaxsoft.normalizers",
    "attention": "jaxsoft.attention",
    "linear": "jaxsoft.linear",
    "losses": "jaxsoft.losses",
    "kernels": "kernels_pallas",
    "pooling": "jaxsoft.pooling",
}
_MODULES: dict[str, types.ModuleType] = {
    "normalizers": normalizers, "attention": attention, "linear": linear, "losses": losses,
    "kernels": kernels_pallas, "pooling": pooling,
}

_FEATURE_ID = re.compile(r"\b([NALKE]\d\d)\b")
_FEATURE_PHRASE = re.compile(r"\bfeatures? ([NALKE]\d\d)\b")
_SECTION = re.compile(r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Examples?|References|"
                      r"Notes?|See Also|Warnings?):\s*$")


class UsageError(Exception):
  """A name or argument the CLI cannot resolve (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Entry:
  """One public name: where it lives, its feature id, kernel class and description."""

  name: str
  category: str
  obj: Any
  catalogue_id: str = ""
  kernel_class: str = ""
  description: str = ""
  spec: Any = None  # the NormalizerSpec of a registered normalizer


# --- docstrings ---------------------------------------------------------------------------


def _unwrap(obj):
  while isinstance(obj, functools.partial):
    obj = obj.func
  return obj


def _own_doc(obj) -> str:
  """``obj``'s own docstring, cleaned (not one inherited from its type, as for constants)."""
  obj = _unwrap(obj)
  doc = getattr(obj, "__doc__", None)
  if not isinstance(doc, str) or not callable(obj) or (
      not isinstance(obj, type) and doc == type(obj).__doc__):
    return ""
  return inspect.cleandoc(doc)


def _summary(obj) -> str:
  doc = _own_doc(obj)
  if doc:
    return doc.splitlines()[0].strip()
  text = repr(obj)
  return f"constant {type(obj).__name__}: " + (text if len(text) <= 60 else text[:57] + "...")


def _sections(doc: str) -> tuple[str, dict[str, str]]:
  """(the text before the first section, {section title: its dedented body})."""
  lines = doc.splitlines()
  head: list[str] = []
  sections: dict[str, list[str]] = {}
  current: list[str] | None = None
  for line in lines:
    match = _SECTION.match(line)
    if match:
      current = sections.setdefault(match.group(1), [])
    elif current is None:
      head.append(line)
    else:
      current.append(line)
  return ("\n".join(head).strip(),
          {k: inspect.cleandoc("\n".join(v)) for k, v in sections.items()})


def _catalogue_id(obj) -> str:
  doc = _own_doc(obj)
  if not doc:
    return ""
  first = _FEATURE_ID.search(doc.split("\n\n")[0])
  if first:
    return first.group(1)
  phrase = _FEATURE_PHRASE.search(doc)
  return phrase.group(1) if phrase else ""


# --- the catalogue ------------------------------------------------------------------------


def _public_names(module) -> list[str]:
  names = getattr(module, "__all__", None)
  if names is not None:
    return list(names)
  # a package without __all__ (jaxsoft.normalizers): its private modules' __all__
  found: list[str] = []
  prefix = module.__name__ + "._"
  for value in vars(module).values():
    if isinstance(value, types.ModuleType) and value.__name__.startswith(prefix):
      found += [n for n in getattr(value, "__all__", ()) if n not in found]
  return found


def entries(category: str) -> list[Entry]:
  """The public names of one category, in the order its package lists them."""
  if category not in CATEGORIES:
    raise UsageError(_unknown("category", category, list(CATEGORIES)))
  module = _MODULES[category]
  if category == "normalizers":
    out = []
    for name in module.names():
      spec = module.get(name)
      out.append(Entry(name, category, spec.fn, spec.catalogue_id, spec.kernel_class,
                       spec.description or _summary(spec.fn), spec))
    return out
  return [Entry(name, category, getattr(module, name), _catalogue_id(getattr(module, name)),
                "", _summary(getattr(module, name)))
          for name in _public_names(module)]


def _everything() -> list[Entry]:
  out = []
  for category in CATEGORIES:
    out += entries(category)
  # the normalizers' helper functions (thresholds, log-forms) that are not registry names
  module = normalizers
  registered = set(module.names())
  out += [Entry(name, "normalizers", getattr(module, name), _catalogue_id(getattr(module, name)),
                "", _summary(getattr(module, name)))
          for name in _public_names(module) if name not in registered]
  return out


def _unknown(what: str, name: str, choices) -> str:
  close = difflib.get_close_matches(name, list(choices), n=5, cutoff=0.6)
  hint = f"; did you mean: {', '.join(close)}?" if close else ""
  return (f"unknown {what} {name!r}{hint} (`python -m jaxsoft list "
          f"{'|'.join(CATEGORIES)}` lists them)")


def lookup(name: str) -> list[Entry]:
  """Every entry called ``name`` (``category.name`` picks one category); UsageError if none."""
  everything = _everything()
  category, _, short = name.rpartition(".")
  if category in CATEGORIES:
    found = [e for e in everything if e.category == category and e.name == short]
  else:
    found = [e for e in everything if e.name == name]
  if not found:
    choices = {e.name for e in everything} | {f"{e.category}.{e.name}" for e in everything}
    raise UsageError(_unknown("name", name, sorted(choices)))
  # one entry per object: a registered normalizer shadows its function's helper entry
  unique: list[Entry] = []
  for entry in found:
    if not any(_unwrap(u.obj) is _unwrap(entry.obj) and u.category == entry.category
               and u.spec is not None for u in unique):
      unique.append(entry)
  return unique


# --- output -------------------------------------------------------------------------------


def format_list(category: str) -> str:
  """The ``list CATEGORY`` table."""
  rows = entries(category)
  width = max(len(e.name) for e in rows) + 2
  header = f"{'name':<{width}}{'id':<5}{'class':<7}description"
  lines = [header, "-" * len(header)]
  for e in rows:
    lines.append(f"{e.name:<{width}}{e.catalogue_id or '-':<5}{e.kernel_class or '-':<7}"
                 f"{e.description}")
  return "\n".join(lines)


class _Annotation:
  """A postponed (string) annotation printed without quotes."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


def _signature(obj) -> str:
  try:
    sig = inspect.signature(obj)
  except (TypeError, ValueError):
    return ""

  def plain(annotation):
    return _Annotation(annotation) if isinstance(annotation, str) else annotation
  params = [p.replace(annotation=plain(p.annotation)) for p in sig.parameters.values()]
  return str(sig.replace(parameters=params, return_annotation=plain(sig.return_annotation)))


def _interval(param) -> str:
  low = "-inf" if param.low is None else f"{param.low:g}"
  high = "inf" if param.high is None else f"{param.high:g}"
  left = "(" if param.low is None or param.low_open else "["
  right = ")" if param.high is None or param.high_open else "]"
  return f"{left}{low}, {high}{right}"


def _qualified(entry: Entry) -> str:
  module = CATEGORIES[entry.category]
  if entry.spec is not None:
    fn = _unwrap(entry.spec.fn)
    package = _MODULES[entry.category]
    fn_name = getattr(fn, "__name__", "")
    if fn_name and _unwrap(getattr(package, fn_name, None)) is fn:
      return f"{module}.{fn_name}"
  return f"{module}.{entry.name}"


def format_info(entry: Entry) -> str:
  """The ``info NAME`` text of one entry."""
  from jaxsoft._features import _implementations  # noqa: PLC0415  (imports the registry)

  kind = {"normalizers": "normalizer", "kernels": "Pallas kernel API"}.get(
      entry.category, entry.category)
  tags = [kind] + ([f"feature {entry.catalogue_id}"] if entry.catalogue_id else [])
  tags += [f"kernel class {entry.kernel_class}"] if entry.kernel_class else []
  lines = [f"{entry.name} ({', '.join(tags)})", ""]
  sig = _signature(entry.obj)
  if sig:
    lines.append(f"  {_qualified(entry)}{sig}")
  elif not callable(entry.obj):
    lines.append(f"  {_qualified(entry)} = {entry.obj!r}")
  else:
    lines.append(f"  {_qualified(entry)}")
  if entry.spec is not None:
    spec = entry.spec
    lines += ["", f"  usable as normalizer={spec.name!r}; {spec.description}"]
    lines += ["", "Hyperparameters:"]
    if spec.params:
      for p in spec.params:
        note = "; an array broadcast to the rows is accepted" if p.row_broadcast else ""
        lines.append(f"  {p.name} = {p.default!r}  in {_interval(p)}{note}")
    else:
      lines.append("  (none)")
    flags = [f for f in ("sums_to_one", "at_most_one", "nonnegative", "shift_invariant",
                         "can_be_sparse", "length_dependent", "needs_key", "smooth")
             if getattr(spec, f)]
    lines += ["", "Properties: " + ", ".join(flags)]
    dense, attention = _implementations(spec)
    lines += ["", "Implementations:", f"  normalizer: {dense}",
              f"  attention (dot_product_attention implementation=): {attention}"]
  head, sections = _sections(_own_doc(entry.obj))
  if head:
    lines += ["", "Description:"] + [f"  {line}" if line else "" for line in head.splitlines()]
  if sections.get("References"):
    lines += ["", "References:"] + [f"  {line}" if line else ""
                                    for line in sections["References"].splitlines()]
  return "\n".join(lines)


def gallery(row=None) -> str:
  """Every registered normalizer applied to one sample row (``python -m jaxsoft``)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import jaxsoft as js  # noqa: PLC0415

  if row is None:
    row = jnp.array([2.0, 1.5, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -2.0, -3.0], jnp.float32)
  lines = [f"jaxsoft {js.__version__} on JAX {jax.__version__}: each normalizer on x = "
           f"{np.array2string(np.asarray(row), precision=2)}", ""]
  width = max(21, max(len(name) for name in js.normalizers.names()) + 1)
  header = f"{'name':<{width}}{'id':<5}{'class':<6}{'sum':>6}  weights"
  lines += [header, "-" * len(header)]
  key = jax.random.key(0)
  for name in js.normalizers.names():
    spec = js.normalizers.get(name)
    w = spec.fn(key, row) if spec.needs_key else spec.fn(row)
    w = np.asarray(w)
    lines.append(f"{name:<{width}}{spec.catalogue_id:<5}{spec.kernel_class:<6}{w.sum():6.3f}  "
                 + " ".join(f"{v:6.3f}" for v in w))
  return "\n".join(lines)


# --- the command line ---------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
  """The argument parser (its help texts are the CLI's documentation)."""
  top = argparse.ArgumentParser(
      prog="python -m jaxsoft",
      description="jaxsoft: softmax-like normalizers, attention variants and softmax-based "
                  "losses in JAX. Without a subcommand, prints the gallery.")
  sub = top.add_subparsers(dest="command", metavar="COMMAND")
  listing = sub.add_parser(
      "list", help="list the public names of one part of the library",
      description="One line per public name: name, feature id (docs/feature_ids.md), kernel "
                  "class (normalizers) and a one-line description.")
  listing.add_argument("category", choices=list(CATEGORIES),
                       help="which part: " + ", ".join(
                           f"{c} ({m})" for c, m in CATEGORIES.items()))
  info = sub.add_parser(
      "info", help="explain one name: signature, hyperparameters, formula, paper, "
                   "implementations",
      description="Explain one public name (a registered normalizer such as sparsemax, or a "
                  "function of any part, e.g. topk_attention; CATEGORY.NAME picks one part, "
                  "e.g. kernels.attention).")
  info.add_argument("name", help="a name that `list` shows")
  sub.add_parser("gallery", help="every registered normalizer applied to one sample row "
                                 "(the default)",
                 description="Every registered normalizer applied to one sample row.")
  return top


def main(argv=None, out=None, err=None) -> int:
  """Runs the command line on ``argv`` (``sys.argv[1:]`` by default); returns the exit status.

  Output goes to ``out`` (stdout) and errors to ``err`` (stderr); an unknown name is exit
  status 2 with the closest names suggested. argparse's own errors (an unknown category or
  subcommand) and ``--help`` raise SystemExit as usual (status 2 and 0).
  """
  out = sys.stdout if out is None else out
  err = sys.stderr if err is None else err
  args = parser().parse_args(argv)
  try:
    if args.command == "list":
      text = format_list(args.category)
    elif args.command == "info":
      text = "\n\n\n".join(format_info(e) for e in lookup(args.name))
    else:
      text = gallery()
  except UsageError as error:
    print(f"python -m jaxsoft: error: {error}", file=err)
    return 2
  try:
    print(text, file=out)
    out.flush()
  except BrokenPipeError:  # the reader stopped early (`python -m jaxsoft list losses | head`)
    if out is sys.stdout:  # no second error when the interpreter flushes stdout at exit
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
  return 0
