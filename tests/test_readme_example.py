"""The README's usage example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_usage_example_runs():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  example = next(b for b in blocks if "import jaxsoft as js" in b)
  namespace = {}
  exec(compile(example, "README.md", "exec"), namespace)  # noqa: S102
  assert namespace["out"].shape == namespace["q"].shape
  assert float(namespace["js"].normalizers.sparsemax(namespace["x"])[-1]) == 0.0
