"""The README's usage example runs as written, and every value its comments show is what it returns.

In the "Using it" block each expression statement (a line that is not an assignment or an
import) ends with a comment that starts with the value it returns: a list such as
``[0.6, 0.4, 0, 0]`` (numbers with d decimals are checked to half a unit of the last place,
numbers written without a decimal point exactly), a tuple such as a shape ``(2, 512, 8, 64)``
(exactly), or ``True`` / ``False``. Any prose after the value is free. A statement without
such a comment fails the test, so no shown value goes unchecked.
"""

import ast
import io
import pathlib
import re
import tokenize

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _usage_block():
  text = README.read_text()
  section = text[text.index("## Using it"):]
  return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def _comments(source):
  """line number -> the text of the comment ending that line."""
  out = {}
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      out[tok.start[0]] = tok.string[1:].strip()
  return out


def _leading_value(comment):
  """The value a comment starts with, as (kind, text), or None."""
  if comment.startswith(("True", "False")):
    return "bool", comment.split()[0].rstrip(":,")
  if comment[:1] in "[(":
    depth = 0
    for i, ch in enumerate(comment):
      depth += ch in "[("
      depth -= ch in "])"
      if depth == 0:
        return ("list" if comment[0] == "[" else "tuple"), comment[:i + 1]
  return None


def _check(value, kind, text, where):
  if kind == "bool":
    assert value is (text == "True"), f"{where}: returns {value!r}, the comment says {text}"
  elif kind == "tuple":
    assert tuple(value) == ast.literal_eval(text), f"{where}: returns {value}, the comment says {text}"
  else:
    expected = np.asarray(ast.literal_eval(text), dtype=np.float64)
    actual = np.asarray(value, dtype=np.float64)
    assert actual.shape == expected.shape, f"{where}: shape {actual.shape}, the comment shows {expected.shape}"
    tokens = NUMBER.findall(text)
    assert len(tokens) == expected.size, (where, tokens)
    atol = np.array([0.5 * 10.0 ** -len(t.split(".")[1].split("e")[0]) if "." in t else 0.0
                     for t in tokens]).reshape(expected.shape)
    ok = np.abs(actual - expected) <= atol + 1e-7
    assert ok.all(), f"{where}: returns {np.round(actual, 4).tolist()}, the comment says {text}"


def _run_checked(source):
  """Executes the block statement by statement; returns the checked (line, comment) pairs."""
  comments = _comments(source)
  namespace = {}
  checked = []
  for stmt in ast.parse(source).body:
    where = f"README.md usage line {stmt.end_lineno}: {source.splitlines()[stmt.lineno - 1].strip()}"
    if isinstance(stmt, ast.Expr):
      value = eval(compile(ast.Expression(stmt.value), "README.md", "eval"), namespace)  # noqa: S307
      comment = comments.get(stmt.end_lineno, "")
      parsed = _leading_value(comment)
      assert parsed is not None, f"{where}: an expression line must end with `# <its value>`"
      _check(value, *parsed, where)
      checked.append((stmt.end_lineno, comment))
    else:
      exec(compile(ast.Module([stmt], []), "README.md", "exec"), namespace)  # noqa: S102
  return checked


def test_readme_usage_example_values_are_what_it_returns():
  checked = _run_checked(_usage_block())
  shown = [c for c in _comments(_usage_block()).values() if _leading_value(c) and NUMBER.search(c)]
  # every comment that shows a number belongs to a checked expression (none on an assignment)
  assert len(checked) >= len(shown) >= 10, (checked, shown)


def test_readme_sparsemax_example_is_one_hot_where_the_margin_is_large():
  # the example: sparsemax of [2, 1, 0.5, -1] is [1, 0, 0, 0]
  assert "js.normalizers.sparsemax(logits)               # [[1, 0, 0, 0]" in _usage_block()


@pytest.mark.parametrize("comment, message", [
    ("[0.6, 0.5, 0, 0]", "the comment says"),      # a wrong number
    ("[0.6, 0.4, 0.001, 0]", "the comment says"),  # a written 0.001 where the value is exactly 0
    ("[0.6, 0.4, 0]", "shape"),                    # a wrong length
    ("exact zeros", "must end with"),              # prose without the value
])
def test_a_wrong_comment_is_caught(comment, message):
  source = f"import jax.numpy as jnp\nimport jaxsoft as js\njs.normalizers.sparsemax(jnp.array([1.0, 0.8, 0.1, -1.0]))  # {comment}\n"
  with pytest.raises(AssertionError, match=message):
    _run_checked(source)
