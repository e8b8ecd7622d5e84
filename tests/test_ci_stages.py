""".ci/run's vLLM-line stages: the modules they run (``line_tests``) are exactly those holding tests
marked ``vllm_line``, so a test marked so in another module cannot silently run on one line only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _marks_vllm_line(module: Path) -> bool:
    """``pytest.mark.vllm_line`` appears in the module's code (a decorator or ``pytestmark``)."""
    tree = ast.parse(module.read_text(), filename=str(module))
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "vllm_line"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        for node in ast.walk(tree)
    )


def test_the_line_stages_run_every_module_with_vllm_line_tests() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    found = re.search(r"^line_tests=\(([^)]*)\)", script, re.MULTILINE)
    assert found, ".ci/run has no line_tests=(...) list"
    listed = set(found.group(1).split())
    marked = {
        str(module.relative_to(ROOT))
        for module in sorted(ROOT.glob("tests/test_*.py"))
        if _marks_vllm_line(module)
    }
    assert listed and listed == marked
