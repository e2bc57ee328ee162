"""Writes the API reference's page sources, ``docs/api/*.rst``, from the public ``__all__`` lists.

    .venv/bin/python docs/api/generate.py

Each package page lists every public name in ``autosummary`` blocks (one generated page per
name), in sections by the private module that defines it, titled from that module
docstring's first line (the part before ``": "``; ``HEADINGS`` shortens the long ones).
``train.rst`` has one section per module of the training loop. Run it after adding or
removing a public name, and review the diff; ``tests/docs/test_api_pages.py`` fails while a
public name has no entry. (A name can also be added by hand to the list of its section.)
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys

API = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(API.parents[1]))  # train/ is imported from the repository root

# page -> (package, title)
PACKAGES = {
    "normalizers": ("jaxsoft.normalizers", "Normalizers"),
    "attention": ("jaxsoft.attention", "Attention"),
    "linear": ("jaxsoft.linear", "Linear attention"),
    "losses": ("jaxsoft.losses", "Losses"),
    "nn": ("jaxsoft.nn", "Flax NNX modules"),
    "pooling": ("jaxsoft.pooling", "Pooling"),
    "testing": ("jaxsoft.testing", "Testing"),
    "checks": ("jaxsoft.checks", "Runtime checks"),
    "optim": ("jaxsoft.optim", "Optimizer transformations"),
    "kernels_pallas": ("kernels_pallas", "Pallas kernels"),
}
TRAIN_MODULES = ("config", "model", "layers", "kinds", "positions", "data", "sharding",
                 "checkpoint", "metrics", "sample", "train")

# the first line of a module docstring -> a shorter section title
HEADINGS = {
    "jaxsoft.attention.dot_product_attention": "The entry point",
    "Mask *structure*": "Mask structure",
    'implementation="xla"': "The dense reference",
    "Which derivatives the blockwise attention paths take, and the clear refusal of the rest":
        "Differentiation",
    "N30 calibration maps (temperature scaling, Dirichlet calibration, power softening) and the":
        "N30 calibration maps",
    "L19 training-free hallucination scores from the logits of a language model's head:":
        "L19 training-free hallucination scores",
    "The wrapped Cauchy distribution on the circle and WCDAS, the softmax over wrapped-Cauchy":
        "The wrapped Cauchy distribution and WCDAS",
    "The kinds of :class:`~jaxsoft.nn.LinearMixer` as one table": "The kinds of LinearMixer",
    "kernels_pallas.attention and the adapter jaxsoft.attention calls": "The attention kernel",
    "sharded_attention": "Sharding",
    "NormalizerSpec": "The registry",
    "MultiHeadAttention": "Multi-head attention",
    "attention_fn": "attention_fn for Flax attention layers",
}


def heading(module_name: str) -> str:
  doc = (inspect.getdoc(sys.modules[module_name]) or "").strip().split("\n")[0]
  doc = doc.replace("``", "")
  title = (doc.split(": ")[0] if ": " in doc else doc.rstrip(".")).strip()
  if re.fullmatch(r"[A-Z]\d\d", title):  # "K12: Edge-MoE's single-pass softmax, as ..."
    title += " " + re.split(r"[,(.;]", doc.split(": ", 1)[1])[0].strip()
  return HEADINGS.get(title, title)


def public(module) -> list[str]:
  return getattr(module, "__all__", None) or [
      n for n in dir(module)
      if not n.startswith("_") and not inspect.ismodule(getattr(module, n))]


def defining_module(obj) -> str | None:
  """The module that defines a function or class; None for a constant."""
  if inspect.isfunction(obj) or inspect.isclass(obj) or hasattr(obj, "__wrapped__"):
    name = getattr(obj, "__module__", None)
    return name if name in sys.modules else None
  return None


def underline(text: str, char: str) -> str:
  return f"{text}\n{char * len(text)}\n\n"


def autosummary(names: list[str]) -> str:
  return (".. autosummary::\n   :toctree: _autosummary\n   :nosignatures:\n\n"
          + "".join(f"   {n}\n" for n in names) + "\n")


def package_page(package: str, title: str) -> str:
  module = importlib.import_module(package)
  sections: dict[str | None, list[str]] = {}
  for name in public(module):
    source = defining_module(getattr(module, name))
    key = "Constants" if source is None else (None if source == package else heading(source))
    sections.setdefault(key, []).append(name)
  order = list(sections)
  if package == "jaxsoft.normalizers":  # the registry, then by catalogue id
    order.sort(key=lambda h: (h != "The registry", not str(h).startswith("N"),
                              not str(h).startswith("K"), h == "Constants", str(h)))
  text = underline(f"{title}: ``{package}``", "=")
  text += f".. automodule:: {package}\n\n.. currentmodule:: {package}\n\n"
  for key in order:
    if key is not None and len(sections) > 1:
      text += underline(key, "-")
    text += autosummary(sections[key])
  return text


def train_page() -> str:
  text = underline("Training loop: ``train``", "=") + ".. automodule:: train\n\n"
  for name in TRAIN_MODULES:
    module = importlib.import_module(f"train.{name}")
    text += underline(f"``train.{name}``", "-")
    if name == "train":  # its module docstring is a command line, not reST
      text += (".. py:module:: train.train\n\nThe entry point, ``python train/train.py "
               "--preset smoke --workdir DIR``, and the train step.\n\n")
    else:
      text += f".. automodule:: train.{name}\n\n"
    text += f".. currentmodule:: train.{name}\n\n" + autosummary(list(module.__all__))
  return text


def main() -> None:
  for page, (package, title) in PACKAGES.items():
    (API / f"{page}.rst").write_text(package_page(package, title))
  (API / "train.rst").write_text(train_page())


if __name__ == "__main__":
  main()
